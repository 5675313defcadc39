"""`convert_checkpoint`: a HF MiniMax-M3 directory in one layout -> the other, one tensor at a time.

The same tensors as `save_pretrained(from_pretrained(src, dtype), dst, layout)` (tests/test_convert_stream.py:
bitwise), without the model: each target tensor is the region of one model parameter (`layouts.slots`), filled
from the source tensors that overlap that region (`read_blocks.fill_block`) in the parameter's dtype (the router
and its bias stay fp32, as the model keeps them), and written as soon as it is complete. Host memory: one target
tensor, where the model's round trip held the whole model (~850 GB for the release). The parameters' shapes and
dtypes come from the model built abstractly (`nnx.eval_shape`).
"""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from m3jax.config import M3Config
from m3jax.hf import layouts
from m3jax.hf.load import checkpoint_files, plan_load
from m3jax.hf.read_blocks import TensorReader, fill_block, slot_region
from m3jax.hf.safetensors_io import CheckpointError
from m3jax.hf.save import parse_size, split_shards, write_shards


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, layout: str = "native", dtype=None,
                       max_shard_size: int | str = "5GB", check_finite: bool = True) -> str:
    """Write `src` (either layout) to `dst` in `layout`; dtype: the parameters' (default: the checkpoint's embedding
    dtype, as `from_pretrained`). The checkpoint's headers are all checked first (`plan_load`); a tensor holding
    NaN or Inf is refused as it is read (`check_finite`), and `dst` appears only when complete."""
    from m3jax.model.decoder import M3ForCausalLM

    if layout not in ("native", "released"):
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    cfg = M3Config.from_pretrained(src)
    _, slots, tensors = plan_load(cfg, checkpoint_files(src))
    dtype = tensors[slots[0].name].np_dtype if dtype is None else np.dtype(dtype)
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract))}
    sources: dict[tuple, list] = {}
    for slot in slots:
        sources.setdefault(slot.param, []).append(slot)
    targets = list(layouts.slots(cfg, layout))
    entries = [(t.name, np.dtype(params[t.param].dtype), t.shape) for t in targets]

    def tensors_out():
        with TensorReader() as reader:
            for target in targets:
                param = params[target.param]
                region = slot_region(target.index, param.shape)
                block = np.empty([b - a for a, b in region], param.dtype)
                problems = fill_block(block, region, param.shape, sources[target.param], tensors, reader,
                                      check_finite)
                if problems:
                    raise CheckpointError(problems[0] + ": the checkpoint's weights are not finite (a diverged run "
                                          "or a broken export); pass check_finite=False to convert it anyway")
                yield target.name, block.reshape(target.shape)

    shards = split_shards(entries, parse_size(max_shard_size))
    return write_shards(cfg, dtype, dst, layout, [(shard, True) for shard in shards], tensors_out())
