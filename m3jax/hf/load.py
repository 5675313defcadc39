"""`from_pretrained`: a local HF directory (either layout) -> M3ForCausalLM, streamed tensor by tensor.

Everything that can be wrong with the checkpoint is found from the headers before any parameter is
allocated: missing, unexpected, mis-shaped or non-float tensors, truncated or corrupt files, an index
pointing at a file that lacks the tensor. Values that are not finite (NaN, Inf) can only be seen as each
tensor is read, and are refused there. Then the model is created abstractly (`nnx.eval_shape`),
each parameter is allocated once on its final devices, and every HF tensor is read from disk into a
host buffer of its own size and written into its slice with a donated in-place update. Peak host
memory is the model plus the largest single HF tensor.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.config import M3Config
from m3jax.hf import layouts
from m3jax.hf.safetensors_io import CheckpointError, TensorInfo, count_nonfinite, read_header, read_into
from m3jax.model.decoder import M3ForCausalLM
from sharding.layout import as_layout
from sharding.mesh import mesh_config_of, validate

log = logging.getLogger(__name__)
_FLOAT = ("F32", "BF16", "F16", "F64")


def checkpoint_files(path: str) -> dict[str, TensorInfo]:
    """name -> TensorInfo over `model.safetensors` or the files of `model.safetensors.index.json`."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError(f"weight_map is not a {{tensor name: file name}} dict: {str(weight_map)[:200]}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r}); expected a 'weight_map'") from None
        tensors: dict[str, TensorInfo] = {}
        for fname in sorted(set(weight_map.values())):
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{index} names {fname}, which does not exist in {path}")
            tensors.update(read_header(fpath))
        absent = sorted(n for n, f in weight_map.items()
                        if n not in tensors or os.path.basename(tensors[n].file) != f)
        if absent:
            raise CheckpointError(f"{index}: {len(absent)} tensor(s) are not in the file the index names: "
                                  f"{_listing(absent)}")
        return tensors
    if os.path.exists(single):
        return read_header(single)
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _listing(names, limit=20) -> str:
    names = list(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def plan_load(cfg: M3Config, tensors: dict[str, TensorInfo]):
    """Match checkpoint tensors to model slots; raise one error listing every problem found.

    Returns (layout, slots, tensors keyed by the names `slots` uses).
    """
    layout = layouts.detect_layout(tensors)
    if layout == "released":
        tensors = {layouts.canonical_name(n): t for n, t in tensors.items()}
    slots = list(layouts.slots(cfg, layout))
    expected = {s.name for s in slots}
    skipped = [n for n in tensors if n not in expected and layouts.SKIPPED.search(n)]
    unexpected = sorted(n for n in tensors if n not in expected and n not in skipped)
    missing = [s.name for s in slots if s.name not in tensors]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
    for s in slots:
        t = tensors.get(s.name)
        if t is None:
            continue
        if t.shape != s.shape:
            problems.append(f"tensor {s.name} has shape {list(t.shape)}, the config implies {list(s.shape)}")
        if t.dtype not in _FLOAT:
            problems.append(f"tensor {s.name} has dtype {t.dtype}, expected a float type {_FLOAT}")
    if problems:
        raise CheckpointError(f"checkpoint ({layout} layout) does not match its config: " + "; ".join(problems))
    if skipped:
        log.info("skipping %d vision/MTP tensor(s) the text model does not use", len(skipped))
    return layout, slots, tensors


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write_slice(buf, value, index, n_lead):
    update = value.astype(buf.dtype).reshape((1,) * n_lead + buf.shape[n_lead:])
    start = tuple(index[i] for i in range(n_lead)) + (0,) * (buf.ndim - n_lead)
    return jax.lax.dynamic_update_slice(buf, update, start)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding) -> jax.Array:
    """A zero buffer placed on its shards; one compile per (shape, dtype, sharding) per process (a fresh
    lambda per stacked parameter compiled again on every load: ~80 compiles per tiny checkpoint)."""
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


def from_pretrained(path: str | os.PathLike, dtype=None, *, mesh=None, check_finite: bool = True,
                    **model_options) -> M3ForCausalLM:
    """Load a local HF MiniMax-M3 directory (native or released layout, single file or sharded).

    dtype: parameter dtype (router and its bias stay fp32); default: the checkpoint's embedding dtype.
    mesh: the layout from `sharding.mesh.build_mesh` (or a jax Mesh with axes ("data", "context", "expert",
    "tensor") and the default rules): each parameter is placed on its shards per the layout's rules, and
    the model keeps the layout for every later call. A mesh that cannot hold this model raises
    `MeshError` naming the field before anything is read. Default: the default device.
    check_finite: refuse a tensor holding NaN or Inf (`CheckpointError` naming it and its file), checked as it
    is read, at about the speed of a read from the page cache (`count_nonfinite`, scripts/bench_finite_check.py):
    such weights (a diverged run's, a broken export) would otherwise load silently and turn every logit they
    touch into NaN.
    model_options: passed to M3ForCausalLM (remat, moe_capacity_factor, moe_exchange, moe_kernel).
    """
    path = os.fspath(path)
    cfg = M3Config.from_pretrained(path)
    tensors = checkpoint_files(path)
    _, slots, tensors = plan_load(cfg, tensors)
    layout = as_layout(mesh)
    if layout.mesh is not None:
        validate(mesh_config_of(layout), cfg, num_devices=layout.num_devices)
    if dtype is None:
        dtype = tensors[slots[0].name].np_dtype
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), layout=layout,
                                                    **model_options))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    target = {p: layout.sharding(v.get_metadata()["logical_axes"]) for p, v in flat.items()}
    arrays: dict[tuple, jax.Array] = {}
    for slot in slots:
        var = flat[slot.param]
        shape, pdtype = var.get_value().shape, var.get_value().dtype
        host = read_into(tensors[slot.name])
        if check_finite and (bad := count_nonfinite(host)):
            raise CheckpointError(f"tensor {slot.name} ({tensors[slot.name].file}) holds {bad} NaN or Inf value(s) of "
                                  f"{host.size}: the checkpoint's weights are not finite (a diverged run or a broken "
                                  "export); pass check_finite=False to load it anyway")
        if not slot.index:  # the tensor is the whole parameter
            arrays[slot.param] = jax.device_put(host.reshape(shape).astype(pdtype, copy=False), target[slot.param])
        else:
            if slot.param not in arrays:
                arrays[slot.param] = _zeros(shape, pdtype, target[slot.param])
            sub = host.reshape(shape[len(slot.index):])
            arrays[slot.param] = _write_slice(arrays[slot.param], sub, np.asarray(slot.index, np.int32),
                                              len(slot.index))
        arrays[slot.param].block_until_ready()  # bound host memory to one tensor in flight
        del host
    for p, var in flat.items():
        var.set_value(arrays[p])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
