"""Routed-expert execution: local (one device) or expert-parallel inside `jax.shard_map`.

Expert parallel over the mesh axes that `sharding.rules` gives the "experts" axis (n_ep devices,
E / n_ep experts each). Per device, on its own tokens:
  1. route (done by the caller's `route_fn`), sort the T*k assignments by global expert id;
  2. exchange rows with the owners of their experts (all-to-all over the EP axes);
  3. group received rows by local expert and run the grouped matmuls (`expert_fn`);
  4. send the outputs back, weight them by the router and sum per token.
The exchange on CPU is a padded `all_to_all` sized for the worst case (dropless) unless a capacity
factor caps the rows per destination (overflowing assignments are dropped, i.e. contribute zero).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.rules import active_mesh, logical_to_spec, mesh_axes_of


def sort_by_expert(idx: jax.Array, num_experts: int):
    """Assignments [T, k] -> (order, token_of_row, expert_of_row, rows per expert [E])."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, order // idx.shape[1], flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def combine(x: jax.Array, rows_out: jax.Array, weights: jax.Array, order: jax.Array, token_of_row) -> jax.Array:
    """sum_k w_k * out_k per token: fp32 weight times output, cast to x.dtype, summed (HF's order)."""
    out = (rows_out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token_of_row].add(out)


def local_experts(x, weights, idx, expert_fn: Callable, num_experts: int) -> jax.Array:
    """Every expert on this device: sort rows by expert, grouped matmuls, weighted sum."""
    order, token_of_row, _, group_sizes = sort_by_expert(idx, num_experts)
    return combine(x, expert_fn(x[token_of_row], group_sizes), weights, order, token_of_row)


def exchanged_experts(x, weights, idx, expert_fn: Callable, num_experts: int, ep_axes: tuple[str, ...],
                      n_ep: int, capacity_factor: float | None = None) -> jax.Array:
    """Expert-parallel body (inside shard_map): this device owns experts [r*E_loc, (r+1)*E_loc)."""
    t, k = idx.shape
    d = x.shape[-1]
    e_loc = num_experts // n_ep
    order, token_of_row, expert_of_row, per_expert = sort_by_expert(idx, num_experts)
    send_counts = per_expert.reshape(n_ep, e_loc)  # rows for each destination, by its local expert
    dest = expert_of_row // e_loc
    dest_start = jnp.cumsum(send_counts.sum(1)) - send_counts.sum(1)
    slot = jnp.arange(t * k) - dest_start[dest]  # position inside the destination's block
    cap = t * min(k, e_loc)  # a token sends at most min(k, E_loc) rows to one device: dropless
    if capacity_factor is not None:
        cap = min(cap, max(1, math.ceil(capacity_factor * t * k / n_ep)))
    kept = slot < cap
    # Overflowing assignments drop out: their rows are not sent and their counts not announced.
    send_counts = jnp.minimum(jnp.cumsum(send_counts, axis=1), cap) - \
        jnp.minimum(jnp.cumsum(send_counts, axis=1) - send_counts, cap)
    send = jnp.zeros((n_ep, cap, d), x.dtype).at[dest, slot].set(x[token_of_row], mode="drop")

    recv = jax.lax.all_to_all(send, ep_axes, 0, 0, tiled=True) if n_ep > 1 else send
    recv_counts = jax.lax.all_to_all(send_counts, ep_axes, 0, 0, tiled=True) if n_ep > 1 else send_counts
    # Received row r of source s belongs to local expert searchsorted(cumsum(recv_counts[s]), r).
    bounds = jnp.cumsum(recv_counts, axis=1)  # [n_ep, E_loc]
    r = jnp.arange(cap)
    local_expert = jax.vmap(lambda b: jnp.searchsorted(b, r, side="right"))(bounds).reshape(-1)
    regroup = jnp.argsort(local_expert, stable=True)  # invalid rows (id E_loc) sort last
    grouped_out = expert_fn(recv.reshape(n_ep * cap, d)[regroup], recv_counts.sum(0))
    back = jnp.zeros_like(grouped_out).at[regroup].set(grouped_out).reshape(n_ep, cap, d)
    back = jax.lax.all_to_all(back, ep_axes, 0, 0, tiled=True) if n_ep > 1 else back
    rows_out = jnp.where(kept[:, None], back[dest, jnp.minimum(slot, cap - 1)], 0)
    return combine(x, rows_out, weights, order, token_of_row)


def routed_experts(x: jax.Array, route_fn: Callable, router: tuple, expert_fn: Callable, gate_up: jax.Array,
                   down: jax.Array, *, capacity_factor: float | None = None) -> jax.Array:
    """Routed output for hidden x [B, S, d].

    route_fn(tokens [T, d], *router) -> (weights [T, k], expert ids [T, k]); router arrays are replicated;
    expert_fn(rows [N, d], group_sizes [E_here], gate_up [E_here, 2, I, d], down [E_here, d, I]) -> [N, d].
    Without an m3jax mesh in context every expert runs locally; with one, the same math runs in
    shard_map with experts sharded per the rules table and tokens exchanged over those axes.
    """
    num_experts = gate_up.shape[0]
    mesh = active_mesh()

    def body(x, router, gate_up, down):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        w, idx = route_fn(t, *router)
        fn = lambda rows, sizes: expert_fn(rows, sizes, gate_up, down)  # noqa: E731
        if mesh is None:
            return local_experts(t, w, idx, fn, num_experts).reshape(b, s, d)
        ep_axes = tuple(a for a in mesh_axes_of("experts") if mesh.shape[a] > 1)
        n_ep = math.prod(mesh.shape[a] for a in ep_axes)
        out = exchanged_experts(t, w, idx, fn, num_experts, ep_axes, n_ep, capacity_factor)
        if any(mesh.shape[a] > 1 for a in mesh_axes_of("expert_mlp")):
            out = jax.lax.psum(out, mesh_axes_of("expert_mlp"))  # partial sums over the sharded width
        return out.reshape(b, s, d)

    if mesh is None:
        return body(x, router, gate_up, down)
    shape = dict(mesh.shape)
    x_spec = logical_to_spec(("act_batch", "act_seq", None), mesh_shape=shape)
    gu_spec = logical_to_spec(("experts", None, "expert_mlp", None), mesh_shape=shape)
    down_spec = logical_to_spec(("experts", None, "expert_mlp"), mesh_shape=shape)
    router_spec = jax.tree.map(lambda _: P(), router)
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, router_spec, gu_spec, down_spec), out_specs=x_spec)(
        x, router, gate_up, down)
