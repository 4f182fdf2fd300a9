"""vLLM's `kv_load_failure_policy` (NixlConnector `kv_transfer_config`) and the cluster flag's SPEC (pure).

A failed KV load (dead or unreachable remote, expired lease, declined read) either fails the request
("fail", vLLM's default: HTTP 500) or computes its prompt locally ("recompute": an ordinary answer).

`ppd-sim cluster --kv-load-failure-policy SPEC`: SPEC is one policy for every worker (`recompute`) or a
comma list of `WORKER_ID=POLICY` for chosen workers (`D1=recompute,D2=recompute`; the others keep the
default).

`--bidir-workers IDS` (both cluster launchers): the comma list of worker ids that run vLLM's
`bidirectional_kv_xfer` (`parse_worker_ids`), so one cluster can hold workers with and without it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal, get_args

__all__ = [
    "KV_LOAD_FAILURE_POLICIES",
    "KvLoadFailurePolicy",
    "PolicySpecError",
    "parse_policy_spec",
    "parse_worker_ids",
]

KvLoadFailurePolicy = Literal["fail", "recompute"]
KV_LOAD_FAILURE_POLICIES: tuple[KvLoadFailurePolicy, ...] = get_args(KvLoadFailurePolicy)


class PolicySpecError(ValueError):
    """The SPEC names an unknown policy or worker, or is not `POLICY` / `ID=POLICY[,ID=POLICY...]`."""


def _policy(text: str, spec: str) -> KvLoadFailurePolicy:
    for policy in KV_LOAD_FAILURE_POLICIES:
        if text == policy:
            return policy
    choices = ", ".join(KV_LOAD_FAILURE_POLICIES)
    raise PolicySpecError(f"bad kv_load_failure_policy {spec!r}: unknown policy {text!r} (choose {choices})")


def parse_policy_spec(
    spec: str, worker_ids: Collection[str], default: KvLoadFailurePolicy = "fail"
) -> dict[str, KvLoadFailurePolicy]:
    """The policy of every worker in `worker_ids` under `spec`; raises PolicySpecError when it is bad."""
    text = spec.strip()
    if not text:
        raise PolicySpecError("bad kv_load_failure_policy '': expected POLICY or ID=POLICY[,ID=POLICY...]")
    if "=" not in text:
        policy = _policy(text, spec)
        return dict.fromkeys(worker_ids, policy)
    policies: dict[str, KvLoadFailurePolicy] = dict.fromkeys(worker_ids, default)
    seen: set[str] = set()
    for item in text.split(","):
        worker_id, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not worker_id:
            raise PolicySpecError(f"bad kv_load_failure_policy {spec!r}: {item.strip()!r} is not ID=POLICY")
        if worker_id not in policies:
            known = ", ".join(worker_ids)
            raise PolicySpecError(
                f"bad kv_load_failure_policy {spec!r}: no worker {worker_id!r} (workers: {known})"
            )
        if worker_id in seen:
            raise PolicySpecError(f"bad kv_load_failure_policy {spec!r}: worker {worker_id!r} given twice")
        seen.add(worker_id)
        policies[worker_id] = _policy(raw, spec)
    return policies


def parse_worker_ids(spec: str, worker_ids: Collection[str]) -> frozenset[str]:
    """The ids of a comma list (`P0,D1`; "" = none, "all" = every worker); raises PolicySpecError for an
    unknown or repeated one."""
    if spec.strip() == "all":
        return frozenset(worker_ids)
    chosen: set[str] = set()
    for item in (part.strip() for part in spec.split(",")) if spec.strip() else ():
        if item not in worker_ids:
            raise PolicySpecError(
                f"bad worker list {spec!r}: no worker {item!r} (workers: {', '.join(worker_ids)})"
            )
        if item in chosen:
            raise PolicySpecError(f"bad worker list {spec!r}: worker {item!r} given twice")
        chosen.add(item)
    return frozenset(chosen)
