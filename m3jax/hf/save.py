"""`save_pretrained`: M3ForCausalLM -> HF directory (native or released layout), written atomically.

Tensors are fetched from the devices one HF tensor at a time and streamed into safetensors shards of
at most `max_shard_size` bytes, so the host never holds more than one tensor beyond the model. The
directory appears only when complete: it is written beside the target and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import jax
import numpy as np
from flax import nnx

from m3jax.hf import layouts
from m3jax.hf.safetensors_io import StreamingWriter

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(size: int | str) -> int:
    """5_000_000_000, "5GB", "512MiB" -> bytes."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * _UNITS[unit])
    return int(s)


def hf_tensors(model, layout: str = "native", on_host: bool = True):
    """Yield (HF name, host numpy array) for every tensor of `layout`, fetching one slice at a time.

    The one conversion path from m3jax parameters to HF names and shapes: saving and weight transfer
    both iterate this. on_host=False: each is a JAX array where the parameter lives (sliced and reshaped
    there; sharded like it), for a weight push whose buckets are on the accelerator (nothing via the host).
    """
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for slot in layouts.slots(model.cfg, layout):
        value = flat[slot.param].get_value()
        value = value[slot.index] if slot.index else value
        yield slot.name, (_on_host(value) if on_host else value).reshape(slot.shape)


def _on_host(value) -> np.ndarray:
    """The whole array in host memory. An array spanning other hosts' devices (multi-host mesh) is
    gathered: a collective, so every process must iterate `hf_tensors` in the same order."""
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def save_pretrained(model, path: str | os.PathLike, layout: str = "native",
                    max_shard_size: int | str = "5GB") -> str:
    """Write `model` as a HF checkpoint directory in `layout` ("native" or "released").

    On a multi-host mesh every process must call this (the tensors are gathered collectively); process 0
    writes, and every process returns once the directory is in place."""
    if layout not in ("native", "released"):
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        if jax.process_index() != 0:
            for _ in hf_tensors(model, layout):  # take part in the gathers; process 0 writes
                pass
        else:
            path = _write(model, path, layout, max_shard_size)
        multihost_utils.sync_global_devices("m3jax.save_pretrained")
        return os.path.abspath(os.fspath(path))
    return _write(model, path, layout, max_shard_size)


def _write(model, path, layout: str, max_shard_size: int | str) -> str:
    path = os.path.abspath(os.fspath(path))
    limit = parse_size(max_shard_size)
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    entries = []
    for slot in layouts.slots(cfg, layout):
        dtype = flat[slot.param].get_value().dtype
        entries.append((slot.name, np.dtype(dtype), slot.shape))
    shards, current, size = [], [], 0
    for e in entries:
        nbytes = int(np.prod(e[2])) * e[1].itemsize
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        tensors = hf_tensors(model, layout)
        weight_map = {}
        for fname, shard in zip(names, shards):
            writer = StreamingWriter(os.path.join(tmp, fname), shard)
            for name, _, _ in shard:
                got, array = next(tensors)
                writer.write(got, array)
                weight_map[name] = fname
            writer.close()
        if len(shards) > 1:
            total = sum(int(np.prod(e[2])) * e[1].itemsize for e in entries)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        hf_config = cfg.to_hf_dict(layout)
        hf_config["dtype"] = np.dtype(model.dtype).name
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_dir(src: str, dst: str) -> None:
    """Move a finished directory into place; an existing one is swapped out, then removed."""
    if os.path.exists(dst):
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old)
    else:
        os.rename(src, dst)
