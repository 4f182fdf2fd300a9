"""Real vLLM workers on this machine's CPU: a separate venv, a tiny seeded model, P/D launchers.

Development and test tooling, never imported by the product packages. The modules in ``remote/``
run inside the vLLM venv (they import vLLM, torch and transformers); everything else runs in ours.
"""
