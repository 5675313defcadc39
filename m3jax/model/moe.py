"""Mixture of experts: sigmoid router with a selection-only bias, grouped expert matmuls, shared expert.

Work is proportional to tokens x top-k: assignments are sorted by expert and each expert multiplies
only its own rows (`sharding.grouped_matmul`), never every expert on every token. The grouped-matmul
kernel (`moe_kernel`: auto | ragged_dot | tiled) decides whether padding rows of an expert-parallel
receive buffer are multiplied too (ragged_dot's dense lowerings) or skipped (tiled).
"""

import functools

import jax
import jax.numpy as jnp

from m3jax.model.mlp import dense_mlp, swiglu_oai
from sharding.expert import routed_experts
from sharding.grouped_matmul import grouped_mlp
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
    w = jnp.take_along_axis(p, idx, axis=-1)
    return w / jnp.sum(w, axis=-1, keepdims=True), idx.astype(jnp.int32)


def grouped_experts(rows: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                    alpha: float, limit: float, kernel: str = "auto") -> jax.Array:
    """SwiGLU-OAI experts on expert-sorted rows [N, d]: rows of group e go through expert e.

        out[r] = down_e @ swiglu_oai(gate_e @ rows[r], up_e @ rows[r])     e = the group of row r
    gate_up [E, 2, I, d] (HF [out, in] layout, gate half then up half), down [E, d, I].
    Rows past sum(group_sizes) (padding) come back as zeros. kernel: `sharding.grouped_matmul.KERNELS`
    (tiled fuses the two matmuls per row tile and skips the padding).
    """
    e, _, i, d = gate_up.shape
    act = lambda gu: swiglu_oai(gu[..., :i], gu[..., i:], alpha, limit)  # noqa: E731
    return grouped_mlp(rows, gate_up.reshape(e, 2 * i, d), down, group_sizes, act, kernel=kernel)


def moe_block(p: dict, x: jax.Array, cfg, layout: Layout = Layout(), capacity_factor: float | None = None,
              exchange: str | None = None, kernel: str | None = None) -> jax.Array:
    """y = routed_scaling_factor * sum_k w_k Expert_k(x) + SharedExpert(x), x [B, S, d].

    Where the experts run (locally, or expert-parallel over the layout's mesh) is `sharding.expert`'s business;
    kernel: the grouped-matmul kernel of the experts (None = "auto").
    """
    alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit
    routed = routed_experts(
        x, functools.partial(route, top_k=cfg.num_experts_per_tok), (p["router"], p["router_bias"]),
        functools.partial(grouped_experts, alpha=alpha, limit=limit, kernel=kernel or "auto"), p["experts_gate_up"], p["experts_down"],
        layout=layout, capacity_factor=capacity_factor, exchange=exchange)
    shared = dense_mlp(x, p["shared_gate_up"], p["shared_down"], alpha, limit)
    return routed * cfg.routed_scaling_factor + shared
