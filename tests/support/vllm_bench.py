"""Paths of the vLLM benchmark output files under tests/table_builder/data/vllm_bench/ and loaders.

The files are written in vLLM's formats (``docs/vllm-protocol.md`` 6.3 and 7.1): what ``vllm bench serve
--save-result [--save-detailed] [--append-result]`` and the multi-turn benchmark's
``--stats-json-output`` / ``--output-file`` write, field for field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VLLM_BENCH = Path(__file__).resolve().parent.parent / "table_builder" / "data" / "vllm_bench"

#: 6 requests at 2 QPS, 512 prompt tokens (a 256-token shared prefix), 64 out; request 3 failed.
SERVE_PD = VLLM_BENCH / "serve_pd_detailed.json"
#: The same shape of run against the local deployment, no failures.
SERVE_LOCAL = VLLM_BENCH / "serve_local_detailed.json"
#: A run saved with --save-result but without --save-detailed.
SERVE_SUMMARY = VLLM_BENCH / "serve_summary_only.json"
#: Two runs (4 and 8 QPS, backend openai-chat) in one --append-result file, one object per line.
SERVE_APPEND = VLLM_BENCH / "serve_append_result.json"
#: SERVE_PD cut short after 2/5 of its bytes.
SERVE_TRUNCATED = VLLM_BENCH / "serve_truncated.json"
#: --stats-json-output: two Turn 1 and three Turn 2 entries; the last one's stream ended without [DONE].
MULTI_TURN = VLLM_BENCH / "multi_turn_stats.json"
#: --output-file: the conversations with the server's answers (no figures).
MULTI_TURN_CONVERSATIONS = VLLM_BENCH / "multi_turn_conversations.json"


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, doc: Any) -> Path:
    """Write ``doc`` as vLLM does (``json.dump``, default separators)."""
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path
