"""A checkpoint directory without weights (written by `m3jax.hf.save.save_shapes`): config.json and a table of every
tensor's name, dtype and shape.

A vLLM engine starts from it with vLLM's dummy weights (`load_format="dummy"`: random values of the right shapes),
and the trainer's first weight push gives them the model's values. A random model's engines so start without the
model going through disk; at the release's size the export it replaces writes 0.85 TB. What reads a checkpoint's
tensor list (the engines' check of every push, the sizing of the transfer buffers) reads the table instead of the
safetensors headers (`tensor_table`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from m3jax.hf.safetensors_io import DTYPES, CheckpointError, read_header

TENSOR_TABLE = "m3jax-tensors.json"
TABLE_FORMAT = "m3jax-tensors/1"


def shapes_only(model_dir: str) -> bool:
    """Whether `model_dir` is a checkpoint's shapes alone (`save_shapes`): a tensor table and no safetensors file
    (False for a path that is not a directory: what reads it says why)."""
    if not os.path.isdir(model_dir):
        return False
    entries = os.listdir(model_dir)
    return TENSOR_TABLE in entries and not any(f.endswith(".safetensors") for f in entries)


def tensor_table(model_dir: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} of every tensor of a checkpoint directory, in file and header order: from its
    safetensors headers, or, in a directory without weights, from its tensor table. A directory with neither, or a
    table that is not one, raises CheckpointError naming it."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if files:
        return {name: (tuple(info.shape), info.np_dtype)
                for f in files for name, info in read_header(os.path.join(model_dir, f)).items()}
    path = os.path.join(model_dir, TENSOR_TABLE)
    if not os.path.exists(path):
        raise CheckpointError(f"{model_dir}: no .safetensors files and no {TENSOR_TABLE}: expected a checkpoint "
                              "(m3jax.save_pretrained) or a directory of its shapes (m3jax.hf.save.save_shapes)")
    try:
        with open(path) as f:
            table = json.load(f)
        if table.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {table.get('format')!r}, expected {TABLE_FORMAT!r}")
        return {str(name): (tuple(int(n) for n in shape), DTYPES[code]) for name, code, shape in table["tensors"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a tensor table ({type(e).__name__}: {e}); write it with "
                              "m3jax.hf.save.save_shapes") from None


def tensor_bytes(model_dir: str) -> list[int]:
    """Byte size of each tensor of `tensor_table(model_dir)`, in its order."""
    return [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in tensor_table(model_dir).values()]
