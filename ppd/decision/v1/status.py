"""Status details of the v1 DecisionService beyond the gRPC status code (hand-written; the rest of
this package is generated from proto/ppd/decision/v1/decision.proto).

A Route or DescribeTable call the service cannot answer because it holds no table for it (none loaded
yet, or the default table missing) ends UNAVAILABLE with the trailing metadata
`UNAVAILABLE_CAUSE_KEY: UNAVAILABLE_NO_TABLE`, so a client tells "no table" from "no server" without
reading the message text, which is for people and may change.
"""

from __future__ import annotations

from typing import Final

__all__ = ["UNAVAILABLE_CAUSE_KEY", "UNAVAILABLE_NO_TABLE"]

UNAVAILABLE_CAUSE_KEY: Final = "ppd-unavailable"
UNAVAILABLE_NO_TABLE: Final = "no-table"
