"""The prefill side's pinned KV blocks and their leases (NixlConnector pull mode; pure, clock passed in).

Invariants:
- Rule 1: a lease is claimed at most once; a claim after its deadline fails and counts as expired.
- Rule 2: `expire(now)` drops every lease past its deadline and returns them, so the owner can unpin
  their blocks and count `vllm:nixl_num_kv_expired_reqs`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lease", "LeaseBook"]


@dataclass(frozen=True, slots=True)
class Lease:
    remote_request_id: str
    num_tokens: int
    block_ids: tuple[int, ...]
    deadline: float


class LeaseBook:
    """Leases by `remote_request_id`; insertion order is deadline order for a fixed lease duration."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def pin(self, lease: Lease) -> None:
        self._leases[lease.remote_request_id] = lease

    def claim(self, remote_request_id: str, now: float) -> Lease | None:
        """The lease if it is still valid (and it is released); None when unknown or expired."""
        lease = self._leases.pop(remote_request_id, None)
        if lease is None or lease.deadline < now:
            return None
        return lease

    def peek(self, remote_request_id: str) -> Lease | None:
        return self._leases.get(remote_request_id)

    def expire(self, now: float) -> list[Lease]:
        gone = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in gone:
            del self._leases[lease.remote_request_id]
        return gone
