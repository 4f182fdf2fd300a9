"""The picker behind the real Envoy in the GIE-style full-duplex mode (deploy/envoy/picker/envoy-gie.yaml):
what Envoy sends still matches the committed recording the replay tests use, the clients get their
answers (trailers and the 413 included), and a multi-turn streamed chat gives the same answers and
X-PPD headers through that config as through our own.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import openai
import pytest

from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.extproc_recorder import LIMIT, kinds, load, record
from tests.deploy.picker_stack import picker_stack, turn
from tests.gateway.fakes import KV_PARAMS

pytestmark = pytest.mark.integration

#: The headers a turn's routing shows; the session and request ids differ by design.
ROUTING = ("x-ppd-path", "x-ppd-reason", "x-ppd-turn", "x-ppd-decode-worker", "x-ppd-prefill-worker")


def test_envoy_sends_the_recorded_sequences_and_every_client_gets_its_answer(tmp_path: Path) -> None:
    recorded = record(tmp_path)
    committed = load()
    assert set(recorded.streams) == set(committed)
    for name, messages in recorded.streams.items():
        assert kinds(messages) == kinds(committed[name]), name

    completion = recorded.exchanges["multi_chunk_completion"]
    assert completion.status == 200
    assert (completion.headers["x-ppd-path"], completion.headers["x-ppd-turn"]) == ("pd", "1")
    assert b"hello" in completion.body
    ((line, body, _),) = recorded.upstream["multi_chunk_completion"]
    assert line.startswith("POST /v1/chat/completions")
    assert json.loads(body)["kv_transfer_params"] == KV_PARAMS  # the picker's body reached D whole

    too_long = recorded.exchanges["over_the_limit"]
    assert too_long.status == 413
    error = json.loads(too_long.body)["error"]
    assert (error["code"], error["message"]) == (413, f"request body over the limit of {LIMIT} bytes")
    assert recorded.upstream["over_the_limit"] == []

    assert recorded.exchanges["models"].status == 200
    other = recorded.exchanges["other_post"]
    assert json.loads(other.body)["echo"] == '{"model": "m", "input": "hi"}'  # passed through unchanged

    trailers = recorded.exchanges["trailers"]
    assert trailers.status == 200
    assert trailers.trailers == {"x-upstream-trailer": "done"}  # the response's, echoed
    ((_, body, sent_trailers),) = recorded.upstream["trailers"]
    assert sent_trailers == {"x-client-trailer": "yes"}  # the request's, answered and forwarded
    assert json.loads(body)["kv_transfer_params"] == KV_PARAMS


def test_a_multi_turn_streamed_chat_is_the_same_through_the_gie_config(tmp_path: Path) -> None:
    """One picker, two Envoys in front of it (ours: BUFFERED; GIE's: full duplex): the same
    conversation, each under its own session, gets the same answers and routing headers; the
    scenario's verify.sh passes against the GIE-style Envoy too."""
    with picker_stack(tmp_path, mode="local") as stack:
        gie = Envoy.start(
            "picker",
            tmp_path / "envoy-gie",
            cluster="unused",
            upstream_ports=[],
            extra={
                "PICKER_PORT": str(stack.picker.info["grpc"]),
                "WORKER_ENDPOINTS": stack.worker_endpoints,
            },
            template=(SCENARIOS / "picker" / "envoy-gie.yaml").read_text(),
        )
        try:
            gie.await_healthy("picker", {int(stack.picker.info["grpc"])})
            gie_url = f"http://127.0.0.1:{gie.listeners['picker']}"
            results = {
                name: _chat(url, session=name) for name, url in (("ours", stack.url), ("gie", gie_url))
            }
            env = {
                **os.environ,
                "ENVOY": gie_url.removeprefix("http://"),
                "ADMIN": gie.admin.removeprefix("http://"),
            }
            verify = subprocess.run(
                ["bash", str(SCENARIOS / "picker" / "verify.sh")],
                env=env, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
        finally:
            gie.close()
    assert verify.returncode == 0, verify.stdout + verify.stderr  # the scenario's checks hold too
    assert results["gie"] == results["ours"]
    assert [(routing[0], routing[2], routing[3]) for _, routing in results["gie"]] == [
        ("pd", "1", "D0"),
        ("local", "2", "D0"),
        ("local", "3", "D0"),
    ]
    assert all(answer for answer, _ in results["gie"])


def _chat(url: str, *, session: str) -> list[tuple[str, tuple[str | None, ...]]]:
    """Three streamed turns of one conversation: each answer and its routing headers."""
    messages = [{"role": "user", "content": "Tell me about full duplex."}]
    seen: list[tuple[str, tuple[str | None, ...]]] = []
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        for n in (1, 2, 3):
            answer, headers = turn(client, messages, stream=True, headers={"x-session-id": session})
            seen.append((answer, tuple(headers.get(h) for h in ROUTING)))
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"turn {n + 1}"},
            ]
    return seen
