"""The tensors of a checkpoint that the text model does not hold, carried into a released-layout export.

The release is a vision-language checkpoint: besides the text model it holds the vision tower, its projector and
the patch merger (`layouts.SKIPPED`), which the text model skips on load. An export or a conversion that wrote only
the text tensors made a checkpoint whose vision tower a VL loader (transformers' VL class, vLLM's) initialises at
random: fine for text, silently wrong for an image. Carried byte for byte from the checkpoint the model came from,
the export is that multimodal checkpoint with the new text weights. The native layout is the text class's: nothing
is carried into it.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import numpy as np

from m3jax.hf import layouts
from m3jax.hf.read_blocks import TensorReader
from m3jax.hf.safetensors_io import TensorInfo

log = logging.getLogger(__name__)


def carried(src: str | os.PathLike | None, layout: str) -> dict[str, TensorInfo]:
    """{name: where it lies} of the tensors of checkpoint `src` that an export in `layout` carries: those the text
    model does not hold, for the released layout; none for the native one or without `src`."""
    if layout != "released":
        return {}
    if src is None:
        log.info("a released checkpoint without a source to carry from holds the text model only: a VL loader will "
                 "initialise its vision tower")
        return {}
    from m3jax.hf.load import checkpoint_files
    kept = {n: t for n, t in checkpoint_files(os.fspath(src)).items() if layouts.SKIPPED.search(n)}
    if not kept:
        log.info("%s holds no vision tower to carry (a native-layout or text-only checkpoint): the released "
                 "checkpoint holds the text model only", src)
    return kept


def with_source_config(cfg, src: str | os.PathLike | None, infos: dict[str, TensorInfo]):
    """`cfg` (an M3Config) carrying what the config of `src`, the checkpoint the model came from, holds beyond the
    model: its text config's other fields (`M3Config.text_passthrough`), and its vision config where its tensors
    are carried (`infos`), so the config describes the vision tower the checkpoint holds. A `src` whose text model
    differs from `cfg`'s is refused, in either layout: its fields, tokenizer and chat template (the files carried
    beside the weights, `m3jax.hf.side_files`) and vision tower belong to another model (a conversion with another
    model's `--carry-from` shipped its tokenizer, an audit). Without `src`, `cfg` as it is: a model loaded from a
    checkpoint holds that one's fields already."""
    if src is None:
        return cfg
    import dataclasses

    from m3jax.config import PASSTHROUGH_FIELDS, M3Config
    from m3jax.hf.safetensors_io import CheckpointError
    theirs = M3Config.from_pretrained(os.fspath(src))
    bare = dict.fromkeys(PASSTHROUGH_FIELDS, "")
    if dataclasses.replace(theirs, **bare) != dataclasses.replace(cfg, **bare):
        differ = [f.name for f in dataclasses.fields(cfg) if f.name not in PASSTHROUGH_FIELDS
                  and getattr(cfg, f.name) != getattr(theirs, f.name)]
        raise CheckpointError(f"{src}: its text model differs from the one written ({', '.join(differ[:5])}): its "
                              "config fields, tokenizer and vision tower are not carried into another model's "
                              "checkpoint")
    cfg = dataclasses.replace(cfg, text_passthrough=theirs.text_passthrough)
    if not infos:
        return cfg
    return dataclasses.replace(cfg, vl_passthrough=theirs.vl_passthrough)


def entries(infos: dict[str, TensorInfo]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each carried tensor, as the shard plan takes them (`save.split_shards`)."""
    return [(name, info.np_dtype, tuple(info.shape)) for name, info in infos.items()]


def tensors(infos: dict[str, TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, its array as stored) for each carried tensor, one read at a time."""
    with TensorReader() as reader:
        for name, info in infos.items():
            yield name, reader.read(info, tuple(info.shape), tuple((0, n) for n in info.shape))
