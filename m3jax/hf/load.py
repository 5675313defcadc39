"""`from_pretrained`: a local HF directory (either layout) -> M3ForCausalLM, streamed tensor by tensor.

Everything that can be wrong with the checkpoint is found from the headers before any parameter is
allocated: missing, unexpected, mis-shaped or non-float tensors, truncated or corrupt files, an index
pointing at a file that lacks the tensor. Values that are not finite (NaN, Inf) can only be seen as each
tensor is read, and are refused there. Then the model is created abstractly (`nnx.eval_shape`), and
each parameter is built on its final devices from the blocks this process's devices hold, each block read
once from the checkpoint's files (`m3jax.hf.read_blocks`): on a multi-host mesh a process reads
its own shards' bytes, not the whole checkpoint. Host memory in flight: one device block of one parameter.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import numpy as np
from flax import nnx

from m3jax.config import ConfigError, M3Config
from m3jax.hf import layouts
from m3jax.hf.progress import Tenths
from m3jax.hf.read_blocks import ParamBlocks, TensorReader, build_params
from m3jax.hf.safetensors_io import CheckpointError, TensorInfo, read_header
from m3jax.hf.tensors import processes_where
from m3jax.model.decoder import M3ForCausalLM
from sharding.layout import as_layout
from sharding.mesh import mesh_config_of, validate

PARAM_DTYPES = tuple(np.dtype(d) for d in ("float32", "bfloat16", "float16"))  # what the model computes in

log = logging.getLogger(__name__)
_FLOAT = ("F32", "BF16", "F16", "F64")
PROGRESS_BYTES = 8 << 30  # a load of at least this many parameter bytes logs its progress, every tenth of it


def checkpoint_files(path: str) -> dict[str, TensorInfo]:
    """name -> TensorInfo over `model.safetensors` or the files of `model.safetensors.index.json` (a directory with
    both, the index naming other files, is refused)."""
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
        if os.path.exists(single) and "model.safetensors" not in set(weight_map.values()):
            # transformers loads model.safetensors, vLLM the index: two tools, two models (a sharded export copied
            # over a single-file one leaves both)
            raise CheckpointError(f"{path} holds two checkpoints, model.safetensors and the shards of "
                                  "model.safetensors.index.json, which name different files; transformers would load "
                                  "the first, vLLM the second: remove the stale one")
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


def from_pretrained(path: str | os.PathLike, dtype=None, *, mesh=None, check_finite: bool = True,
                    **model_options) -> M3ForCausalLM:
    """Load a local HF MiniMax-M3 directory (native or released layout, single file or sharded).

    dtype: parameter dtype (router and its bias stay fp32); default: the checkpoint's embedding dtype (float32 for
    a float64 checkpoint: `default_param_dtype`).
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
    check_param_dtype(dtype)
    cfg = M3Config.from_pretrained(path)
    tensors = checkpoint_files(path)
    _, slots, tensors = plan_load(cfg, tensors)
    layout = as_layout(mesh)
    if layout.mesh is not None:
        validate(mesh_config_of(layout), cfg, num_devices=layout.num_devices)
    chosen = dtype is not None
    if dtype is None:
        dtype = default_param_dtype(tensors[slots[0].name])
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), layout=layout,
                                                    **model_options))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    if not chosen:
        warn_narrowed(path, slots, tensors, lambda param: flat[param].get_value().dtype)
    slots_of: dict[tuple, list] = {}
    for slot in slots:
        slots_of.setdefault(slot.param, []).append(slot)
    problems: list[str] = []
    keys = list(flat)
    params = [ParamBlocks(var.get_value().shape, var.get_value().dtype,
                          layout.sharding(var.get_metadata()["logical_axes"]), slots_of[p]) for p, var in flat.items()]
    sizes = [math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params]
    progress = Tenths(log, f"loading {path}", "of parameters in place", sum(sizes)) if sum(sizes) >= PROGRESS_BYTES \
        else None
    with TensorReader() as reader:
        built = build_params(params, tensors, reader, check_finite)
        try:
            for i, array, found in built:
                flat[keys[i]].set_value(array)
                if progress:
                    progress.add(sizes[i])
                problems += found
                if problems and jax.process_count() == 1:
                    break
        finally:
            built.close()  # its reads stop before the reader closes the files
        read = reader.bytes_read
    if check_finite:
        _agree_finite(problems)
    total = sum(t.end - t.start for t in (tensors[s.name] for s in slots))
    log.log(logging.INFO if jax.process_count() > 1 else logging.DEBUG,
            "read %d of the checkpoint's %d bytes (the blocks this process's devices hold)", read, total)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def warn_narrowed(path: str, slots, tensors: dict[str, TensorInfo], dtype_of, what: str = "load") -> None:
    """Warn where the default parameter dtype (the embedding's; `dtype_of(param)`) is narrower than what a tensor is
    stored in: a bf16 checkpoint with fp32 norms loads (or converts) them rounded to bf16, and its export then holds
    them so, silently. (A float64 tensor has no parameter dtype to keep it in: not warned of.)"""
    narrowed = [s.name for s in slots if tensors[s.name].np_dtype in PARAM_DTYPES
                and tensors[s.name].np_dtype.itemsize > np.dtype(dtype_of(s.param)).itemsize]
    if narrowed:
        log.warning("%s: %d tensor(s) stored wider than the parameter dtype %s, the embedding's, %s rounded to it "
                    "(%s): pass dtype=float32 to keep them", path, len(narrowed),
                    np.dtype(dtype_of(slots[0].param)).name, what, _listing(narrowed, 5))


def _agree_finite(problems: list[str]) -> None:
    """Raise the non-finite weights found, on every process alike: each process reads only its own blocks, so a
    NaN in one host's expert is seen there alone, and a process that went on would wait at its first collective
    for the one that stopped."""
    if jax.process_count() > 1:
        found = processes_where(bool(problems))
        if not problems and found:
            where = ", ".join(map(str, found))
            problems = [f"process(es) {where} read weights holding NaN or Inf (their logs name the tensors)"]
        for line in problems:
            log.error("%s", line)
    if problems:
        raise CheckpointError("; ".join(problems[:5]) + (f"; ... and {len(problems) - 5} more" if len(problems) > 5
                                                        else "") + ": the checkpoint's weights are not finite (a "
                              "diverged run or a broken export): use an earlier checkpoint or export this one again "
                              "(from Python, m3jax.from_pretrained(..., check_finite=False) loads it as it is)")


def default_param_dtype(embedding: TensorInfo) -> np.dtype:
    """The parameter dtype of a load or conversion given none: the checkpoint's embedding dtype, float32 for a
    float64 checkpoint. Without JAX's x64 mode a float64 model holds float32 arrays: before, its `dtype` still said
    float64, and the config.json its export wrote (or a conversion's) declared float64 over float32 tensors, which
    transformers then loaded upcast to float64."""
    dtype = embedding.np_dtype
    return dtype if dtype in PARAM_DTYPES else np.dtype(np.float32)


def check_param_dtype(dtype) -> None:
    """A parameter dtype is one of PARAM_DTYPES (an int dtype truncated every weight, and the export it wrote was
    then refused by this loader); refused before anything is read (by `convert_checkpoint` too)."""
    if dtype is None:
        return
    try:
        ok = np.dtype(dtype) in PARAM_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"dtype = {dtype!r}: not a parameter dtype; allowed: a float type (float32, bfloat16, "
                          "float16)")
