"""The picker's evidence for the closed loop through the real Envoy (issue 25 item 3; gateway/picker.py
rule 6): a sampled or explored turn's answer is switched to STREAMED by the picker's `mode_override`,
observed chunk by chunk, and leaves the standalone gateway's request-log line and TTFT/TPOT metrics;
any other answer streams past Python as before. Two stacks on the simulated 1P1D cluster:

- `sampled`: `local` mode, `[log] picker_observe_share = 1.0`: every turn observed;
- `explored`: `ppd` mode with the real DecisionService, share 0 and exploration forced (epsilon 1):
  Turn 1 (never explored) is not observed, every Turn 2 is explored and so observed.

The `sampled` picker is also put behind the GIE-style Envoy (envoy-gie.yaml, full duplex both ways),
where the answer reaches the picker as echoed chunks without any override.
"""

from __future__ import annotations

import dataclasses
import http.client as httpc
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from table_builder.build import BuildOptions, build_from_records, default_header
from table_builder.records import Record
from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.picker_stack import MODEL, PickerStack, decision_service, http, picker_stack, turn
from tests.deploy.processes import REPO
from tests.support.metrics import total
from tests.support.polling import wait_until
from tests.support.records import base_records

pytestmark = pytest.mark.integration

SHAPE, MODEL_LABEL = "1P1D", "llama-3.1-8b"
TTFT_COUNT = "ppd_gateway_time_to_first_token_seconds_count"
TPOT_COUNT = "ppd_gateway_time_per_output_token_seconds_count"


def _log_lines(shape: str) -> list[str]:
    """The request log and its labels (flushed by the picker's sweep every 0.2 s)."""
    return [
        "",
        "[sessions]",
        "sweep_interval_s = 0.2",
        "",
        "[log]",
        'request_log = "{log}"',
        'run_id = "picker"',
        f'shape = "{shape}"',
        f'model = "{MODEL_LABEL}"',
    ]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PickerStack, Path]]:
    tmp = tmp_path_factory.mktemp("sampled")
    log = tmp / "requests.jsonl"
    extra = [line.format(log=log) for line in _log_lines(SHAPE)] + ["picker_observe_share = 1.0"]
    with picker_stack(tmp, mode="local", extra=extra) as stack:
        yield stack, log


@pytest.fixture(scope="module")
def explored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PickerStack, Path]]:
    tmp = tmp_path_factory.mktemp("explored")
    log = tmp / "requests.jsonl"
    with ExitStack() as exits:
        decision = decision_service(tmp)
        exits.callback(decision.close)
        extra = [line.format(log=log) for line in _log_lines(SHAPE)] + [
            "picker_observe_share = 0.0",
            "",
            "[decision]",
            f'address = "127.0.0.1:{decision.info["grpc"]}"',
            "deadline_ms = 10000.0",
            "",
            "[explore]",
            "epsilon = 1.0",
            "seed = 7",
            "max_per_worker_per_s = 1000000.0",
        ]
        yield exits.enter_context(picker_stack(tmp, mode="ppd", extra=extra)), log


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _session_lines(path: Path, session: str, count: int) -> list[dict[str, Any]]:
    """The log's lines of one conversation, once `count` of them are there (by turn)."""
    wait_until(
        lambda: len([x for x in _lines(path) if x["conversation_id"] == session]) >= count,
        deadline_s=30,
        what=f"{count} request-log line(s) of {session}",
    )
    return sorted((x for x in _lines(path) if x["conversation_id"] == session), key=lambda x: x["turn"])


def _metric(stack: PickerStack, name: str, **labels: str) -> float:
    status, body = http(stack.picker_metrics + "/metrics")
    assert status == 200
    return total(body, name, **labels) or 0.0


def _raw_stream(stack: PickerStack, messages: list[dict[str, str]]) -> tuple[bytes, dict[str, str]]:
    """One streamed completion as the client's bytes (the body, de-chunked) and headers."""
    port = stack.envoy.listeners["picker"]
    conn = httpc.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def test_a_sampled_turn_leaves_its_line_with_ttft_tpot_and_tokens_and_moves_the_metrics(
    sampled: tuple[PickerStack, Path],
) -> None:
    stack, log = sampled
    ttft_before = _metric(stack, TTFT_COUNT, path="pd", turn_class="first")
    tpot_before = _metric(stack, TPOT_COUNT, path="local", turn_class="later")
    messages = [{"role": "user", "content": "Tell me about sampled answers."}]
    with stack.client() as client:
        answer, first = turn(client, messages, stream=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
        answer, second = turn(client, messages, stream=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Whole?"}]
        _, third = turn(client, messages, stream=False)
    session = first["x-ppd-session-id"]
    assert second["x-ppd-session-id"] == third["x-ppd-session-id"] == session
    one, two, three = _session_lines(log, session, 3)
    for line, path in ((one, "pd"), (two, "local")):
        assert (line["ok"], line["error"], line["path"], line["mode"]) == (True, None, path, "local")
        assert line["ttft_ms"] > 0
        assert line["tpot_ms"] > 0
        assert line["e2e_ms"] >= line["ttft_ms"]
        assert line["n_out"] == 8  # the answer's content chunks (turn() asks for 8 tokens)
        assert (line["shape"], line["model"]) == (SHAPE, MODEL_LABEL)
    # A whole answer: its usage, no TTFT (as the standalone gateway's line).
    assert (three["ok"], three["turn"], three["n_out"], three["ttft_ms"]) == (True, 3, 8, None)
    assert _metric(stack, TTFT_COUNT, path="pd", turn_class="first") == ttft_before + 1
    assert _metric(stack, TPOT_COUNT, path="local", turn_class="later") == tpot_before + 1
    assert _metric(stack, "ppd_gateway_requests_in_flight") == 0


def test_through_the_gie_config_an_observed_answer_is_read_from_its_echoed_chunks(
    sampled: tuple[PickerStack, Path], tmp_path: Path
) -> None:
    """envoy-gie.yaml (both bodies FULL_DUPLEX_STREAMED): every answer chunk comes to the picker as it
    is; the drawn turns are observed from those echoes, with the same line as through our config."""
    stack, log = sampled
    gie = Envoy.start(
        "picker",
        tmp_path / "envoy-gie",
        cluster="unused",
        upstream_ports=[],
        extra={"PICKER_PORT": str(stack.picker.info["grpc"]), "WORKER_ENDPOINTS": stack.worker_endpoints},
        template=(SCENARIOS / "picker" / "envoy-gie.yaml").read_text(),
    )
    try:
        gie.await_healthy("picker", {int(stack.picker.info["grpc"])})
        messages = [{"role": "user", "content": "Observed in full duplex?"}]
        url = f"http://127.0.0.1:{gie.listeners['picker']}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            answer, first = turn(client, messages, stream=True)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
            _, second = turn(client, messages, stream=True)
    finally:
        gie.close()
    assert (first["x-ppd-path"], second["x-ppd-path"]) == ("pd", "local")
    one, two = _session_lines(log, first["x-ppd-session-id"], 2)
    for line in (one, two):
        assert (line["ok"], line["error"], line["n_out"]) == (True, None, 8)
        assert line["ttft_ms"] > 0
        assert line["tpot_ms"] > 0


def test_the_client_gets_the_same_bytes_observed_or_not(
    sampled: tuple[PickerStack, Path], explored: tuple[PickerStack, Path]
) -> None:
    """The same Turn 1 (the simulator's text is a function of the prompt) through a picker that
    observes it and one that does not: byte for byte the same answer, but for the response id (the
    picker's request id) and the `created` second."""
    messages = [{"role": "user", "content": "Say the same thing twice, please."}]
    observed, seen_headers = _raw_stream(sampled[0], messages)
    unobserved, plain_headers = _raw_stream(explored[0], messages)
    assert seen_headers["x-ppd-path"] == plain_headers["x-ppd-path"] == "pd"
    assert "x-ppd-explored" not in plain_headers
    session = plain_headers["x-ppd-session-id"]
    (line,) = _session_lines(sampled[1], seen_headers["x-ppd-session-id"], 1)  # it was observed
    assert line["ok"]
    assert not [x for x in _lines(explored[1]) if x["conversation_id"] == session]  # it was not

    def normal(raw: bytes, headers: dict[str, str]) -> bytes:
        raw = raw.replace(headers["x-request-id"].encode(), b"RID")
        return re.sub(rb'"created":\s*\d+', b'"created":0', raw)

    assert observed.count(b"data: ") > 8
    assert normal(observed, seen_headers) == normal(unobserved, plain_headers)


def test_share_zero_logs_no_unexplored_turn_and_every_explored_one(
    explored: tuple[PickerStack, Path],
) -> None:
    stack, log = explored
    messages = [{"role": "user", "content": "Explore with me."}]
    with stack.client() as client:
        answer, first = turn(client, messages, stream=True)
        assert "x-ppd-explored" not in first  # Turn 1 is never explored
        for n in (2, 3):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"turn {n}"}]
            answer, headers = turn(client, messages, stream=True)
            assert headers["x-ppd-explored"] == "1", headers
            assert headers["x-ppd-reason"] == "explore"
    session = first["x-ppd-session-id"]
    two, three = _session_lines(log, session, 2)
    assert (two["turn"], three["turn"]) == (2, 3)  # no line for Turn 1
    for line in (two, three):
        assert (line["ok"], line["explored"], line["mode"]) == (True, True, "ppd")
        assert line["ttft_ms"] > 0
        assert line["tpot_ms"] > 0
        assert line["n_out"] == 8


def _base_records() -> list[Record]:
    """tests/support/records.py's base records (one cell measured by static pd and local runs), of
    this cluster's shape."""
    return [dataclasses.replace(r, shape=SHAPE) for r in base_records()]


def test_table_refresh_takes_the_pickers_explored_lines_as_evidence(
    explored: tuple[PickerStack, Path], tmp_path: Path
) -> None:
    stack, log = explored
    messages = [{"role": "user", "content": "Evidence, please."}]
    with stack.client() as client:
        answer, first = turn(client, messages, stream=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
        turn(client, messages, stream=True)
    _session_lines(log, first["x-ppd-session-id"], 1)
    raw = log.read_bytes()  # once: the picker may still be flushing another test's lines
    lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    evidence = [x for x in lines if x["ok"] and x["turn"] >= 2 and x["path"] in ("pd", "local")]
    assert evidence
    base = tmp_path / "base" / f"{SHAPE}__{MODEL_LABEL}.ppdt"
    base.parent.mkdir()
    built = build_from_records(
        _base_records(), BuildOptions(header=default_header(SHAPE, MODEL_LABEL), min_samples=2)
    )
    base.write_bytes(built.encode())
    logs = tmp_path / "logs" / "picker-0"
    logs.mkdir(parents=True)
    (logs / "requests.jsonl").write_bytes(raw)
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "table_builder", "refresh", "--logs", str(logs.parent), "--base", str(base),
         "--out", f"{out}/", "--json"],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (report_line,) = [s for s in result.stdout.splitlines() if s.startswith("{")]
    report = json.loads(report_line)
    assert report["used"] == len(evidence), report
    assert (out / base.name).exists()
