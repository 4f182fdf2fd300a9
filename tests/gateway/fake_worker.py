"""The gateway tests' name for the one fake OpenAI server (``tests/support/fake_openai.py``)."""

from tests.support.fake_openai import MODEL, FakeWorker, Knobs, Seen

__all__ = ["MODEL", "FakeWorker", "Knobs", "Seen"]
