"""GPU-free stand-ins for vLLM workers: ``core`` (the pure engine model), ``server`` (the real-time
HTTP workers) and ``tools`` (the command line). See simulator/README.md, "Module map".
"""
