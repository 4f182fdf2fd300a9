"""Fixtures shared by the simulator's tests (core, server and tools)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from simulator.core.profile import Profile, load_profile
from simulator.core.tokenizer import Llama3Tokenizer


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture(scope="session")
def tok() -> Llama3Tokenizer:
    """The exact Llama-3 tokenizer (read-only after construction)."""
    return Llama3Tokenizer()


@pytest.fixture(scope="session")
def profile() -> Profile:
    """The default cost-model profile (a frozen value)."""
    return load_profile()
