"""Build the tiny Llama-3 model folder: seeded random weights, the exact Llama-3 tokenizer, its chat template.

Run by the vLLM venv's interpreter (``python build_model.py --spec SPEC.json --vocab V --out DIR``):
torch and transformers come from that venv. The BPE ranks and special tokens come from quicktok's data
(exported by our venv into ``--vocab``, one ``<base64 bytes> <rank>`` line per token, tiktoken's
format), so the ids are quicktok's by construction and checked afterwards by ``prepare``.

Rule 1: the same spec gives the same weights (torch's generator seeded before the model is made).
Rule 2: no sampling defaults in ``generation_config.json`` (vLLM would apply them to every request).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Llama-3's pre-tokenizer split pattern (the one its tiktoken encoding uses).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: The Llama-3.1-Instruct chat template without tools: a system header with the knowledge and
#: today dates (today fixed, as vLLM renders it with no date given), then one header per message.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _build_tokenizer(vocab: Path, specials: list[str], out: Path) -> None:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(vocab), pattern=SPLIT_PATTERN, extra_special_tokens=specials)
    backend = converter.converted()
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|eot_id|>",  # noqa: S106 (a token, not a password)
        pad_token="<|end_of_text|>",  # noqa: S106
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))


def _build_model(spec: dict[str, Any], out: Path, eos_ids: list[int], bos_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        vocab_size=spec["vocab_size"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        rope_theta=500_000.0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    # Only the token ids: no temperature/top_p defaults that vLLM would apply to every request.
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids).save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny random-weight Llama-3 model folder.")
    parser.add_argument("--spec", type=Path, required=True, help="JSON model shape (vllm_harness.spec)")
    parser.add_argument("--vocab", type=Path, required=True, help="BPE ranks, tiktoken format")
    parser.add_argument("--specials", type=Path, required=True, help="JSON list of special tokens, by id")
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    specials: list[str] = json.loads(args.specials.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(args.vocab, specials, args.out)
    first_special = spec["vocab_size"] - len(specials)
    ids = {name: first_special + i for i, name in enumerate(specials)}
    _build_model(spec, args.out, [ids["<|end_of_text|>"], ids["<|eot_id|>"]], ids["<|begin_of_text|>"])


if __name__ == "__main__":
    main()
