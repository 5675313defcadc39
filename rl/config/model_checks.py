"""Rules that tie the run to its model's own config (model.tiny's fields or model.path's config.json): the
sequence limits against the model's positions, the stop tokens against its vocabulary."""

from __future__ import annotations

from rl.config.errors import _Problem
from rl.config.fields import _show
from rl.config.validate_eval import eval_lengths

# Checks take the whole `rl.config.run.RunConfig` (named in annotations only: that module imports the validator).


def model_checks(cfg: RunConfig) -> list[_Problem]:
    """Both checks below, reading the model's config once (nothing when model.path / model.tiny are themselves
    wrong: those are reported on their own)."""
    m = cfg.model
    if (m.path is None) == (m.tiny is None):
        return []
    try:
        m3 = m.m3_config()
    except Exception:  # noqa: BLE001  (a bad model.tiny or an unreadable model.path has its own error)
        return []
    return _position_checks(cfg, m3) + _stop_token_checks(cfg, m3) + _layer_kind_checks(cfg, m3)


def _layer_kind_checks(cfg: RunConfig, m3) -> list[_Problem]:
    """An option for a kind of layer the model does not have (the indexer's alignment loss, a replay of routes or
    block selections) would do nothing: refused."""
    out = []
    g = cfg.grpo
    if cfg.model.indexer_loss_coef > 0 and not m3.has_sparse_attention:
        out.append(_Problem("model.indexer_loss_coef", (
            f"model.indexer_loss_coef = {_show(cfg.model.indexer_loss_coef)}: the model has no sparse (indexer) "
            "layers to align; allowed: 0, or a model whose layer_types include \"minimax_m3_sparse\"")))
    if g.routing_replay != "none" and not m3.has_moe:
        out.append(_Problem("grpo.routing_replay", (
            f"grpo.routing_replay = {_show(g.routing_replay)}: the model has no MoE layer whose routes could be "
            f"replayed ({_source(cfg, 'mlp_layer_types')} holds no \"sparse\"); allowed: \"none\"")))
    if g.indexer_replay != "none" and not m3.has_sparse_attention:
        out.append(_Problem("grpo.indexer_replay", (
            f"grpo.indexer_replay = {_show(g.indexer_replay)}: the model has no sparse (indexer) layer whose block "
            f"selection could be replayed ({_source(cfg, 'layer_types')} holds no \"minimax_m3_sparse\"); allowed: "
            "\"none\"")))
    return out


def _source(cfg: RunConfig, field: str) -> str:
    return f"model.tiny.{field}" if cfg.model.tiny is not None else f"{field} in {cfg.model.path}/config.json"


def _position_checks(cfg: RunConfig, m3) -> list[_Problem]:
    """A sequence (prompt + response, in training and in evaluation) must fit the model's positions: RoPE has no
    table and would run past them silently, producing text from positions the model never saw (vLLM refuses a
    max_model_len over max_position_embeddings the same way)."""
    gen, limit = cfg.generation, m3.max_position_embeddings
    source = "model.tiny.max_position_embeddings" if cfg.model.tiny is not None else f"{cfg.model.path}/config.json"
    lengths = [("generation", gen.max_prompt_tokens, gen.max_new_tokens)]
    if cfg.eval.enabled and eval_lengths(cfg) != (gen.max_prompt_tokens, gen.max_new_tokens):
        lengths.append(("eval", *eval_lengths(cfg)))
    out = []
    for section, prompt, new in lengths:
        if prompt + new > limit:
            out.append(_Problem(f"{section}.max_new_tokens", (
                f"{section}.max_prompt_tokens + {section}.max_new_tokens = {prompt} + {new} = {prompt + new}: more "
                f"positions than the model has (max_position_embeddings = {limit}, from {source}); allowed: "
                f"prompt + response limits of at most {limit} tokens"), (f"{section}.max_prompt_tokens",)))
    return out


def _stop_token_checks(cfg: RunConfig, m3) -> list[_Problem]:
    """The tokens that end a response (generation.stop_token_ids, or the model's end tokens when that list is empty:
    generation_config.json's eos_token_id, else config.json's) must be ids the model can sample: one past its
    vocabulary never comes, so every response would run to max_new_tokens and be scored (and trained on)
    truncated, with nothing said."""
    gen, vocab = cfg.generation, m3.vocab_size
    out = []
    for i, t in enumerate(gen.stop_token_ids):
        if t >= vocab:
            out.append(_Problem(f"generation.stop_token_ids[{i}]", (
                f"generation.stop_token_ids[{i}] = {t}: not a token of the model; allowed: an integer in "
                f"[0, {_source(cfg, 'vocab_size')}={vocab})"),
                ("model.tiny.vocab_size" if cfg.model.tiny is not None else "model.path",)))
    if gen.stop_token_ids:
        return out
    if cfg.model.path is None:  # model.tiny's eos_token_id is checked as a field
        if m3.eos_token_id is None or m3.eos_token_id == ():
            out.append(_no_end_token(cfg, "model.tiny.eos_token_id names no token"))
        return out
    from m3jax.hf.end_tokens import end_token_ids
    from m3jax.hf.safetensors_io import CheckpointError
    try:
        ends = end_token_ids(cfg.model.path, m3.eos_token_id)
    except CheckpointError as e:
        return out + [_Problem("model.path", f"model.path = {cfg.model.path!r}: {e}")]
    if not ends:
        return out + [_no_end_token(cfg, f"{cfg.model.path} names no eos_token_id (in generation_config.json or "
                                         "config.json)")]
    outside = [t for t in ends if not 0 <= t < vocab]
    if outside:
        out.append(_Problem("generation.stop_token_ids", (
            f"generation.stop_token_ids = []: responses would stop at the model's end token(s) {list(ends)} "
            f"({cfg.model.path}'s generation_config.json eos_token_id, else its config.json's), but {outside[0]} is "
            f"not below its vocab_size = {vocab}, so no response would ever stop; allowed: the ids that end a "
            "response (e.g. the tokenizer's eos_token_id), or a checkpoint whose eos_token_id is in [0, vocab_size)"),
            ("model.path",)))
    return out


def _no_end_token(cfg: RunConfig, why: str) -> _Problem:
    """No token would end a response: each would run to max_new_tokens and count as truncated (all of them filtered
    under grpo.overlong_filter, all punished under grpo.overlong_buffer), with nothing said."""
    return _Problem("generation.stop_token_ids", (
        f"generation.stop_token_ids = [] and {why}: no token ends a response, so every response would run to "
        f"generation.max_new_tokens = {cfg.generation.max_new_tokens} and be truncated; allowed: the ids that end a "
        "response (e.g. the tokenizer's eos_token_id)"),
        ("model.tiny.eos_token_id" if cfg.model.tiny is not None else "model.path",))
