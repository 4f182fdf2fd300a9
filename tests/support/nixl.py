"""What vLLM's toy P/D proxy sends to a prefill worker, for the simulator's HTTP tests."""

from __future__ import annotations

from typing import Any


def prefill_kv_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill leg (a fresh dict each call)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
