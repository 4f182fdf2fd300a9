"""The simulated vLLM workers: the core driven by the wall clock on one event loop, behind aiohttp.

Builds on ``simulator.core`` and never on ``simulator.tools``. See simulator/README.md.
"""
