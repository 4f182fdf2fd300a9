"""The simulator's pure core: the vLLM engine model, the virtual-time cluster and the vLLM API values.

No I/O, no clock, no event loop (an import-linter contract checks it): every call takes the time it
happens at. The server (``simulator.server``) runs it in real time behind HTTP; the virtual-time
drivers (``virtual``, ``cluster``) run it in fast-forward. See simulator/README.md.
"""
