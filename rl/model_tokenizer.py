"""The tokenizer of an HF model directory (`model.path`), or one CheckpointError naming the directory and what is
missing or broken there: transformers' own errors for a directory without tokenizer files ("Couldn't instantiate
the backend tokenizer ...") or with a damaged tokenizer.json (a bare JSONDecodeError) name neither."""

from __future__ import annotations

import json
import os

# what transformers' fast and slow tokenizers load from (tokenizer_config.json alone names the class, not a vocab)
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tiktoken.model")
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from m3jax.hf.safetensors_io import CheckpointError
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(_why(path, e)) from None


def _why(path: str, e: Exception) -> str:
    """The cause named by file, where the directory's files show it; else transformers' first line."""
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in _VOCAB_FILES):
            return (f"no tokenizer in {path}: expected tokenizer.json (or tokenizer.model / vocab.json) beside its "
                    "config.json, as Hugging Face saves a model with its tokenizer")
        for name in _JSON_FILES:
            f = os.path.join(path, name)
            if not os.path.isfile(f):
                continue
            try:
                with open(f, encoding="utf-8") as fh:
                    json.load(fh)
            except (ValueError, RecursionError) as bad:  # JSONDecodeError, UnicodeDecodeError
                return f"{f} is not valid JSON ({str(bad)[:120]}); expected the tokenizer's {name}"
            except OSError as bad:
                return f"{f} cannot be read ({bad.strerror or bad}); expected the tokenizer's {name}"
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: {first})"
