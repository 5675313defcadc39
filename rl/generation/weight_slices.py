"""The part of each checkpoint tensor a vLLM worker reads: tensor-parallel slices cut on the sender.

vLLM's loaders take each rank's slice of a whole checkpoint tensor: q/k/v and gate/up their rank's rows,
o/down its columns, the embedding and lm_head its vocabulary range (k/v replicated where there are fewer
kv heads than ranks). A worker sent the whole tensor discards (TP - 1) / TP of it. In the 32-node recipe
the non-expert tensors are 3 % of 852 GB, ~26 GB that every one of an engine's 16 ranks would receive
whole, a third of each rank's 77 GB (docs/vllm.md, refit on paper); sliced, 1.6 GB.

The slice ("box": [start, stop) per dimension) is not taken from a table of vLLM's layer classes, which
changes between versions and models, but from the loaders themselves: `read_boxes` runs the model's own
`load_weights` over never-written full-shape tensors under a `TorchFunctionMode` that records the box of
each view of them a loader copies into a parameter, and skips every in-place write to a parameter (that
copy, and a loader's own fills), so the model is unchanged. A tensor whose loader does anything else with
it (a conversion or a reshape that copies, a copy into a temporary, reading a value) is opaque and travels
whole. So a box holds every element the loader reads, by construction.

On apply the receiver hands vLLM a full-shape tensor with the box written and the rest never touched
(`expand`: np.empty, whose pages outside the box are never faulted in; kept between updates, so only the
first faults even the box in), which the loader slices exactly as it did under the probe. That costs one
extra copy of the sliced bytes (1/TP of them).
"""

from __future__ import annotations

import collections

import numpy as np

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension

# Tensor methods / properties that read metadata, not data: a loader may call them on a probe.
_METADATA = frozenset({"size", "dim", "shape", "dtype", "device", "stride", "storage_offset", "is_contiguous",
                       "numel", "ndim", "__len__", "element_size", "is_floating_point", "layout", "requires_grad",
                       "is_cuda", "is_cpu", "untyped_storage", "data_ptr", "is_meta", "names", "nelement"})


class _Opaque(BaseException):  # not an Exception: a loader's `except Exception` must not swallow it
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def box_of(view, full_shape) -> Box:
    """The box of `full_shape` that `view` (a strided view of a C-contiguous tensor of that shape) covers;
    _Opaque(None) when it is not one (other strides: a transpose or a reshape)."""
    full_shape = tuple(int(n) for n in full_shape)
    strides = [int(np.prod(full_shape[d + 1:], dtype=np.int64)) for d in range(len(full_shape))]
    shape = tuple(int(n) for n in view.shape)
    if len(shape) != len(full_shape) or any(st != s for st, s, n in zip(view.stride(), strides, shape) if n > 1):
        raise _Opaque(None)
    offset, starts = int(view.storage_offset()), []
    for s in strides:
        starts.append(offset // s)
        offset %= s
    box = tuple((a, a + n) for a, n in zip(starts, shape))
    if any(stop > n for (_, stop), n in zip(box, full_shape)):
        raise _Opaque(None)
    return box


def bounding(boxes: list[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property of Tensor: the descriptor names it
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _tensors(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _tensors(t)


def _in_place(func) -> bool:
    name = _func_name(func)
    return name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.startswith("__"))


def _storage(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage
        return None


def _recorder(targets):
    import torch
    from torch.overrides import TorchFunctionMode

    class Recorder(TorchFunctionMode):
        """Records the box of every probe view copied into a parameter (`targets`), and skips the copy; no
        in-place op writes a parameter while it records. A probe used any other way than through views and
        metadata raises _Opaque(its name) before anything reads it."""

        def __init__(self):
            super().__init__()
            self.targets = {p for p in map(_storage, targets) if p}
            # storage address -> (name, full shape, the probe): every probe of a load_weights call stays alive
            # until it returns, so no other tensor can take its address while a loader may still hold a view
            self.live: dict = {}
            self.boxes: dict[str, list[Box]] = collections.defaultdict(list)
            self.opaque: set[str] = set()  # also when a loader swallowed the _Opaque

        def add(self, name: str, probe) -> None:
            self.live[probe.untyped_storage().data_ptr()] = (name, tuple(probe.shape), probe)

        def _probe_of(self, t):
            hit = self.live.get(_storage(t))
            return None if hit is None else hit[:2]

        def opaque_use(self, name: str) -> _Opaque:
            self.opaque.add(name)
            return _Opaque(name)

        def _record(self, src):
            name, shape = self._probe_of(src)
            try:
                box = box_of(src, shape)
            except _Opaque:
                raise self.opaque_use(name) from None
            if src.numel():
                self.boxes[name].append(box)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            mine = [(t, self._probe_of(t)) for t in _tensors((args, kwargs))]
            mine = [(t, p) for t, p in mine if p is not None]
            writes = _in_place(func) and bool(args) and isinstance(args[0], torch.Tensor)
            skipped = args[0] if writes and func is not torch.Tensor.__setitem__ else None
            if writes and _storage(args[0]) in self.targets:  # a parameter: never written while recording
                if mine:
                    src = args[1] if func is torch.Tensor.copy_ else args[2] if func is torch.Tensor.__setitem__ else None
                    if src is None or len(mine) > 1 or mine[0][0] is not src:  # e.g. param.add_(probe), a probe key
                        raise self.opaque_use(mine[0][1][0])
                    self._record(src)  # a probe view into a parameter: what this rank reads
                return skipped
            if not mine:
                return func(*args, **kwargs)
            name = mine[0][1][0]
            if writes:  # probe data into a temporary (it may reach a parameter unrecorded), or into a probe
                raise self.opaque_use(name)
            out = func(*args, **kwargs)
            leaves = list(_tensors(out))
            if any(self._probe_of(t) is None for t in leaves):  # a copy of probe data: unrecorded on its way
                raise self.opaque_use(name)
            if not leaves and out is not None and _func_name(func) not in _METADATA:
                raise self.opaque_use(name)  # a value read out of the probe (.item(), .tolist(), ...)
            return out

    return Recorder()


def unwritten(shape, dtype):
    """A torch tensor of `shape` and the numpy `dtype` whose memory is never written: numpy's empty, which
    (unlike torch.empty under `torch.use_deterministic_algorithms`) never fills it, so its pages are never
    faulted in (an M3 worker probes ~26 GB of non-expert tensors)."""
    from rl.generation.torch_arrays import to_torch

    return to_torch(np.empty(tuple(shape), np.dtype(dtype)))


def read_boxes(load_weights, manifest: dict, names, targets) -> dict[str, Box]:
    """The box of every tensor in `names` (of manifest: name -> (shape, dtype)) that `load_weights` (a vLLM
    model's, whose parameters are in their loaded layout) reads only part of. A tensor it reads whole, not
    at all, or opaquely (module docstring) is absent: it travels whole. `targets`: the model's parameters and
    buffers, which no in-place op writes while this runs, so the model is left unchanged."""
    import torch

    names = [n for n in names if int(np.prod(manifest[n][0], dtype=np.int64)) > 1]
    rec, start = _recorder(targets), 0
    while start < len(names):
        def probes(first=start):
            for i in range(first, len(names)):
                shape, dtype = manifest[names[i]]
                probe = unwritten(shape, dtype)
                rec.add(names[i], probe)
                yield names[i], probe

        try:
            with rec, torch.no_grad():
                load_weights(probes())
            break
        except _Opaque as e:
            start = names.index(e.name) + 1  # the ones after it again: a loader may have read ahead
        finally:
            rec.live.clear()
    out = {}
    for name, boxes in rec.boxes.items():
        if name in rec.opaque:
            continue
        box = bounding(boxes)
        if box != tuple((0, int(n)) for n in manifest[name][0]):
            out[name] = box
    return out


def cut(array: np.ndarray, box: Box | None) -> np.ndarray:
    """The box of `array` (all of it for None)."""
    return array if box is None else array[tuple(slice(a, b) for a, b in box)]


def expand(piece, box: Box, full_shape, out=None):
    """A full-shape array holding `piece` at `box`; the rest is never written (and never read by the loader
    whose box this is). `out`: such an array to reuse (kept between updates, its box's pages already
    faulted in). A torch piece (received on a device) gets a torch tensor on its device."""
    if not isinstance(piece, np.ndarray):
        import torch

        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(full_shape) or out.dtype != piece.dtype
                or out.device != piece.device):
            out = torch.empty(tuple(full_shape), dtype=piece.dtype, device=piece.device)
        out[tuple(slice(a, b) for a, b in box)] = piece
        return out
    if not isinstance(out, np.ndarray) or out.shape != tuple(full_shape) or out.dtype != piece.dtype:
        out = np.empty(tuple(full_shape), piece.dtype)
    out[tuple(slice(a, b) for a, b in box)] = piece
    return out


def name_key(name: str) -> int:
    """A tensor name as the integer the senders agree on: the low 62 bits of XXH3-64 of its UTF-8 bytes."""
    import xxhash

    return xxhash.xxh3_64_intdigest(name.encode()) & ((1 << 62) - 1)


MAX_DIMS = 4  # the slices table's width; a deeper tensor travels whole
WIDTH = 4 + 2 * MAX_DIMS  # the table's columns
_HALF = 31  # every entry < 2^31: the trainer processes agree on the table through JAX, whose integers are int32


def encode(slices: list[dict[str, Box]]) -> np.ndarray:
    """Per route, its boxes as int64 rows [route, name key (high, low 31 bits), ndim, (start, stop) x MAX_DIMS]."""
    rows = []
    for g, boxes in enumerate(slices):
        keys = {}
        for name, box in sorted(boxes.items()):
            if len(box) > MAX_DIMS:
                continue
            key = name_key(name)
            if keys.setdefault(key, name) != name:
                raise ValueError(f"tensor names {keys[key]!r} and {name!r} have the same key (XXH3-64, 62 bits)")
            flat = [x for ab in box for x in ab] + [0, 0] * (MAX_DIMS - len(box))
            if any(x >= 1 << _HALF for x in flat):
                continue  # a dimension of 2^31 or more: whole
            rows.append([g, key >> _HALF, key & ((1 << _HALF) - 1), len(box), *flat])
    return np.array(rows, np.int64).reshape(-1, WIDTH)


def decode(table, routes: int) -> list[dict[int, Box]]:
    """encode's rows back as, per route, name key -> box."""
    out: list[dict[int, Box]] = [{} for _ in range(routes)]
    for row in np.asarray(table, np.int64):
        g, key, ndim = int(row[0]), (int(row[1]) << _HALF) | int(row[2]), int(row[3])
        out[g][key] = tuple((int(row[4 + 2 * d]), int(row[5 + 2 * d])) for d in range(ndim))
    return out
