"""Which receivers of the collective weight path need which tensors: expert-parallel workers need only theirs.

A worker of an expert-parallel engine holds a fraction of the routed experts (vLLM places each expert
whole on one rank); of every other tensor its loaders read its tensor-parallel slice. Sending every worker
every byte would make each receive the whole model: for the 32-node recipe 852 GB per GPU instead of
53.3 GB (docs/vllm.md, refit on paper). So the receivers are grouped by the set of experts they hold
(a "route"; None = every expert: a worker without expert parallelism, or an engine in one process) and
each sender opens one weight group per route: a routed expert goes to the groups whose route holds it,
every other tensor to every group. Without expert parallelism there is one route and one group, as before.
With tensor parallelism the receivers also say which slice of each other tensor they read
(rl.generation.weight_slices): ranks that read different slices are in different groups, and each
group is sent only its slices.
"""

from __future__ import annotations

import re

_EXPERT = re.compile(r"\.experts\.(\d+)\.w[123]\.weight$")  # the released layout's routed experts

Route = frozenset | None


def expert_of(name: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to, or None for every other tensor."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def wants(route: Route, name: str) -> bool:
    expert = expert_of(name)
    return route is None or expert is None or expert in route


def reads(entry) -> tuple[Route, tuple]:
    """A receiver's entry (the experts it holds, or {"experts": ..., "slices": {name: box}}) as a hashable
    (route, slices) key; boxes come back from Ray as lists."""
    experts, slices = (entry.get("experts"), entry.get("slices") or {}) if isinstance(entry, dict) else (entry, {})
    route = None if experts is None else frozenset(int(e) for e in experts)
    return route, tuple(sorted((n, tuple((int(a), int(b)) for a, b in box)) for n, box in slices.items()))


def plan(receivers: list[list]) -> tuple[list[Route], list[list[tuple[int, int, int]]], list[dict]]:
    """receivers[i][j]: what rank j of engine i reads: the experts it holds (a list; None = all), or a dict
    {"experts": that, "slices": {name: box}} whose boxes are the tensor-parallel slices it reads
    (rl.generation.weight_slices). Receivers that read the same share a group. Returns the routes (one
    weight group each, per sender: its experts), for every engine per rank (route index, rank in that
    group, group size; rank 0 of each group is its sender), and each route's slices (name -> box)."""
    keys: list[tuple] = []
    for ranks in receivers:
        for entry in ranks:
            k = reads(entry)
            if k not in keys:
                keys.append(k)
    keys.sort(key=lambda k: (k[0] is not None, sorted(k[0] or ()), k[1]))
    members = [0] * len(keys)
    placed = []
    for ranks in receivers:
        mine = []
        for entry in ranks:
            g = keys.index(reads(entry))
            members[g] += 1
            mine.append((g, members[g], 0))
        placed.append(mine)
    return ([k[0] for k in keys], [[(g, rank, 1 + members[g]) for g, rank, _ in mine] for mine in placed],
            [dict(k[1]) for k in keys])


def encode(routes: list[Route], worlds: list[int], num_experts: int):
    """routes and group sizes as int64[len(routes), 2 + num_experts] (the form the senders agree on):
    group size, 1 if the route is every expert, then one membership flag per expert."""
    import numpy as np

    out = np.zeros((len(routes), 2 + num_experts), np.int64)
    for g, (r, w) in enumerate(zip(routes, worlds)):
        out[g, 0], out[g, 1] = w, r is None
        for e in r or ():
            if not 0 <= e < num_experts:
                raise ValueError(f"a receiver holds expert {e}, but the model has {num_experts}")
            out[g, 2 + e] = 1
    return out


def decode(table) -> tuple[list[Route], list[int]]:
    routes = [None if row[1] else frozenset(int(e) for e in row[2:].nonzero()[0]) for row in table]
    return routes, [int(row[0]) for row in table]
