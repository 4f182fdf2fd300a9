"""The picker's GIE subset hint and llm-d sidecar mode through the real Envoy (picker.py rules 7 and 8).

Subset hints: our picker config plus what a gateway that sends hints adds: a
`header_to_metadata` filter before ext_proc that writes the test's `x-test-subset` header as
`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` (a flat comma string, the form
such a rule gives) and `metadata_options.forwarding_namespaces` listing that namespace, so Envoy
sends it to the picker in `metadata_context`.

llm-d's sidecar mode: each simulated D sits behind tests/deploy/llmd_sidecar.py (the picker's config
names the sidecar as the decode worker, as an llm-d InferencePool targets the sidecar's port); the
picker runs no P leg and names P in `x-prefiller-host-port`, and the sidecar runs P then D.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.deploy.envoy_harness import SCENARIOS
from tests.deploy.picker_stack import MODEL, PickerStack, http, picker_stack, turn
from tests.deploy.processes import Announced

pytestmark = pytest.mark.integration

SUBSET_HEADER = "x-test-subset"
_HINT_FILTER = """\
          # Test only: the gateway's subset hint, from a request header.
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                remove: true
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
"""
# envoy.yaml forwards envoy.lb already (the served endpoint, gateway/picker_failover.py); the hint's
# namespace joins it.
_FORWARDED = """\
                forwarding_namespaces:
                  untyped: ["envoy.lb"]
"""
_FORWARD = """\
                forwarding_namespaces:
                  untyped: ["envoy.lb", "envoy.lb.subset_hint"]
"""


_PICKER_FILTER = "          # 2. The picker.\n"
_RECEIVING = "                receiving_namespaces:\n"


def hinting_config() -> str:
    """deploy/envoy/picker/envoy.yaml with the hint filter before ext_proc and the namespace forwarded."""
    text = (SCENARIOS / "picker" / "envoy.yaml").read_text()
    for anchor in ("          # 2. The picker.\n", _FORWARDED):
        assert text.count(anchor) == 1, f"envoy.yaml changed: {anchor!r} is no longer there once"
    text = text.replace("          # 2. The picker.\n", _HINT_FILTER + "          # 2. The picker.\n")
    return text.replace(_FORWARDED, _FORWARD)


def _address(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


@pytest.fixture(scope="module")
def hinted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    tmp = tmp_path_factory.mktemp("picker-subset")
    with picker_stack(tmp, mode="local", topology="1P2D", envoy_template=hinting_config()) as running:
        yield running


def test_completions_go_to_the_d_the_hint_names(hinted: PickerStack) -> None:
    d1 = _address(hinted.workers["D1"])
    with hinted.client() as client:
        for n in range(3):  # without the hint, equally loaded Ds take turns (pool.py's rank)
            messages = [{"role": "user", "content": f"Conversation {n} inside the subset."}]
            answer, headers = turn(
                client, messages, stream=True, headers={SUBSET_HEADER: f"10.9.9.9:1, {d1}"}
            )
            assert answer
            assert (headers["x-ppd-decode-worker"], headers["x-ppd-path"]) == ("D1", "pd")
            assert headers["x-ppd-prefill-worker"] == "P0"  # P is never narrowed


def test_a_hint_with_no_live_d_is_a_503_from_the_picker(hinted: PickerStack) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    hint = {SUBSET_HEADER: _address(hinted.workers["P0"]), "Content-Type": "application/json"}
    status, answer = http(hinted.url + "/v1/chat/completions", body.encode(), hint)
    assert status == 503
    error = json.loads(answer)["error"]
    assert error["message"] == "no live decode worker in the gateway's endpoint subset (envoy.lb.subset_hint)"
    status, _ = http(hinted.url + "/v1/models", None, {SUBSET_HEADER: "10.9.9.9"})
    assert status == 503  # a pass-through too
    status, _ = http(hinted.url + "/v1/models", None, {SUBSET_HEADER: _address(hinted.workers["P0"])})
    assert status == 200  # any worker inside, P included


def test_llmd_mode_names_p_to_the_sidecar_which_runs_p_then_d(tmp_path: Path) -> None:
    sidecars: dict[str, str] = {}

    def start(exits: ExitStack, urls: dict[str, str]) -> dict[str, str]:
        sidecar = Announced.start(
            [sys.executable, "-m", "tests.deploy.llmd_sidecar", "--decode", urls["D0"]],
            log=tmp_path / "sidecar.log",
        )
        exits.callback(sidecar.close)
        sidecars["D0"] = str(sidecar.info["url"])
        return dict(sidecars)

    extra = ["", "[routing]", "llmd_sidecar = true"]
    with (
        picker_stack(tmp_path, mode="local", extra=extra, worker_urls=start) as stack,
        stack.client() as client,
    ):
        seen = sidecars["D0"] + "/_sidecar/seen"
        p_before = stack.prompt_tokens("P0")
        pulled_before = stack.prompt_tokens("D0", "external_kv_transfer")
        messages = [{"role": "user", "content": "Tell me about llm-d's sidecar."}]
        answer, first = turn(client, messages, stream=True)
        assert answer
        assert (first["x-ppd-path"], first["x-ppd-prefill-worker"], first["x-ppd-decode-worker"]) == (
            "pd",
            "P0",
            "D0",
        )
        assert json.loads(http(seen)[1]) == [_address(stack.workers["P0"])]  # P's ip:port
        assert stack.prompt_tokens("P0") > p_before  # the sidecar ran the P leg
        assert stack.prompt_tokens("D0", "external_kv_transfer") > pulled_before  # D pulled P's KV

        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        p_after_one = stack.prompt_tokens("P0")
        answer2, second = turn(client, messages, stream=False)
        assert answer2
        assert (second["x-ppd-path"], second["x-ppd-turn"]) == ("local", "2")
        assert json.loads(http(seen)[1])[1:] == [None]  # no prefiller header: D alone
        assert stack.prompt_tokens("P0") == p_after_one
