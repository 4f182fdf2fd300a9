"""Workers configured by host name (as on Kubernetes: `vllm-decode-0.vllm-decode`) behind the real
Envoy: the picker names their IP addresses (gateway/destinations.py), since Envoy's ORIGINAL_DST
cluster resolves no names. The simulated 1P1D cluster listens on 127.0.0.1 and the picker's config
calls it `localhost`; Turn 1 goes through P and Turn 2 stays on D, with Envoy connecting to the
address the name resolves to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.deploy.picker_stack import MODEL, PickerStack, http, picker_stack, turn

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    with picker_stack(
        tmp_path_factory.mktemp("picker-names"), mode="local", worker_host="localhost"
    ) as running:
        yield running


def test_a_conversation_on_workers_named_by_host_name(stack: PickerStack) -> None:
    messages = [{"role": "user", "content": "Which address does Envoy connect to?"}]
    with stack.client() as client:
        answer, first = turn(client, messages, stream=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And now?"}]
        answer2, second = turn(client, messages, stream=False)
    assert answer
    assert answer2
    assert (first["x-ppd-path"], first["x-ppd-decode-worker"]) == ("pd", "D0")
    assert (second["x-ppd-path"], second["x-ppd-turn"], second["x-ppd-decode-worker"]) == ("local", "2", "D0")
    # Envoy made its upstream host from the picker's header: D's IP address and port, not a name.
    d_port = urlsplit(stack.workers["D0"]).port
    _, clusters = stack.envoy.get("/clusters")
    assert f"workers::127.0.0.1:{d_port}::" in clusters.decode()
    assert "localhost" not in clusters.decode()


def test_other_routes_pass_through_to_a_worker_named_by_host_name(stack: PickerStack) -> None:
    status, body = http(stack.url + "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == MODEL
