"""Scripts run by the vLLM venv's interpreter (by file path), never imported by our own venv."""
