"""The load generator (`ppd-bench`): multi-turn conversations against any OpenAI-compatible URL."""
