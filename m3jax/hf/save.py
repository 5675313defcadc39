"""`save_pretrained`: M3ForCausalLM -> HF directory (native or released layout), written atomically.

Tensors are fetched from the devices one HF tensor at a time and streamed into safetensors shards of
at most `max_shard_size` bytes, so the host never holds more than one tensor beyond the model; on a multi-host
mesh each process writes the tensors its devices hold, into shards of its own. The directory appears only when
complete: it is written beside the target and renamed into place.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shutil
import uuid

import jax
import numpy as np
from flax import nnx

from m3jax.hf import carry, layouts
from m3jax.hf.side_files import copy_side_files, side_files
from m3jax.hf.safetensors_io import CODES, StreamingWriter
from m3jax.hf.shapes import TABLE_FORMAT, TENSOR_TABLE
from m3jax.hf.tensors import hf_tensors, processes_where

log = logging.getLogger(__name__)
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(size: int | str) -> int:
    """5_000_000_000, "5GB", "512MiB" -> bytes (ValueError naming the value unless it is a positive size)."""
    try:
        if isinstance(size, str):
            s = size.strip().upper()
            unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if s.endswith(u)), "")
            nbytes = int(float(s[: len(s) - len(unit)]) * _UNITS[unit]) if unit else int(s)
        else:
            nbytes = int(size) if int(size) == size else -1
    except (TypeError, ValueError, OverflowError):
        nbytes = -1
    if nbytes < 1:
        raise ValueError(f"max_shard_size = {size!r}: expected a positive size, such as 5GB, 500MB or a byte count")
    return nbytes


def save_pretrained(model, path: str | os.PathLike, layout: str = "native", max_shard_size: int | str = "5GB",
                    carry_from: str | os.PathLike | None = None) -> str:
    """Write `model` as a HF checkpoint directory in `layout` ("native" or "released").

    carry_from: the checkpoint the model was loaded from; a released-layout export also holds its tensors that the
    text model does not (the vision tower, its projector: `m3jax.hf.carry`), byte for byte, in shards after the text
    model's, so a VL loader finds the checkpoint whole; any export carries its files beside the weights (tokenizer,
    chat template, generation config: `m3jax.hf.side_files`).
    On a multi-host mesh every process must call this, and `path` must be on a filesystem every host sees:
    each process writes the tensors it owns (`m3jax.hf.owned`: those its own devices hold, balanced by bytes)
    into shard files of its own, so no host gathers the model and the hosts write side by side; only a tensor
    that no single host holds is gathered (collectively, by all); process 0 writes the carried tensors. Process 0
    writes the index and config and moves the directory into place; every process returns once it is there."""
    if layout not in ("native", "released"):
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    path = check_destination(path, [carry_from])
    limit = parse_size(max_shard_size)
    kept = carry.carried(carry_from, layout)  # every process plans the same shards; process 0 reads them
    carried_shards = split_shards(carry.entries(kept), limit)
    cfg = carry.with_source_config(model.cfg, carry_from, kept)
    side = side_files(carry_from)
    lost = [] if carry_from is not None or not os.path.isdir(path) else [os.path.basename(f) for f in side_files(path)]
    if lost and jax.process_index() == 0:  # saved over the directory the model came from: its tokenizer went
        log.warning("%s is replaced whole, and its %s are not in the new checkpoint (no carry_from): copy them "
                    "first, or save to a new directory with carry_from=%s", path, ", ".join(lost), path)
    if jax.process_count() == 1:
        entries = [(slot.name, dtype, slot.shape) for slot, dtype in slot_dtypes(model, layout)]
        shards = split_shards(entries, limit) + carried_shards
        return write_shards(cfg, model.dtype, path, layout, [(shard, True) for shard in shards],
                            itertools.chain(hf_tensors(model, layout), carry.tensors(kept)), side=side)
    from jax.experimental import multihost_utils

    from m3jax.hf.owned import owned_hf_tensors, owner_plan
    me = jax.process_index()
    plan = owner_plan(model, layout, jax.process_count())
    owned = [[(s.name, np.dtype(v.dtype), s.shape) for s, v, _, _, o in plan if o == p]
             for p in range(jax.process_count())]
    shards = [(shard, p == me) for p, entries in enumerate(owned) for shard in split_shards(entries, limit)]
    shards += [(shard, me == 0) for shard in carried_shards]
    token = int(multihost_utils.broadcast_one_to_all(np.int32(uuid.uuid4().int % (1 << 31))))
    tensors = owned_hf_tensors(model, layout)
    return write_shards(cfg, model.dtype, path, layout, shards,
                        itertools.chain(tensors, carry.tensors(kept)) if me == 0 else tensors,
                        token=f"{token:08x}", side=side)


def save_shapes(model, path: str | os.PathLike, layout: str = "released") -> str:
    """Write `model`'s config and tensor table (`m3jax.hf.shapes`: each tensor of `layout` with the dtype the model
    holds it in) as the directory `path`, atomically; no weight is fetched from the devices. `path` is refused, or
    replaced whole, as `save_pretrained`'s is (`check_destination`). Call it on one process: it writes the whole
    directory."""
    path = check_destination(path)
    clear_leftovers(path)
    tensors = [[slot.name, CODES[dtype], list(slot.shape)] for slot, dtype in slot_dtypes(model, layout)]
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, TENSOR_TABLE), "w") as f:
            json.dump({"format": TABLE_FORMAT, "layout": layout, "tensors": tensors}, f)
        finish_checkpoint(model.cfg, model.dtype, tmp, path, layout, names=[], shards=[])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def slot_dtypes(model, layout: str):
    """(slot, the dtype the model holds its parameter in) for each tensor of `layout`: what an export writes."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return [(slot, np.dtype(flat[slot.param].get_value().dtype)) for slot in layouts.slots(model.cfg, layout)]


def split_shards(entries: list, limit: int) -> list[list]:
    """(name, dtype, shape) entries in order -> consecutive groups of at most `limit` bytes (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for e in entries:
        nbytes = int(np.prod(e[2])) * e[1].itemsize
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    return shards + [current] if current else shards


def shard_names(n: int) -> list[str]:
    """HF's file names for a checkpoint of `n` shard files."""
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def check_destination(dst: str | os.PathLike, sources=()) -> str:
    """`dst` as an absolute path, refused (FileExistsError) before anything is read or written where writing a
    checkpoint there would lose something: the checkpoint replaces an existing `dst` whole, so `dst` must be new, an
    empty directory, or a checkpoint directory (config.json, safetensors files or a tensor table, no subdirectory: an
    earlier export), and must neither be nor hold one of `sources` (the checkpoint being read). Before, a run
    directory given as the export's destination, or a conversion into its source's parent, was deleted."""
    dst = os.path.abspath(os.fspath(dst))
    for source in sources:
        if source is not None and _within(os.path.abspath(os.fspath(source)), dst):
            raise FileExistsError(f"destination {dst} is or holds the checkpoint being read ({source}), and "
                                  "writing replaces it whole: choose another directory")
    if not os.path.lexists(dst):
        parent = os.path.dirname(dst)
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):  # else the error named the temporary directory the write starts with
            raise FileExistsError(f"destination {dst}: {parent} is a file, not a directory: expected a directory path")
        return dst
    if not os.path.isdir(dst) or os.path.islink(dst):
        raise FileExistsError(f"destination {dst} exists and is not a directory: expected a new directory, an empty "
                              "one, or a checkpoint directory to replace")
    entries = os.listdir(dst)
    subdirectories = sorted(e for e in entries if os.path.isdir(os.path.join(dst, e)))
    # a checkpoint, or the shapes of one (m3jax.hf.shapes: a random model's engines start from them)
    checkpoint = "config.json" in entries and any(e.endswith(".safetensors") or e == TENSOR_TABLE for e in entries)
    if entries and (subdirectories or not checkpoint):
        held = ", ".join((subdirectories or sorted(entries))[:4])
        raise FileExistsError(f"destination {dst} exists and is not a checkpoint directory (it holds {held}"
                              f"{', ...' if len(entries) > 4 else ''}), and writing replaces it whole: choose a new "
                              "or empty directory")
    return dst


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def clear_leftovers(path: str) -> list[str]:
    """Remove what an interrupted write of a checkpoint to `path` left beside it, and return those paths: its
    unfinished directory (`path.tmp-XXXXXXXX`, up to the whole checkpoint) and the replaced one of a swap
    (`path.old-XXXXXXXX`; X a hex digit: another name is a user's, left alone).
    Nothing reads them, and a rerun's space check counted them as used: after a killed conversion of the release, a
    rerun was refused for want of space. A swap cut between its two renames left `path` absent: its `.old-*` is
    renamed back to `path` first."""
    parent, base = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    # exactly the names the writes give (an 8-hex-digit token): a user's own `export.old-backup` beside the
    # destination was restored over it, or removed (a helper's audit)
    ours = re.compile(rf"{re.escape(base)}\.(tmp|old)-[0-9a-f]{{8}}")
    olds = [os.path.join(parent, n) for n in os.listdir(parent) if (m := ours.fullmatch(n)) and m[1] == "old"]
    olds = [d for d in olds if os.path.isdir(d) and not os.path.islink(d)]
    if olds and not os.path.exists(path):
        # the swap was cut after its first rename: `.old-*` is the checkpoint `path` held. Put it back, so that this
        # write failing too (a full disk) still leaves it, where removing it with the rest left nothing.
        previous = max(olds, key=os.path.getmtime)
        try:
            os.rename(previous, path)
            log.warning("restored %s from %s, left by an interrupted swap", path, previous)
        except OSError:  # another process of the job restored it first
            pass
    gone = []
    for name in sorted(os.listdir(parent)):
        left = os.path.join(parent, name)
        if ours.fullmatch(name) and os.path.isdir(left) and not os.path.islink(left):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(left) for f in files)
            shutil.rmtree(left, ignore_errors=True)  # every process of a job may clear the same ones
            log.warning("removed %s (%.2f GB), left by an interrupted write of %s", left, size / 1e9, path)
            gone.append(left)
    return gone


def check_space(dst: str, need: int) -> None:
    """Refuse, before anything is written, a checkpoint of `need` bytes that `dst`'s filesystem cannot hold (its
    directories are made as needed): an export at the end of a run, or a conversion of the release's 850 GB, would
    otherwise fail after minutes of writing."""
    parent = os.path.dirname(dst)
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if st.f_blocks and free < need:  # a filesystem reporting no size at all (a FUSE mount without statfs) is not judged
        raise OSError(errno.ENOSPC, f"{dst}: the checkpoint needs {need / 1e9:.2f} GB and its filesystem has "
                                    f"{free / 1e9:.2f} GB free")


def write_shards(cfg, dtype, path: str, layout: str, shards: list[tuple[list, bool]], tensors,
                 token: str | None = None, side: list[str] = ()) -> str:
    """Write the shards marked as this process's (in order: `tensors` yields exactly their tensors) into a
    temporary directory beside `path`, then (process 0) the `side` files, the index and the config (`cfg` in
    `layout`, model dtype `dtype`), and move it into place. With a `token` (several processes) the directory's
    name is shared, and the processes agree after writing: if one failed (a full disk), every one raises and the directory is removed,
    rather than the others waiting for it forever."""
    names = shard_names(len(shards))
    tmp = f"{path}.tmp-{token or uuid.uuid4().hex[:8]}"
    first = jax.process_index() == 0
    need = sum(int(np.prod(e[2])) * np.dtype(e[1]).itemsize for shard, _ in shards for e in shard)
    clear_leftovers(path)
    if token is None:
        check_space(path, need)
    else:  # every process checks (the directory is shared) and all agree, so that none waits for another
        try:
            check_space(path, need)
            problem = None
        except OSError as e:
            problem = e
        _agree(problem, f"checking the space for {path}", None)
    if first:
        os.makedirs(tmp)
    if token is None:
        try:
            _write_mine(tmp, names, shards, tensors)
            finish_checkpoint(cfg, dtype, tmp, path, layout, names, shards, side)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("m3jax.save_pretrained: directory made")
    error = None
    try:
        written = _write_mine(tmp, names, shards, tensors)
        log.info("process %d wrote %d bytes in %d of the %d shard files", jax.process_index(), written,
                 sum(mine for _, mine in shards), len(shards))
    except Exception as e:  # the others are still writing: meet them below, then raise
        error = e
        log.error("process %d could not write its shards of %s: %r", jax.process_index(), path, e)
    for _ in tensors:  # the gathers of tensors other processes write (collectives: every process takes part)
        pass
    _agree(error, f"writing the shards of {path}", tmp if first else None)
    if first:
        try:
            finish_checkpoint(cfg, dtype, tmp, path, layout, names, shards, side)
        except Exception as e:
            error = e
    _agree(error, f"moving {path} into place", tmp if first else None)
    return path


def _write_mine(tmp: str, names: list[str], shards: list[tuple[list, bool]], tensors) -> int:
    """Write this process's shards (those marked mine) from `tensors`; -> the bytes written."""
    written = 0
    for fname, (shard, mine) in zip(names, shards):
        if not mine:
            continue
        writer = StreamingWriter(os.path.join(tmp, fname), shard)
        for name, _, _ in shard:
            got, array = next(tensors)
            assert got == name, (got, name)  # the plan and the generator walk the slots alike
            writer.write(got, array)
            written += array.nbytes
        writer.close()
    return written


def _agree(error: Exception | None, what: str, tmp: str | None) -> None:
    """Every process learns whether any failed at `what` (an allgather of one flag) and, if one did, removes
    `tmp` (given on process 0) and raises: this process's own error, or one naming the processes that failed."""
    failed = processes_where(error is not None)
    if not failed:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    raise OSError(f"save_pretrained: process(es) {', '.join(map(str, failed))} failed at {what} (their logs say "
                  "why); nothing was written")


def finish_checkpoint(cfg, dtype, tmp: str, path: str, layout: str, names: list[str],
                      shards: list[tuple[list, bool]], side: list[str] = ()) -> None:
    """The `side` files (`m3jax.hf.side_files`), the index (several shards) and config.json written into `tmp` (its
    shards complete), then `tmp` moved into place as `path`. The shards are synced as written; these small files and
    the directory are synced before the rename, and the parent after it: before, only the shards were, so a crash
    soon after an export had returned could leave `path` whole but its config.json or index empty."""
    copy_side_files(side, tmp)
    if len(shards) > 1:
        weight_map = {name: fname for fname, (shard, _) in zip(names, shards) for name, _, _ in shard}
        total = sum(int(np.prod(e[2])) * e[1].itemsize for shard, _ in shards for e in shard)
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = with_dtype(cfg.to_hf_dict(layout), np.dtype(dtype).name)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    for name in sorted(set(os.listdir(tmp)) - set(names)):
        _sync(os.path.join(tmp, name))
    _sync(tmp)
    _replace_dir(tmp, path)
    _sync(os.path.dirname(path))


def with_dtype(hf_config: dict, dtype: str) -> dict:
    """config.json stating the tensors' `dtype` at its top level, and in each dtype field the source's config held
    (carried with its other fields): `torch_dtype` (transformers before 5), the text config's own. Before, only the
    top level's `dtype` was written, so a bf16 source exported in fp32 still said bfloat16 there."""
    hf_config["dtype"] = dtype
    for part in (hf_config, hf_config.get("text_config", {})):
        for key in ("dtype", "torch_dtype"):
            if key in part:
                part[key] = dtype
    return hf_config


def _sync(path: str) -> None:
    """fsync a file, or a directory (its entries: the names created or renamed in it). A filesystem that cannot
    sync a directory (some network and FUSE mounts: EINVAL) is left as it is: nothing more can be done there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (os.path.isdir(path) and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _replace_dir(src: str, dst: str) -> None:
    """Move a finished directory into place; an existing one is swapped out, then removed."""
    if os.path.exists(dst):
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old)
    else:
        os.rename(src, dst)
