"""The deterministic sampler: which token ids a request generates, why it stops, and their block hashes."""

from __future__ import annotations

from simulator.core.sampler import SamplerSettings, sample_output
from simulator.core.tokenizer import Llama3Tokenizer


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


def test_generated_blocks_hash_like_token_blocks(tok: Llama3Tokenizer) -> None:
    from simulator.core.kv_cache import TokenBlocks
    from simulator.core.sampler import GeneratedBlocks

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
