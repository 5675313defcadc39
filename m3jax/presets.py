"""Named model shapes: a released model's M3Config fields without its checkpoint.

A run trains a randomly initialised model of such shapes with `model.tiny: {preset: release}` (a throughput and fit
run of a recipe before the weights are downloaded); the planner plans them with `--model release`.
"""

from __future__ import annotations

from typing import Any

from m3jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION

RELEASE_DENSE_LAYERS = 3  # the release's layers 0..2: full attention + dense MLP; 3..59: sparse attention + MoE


def release_fields(num_dense: int = RELEASE_DENSE_LAYERS, num_moe: int = 57) -> dict[str, Any]:
    """The MiniMax-M3 text model's released values (../shared/docs/m3-architecture.md §1): `num_dense` full-attention
    dense-MLP layers, then `num_moe` indexer-sparse MoE layers (the release: 3 + 57; fewer give the reduced depths
    the planner's compile check uses, at the real widths). Token ids are the HF defaults (M3Config's)."""
    n = num_dense + num_moe
    return dict(
        vocab_size=200064, hidden_size=6144, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
        num_local_experts=128, num_experts_per_tok=4,
        layer_types=[FULL_ATTENTION] * num_dense + [SPARSE_ATTENTION] * num_moe,
        mlp_layer_types=[DENSE_MLP] * num_dense + [MOE_MLP] * num_moe,
        rope_theta=5_000_000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-6, routed_scaling_factor=2.0,
        index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
        max_position_embeddings=1048576)


def _release(num_hidden_layers: int | None = None) -> dict[str, Any]:
    if num_hidden_layers is None:
        return release_fields()
    dense = min(RELEASE_DENSE_LAYERS, num_hidden_layers)
    return release_fields(dense, num_hidden_layers - dense)


PRESETS = {"release": _release}


class PresetError(ValueError):
    """A `{preset: NAME, ...}` mapping that names no preset, or sets its depth wrongly (str: which, and what is
    allowed)."""


def expand_preset(fields: dict[str, Any]) -> dict[str, Any]:
    """{preset: NAME, **rest} -> NAME's M3Config fields with `rest` replacing them; a mapping without `preset` is
    returned as it is. A `num_hidden_layers` given gives the preset's layer pattern at that depth (for release: up to
    3 full dense layers first, the rest sparse MoE) to whichever of `layer_types` / `mlp_layer_types` is not given."""
    if "preset" not in fields:
        return fields
    rest = {k: v for k, v in fields.items() if k != "preset"}
    name = fields["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        raise PresetError(f"preset = {name!r}: no such model preset; allowed: {', '.join(sorted(PRESETS))}")
    depth = rest.get("num_hidden_layers")
    if depth is None:
        return {**PRESETS[name](), **rest}
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise PresetError(f"num_hidden_layers = {depth!r} with preset {name!r}: allowed: an integer >= 1")
    return {**PRESETS[name](depth), **rest}
