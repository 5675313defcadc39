"""The tokens a checkpoint's configs say its responses end at, decided as transformers' `generate` decides them
(vLLM adds the tokenizer's eos token: `rl.generation.backends.model_end_tokens`)."""

from __future__ import annotations

import json
import os

from m3jax.hf.safetensors_io import CheckpointError

GENERATION_CONFIG = "generation_config.json"


def end_token_ids(path: str | os.PathLike, eos_token_id) -> tuple[int, ...]:
    """The ids generation stops at for the checkpoint directory `path`: generation_config.json's eos_token_id
    (an id or a list) where the directory has that file and it sets one, else `eos_token_id` (config.json's, as the
    caller's M3Config read it); () when neither names one.

    A chat model often ends its turns at a token its generation_config.json lists beside config.json's eos (an
    end-of-turn token): transformers and vLLM stop at those, and a trainer that stopped at config.json's alone would
    run every such response to max_new_tokens. A generation_config.json that is not a JSON object, or whose
    eos_token_id is not an id or a list of ids, is a CheckpointError naming the file."""
    file = os.path.join(os.fspath(path), GENERATION_CONFIG)
    ids = eos_token_id
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not a readable JSON file ({e}); expected transformers' generation "
                                  "config, or no such file") from None
        if not isinstance(got, dict):
            raise CheckpointError(f"{file}: holds a JSON {type(got).__name__}; expected an object")
        if got.get("eos_token_id") is not None:
            ids = got["eos_token_id"]
            if not _ids(ids):
                raise CheckpointError(f"{file}: eos_token_id = {ids!r}; expected a token id or a list of them")
    return as_token_ids(ids)


def as_token_ids(ids) -> tuple[int, ...]:
    """An id, a list (or tuple) of ids, or None (as config files write eos_token_id) -> a tuple of ids."""
    if ids is None:
        return ()
    return tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def _ids(x) -> bool:
    def one(i):
        return isinstance(i, int) and not isinstance(i, bool) and i >= 0
    return one(x) or (isinstance(x, list) and len(x) > 0 and all(one(i) for i in x))
