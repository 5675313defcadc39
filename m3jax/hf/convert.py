"""`convert_checkpoint`: a HF MiniMax-M3 directory in one layout -> the other, in parallel parts, without the model.

The same tensors as `save_pretrained(from_pretrained(src, dtype), dst, layout)` (tests/test_convert_stream.py:
bitwise). Every tensor of either layout fills one model parameter at a leading index with whole trailing dimensions
(`layouts.slots`), so where a source tensor meets a target tensor they share one contiguous run of elements, in
both (`overlap`). The conversion is a list of such runs, cut into parts of about READ_CHUNK_BYTES: each part is
read from its source tensor (`TensorReader`), cast to the parameter's dtype (the router and its bias stay fp32, as
the model keeps them), checked for NaN / Inf and written at its place in the target's shard file (`os.pwrite`), on
READ_THREADS threads (`read_ahead`). A disk then sees several requests at once and the reads overlap the writes,
where one thread read a whole target tensor and then wrote it; host memory is the parts in flight (threads x
part), not a whole target tensor (9.7 GB for a layer's stacked expert weights of the release in the native layout).
The parameters' shapes and dtypes come from the model built abstractly (`nnx.eval_shape`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import shutil
import sys
import uuid
from typing import NamedTuple

import numpy as np
from flax import nnx

from m3jax.config import M3Config
from m3jax.hf import carry, layouts
from m3jax.hf.load import check_param_dtype, checkpoint_files, default_param_dtype, plan_load, warn_narrowed
from m3jax.hf.progress import Tenths, redraws_in_place
from m3jax.hf.read_blocks import READ_AHEAD_BYTES, READ_CHUNK_BYTES, READ_THREADS, TensorReader, read_ahead
from m3jax.hf.safetensors_io import CheckpointError, count_nonfinite, header_bytes
from m3jax.hf.save import (check_destination, check_space, clear_leftovers, finish_checkpoint, parse_size, shard_names,
                           split_shards)
from m3jax.hf.side_files import side_files

log = logging.getLogger(__name__)


class Part(NamedTuple):
    """`count` elements of source tensor `source` from element `source_at` (flattened), cast to `dtype` and written
    at byte `file_at` of the file open as `fd`: part of target tensor `target` (an index into the targets)."""
    target: int
    source: str
    source_at: int
    count: int
    dtype: np.dtype
    fd: int
    file_at: int


def overlap(source_index: tuple[int, ...], target_index: tuple[int, ...], shape: tuple[int, ...]):
    """Where two tensors meet that fill a parameter of `shape` at these leading indices, each with the parameter's
    remaining dimensions whole: they meet iff one index is a prefix of the other, in the region the longer one
    fills, one contiguous run of C-order elements of both -> (its first element in the source tensor, its first
    element in the target tensor, its length), or None. With the longer index `i` of length m, the run starts at
    sum_{j >= len(own index)} i_j * prod(shape[j+1:]) in a tensor filling at `own index`, and holds
    prod(shape[m:]) elements."""
    k = min(len(source_index), len(target_index))
    if tuple(source_index[:k]) != tuple(target_index[:k]):
        return None
    longer = max(source_index, target_index, key=len)

    def start(own):
        return sum(i * math.prod(shape[j + 1:]) for j, i in enumerate(longer) if j >= len(own))
    return start(source_index), start(target_index), math.prod(shape[len(longer):])


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, layout: str = "native", dtype=None,
                       max_shard_size: int | str = "5GB", check_finite: bool = True, threads: int = READ_THREADS,
                       chunk_bytes: int = READ_CHUNK_BYTES, carry_from: str | os.PathLike | None = None,
                       progress: bool = False) -> str:
    """Write `src` (either layout) to `dst` in `layout`; dtype: the parameters' (default: the checkpoint's embedding
    dtype, as `from_pretrained`). The checkpoint's headers are all checked first (`plan_load`), and the space the
    result needs against its filesystem's; a tensor holding NaN or Inf is refused as it is read (`check_finite`),
    and `dst` appears only when complete. `threads` parts of about `chunk_bytes` are read and written at once.
    A released result carries the vision tower (`m3jax.hf.carry`) of `carry_from`, by default `src`'s own, and any
    result carries that checkpoint's files beside its weights (tokenizer, chat template: `m3jax.hf.side_files`).
    progress: the bytes written, as a tqdm bar where stderr is a terminal, else an INFO line per tenth (the
    release's 850 GB take minutes)."""
    from m3jax.model.decoder import M3ForCausalLM

    if layout not in ("native", "released"):
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    check_param_dtype(dtype)  # an int dtype wrote every weight truncated, into a checkpoint the loader refuses
    src, dst = os.fspath(src), check_destination(dst, [src, carry_from])
    if os.path.isdir(src) and os.path.commonpath([dst, os.path.abspath(src)]) == os.path.abspath(src):
        raise FileExistsError(f"destination {dst} lies inside the checkpoint being read ({src}), which it would then "
                              "hold as a subdirectory: choose a directory outside it")
    cfg = M3Config.from_pretrained(src)
    _, slots, tensors = plan_load(cfg, checkpoint_files(src))
    chosen = dtype is not None
    dtype = np.dtype(dtype) if chosen else default_param_dtype(tensors[slots[0].name])
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract))}
    if not chosen:
        warn_narrowed(src, slots, tensors, lambda param: params[param].dtype, "the conversion")
    targets = list(layouts.slots(cfg, layout))
    kept = carry.carried(carry_from or src, layout)  # the vision tower and its kin, byte for byte
    cfg = carry.with_source_config(cfg, carry_from or src, kept)
    entries = [(t.name, np.dtype(params[t.param].dtype), t.shape) for t in targets]
    limit = parse_size(max_shard_size)
    shards = split_shards(entries, limit) + split_shards(carry.entries(kept), limit)
    entries += carry.entries(kept)
    clear_leftovers(dst)
    check_space(dst, sum(math.prod(shape) * d.itemsize for _, d, shape in entries))
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    fds: list[int] = []
    try:
        file_at = {}
        for fname, shard in zip(shard_names(len(shards)), shards):
            head, starts = header_bytes(shard)
            fds.append(os.open(os.path.join(tmp, fname), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            _write_at(fds[-1], memoryview(head), 0)
            file_at.update((name, (fds[-1], at)) for name, at in starts.items())
        parts = _parts(targets, params, slots, tensors, file_at, chunk_bytes)
        parts += _carried_parts(kept, len(targets), file_at, chunk_bytes)
        with TensorReader() as reader:
            _copy_parts(parts, [t.name for t in targets] + list(kept), {**tensors, **kept}, reader, check_finite,
                        threads, progress)
        for fd in fds:
            os.fsync(fd)
        finish_checkpoint(cfg, dtype, tmp, dst, layout, shard_names(len(shards)), [(s, True) for s in shards],
                          side_files(carry_from or src))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return dst


def _parts(targets, params: dict, slots, tensors: dict, file_at: dict, chunk_bytes: int) -> list[Part]:
    """Every run where a source tensor meets a target tensor, cut into parts of at most `chunk_bytes` (of the wider
    of the two dtypes), in the targets' order. The runs of each target must cover it exactly once."""
    sources = collections.defaultdict(list)
    for s in slots:
        sources[s.param].append(s)
    parts = []
    for k, t in enumerate(targets):
        shape, dtype = params[t.param].shape, np.dtype(params[t.param].dtype)
        fd, at, covered = *file_at[t.name], 0
        for s in sources[t.param]:
            met = overlap(s.index, t.index, shape)
            if met is None:
                continue
            source_at, target_at, count = met
            width = max(dtype.itemsize, tensors[s.name].np_dtype.itemsize)
            parts += _cut(k, s.name, source_at, count, dtype, fd, at + target_at * dtype.itemsize, chunk_bytes // width)
            covered += count
        if covered != math.prod(t.shape):  # a layout bug, found before anything is read
            raise RuntimeError(f"the source tensors fill {covered} of the {math.prod(t.shape)} elements of {t.name}")
    return parts


def _carried_parts(kept: dict, first: int, file_at: dict, chunk_bytes: int) -> list[Part]:
    """Each carried tensor (`m3jax.hf.carry`) copied whole in its own dtype, in parts; targets numbered from
    `first`."""
    parts = []
    for k, (name, info) in enumerate(kept.items(), start=first):
        parts += _cut(k, name, 0, math.prod(info.shape), info.np_dtype, *file_at[name],
                      chunk_bytes // info.np_dtype.itemsize)
    return parts


def _cut(target: int, source: str, source_at: int, count: int, dtype: np.dtype, fd: int, file_at: int,
         step: int) -> list[Part]:
    """The run of `count` elements from `source_at` of `source`, written from byte `file_at`, in parts of at most
    `step` elements."""
    step = max(1, step)
    return [Part(target, source, source_at + a, min(step, count - a), dtype, fd, file_at + a * dtype.itemsize)
            for a in range(0, count, step)]


def _copy_parts(parts: list[Part], names: list[str], tensors: dict, reader: TensorReader, check_finite: bool,
                threads: int, progress: bool = False) -> None:
    """Read, cast, check and write every part, `threads` at once; the first target holding NaN or Inf raises once
    all its parts are in, naming its first such source tensor and how many of the values read were not finite."""
    left = collections.Counter(p.target for p in parts)
    bad: dict[int, dict[str, list[int]]] = collections.defaultdict(dict)  # target -> source -> [non-finite, read]

    def copy(part: Part) -> int:
        info = tensors[part.source]
        out = np.empty(part.count, part.dtype)
        reader.read(info, (math.prod(info.shape),), ((part.source_at, part.source_at + part.count),), out)
        _write_at(part.fd, memoryview(out.view(np.uint8)), part.file_at)
        return count_nonfinite(out) if check_finite else 0

    # A finished part holds no memory (its buffer dies in its thread): the budget only bounds how far ahead parts
    # are queued; what is in flight is at most `threads` parts.
    from tqdm import tqdm
    total = sum(p.count * p.dtype.itemsize for p in parts)
    terminal = progress and redraws_in_place(sys.stderr)  # a job log gets lines, a terminal the bar
    lines = Tenths(log, "converting", "written", total) if progress and not terminal else None
    with contextlib.closing(read_ahead(parts, copy, lambda p: p.count * p.dtype.itemsize, threads,
                                       READ_AHEAD_BYTES)) as done, \
            tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not terminal,
                 dynamic_ncols=True) as bar:
        for part, nonfinite in done:
            bar.update(part.count * part.dtype.itemsize)
            if lines:
                lines.add(part.count * part.dtype.itemsize)
            counts = bad[part.target].setdefault(part.source, [0, 0])
            counts[0] += nonfinite
            counts[1] += part.count
            left[part.target] -= 1
            if left[part.target]:
                continue
            for name, (n, read) in bad.pop(part.target).items():
                if n:
                    info = tensors[name]
                    whole = read == math.prod(info.shape)
                    of = "" if whole else f" (in the {read} of them {names[part.target]} takes)"
                    raise CheckpointError(
                        f"tensor {name} ({info.file}) holds {n} NaN or Inf value(s) of {math.prod(info.shape)}{of}: "
                        "the checkpoint's weights are not finite (a diverged run or a broken export): use an earlier "
                        "checkpoint or export this one again (from Python, convert_checkpoint(..., check_finite=False) "
                        "copies it as it is)")


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        wrote = os.pwrite(fd, data[done:], offset + done)
        if not wrote:
            raise OSError(f"wrote nothing at byte {offset + done} of a converted shard")
        done += wrote
