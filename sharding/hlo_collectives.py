"""The collectives of a compiled XLA program, each with the mesh axes its groups span and whether a loop runs it.

What the partitioner made of a sharded program decides where its bytes travel: an all-gather over the axis that
crosses nodes costs ten times one that stays on NVLink, and one inside a while loop runs once per iteration. Tests
and benches read that from the optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`) with `collectives`.

Replica groups come in three spellings, all read here: explicit lists (`{{0,1},{2,3}}`), iota lists
(`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`), and mesh groups (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, optionally with
`device_ids=(...)`). Only the first group of each op is read: the partitioner's groups are all alike.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"= (\(.*?\)|\S+) (" + "|".join(OPS) + r")(?:-start)?\(")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=(%[\w.\-]+)|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    axes: tuple[str, ...]  # mesh axes along which the devices of one group differ; () = each device alone
    in_loop: bool  # in a while loop's body (or in what such a body calls)
    bytes: int  # size of the result (all of a tuple-shaped result)
    source: str = ""  # the jax operation it partitions (the op_name metadata), e.g. ".../jvp(jit(_take))/gather"


def _iota(text: str) -> np.ndarray:
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text)
    shape = [int(x) for x in m[1].split(",")]
    dims = [int(x) for x in m[2].split(",")] if m[2] else shape
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m[3]:
        ids = ids.transpose([int(x) for x in m[3].split(",")])
    return ids.reshape(shape)


def first_group(line: str) -> list[int] | None:
    """Device ids of the first replica group of an HLO collective line; None if it names none (a permute)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:, device_ids=\((\[[^\]]*\](?:<=\[[^\]]*\])?"
                  r"(?:T\([^)]*\))?)\))?\s*\{([^}]*)\}", line)
    if m:
        named = re.findall(r"'(\w+)'=(\d+)", m[1])
        sizes = [int(n) for _, n in named]
        ids = (_iota(m[2]) if m[2] else np.arange(int(np.prod(sizes)))).reshape(sizes)
        chosen = set(re.findall(r"'(\w+)'", m[3]))
        return ids[tuple(slice(None) if name in chosen else 0 for name, _ in named)].reshape(-1).tolist()
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        return _iota(m[1])[0].tolist()
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return [int(x) for x in m[1].split(",") if x]
    return None


def group_axes(group: list[int], mesh) -> tuple[str, ...]:
    """The axes of `mesh` (a jax Mesh) along which the devices of `group` (device ids) differ."""
    position = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    coords = [position[i] for i in group]
    return tuple(name for k, name in enumerate(mesh.axis_names) if len({c[k] for c in coords}) > 1)


def array_bytes(shape_text: str) -> list[int]:
    """The bytes of each array an HLO shape text names ("(bf16[4,128]{1,0}, s32[])" -> [1024, 4])."""
    size = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "s8": 1, "u8": 1, "pred": 1}
    return [size.get(dtype, 4) * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text)]


def _result_bytes(shape_text: str) -> int:
    return sum(array_bytes(shape_text))


def collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective of an optimised HLO module (`Compiled.as_text()`) on `mesh`."""
    body_of: dict[str, str] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line.startswith((" ", "}")) and "{" in line:
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
            body_of[name] = ""
        elif name is not None:
            body_of[name] += line + "\n"
    calls = {n: {c for a, b in _CALLS.findall(text) for c in ([a] if a else re.findall(r"%[\w.\-]+", b))}
             for n, text in body_of.items()}
    in_loop: set[str] = set()
    todo = [m for text in body_of.values() for m in re.findall(r"\bwhile\(.*?body=(%[\w.\-]+)", text)]
    while todo:
        n = todo.pop()
        if n not in in_loop:
            in_loop.add(n)
            todo.extend(calls.get(n, ()))
    out = []
    for n, text in body_of.items():
        for line in text.splitlines():
            m = _OP.search(line)
            if not m:
                continue
            group = first_group(line)
            axes = () if group is None else group_axes(group, mesh)
            if m[2] == "collective-permute":
                axes = ("pairs",)
            source = re.search(r'op_name="([^"]*)"', line)
            out.append(Collective(m[2], axes, n in in_loop, _result_bytes(m[1]), source[1] if source else ""))
    return out


def bytes_by_kind(found: list[Collective]) -> collections.Counter:
    """Result bytes summed by (op, axes, in_loop): where a program's collectives put their bytes."""
    out: collections.Counter = collections.Counter()
    for c in found:
        out[(c.op, c.axes, c.in_loop)] += c.bytes
    return out
