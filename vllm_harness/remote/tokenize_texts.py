"""Print, as one JSON line, the ids the model folder's tokenizer gives each text (BOS added).

Run by the vLLM venv's interpreter: ``python tokenize_texts.py MODEL_DIR TEXT...``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    print(json.dumps([tokenizer.encode(text) for text in sys.argv[2:]]))


if __name__ == "__main__":
    main()
