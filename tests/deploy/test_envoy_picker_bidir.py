"""vLLM's bidirectional path through the real Envoy (gateway/picker.py rule 7), on a simulated 1P1D
cluster whose workers run `bidirectional_kv_xfer`: the picker observes every answer D may send its
params with, takes them out of what the client gets, as the standalone gateway does, and keeps them
with the session, so Turn 2 and Turn 3 go `bidir` (P pulls the history from D). Streamed and whole
answers, through our config (the answer switched to STREAMED) and the GIE-style one (full duplex both
ways, the answer's chunks echoed with the params taken out). The whole-answer case on our config is
also tests/conformance/test_bidirectional.py's (simulator and real vLLM).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.picker_stack import MODEL, PickerStack, picker_stack

pytestmark = pytest.mark.integration

CONFIGS = ("envoy.yaml", "envoy-gie.yaml")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    tmp = tmp_path_factory.mktemp("bidir")
    with picker_stack(
        tmp,
        mode="bidir",
        extra=["", "[routing]", "bidir = true"],
        cluster_args=("--bidir-workers", "all", "--kv-recompute-threshold", "0"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def gie_url(stack: PickerStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same picker behind envoy-gie.yaml."""
    gie = Envoy.start(
        "picker",
        tmp_path_factory.mktemp("envoy-gie"),
        cluster="unused",
        upstream_ports=[],
        extra={"PICKER_PORT": str(stack.picker.info["grpc"]), "WORKER_ENDPOINTS": stack.worker_endpoints},
        template=(SCENARIOS / "picker" / "envoy-gie.yaml").read_text(),
    )
    try:
        gie.await_healthy("picker", {int(stack.picker.info["grpc"])})
        yield f"http://127.0.0.1:{gie.listeners['picker']}"
    finally:
        gie.close()


def _turn(url: str, messages: list[dict[str, str]], *, stream: bool) -> tuple[str, list[Any], dict[str, str]]:
    """One chat turn: its answer's text, every JSON object the client received (each SSE event's, or
    the whole body) and the response headers (lower-case names)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
        headers = {k.lower(): v for k, v in resp.headers.items()}
    if not stream:
        answer = json.loads(raw)
        return answer["choices"][0]["message"]["content"], [answer], headers
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    return text, events, headers


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_turn_two_and_three_take_the_bidir_path_and_the_client_never_sees_ds_params(
    stack: PickerStack, gie_url: str, config: str, stream: bool
) -> None:
    url = stack.url if config == "envoy.yaml" else gie_url
    pulled = stack.prompt_tokens("P0", "external_kv_transfer")
    messages = [{"role": "user", "content": f"A bidirectional story, {config}, stream={stream}."}]
    paths = []
    for follow_up in ("And then?", "And the end?", None):
        text, objects, headers = _turn(url, messages, stream=stream)
        assert text
        # What the standalone gateway's relay keeps from the client: D's params (a null one may stay).
        assert all(o.get("kv_transfer_params") is None for o in objects), objects
        paths.append((headers["x-ppd-path"], headers["x-ppd-reason"]))
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    assert paths == [("pd", "turn_one"), ("bidir", "mode_bidir"), ("bidir", "mode_bidir")]
    assert stack.prompt_tokens("P0", "external_kv_transfer") > pulled  # P read D's blocks
