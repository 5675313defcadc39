"""Routed-expert execution: local (one device) or expert-parallel inside `jax.shard_map`.

Expert parallel over the mesh axes that the layout's rules give the "experts" axis (n_ep devices,
E / n_ep experts each). Per device, on its own tokens:
  1. route (done by the caller's `route_fn`), sort the T*k assignments by global expert id;
  2. exchange rows with the owners of their experts (all-to-all over the EP axes);
  3. group received rows by local expert and run the grouped matmuls (`expert_fn`);
  4. send the outputs back, weight them by the router and sum per token.
The exchange is `jax.lax.ragged_all_to_all` (only real rows travel) where XLA compiles it (GPU, TPU)
and a padded `all_to_all` of worst-case blocks on CPU. Both are dropless unless a capacity factor
bounds the receive buffer (overflowing assignments are dropped, i.e. contribute zero): per source for
the padded exchange, one pool for all sources for the ragged one (`receive_rows`). Static shapes make
a dropless buffer worst-case sized: n_ep * T * min(k, E_loc) rows, every peer's tokens picking this
device, which is n_ep times the balanced load at E_loc = 1.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from sharding.layout import Layout, on_gpu, platform

# The name `combine` gives the routed experts' output rows (`jax.ad_checkpoint.checkpoint_name`): a remat policy
# that saves it (model.remat_policy save_dots_experts) spares the backward the experts' forward, which the router
# weights' gradient would otherwise re-run to read these rows. An identity without such a policy.
MOE_EXPERT_OUT = "moe_expert_out"
# The name of the routing's integer decisions: each token's top-k expert ids (`m3jax.model.moe.route`) and the
# rows' expert order (`sort_by_expert`'s argsort). They have no gradient and cost a few bytes per token, so every
# remat policy keeps them (`m3jax.model.remat.remat_policy_fn`): the backward does not run the top-k and the
# sort again.
MOE_ROUTING = "moe_routing"


def sort_by_expert(idx: jax.Array, num_experts: int):
    """Assignments [T, k] -> (order, token_of_row, expert_of_row, rows per expert [E]). An id of num_experts
    (`unrouted`) sorts last and is not counted: the exchange neither sends it nor lets it take a slot."""
    flat = idx.reshape(-1)
    order = checkpoint_name(jnp.argsort(flat, stable=True), MOE_ROUTING)
    return order, order // idx.shape[1], flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def combine(x: jax.Array, rows_out: jax.Array, weights: jax.Array, order: jax.Array, token_of_row) -> jax.Array:
    """sum_k w_k * out_k per token: fp32 weight times output, cast to x.dtype, summed (HF's order).
    rows_out carries the checkpoint name `MOE_EXPERT_OUT` (every path, local or exchanged, combines here)."""
    rows_out = checkpoint_name(rows_out, MOE_EXPERT_OUT)
    out = (rows_out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token_of_row].add(out)


def unrouted(idx: jax.Array, token_valid: jax.Array | None, num_experts: int) -> jax.Array:
    """idx [T, k] with the assignments of padding tokens (token_valid [T] False) set to num_experts: with a
    capacity factor, padding would otherwise take receive slots ahead of real tokens and drop theirs (a row's
    right padding sorts before the next row's tokens). Their routed output is zero."""
    return idx if token_valid is None else jnp.where(token_valid[:, None], idx, num_experts)


def local_experts(x, weights, idx, expert_fn: Callable, num_experts: int) -> jax.Array:
    """Every expert on this device: sort rows by expert, grouped matmuls, weighted sum."""
    order, token_of_row, _, group_sizes = sort_by_expert(idx, num_experts)
    return combine(x, expert_fn(x[token_of_row], group_sizes), weights, order, token_of_row)


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` semantics from all_gather + scatter, for backends (XLA:CPU) that
    cannot compile the real collective. Moves n_ep x the data; used to test the ragged bookkeeping."""
    me = jax.lax.axis_index(axis_name)
    everyone = jax.lax.all_gather(operand, axis_name)  # [n_ep, N, d]
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    where = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    rows = jnp.arange(operand.shape[0])
    for src in range(everyone.shape[0]):
        target = jnp.where(rows < sizes[src], where[src] + rows, output.shape[0])  # out of range: dropped
        output = output.at[target].set(everyone[src][(starts[src] + rows) % operand.shape[0]], mode="drop")
    return output


def _ragged_collective(exchange: str):
    return jax.lax.ragged_all_to_all if exchange == "ragged" else ragged_all_to_all_emulated


def exchanged_experts(x, weights, idx, expert_fn: Callable, num_experts: int, ep_axes: tuple[str, ...],
                      n_ep: int, capacity_factor: float | None = None, exchange: str = "padded",
                      return_counts: bool = False):
    """Expert-parallel body (inside shard_map): this device owns experts [r*E_loc, (r+1)*E_loc).

    exchange = "padded" (all_to_all of worst-case-sized blocks; XLA:CPU), "ragged"
    (`jax.lax.ragged_all_to_all`, only the real rows; GPU/TPU) or "ragged_emulated" (the ragged
    bookkeeping over an all_gather, for CPU tests). Buffer sizes: `receive_rows`.
    return_counts: return (output, [kept, real] int32): of this device's assignments of real tokens (`real`),
    those an expert ran (`kept`; the rest the capacity dropped).
    """
    t, k = idx.shape
    order, token_of_row, expert_of_row, per_expert = sort_by_expert(idx, num_experts)
    # the assignments of this device's real tokens (`unrouted` padding excluded): a capacity follows them, not the
    # buffer's T (`capped_rows`)
    real = jnp.sum(idx < num_experts).astype(jnp.int32)
    if exchange == "padded" or n_ep == 1:
        rows_out, kept = _padded_exchange(x[token_of_row], expert_of_row, per_expert, expert_fn, ep_axes, n_ep, t, k,
                                          capacity_factor, real)
    else:
        rows_out, kept = _ragged_exchange(x[token_of_row], per_expert, expert_fn, ep_axes, n_ep, t, k,
                                          capacity_factor, _ragged_collective(exchange), real)
    out = combine(x, rows_out, weights, order, token_of_row)
    return (out, jnp.stack([kept, real]).astype(jnp.int32)) if return_counts else out


def receive_rows(tokens: int, top_k: int, n_ep: int, experts_here: int, capacity_factor: float | None,
                 exchange: str) -> int:
    """Rows of one device's receive buffer (each of the exchange's [rows, d] buffers has this many).

        dropless  W = n_ep * T * min(k, E_loc)       (every token of every peer may pick this device)
        padded    W = n_ep * cap,  cap = min(T * min(k, E_loc), ceil(cf * T * k / n_ep))  per source
        ragged    W = min(dropless, ceil(cf * T * k))   one pool for all sources (T * k = the balanced load)
    with T tokens per device. n_ep = 1 runs locally: W = T * k.
    """
    worst = tokens * min(top_k, experts_here)
    if n_ep == 1:
        return tokens * top_k if capacity_factor is None else min(tokens * top_k, _cap(capacity_factor, tokens * top_k))
    if capacity_factor is None:
        return n_ep * worst
    if exchange == "padded":
        return n_ep * min(worst, _cap(capacity_factor, tokens * top_k / n_ep))
    return min(n_ep * worst, _cap(capacity_factor, tokens * top_k))


def _cap(capacity_factor: float, balanced: float) -> int:
    return max(1, math.ceil(capacity_factor * balanced))


def capped_rows(buffer_rows: int, capacity_factor: float | None, real: jax.Array, full: int, share: int = 1):
    """The rows a capacity keeps, of a buffer of `buffer_rows` (`receive_rows`, sized by the T tokens a device
    holds, padding included): min(buffer_rows, ceil(cf * real / share)), `real` the assignments of real tokens
    (padding is `unrouted`). Padding took no slot but enlarged the cap: the same rows cut to a narrower width
    (`grpo.micro_batch_widths`, whose cut changes no value on one context shard; several are refused with a cap)
    dropped other pairs (log-probs 0.18 apart, an audit), and how much a micro-batch dropped followed its padding. With no padding (`real` = `full`, T * k) it is the
    static bound itself, computed in Python; dropless (cf None): `buffer_rows`."""
    if capacity_factor is None:
        return buffer_rows
    dynamic = jnp.maximum(1, jnp.ceil(capacity_factor * real.astype(jnp.float32) / share)).astype(jnp.int32)
    return jnp.where(real == full, buffer_rows, jnp.minimum(buffer_rows, dynamic))


def _padded_exchange(rows, expert_of_row, per_expert, expert_fn, ep_axes, n_ep, t, k, capacity_factor, real):
    """A [n_ep, cap, d] block per source: source s's rows sorted by local expert, at most `capped_rows` of its
    real assignments / n_ep (overflowing assignments are neither sent nor counted: they contribute zero).
    Returns (rows out, how many of this source's rows an expert ran)."""
    d = rows.shape[-1]
    e_loc = per_expert.shape[0] // n_ep
    send_counts = per_expert.reshape(n_ep, e_loc)  # rows for each destination, by its local expert
    dest = expert_of_row // e_loc
    dest_rows = send_counts.sum(1)
    dest_start = jnp.cumsum(dest_rows) - dest_rows
    cap = receive_rows(t, k, n_ep, e_loc, capacity_factor, "padded") // n_ep  # the block's rows (static)
    keep = capped_rows(cap, capacity_factor, real, t * k, n_ep)  # the rows kept of it
    routed = dest < n_ep  # `unrouted` rows (padding) sort last with dest = n_ep: neither sent nor counted
    # position inside the destination's block (cap, never kept, for an unrouted row)
    slot = jnp.where(routed, jnp.arange(t * k) - dest_start[jnp.minimum(dest, n_ep - 1)], cap)
    kept = slot < keep
    cum = jnp.cumsum(send_counts, axis=1)
    send_counts = jnp.minimum(cum, keep) - jnp.minimum(cum - send_counts, keep)
    recv_counts = jax.lax.all_to_all(send_counts, ep_axes, 0, 0, tiled=True) if n_ep > 1 else send_counts
    send = jnp.zeros((n_ep, cap, d), rows.dtype).at[dest, slot].set(rows, mode="drop")
    recv = jax.lax.all_to_all(send, ep_axes, 0, 0, tiled=True) if n_ep > 1 else send
    # Received row r of source s belongs to local expert searchsorted(cumsum(recv_counts[s]), r).
    bounds = jnp.cumsum(recv_counts, axis=1)  # [n_ep, E_loc]
    r = jnp.arange(cap)
    local_expert = jax.vmap(lambda b: jnp.searchsorted(b, r, side="right"))(bounds).reshape(-1)
    back = _grouped(recv.reshape(n_ep * cap, d), local_expert, recv_counts.sum(0), expert_fn).reshape(n_ep, cap, d)
    back = jax.lax.all_to_all(back, ep_axes, 0, 0, tiled=True) if n_ep > 1 else back
    return jnp.where(kept[:, None], back[jnp.minimum(dest, n_ep - 1), jnp.minimum(slot, cap - 1)], 0), jnp.sum(kept)


def _grouped(recv, local_expert, group_sizes, expert_fn, packed: bool = False):
    """expert_fn on received rows regrouped expert-major (invalid rows, id E_loc, sort last), and the
    outputs put back in receive order. Packed rows of one local expert are grouped already."""
    if packed and group_sizes.shape[0] == 1:
        return expert_fn(recv, group_sizes)
    regroup = jnp.argsort(local_expert, stable=True)
    out = expert_fn(recv[regroup], group_sizes)
    return jnp.zeros_like(out).at[regroup].set(out)


def _ragged_exchange(rows, per_expert, expert_fn, ep_axes, n_ep, t, k, capacity_factor, collective, real):
    """Rows travel packed: receiver r lays the rows of source s at offset sum_{s' < s} of what it accepts
    from s', in one pool of W rows (`receive_rows`). With a capacity below the dropless W, a receiver
    accepts sources in rank order until the pool is full; the rest of a source's block (its last local
    experts' rows) is dropped. Everyone derives the acceptance from the all-gathered [n_ep, n_ep] row counts.
    Returns (rows out, how many of this source's rows an expert ran: what its destinations accepted)."""
    d = rows.shape[-1]
    e_loc = per_expert.shape[0] // n_ep
    me = jax.lax.axis_index(ep_axes)
    pool = receive_rows(t, k, n_ep, e_loc, capacity_factor, "ragged")
    send_counts = per_expert.reshape(n_ep, e_loc)
    sent = jax.lax.all_gather(send_counts.sum(1), ep_axes)  # [source, destination] rows before the cap
    # the pool a capacity fills: cf x the balanced load of the real assignments, sum(sent) / n_ep (`capped_rows`)
    fill = capped_rows(pool, capacity_factor, jnp.sum(sent).astype(jnp.int32), n_ep * t * k, n_ep)
    before = jnp.cumsum(sent, axis=0) - sent
    accepted = jnp.clip(fill - before, 0, sent)  # [source, destination]
    offset = jnp.minimum(before, fill)  # where source s's rows start in destination d's pool
    start = jnp.cumsum(sent, axis=1) - sent  # where source s keeps its rows for destination d
    recv = collective(rows, jnp.zeros((pool, d), rows.dtype), start[me], accepted[me], offset[me],
                      accepted[:, me], axis_name=ep_axes)
    recv_counts = jax.lax.all_to_all(send_counts, ep_axes, 0, 0, tiled=True)  # [source, local expert]
    cum = jnp.cumsum(recv_counts, axis=1)
    took = accepted[:, me][:, None]
    recv_counts = jnp.minimum(cum, took) - jnp.minimum(cum - recv_counts, took)
    # Pool row r: source s = #sources whose block ends at or before r; its local expert from s's counts.
    r = jnp.arange(pool)
    ends = offset[:, me] + accepted[:, me]
    src = jnp.minimum(jnp.searchsorted(ends, r, side="right"), n_ep - 1)
    within = r - offset[src, me]
    right = functools.partial(jnp.searchsorted, side="right")
    local_expert = jnp.where(r < ends[-1], jax.vmap(right)(jnp.cumsum(recv_counts, 1)[src], within), e_loc)
    back = _grouped(recv, local_expert, recv_counts.sum(0), expert_fn, packed=True)
    return collective(back, jnp.zeros((t * k, d), rows.dtype), offset[:, me], accepted[:, me], start[:, me],
                      accepted[me], axis_name=ep_axes), jnp.sum(accepted[me])


def default_exchange(backend: str | None = None) -> str:
    """The real ragged collective where XLA compiles it, the padded all_to_all elsewhere; backend: the
    platform the program is built for (`Layout.backend`; default jax's)."""
    return "ragged" if on_gpu(backend) or platform(backend) in ("rocm", "tpu") else "padded"


def routed_experts(x: jax.Array, route_fn: Callable, router: tuple, expert_fn: Callable, gate_up: jax.Array,
                   down: jax.Array, *, layout: Layout = Layout(), capacity_factor: float | None = None,
                   exchange: str | None = None, ids: jax.Array | None = None, return_ids: bool = False,
                   token_valid: jax.Array | None = None, return_counts: bool = False):
    """Routed output for hidden x [B, S, d].

    route_fn(tokens [T, d], *router) -> (weights [T, k], expert ids [T, k]); router arrays are replicated;
    expert_fn(rows [N, d], group_sizes [E_here], gate_up [E_here, 2, I, d], down [E_here, d, I], *, expected_rows)
    -> [N, d], expected_rows = the rows each expert receives under a balanced load (n_ep * T * k / E for T
    tokens per device): a kernel that sizes work by it (the bucketed one) must not read it off N, which an
    expert-parallel receive buffer sizes for the worst case.
    Without a mesh in `layout` every expert runs locally; with one, the same math runs in shard_map
    with experts sharded per the layout's rules and tokens exchanged over those axes.
    ids [B, S, k] (routing replay): given expert ids, sharded like x's tokens, passed on as
    route_fn(tokens, *router, ids [T, k]); the ids route_fn returns drive the exchange.
    return_ids: return (output, the ids used [B, S, k] int32).
    return_counts: also return, last, [kept, real] int32 over the whole batch: its (token, expert) assignments of
    real tokens (every token where dropless), and those an expert ran; real - kept is what the capacity dropped.
    capacity_factor bounds each device's receive buffer (`receive_rows`) on every layout, one device included
    (n_ep = 1: its own tokens' T * k assignments), so a setting means the same model on one device and on a
    mesh that does not split the experts. token_valid [B, S] (False = padding): with a capacity factor, padding
    tokens are not routed (`unrouted`); dropless, every token is, as in HF.
    """
    num_experts = gate_up.shape[0]
    mesh = layout.mesh
    ep_axes, width_axes = layout.axes("experts"), layout.axes("expert_mlp")

    def body(x, router, gate_up, down, ids=None, valid=None):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        w, idx = route_fn(t, *router) if ids is None else route_fn(t, *router, ids.reshape(b * s, -1))
        n_ep = 1 if mesh is None else layout.size("experts")
        balanced = n_ep * t.shape[0] * idx.shape[1] / num_experts
        fn = lambda rows, sizes: expert_fn(rows, sizes, gate_up, down, expected_rows=balanced)  # noqa: E731
        sent = unrouted(idx, None if valid is None else valid.reshape(-1), num_experts)  # valid: with a cap only
        if mesh is None and capacity_factor is None:
            out = local_experts(t, w, idx, fn, num_experts).reshape(b, s, d)
            counts = jnp.full((2,), idx.size, jnp.int32)
        elif mesh is None:  # the n_ep = 1 bound of a mesh without expert parallelism
            out, counts = exchanged_experts(t, w, sent, fn, num_experts, (), 1, capacity_factor, "padded",
                                            return_counts=True)
            out = out.reshape(b, s, d)
        else:
            out, counts = exchanged_experts(t, w, sent, fn, num_experts, ep_axes, n_ep, capacity_factor,
                                            exchange or default_exchange(layout.backend), return_counts=True)
            if width_axes:
                out = jax.lax.psum(out, width_axes)  # partial sums over the sharded width
            out = out.reshape(b, s, d)
            token_axes = layout.axes("act_batch") + layout.axes("act_seq")
            if return_counts and token_axes:  # each token once: the other axes hold copies of the same tokens
                counts = jax.lax.psum(counts, token_axes)
        return ((out,) + ((idx.astype(jnp.int32).reshape(b, s, -1),) if return_ids else ())
                + ((counts,) if return_counts else ()))

    valid = None if capacity_factor is None or token_valid is None else token_valid.astype(bool)
    args = (x, router, gate_up, down) + (() if ids is None else (ids,))
    if mesh is None:
        return _single(body(*args, valid=valid))
    x_spec = layout.spec(("act_batch", "act_seq", None), drop_trivial=True)
    gu_spec = layout.spec(("experts", None, "expert_mlp", None), drop_trivial=True)
    down_spec = layout.spec(("experts", None, "expert_mlp"), drop_trivial=True)
    router_spec = jax.tree.map(lambda _: P(), router)
    in_specs = (x_spec, router_spec, gu_spec, down_spec) + (() if ids is None else (x_spec,))
    if valid is not None:  # the last argument, by keyword to body
        in_specs += (layout.spec(("act_batch", "act_seq"), drop_trivial=True),)
        args += (valid,)
    sharded = (lambda *a: body(*a[:-1], valid=a[-1])) if valid is not None else body
    out_specs = (x_spec,) + ((x_spec,) if return_ids else ()) + ((P(),) if return_counts else ())
    return _single(jax.shard_map(sharded, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args))


def _single(out: tuple):
    return out if len(out) > 1 else out[0]
