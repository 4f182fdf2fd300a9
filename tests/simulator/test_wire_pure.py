"""Pure wire-layer pieces: tokenizer and chat template, request validation, sampling, topologies, faults."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.api_error import ApiError
from simulator.faults import Faults
from simulator.protocol import ServingLimits, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from simulator.responses import ResponseRenderer, Usage, sse_event
from simulator.sampler import SamplerSettings, sample_output
from simulator.tokenizer import ChatMessage, Llama3Tokenizer, render_chat
from simulator.topology import Topology, TopologyError
from simulator.worker_settings import WorkerSettings

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LIMITS = ServingLimits(model=MODEL, max_model_len=4096)


@pytest.fixture(scope="module")
def tok() -> Llama3Tokenizer:
    return Llama3Tokenizer()


def test_completion_prompt_gets_one_bos(tok: Llama3Tokenizer) -> None:
    ids = tok.encode("hello world", add_special_tokens=True)
    assert ids == [128000, 15339, 1917]
    assert tok.encode("<|begin_of_text|>hello world", add_special_tokens=True) == ids
    assert tok.encode("hello world", add_special_tokens=False) == [15339, 1917]


def test_chat_template_is_llama31(tok: Llama3Tokenizer) -> None:
    messages = [ChatMessage("system", " Be brief. "), ChatMessage("user", "Hi")]
    text = render_chat(messages)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_id
    assert ids.count(tok.bos_id) == 1
    assert ids.count(tok.eot_id) == 2
    assert ids[-2:] == [128007, 271]  # <|end_header_id|> "\n\n"


def test_completion_defaults_and_ids(tok: Llama3Tokenizer) -> None:
    req = parse_completion({"prompt": "hello world"}, tok, LIMITS)
    assert req.max_tokens == 16
    assert req.prompt_ids == (128000, 15339, 1917)
    assert req.model == MODEL
    assert req.kv_transfer is None
    ids = parse_completion({"prompt": [1, 2, 3], "max_tokens": 5, "unknown_field": 1}, tok, LIMITS)
    assert ids.prompt_ids == (1, 2, 3)


def test_chat_max_completion_tokens_wins(tok: Llama3Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "max_completion_tokens": 7}
    assert parse_chat(body, tok, LIMITS).max_tokens == 7
    unlimited = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS)
    assert unlimited.max_tokens == LIMITS.max_model_len - len(unlimited.prompt_ids)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "Stream options can only be defined",
        ),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens must be less than or equal"),
        ({"prompt": "x", "min_tokens": -1}, 400, "min_tokens must be greater than or equal to 0"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"prompt": "x", "max_tokens": 10**12}, 400, "is too large"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "valid integer"),
        ({"prompt": "x", "max_tokens": 1.5}, 400, "fractional"),
        ({"prompt": "x", "stream": "yes"}, 400, "valid boolean"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
        ({"prompt": [10**9]}, 400, "out of vocabulary"),
        ({"prompt": []}, 400, "Prompt cannot be empty"),
        ({"prompt": "", "add_special_tokens": False}, 400, "Prompt cannot be empty"),
        ({"prompt": {"a": 1}}, 400, "prompt must be"),
        ({}, 400, "Field required"),
        ([1, 2], 400, "JSON object"),
        ({"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"prompt": "x", "seed": 2**70}, 400, "seed"),
        ({"prompt": "x", "n": 3}, 400, "n=1"),
    ],
)
def test_completion_validation_errors(tok: Llama3Tokenizer, body: Any, status: int, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion(body, tok, LIMITS)
    assert info.value.status == status
    assert fragment in info.value.message
    error = info.value.body()["error"]
    assert error["code"] == status
    assert error["type"] in {"BadRequestError", "NotFoundError"}


def test_prompt_longer_than_context_is_rejected(tok: Llama3Tokenizer) -> None:
    with pytest.raises(ApiError, match="maximum context length"):
        parse_completion({"prompt": [1] * 5000, "max_tokens": 1}, tok, LIMITS)


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"content": "x"}], [{"role": "user", "content": 5}], [{"role": "user", "content": [1]}]],
)
def test_chat_validation_errors(tok: Llama3Tokenizer, messages: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": messages}, tok, LIMITS)
    assert info.value.status == 400


def test_chat_text_parts_are_joined(tok: Llama3Tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = parse_chat({"messages": [{"role": "user", "content": parts}]}, tok, LIMITS)
    plain = parse_chat({"messages": [{"role": "user", "content": "a\nb"}]}, tok, LIMITS)
    assert joined.prompt_ids == plain.prompt_ids


def test_kv_transfer_params_are_parsed(tok: Llama3Tokenizer) -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "P0-engine",
        "remote_request_id": "cmpl-x-0-abcdefgh",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 40,
        "remote_prefill_cached_tokens": 16,
    }
    kv = parse_completion({"prompt": "x", "kv_transfer_params": params}, tok, LIMITS).kv_transfer
    assert kv is not None
    assert kv.do_remote_prefill
    assert kv.remote_block_ids == ((1, 2, 3),)
    assert kv.remote_prefill_cached_tokens == 16
    assert kv.remote_blocks_expiry_time is None
    # A decode worker's bidirectional params carry the expiry of its pinned blocks.
    d_params = params | {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_blocks_expiry_time": 812.5,
    }
    kv = parse_completion({"prompt": "x", "kv_transfer_params": d_params}, tok, LIMITS).kv_transfer
    assert kv is not None
    assert kv.remote_blocks_expiry_time == 812.5
    bad = params | {"remote_blocks_expiry_time": "soon"}
    with pytest.raises(ApiError, match="kv_transfer_params"):
        parse_completion({"prompt": "x", "kv_transfer_params": bad}, tok, LIMITS)


def test_worker_settings_validate_the_kv_connector_knobs() -> None:
    ok = WorkerSettings(worker_id="D0", role="decode", bidirectional_kv_xfer=True)
    assert (ok.decoder_kv_blocks_ttl_s, ok.kv_recompute_threshold) == (480.0, 64)
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl_s"):
        WorkerSettings(worker_id="D0", role="decode", decoder_kv_blocks_ttl_s=0.0)
    with pytest.raises(ValueError, match="kv_recompute_threshold"):
        WorkerSettings(worker_id="P0", role="prefill", kv_recompute_threshold=-1)


def test_tokenize_and_detokenize(tok: Llama3Tokenizer) -> None:
    ids, strs = parse_tokenize({"prompt": "hello world", "add_special_tokens": False}, tok, LIMITS)
    assert ids == [15339, 1917]
    assert not strs
    chat_ids, _ = parse_tokenize({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS)
    assert chat_ids == tok.encode_chat([ChatMessage("user", "hi")])
    assert parse_detokenize({"tokens": [15339, 1917]}, tok, LIMITS) == [15339, 1917]
    with pytest.raises(ApiError):
        parse_detokenize({"tokens": ["a"]}, tok, LIMITS)
    with pytest.raises(ApiError):
        parse_tokenize({"prompt": 5}, tok, LIMITS)


def test_sampling_is_deterministic_and_honours_limits(tok: Llama3Tokenizer) -> None:
    prompt = tuple(tok.encode("tell me a story", add_special_tokens=True))
    talkative = SamplerSettings(mean_natural_tokens=0)
    a = sample_output(
        prompt, seed=7, max_tokens=20, min_tokens=0, ignore_eos=False, settings=talkative, tokenizer=tok
    )
    b = sample_output(
        prompt, seed=7, max_tokens=20, min_tokens=0, ignore_eos=False, settings=talkative, tokenizer=tok
    )
    c = sample_output(
        prompt, seed=8, max_tokens=20, min_tokens=0, ignore_eos=False, settings=talkative, tokenizer=tok
    )
    assert a == b
    assert a != c
    assert len(a.token_ids) == 20
    assert a.finish_reason == "length"
    assert a.token_ids[0] in tok.first_word_ids
    assert all(t in tok.word_ids for t in a.token_ids[1:])
    text = tok.decode(a.token_ids)
    assert tok.encode(text, add_special_tokens=False) == list(a.token_ids)


def test_eos_min_tokens_and_ignore_eos(tok: Llama3Tokenizer) -> None:
    terse = SamplerSettings(mean_natural_tokens=1)  # wants to stop at once
    prompt = (1, 2, 3)
    stop = sample_output(
        prompt, seed=1, max_tokens=50, min_tokens=0, ignore_eos=False, settings=terse, tokenizer=tok
    )
    assert stop.token_ids == (tok.eot_id,)
    assert stop.finish_reason == "stop"
    assert tok.decode(stop.token_ids) == ""
    held = sample_output(
        prompt, seed=1, max_tokens=50, min_tokens=10, ignore_eos=False, settings=terse, tokenizer=tok
    )
    assert len(held.token_ids) == 11
    assert held.token_ids[-1] == tok.eot_id
    assert tok.eot_id not in held.token_ids[:-1]
    full = sample_output(
        prompt, seed=1, max_tokens=50, min_tokens=0, ignore_eos=True, settings=terse, tokenizer=tok
    )
    assert len(full.token_ids) == 50
    assert full.finish_reason == "length"
    capped = sample_output(
        prompt, seed=1, max_tokens=10, min_tokens=10, ignore_eos=False, settings=terse, tokenizer=tok
    )
    assert len(capped.token_ids) == 10
    assert capped.finish_reason == "length"


def test_renderer_chunks(tok: Llama3Tokenizer) -> None:
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tok,
        LIMITS,
    )
    r = ResponseRenderer(req, response_id="chatcmpl-abc", created=1)
    first = r.role_chunk(None)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    mid = r.delta_chunk(text=" x", token_ids=[1], finish_reason=None, usage=None)
    assert "kv_transfer_params" not in mid
    last = r.delta_chunk(text="", token_ids=[2], finish_reason="length", usage=None)
    assert last["kv_transfer_params"] is None
    usage = r.usage_chunk(Usage(prompt_tokens=5, completion_tokens=2))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


def test_topologies() -> None:
    topo = Topology.parse("1P3D")
    assert [(w.id, w.role) for w in topo.workers] == [
        ("P0", "prefill"),
        ("D0", "decode"),
        ("D1", "decode"),
        ("D2", "decode"),
    ]
    assert [w.id for w in Topology.parse("4r").workers] == ["R0", "R1", "R2", "R3"]
    assert len(Topology.parse("3P1D").workers) == 4
    for bad in ("", "P3D", "1X", "3D", "100R", "0R"):
        with pytest.raises(TopologyError):
            Topology.parse(bad)


def test_faults_update_and_validation() -> None:
    faults = Faults().updated({"error_rate": 0.5, "down_after_requests": 3})
    assert faults.error_rate == 0.5
    assert faults.down_after_requests == 3
    assert faults.updated({"error_rate": None}).error_rate == 0.0
    assert faults.as_json()["down_after_requests"] == 3
    for bad in ({"error_rate": 2}, {"down": "yes"}, {"nope": 1}, {"down_after_requests": -1}, [1]):
        with pytest.raises(ApiError):
            faults.updated(bad)


def test_generated_blocks_hash_like_token_blocks(tok: Llama3Tokenizer) -> None:
    from simulator.kv_cache import TokenBlocks
    from simulator.sampler import GeneratedBlocks

    prompt = tuple(tok.encode("a prompt of a few tokens " * 5, add_special_tokens=True))
    out = sample_output(
        prompt,
        seed=1,
        max_tokens=70,
        min_tokens=0,
        ignore_eos=True,
        settings=SamplerSettings(),
        tokenizer=tok,
    )
    lazy = GeneratedBlocks(prompt, out)
    eager = TokenBlocks([*prompt, *out.token_ids])
    n_blocks = (len(prompt) + 70) // 16
    assert [lazy.block_hash(i) for i in range(n_blocks)] == [eager.block_hash(i) for i in range(n_blocks)]


def test_huge_outputs_cost_nothing_up_front(tok: Llama3Tokenizer) -> None:
    out = sample_output(
        (1, 2),
        seed=None,
        max_tokens=10**6,
        min_tokens=0,
        ignore_eos=True,
        settings=SamplerSettings(),
        tokenizer=tok,
    )
    assert out.length == 10**6
    assert len(out.ids(999_990)) == 10


@pytest.mark.parametrize(
    "module_name",
    [
        "simulator.api_error",
        "simulator.fabric",
        "simulator.faults",
        "simulator.jobs",
        "simulator.metrics",
        "simulator.protocol",
        "simulator.realtime",
        "simulator.responses",
        "simulator.sampler",
        "simulator.serve_cli",
        "simulator.tokenizer",
        "simulator.topology",
        "simulator.worker",
        "simulator.worker_group",
        "simulator.worker_settings",
    ],
)
def test_all_lists_exactly_the_public_names(module_name: str) -> None:
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    exported = set(module.__all__)
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module_name
    }
    assert defined <= exported, f"public but not in __all__: {defined - exported}"
    assert all(hasattr(module, name) for name in exported)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_fast_delta_event_matches_the_slow_path(tok: Llama3Tokenizer, kind: str) -> None:
    if kind == "chat":
        req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True}, tok, LIMITS)
    else:
        req = parse_completion({"prompt": "hi", "stream": True}, tok, LIMITS)
    r = ResponseRenderer(req, response_id="x-1", created=5)
    for text in (" word", 'quote " and \\ back', "caf\u00e9 \u2603", ""):
        slow = sse_event(r.delta_chunk(text=text, token_ids=[1], finish_reason=None, usage=None))
        assert r.delta_event(text) == slow
    assert tok.token_text(tok.word_ids[0]) == tok.decode([tok.word_ids[0]])
