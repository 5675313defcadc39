"""Mixture of experts: sigmoid router with a selection-only bias, grouped expert matmuls, shared expert.

Work is proportional to tokens x top-k: assignments are sorted by expert and each expert multiplies
only its own rows (`sharding.grouped_matmul`), never every expert on every token. The grouped-matmul
kernel (`moe_kernel`: auto | ragged_dot | tiled | bucketed | pallas) decides whether padding rows of an
expert-parallel receive buffer are multiplied too (ragged_dot's dense lowerings) or skipped (the others).
"""

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from m3jax.model.mlp import dense_mlp, swiglu_oai
from sharding.expert import MOE_ROUTING, routed_experts
from sharding.grouped_matmul import DEFAULT_TILE, grouped_mlp
from sharding.layout import Layout


def route(x: jax.Array, router: jax.Array, bias: jax.Array, *, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k expert choice and weights for tokens x [T, d]; router [E, d] and bias [E] in fp32.

        p = sigmoid(x W^T)            (fp32)
        idx = top_k(p + bias)         (the correction bias only picks experts)
        w = p[idx] / sum(p[idx])      (unbiased probabilities, renormalised over the top-k)
    Returns (w [T, k] fp32, idx [T, k] int32). Gradients reach W through w, never through idx.
    """
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), router.astype(jnp.float32))
    p = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(p) + bias, top_k)
    idx = checkpoint_name(idx, MOE_ROUTING)  # kept by every remat policy: no top-k again in the backward
    w = jnp.take_along_axis(p, idx, axis=-1)
    return w / jnp.sum(w, axis=-1, keepdims=True), idx.astype(jnp.int32)


def replay_route(x: jax.Array, router: jax.Array, idx: jax.Array) -> jax.Array:
    """Weights of replayed expert choices (routing replay): tokens x [T, d], router [E, d], ids idx [T, k].

        p = sigmoid(x W^T)            (fp32, the full dense router output)
        w = p[idx] / sum(p[idx])      (the replayed experts' probabilities, renormalised over the k)
    Returns w [T, k] fp32; `moe_block` scales it by routed_scaling_factor as for `route`. The ids are
    given (e.g. the generator's), so the correction bias, which only selects, drops out; the scores are
    gathered from the dense p (never from post-top-k zeros), so the router keeps its gradient for every
    replayed expert. With idx = route(...)[1] this is route(...)[0], the same numbers.
    """
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), router.astype(jnp.float32))
    w = jnp.take_along_axis(jax.nn.sigmoid(logits), idx.astype(jnp.int32), axis=-1)
    return w / jnp.sum(w, axis=-1, keepdims=True)


def route_or_replay(x: jax.Array, router: jax.Array, bias: jax.Array, ids: jax.Array | None = None, *,
                    top_k: int) -> tuple[jax.Array, jax.Array]:
    """`route` (ids None) or `replay_route` of the given ids [T, k]: (w [T, k] fp32, ids [T, k] int32)."""
    if ids is None:
        return route(x, router, bias, top_k=top_k)
    return replay_route(x, router, ids), ids.astype(jnp.int32)


def grouped_experts(rows: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                    alpha: float, limit: float, kernel: str = "auto", backend: str | None = None,
                    tile: int = DEFAULT_TILE, expected_rows: float | None = None) -> jax.Array:
    """SwiGLU-OAI experts on expert-sorted rows [N, d]: rows of group e go through expert e.

        out[r] = down_e @ swiglu_oai(gate_e @ rows[r], up_e @ rows[r])     e = the group of row r
    gate_up [E, 2, I, d] (HF [out, in] layout, gate half then up half), down [E, d, I].
    Rows past sum(group_sizes) (padding) come back as zeros. kernel: `sharding.grouped_matmul.KERNELS`
    (tiled fuses the two matmuls per row tile and skips the padding). backend: the platform the program is
    built for (`Layout.backend`), which resolves "auto". tile: the tiled kernel's rows per step.
    expected_rows: the rows each expert holds under a balanced load (the bucketed kernel's bucket; default
    N / E, right for a buffer without padding).
    """
    e, _, i, d = gate_up.shape
    act = lambda gu: swiglu_oai(gu[..., :i], gu[..., i:], alpha, limit)  # noqa: E731
    return grouped_mlp(rows, gate_up.reshape(e, 2 * i, d), down, group_sizes, act, kernel=kernel, backend=backend,
                       tile=tile, expected_rows=expected_rows)


def moe_block(p: dict, x: jax.Array, cfg, layout: Layout = Layout(), capacity_factor: float | None = None,
              exchange: str | None = None, kernel: str | None = None, routes: jax.Array | None = None,
              return_routes: bool = False, token_valid: jax.Array | None = None, return_counts: bool = False):
    """y = routed_scaling_factor * sum_k w_k Expert_k(x) + SharedExpert(x), x [B, S, d].

    Where the experts run (locally, or expert-parallel over the layout's mesh) is `sharding.expert`'s business;
    kernel: the grouped-matmul kernel of the experts (None = "auto", resolved for the layout's platform).
    routes [B, S, k]: replay these expert ids (`replay_route`: weights from the live router) instead of
    choosing them; they drive the expert-parallel exchange. return_routes: return (y, ids [B, S, k] int32),
    the router's own top-k choice: the ids used without replay; with replay, the ids it would have chosen
    (one more router matmul), so a replayed step still sees how far trainer and generator disagree.
    token_valid [B, S] (False = padding): with a capacity factor, padding takes no expert's capacity.
    return_counts: also return, last, [kept, real] int32: the batch's (token, expert) assignments of real tokens
    and those an expert ran (`routed_experts`); real - kept were dropped by the capacity factor.
    """
    alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit
    routed = routed_experts(
        x, functools.partial(route_or_replay, top_k=cfg.num_experts_per_tok), (p["router"], p["router_bias"]),
        functools.partial(grouped_experts, alpha=alpha, limit=limit, kernel=kernel or "auto", backend=layout.backend),
        p["experts_gate_up"], p["experts_down"],
        layout=layout, capacity_factor=capacity_factor, exchange=exchange, ids=routes,
        return_ids=return_routes and routes is None, token_valid=token_valid, return_counts=return_counts)
    if return_counts:
        *routed, counts = routed
        routed = tuple(routed) if len(routed) > 1 else routed[0]
    if return_routes and routes is None:
        routed, ids = routed
    elif return_routes:
        b, s, d = x.shape
        h = jax.lax.stop_gradient(x).reshape(b * s, d)
        ids = route(h, p["router"], p["router_bias"], top_k=cfg.num_experts_per_tok)[1].reshape(b, s, -1)
    shared = dense_mlp(x, p["shared_gate_up"], p["shared_down"], alpha, limit, layout.num_devices == 1)
    y = routed * cfg.routed_scaling_factor + shared
    out = (y,) + ((ids,) if return_routes else ()) + ((counts,) if return_counts else ())
    return out if len(out) > 1 else y
