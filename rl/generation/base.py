"""The generation-backend protocol shared by the JAX engine and the vLLM pool, and the sampling math
that generator and trainer must agree on."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from rl.config.schema import MIN_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()

    def untruncated(self) -> "SamplingParams":
        """This transform's temperature with every token kept (no top-k / top-p): what the weight probes and the
        KL's reference are scored under."""
        return dataclasses.replace(self, top_k=0, top_p=1.0)

    def __post_init__(self):
        """Refuse what a run's config refuses (rl.config), for callers that build one themselves: a NaN temperature
        sampled at 1, one below MIN_TEMPERATURE returned NaN logprobs, a float top_k or a list of stop ids failed
        deep inside jit."""
        def whole(value) -> bool:
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        if not whole(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not np.isfinite(t) or t < 0 \
                or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature={t!r}: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: expected a value in (0, 1]")
        if not whole(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = off)")
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or not all(whole(x) and x >= 0 for x in stops):
            raise ValueError(f"stop_token_ids={stops!r}: expected a sequence of token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(int(x) for x in stops))  # hashable: a jit static argument


def check_request(prompts: list[list[int]], vocab_size: int | None, max_positions: int, new_tokens: int = 0,
                  responses: list[list[int]] | None = None,
                  limit_name: str = "the model's max_position_embeddings", stop_token_ids=()) -> None:
    """Raise one ValueError naming the first bad row of a generate (`new_tokens` per row) or score (`responses`)
    request, and what was expected, before any work: the JAX model's gather would clamp an id outside
    [0, vocab_size) to a real token, and RoPE would run past the positions the model was trained on, both
    silently; a vLLM engine would raise, and the pool would take that for a dead engine and replace it. Also
    refused: no prompts, and an empty prompt (generation starts from its last token). vocab_size None: ids
    not checked. max_positions / limit_name: the most positions a row may take, and what sets them. A stop token id
    outside the vocabulary (never sampled: the rows would run to max_new_tokens) is refused too."""
    if not prompts:
        raise ValueError("no prompts: expected a non-empty list of token-id lists")
    outside = [int(t) for t in stop_token_ids if vocab_size is not None and not 0 <= int(t) < vocab_size]
    if outside:
        raise ValueError(f"stop token id(s) {outside}: expected ids in [0, {vocab_size}) (the model's vocab_size)")
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses: expected one response per prompt")
    rows = [("prompt", prompts)] + ([("response", responses)] if responses is not None else [])
    for what, seqs in rows:
        lengths = np.array([len(q) for q in seqs])
        if what == "prompt" and not lengths.all():
            raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: expected at least one token id")
        if not lengths.sum():
            continue
        flat = np.concatenate([np.asarray(q, np.int64).reshape(-1) for q in seqs])
        bad = (flat < 0) if vocab_size is None else (flat < 0) | (flat >= vocab_size)
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(f"{what} {int(np.searchsorted(np.cumsum(lengths), at, side='right'))} holds token id "
                             f"{flat[at]}: expected ids in [0, {vocab_size}) (the model's vocab_size)")
    total = np.array([len(q) for q in prompts]) + (np.array([len(r) for r in responses]) if responses is not None
                                                   else new_tokens)
    if (total > max_positions).any():
        i = int(np.argmax(total > max_positions))
        parts = (f"{len(prompts[i])} prompt + {len(responses[i])} response tokens" if responses is not None else
                 f"{len(prompts[i])} prompt tokens + max_new_tokens {new_tokens}")
        raise ValueError(f"row {i}: {parts} = {total[i]} positions: expected at most {limit_name} = {max_positions}")


@dataclasses.dataclass
class Rollout:
    """G samples per prompt, flattened: row i is a sample of prompt i // G."""
    prompt_ids: list[list[int]]  # one per row
    tokens: np.ndarray  # [N, T] response tokens (stop token included), padded with pad_id
    logprobs: np.ndarray  # [N, T] logp_gen of each response token under the sampling transformation
    lengths: np.ndarray  # [N] response lengths
    truncated: np.ndarray  # [N] hit max_new_tokens without a stop token
    weight_version: int = 0
    # [N, W + T, n_moe_layers, k] int16 or None: the expert ids each MoE layer routed each token to, for
    # the token sequence prompt + response of row i (entry j = token j of that concatenation, as
    # `rl.grpo.batch.build_train_batch` lays it out; entries past the sequence are meaningless), for
    # routing replay and `moe/route_mismatch_frac`. n_moe_layers * k * 2 bytes per token (M3: 57 x 4 x 2 =
    # 456 B). None when the backend does not return routes (the vLLM pool; the JAX engine unless asked).
    routes: np.ndarray | None = None
    # [N, W + T, n_sparse_layers, Hi, K] int16 or None: the key blocks (-1 = none) each sparse layer's indexer
    # kept for each index head and token of prompt + response (laid out as routes), for indexer selection
    # replay and `indexer/selection_mismatch_frac`. n_sparse_layers * Hi * K * 2 bytes per token (M3
    # release: 57 x 4 x 16 x 2 = 7,296 B). None when the backend does not return them: this vLLM version
    # has no output for the indexer's selection (an open vLLM RFC); a backend that returns them fills this.
    block_ids: np.ndarray | None = None


class Generator(Protocol):
    """Everything the trainer asks of a generation backend (the JAX engine, a vLLM pool, the
    multi-host wrapper of a pool)."""

    resent_rows: int  # rows re-sent after an engine died or hung (0 for an in-process engine)
    restarts: int  # engines replaced so far

    def generate(self, prompts: list[list[int]], params: SamplingParams, key: jax.Array,
                 prompt_width: int | None = None) -> Rollout:
        """G rows already repeated in `prompts`; `key` seeds every row's sampling; `prompt_width` pads
        prompts to a fixed width (one compiled program for every batch). `Rollout.routes` and
        `Rollout.block_ids` are optional: None from a backend that does not return the MoE routes / the
        sparse layers' key blocks it used."""

    def set_weights(self, params, version: int, rest=None):
        """Generate with these parameters (and non-trainable state) from now on, as weight `version`.
        Returns None when nothing moved (parameters shared in process), else the transfer's
        `rl.generation.transfer.TransferStats`."""

    def score(self, prompts: list[list[int]], responses: list[list[int]], params: SamplingParams
              ) -> list[list[np.ndarray]]:
        """Per engine, per sequence: logprob of each response token given the prompt and the tokens
        before it, under `params`' sampling transformation."""

    def shutdown(self) -> None:
        """Release engines and workers; the generator is unusable afterwards."""


def sampling_logits(logits: jax.Array, temperature: float, top_p: float = 1.0, top_k: int = 0) -> jax.Array:
    """The logits samples are drawn from, in fp32: logits / T, then everything outside the top-k and
    outside the smallest top-p nucleus set to -inf. Greedy (T = 0) scores with T = 1. A top_k of the
    vocabulary's size or more keeps every token (as transformers' and vLLM's samplers do).

    Ties at a cut are kept whole: every token whose logit equals the k-th or the nucleus's last (the JAX engine
    samples from this same set). vLLM's CPU top-k keeps the tied tokens too; its GPU Triton kernel (vLLM 0.32,
    `topk_topp_triton.py`) keeps exactly k, dropping the extra tied ones in vocabulary order, and vLLM and
    transformers cut the nucleus at a position of their sort, so which tied tokens they keep is their sort's
    order among equal values, which no other program reproduces. Keeping them all, no token they sample is scored
    -inf here. The price, where a tie sits at a cut (common in bf16 logits), is a kept set larger than the
    engine's: log p lower than the engine's by log(the mass kept here / the mass it kept), 2e-3 on a 32k
    vocabulary at top_p 0.9-0.99 (a helper's measurement), up to 0.69 nats with two tokens tied at the top and a
    tiny top_p, and for vLLM's GPU top-k with ties at the k-th logit a mean of 1e-2 to 4e-2 nats per row at
    top_k 20-50 on synthetic bf16 logits of the release's vocabulary (an audit's emulation of the kernel's rule:
    importance weights below 1 on those rows; unmeasured on a GPU, docs/limitations.md). Counted in the logged
    mismatch (`gen_kl_error`, `token_mult_prob_error`).

    The trainer computes logp_old / logp with this same function, so on-policy ratios are exactly 1.

    Logits narrower than fp32 are read at their own precision, explicitly (`reduce_precision`): XLA's default
    excess precision otherwise drops the round trip through bf16 inside a fused program, each program
    differently, so the jitted full-logits path, the chunked one and eager code (vLLM's and HF's logits are
    bf16) scored the same bf16 model up to 1.6e-3 apart (an audit).
    """
    z = logits.astype(jnp.float32)
    if jnp.issubdtype(logits.dtype, jnp.floating) and jnp.dtype(logits.dtype).itemsize < 4:
        info = jnp.finfo(logits.dtype)
        z = jax.lax.reduce_precision(z, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    z = z / (temperature if temperature > 0 else 1.0)
    if 0 < top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p < 1.0:
        sorted_z = jnp.sort(z, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_z, axis=-1)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(before < top_p, sorted_z, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < cutoff, -jnp.inf, z)
    return z


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> jax.Array:
    """log p(token) under `sampling_logits`: [..., V] logits, [...] tokens -> [...] fp32."""
    logp = jax.nn.log_softmax(sampling_logits(logits, temperature, top_p, top_k), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float, top_p: float = 1.0,
                               top_k: int = 0) -> tuple[jax.Array, jax.Array]:
    """(log p(token), H) under `sampling_logits`: [..., V] logits, [...] tokens -> two [...] fp32 arrays, H the
    entropy of the distribution tokens are sampled from (after temperature, top-k and top-p):

        H = -sum_v p_v log p_v   over the tokens the transform keeps (p_v = 0 elsewhere, and adds 0)

    log p(token) is `token_logprobs`'s, from the same log-softmax. Differentiable: dH/dz_v = -p_v (log p_v + H)
    on the kept tokens, 0 on the others (their log p, -inf, is replaced by 0 before the product: e^0 * 0 adds 0,
    and no gradient reaches them through the replacement)."""
    logp = jax.nn.log_softmax(sampling_logits(logits, temperature, top_p, top_k), axis=-1)
    safe = jnp.where(jnp.isfinite(logp), logp, 0.0)
    entropy = -jnp.sum(jnp.exp(safe) * safe, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0], entropy
