"""The two Hugging Face config.json forms of the M3 text model, read into M3Config's fields and written back.

- native `minimax_m3_vl_text`: `layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`;
- released `minimax_m3_vl`: the text part nested in `text_config` with legacy keys
  (`moe_layer_freq`, `sparse_attention_config`, `rope_theta`, `partial_rotary_factor`, `rotary_dim`).

(../shared/docs/m3-architecture.md §1.) `M3Config.from_hf_dict` / `to_hf_dict` are the public entry points;
m3jax/config.py keeps the fields and their validation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any

from m3jax.config_errors import ConfigError, as_float, field_error
from m3jax.model.specs import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION

# What reading a config logs is M3Config's to say: its logger keeps the name users and tests filter on.
log = logging.getLogger("m3jax.config")

# What an M3Config holds only to write it back into an export: not the model (comparisons leave them out).
PASSTHROUGH_FIELDS = ("vl_passthrough", "text_passthrough")

# Keys HF writes for bookkeeping or training-only features that do not change the forward pass.
_BOOKKEEPING = {
    "architectures", "transformers_version", "model_type", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "auto_map", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "hidden_act", "base_config_key",
}

# Release keys describing behaviour HF hard-codes: (key, value the model implements).
_HARDCODED = {
    "use_gemma_norm": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "attention_output_gate": False,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "n_shared_experts": 1,
    "sparse_score_type": "max",
    "sparse_init_block": 0,
}
_HIDDEN_ACTS = ("silu", "swigluoai")  # HF rewrites the release's "swigluoai" to "silu"; both mean §3.6


# transformers' MiniMaxM3VLVisionConfig defaults, plus the release key vLLM's vision tower reads.
_DEFAULT_VISION = {
    "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 2016, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "hidden_act": "gelu", "layer_norm_eps": 1e-5,
    "img_token_compression_config": {"spatial_merge_size": 2, "temporal_patch_size": 2},
}



def fields_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """M3Config's keyword arguments from a parsed config.json in either form; unused keys are logged in one line."""
    raw = dict(raw)
    passthrough = {}
    if raw.get("model_type") == "minimax_m3_vl" or "text_config" in raw:
        if not isinstance(raw.get("text_config"), dict):
            raise field_error("text_config", raw.get("text_config"), "a dict holding the text model's config")
        passthrough = {k: v for k, v in raw.items() if k != "text_config"}
        tie = passthrough.get("tie_word_embeddings")
        if tie not in (None, False):
            raise field_error("tie_word_embeddings", tie, "false (M3 has an untied lm_head)")
        text = dict(raw["text_config"])
    else:
        text = raw
    mt = text.get("model_type")
    if mt not in (None, "minimax_m3_vl_text", "minimax_m3"):
        raise field_error("model_type", mt, "'minimax_m3_vl_text' (native) or 'minimax_m3' inside a released "
                   "'minimax_m3_vl' config")
    used: set[str] = set()

    def take(key, default=dataclasses.MISSING):
        if key in text:
            used.add(key)
            return text[key]
        if default is dataclasses.MISSING:
            raise ConfigError(f"config field {key!r} is missing: it is required and has no safe default")
        return default

    kw: dict[str, Any] = {}
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "dense_intermediate_size",
              "shared_intermediate_size", "num_experts_per_tok"):
        kw[f] = take(f)
    if "head_dim" not in text:
        # transformers' config would default to 128 and its model to hidden/heads: ambiguous, so required.
        raise ConfigError("config field 'head_dim' is missing: it is required (transformers' config "
                          "defaults it to 128, not hidden_size / num_attention_heads)")
    kw["head_dim"] = take("head_dim")
    experts = take("num_local_experts", None)
    if experts is None:
        experts = take("num_experts")
    kw["num_local_experts"] = experts
    for f in ("rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit",
              "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if f in text:
            kw[f] = take(f)

    # Layer kinds: native lists win (as in HF), else derived from the legacy frequency lists.
    sparse_cfg = take("sparse_attention_config", None) or {}
    if not isinstance(sparse_cfg, dict):
        raise field_error("sparse_attention_config", sparse_cfg, "a dict")
    n = kw["num_hidden_layers"]
    layer_types = take("layer_types", None)
    if layer_types is None:
        freq = sparse_cfg.get("sparse_attention_freq")
        if freq is None:
            layer_types = [FULL_ATTENTION] * n
        else:
            if not isinstance(freq, list):
                raise field_error("sparse_attention_config.sparse_attention_freq", freq,
                                  "a list with one 0/1 per layer")
            layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq]
    mlp_types = take("mlp_layer_types", None)
    if mlp_types is None:
        freq = take("moe_layer_freq", None)
        if freq is None:
            mlp_types = [MOE_MLP] * n
        else:
            if not isinstance(freq, list):
                raise field_error("moe_layer_freq", freq, "a list with one 0/1 per layer")
            mlp_types = [MOE_MLP if f else DENSE_MLP for f in freq]
    else:
        take("moe_layer_freq", None)
    for name, v in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
        if not isinstance(v, list):  # a string would become a tuple of its characters
            raise field_error(name, v, "a list with one entry per layer")
    kw["layer_types"], kw["mlp_layer_types"] = layer_types, mlp_types

    legacy_index = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                    "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                    "index_local_blocks": "sparse_local_block"}
    for flat, legacy in legacy_index.items():
        if legacy in sparse_cfg:
            kw[flat] = sparse_cfg[legacy]
            take(flat, None)
        elif flat in text:
            kw[flat] = take(flat)
    sparse_extra = {k: v for k, v in sparse_cfg.items()
                    if k not in legacy_index.values() and k != "sparse_attention_freq"}
    _check_hardcoded(sparse_extra, "sparse_attention_config.")

    kw.update(_read_rope(text, take, kw["head_dim"]))

    tie = take("tie_word_embeddings", False)
    if tie not in (None, False):
        raise field_error("tie_word_embeddings", tie, "false (M3 has an untied lm_head)")
    act = take("hidden_act", "silu")
    if act not in _HIDDEN_ACTS:
        raise field_error("hidden_act", act, f"one of {_HIDDEN_ACTS} (SwiGLU-OAI is hard-coded)")
    _check_hardcoded(text, "", used)

    # what no field holds goes back into an export as it came: the keys only checked (hard-coded
    # behaviour, hidden_act) are the source's to state too
    held = used - set(_HARDCODED) - {"hidden_act"}
    carried = {k: v for k, v in text.items() if k not in held}
    if sparse_extra:
        carried["sparse_attention_config"] = sparse_extra
    if carried:
        kw["text_passthrough"] = json.dumps(carried, sort_keys=True)
    unused = sorted((set(text) - used - _BOOKKEEPING)
                    | {f"sparse_attention_config.{k}" for k in sparse_extra if k not in _HARDCODED})
    if unused:
        log.info("config keys not used by the M3 text model (MTP, vision or unknown): %s", ", ".join(unused))
    if passthrough:
        kw["vl_passthrough"] = json.dumps(passthrough, sort_keys=True)
    return kw


def text_dict(cfg) -> dict[str, Any]:
    """Native `minimax_m3_vl_text` fields (what MiniMaxM3VLTextConfig reads)."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
         if f.name not in ("rope_theta", "partial_rotary_factor", *PASSTHROUGH_FIELDS)}
    d["layer_types"], d["mlp_layer_types"] = list(cfg.layer_types), list(cfg.mlp_layer_types)
    if isinstance(cfg.eos_token_id, tuple):
        d["eos_token_id"] = list(cfg.eos_token_id)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor}
    d["rotary_dim"] = cfg.rotary_dim
    d["tie_word_embeddings"] = False
    return d


def hf_dict(cfg, layout: str = "native") -> dict[str, Any]:
    """config.json for a `layout` export: "native" (AutoModelForCausalLM) or "released" (VL class)."""
    text = text_dict(cfg)
    carried = json.loads(cfg.text_passthrough) if cfg.text_passthrough else {}
    sparse_extra = carried.pop("sparse_attention_config", {})
    if layout == "native":  # partial_rotary_factor beside rope_parameters, as transformers' own save writes it
        native = {**carried, "architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text",
                  **text, "partial_rotary_factor": cfg.partial_rotary_factor}
        return {**native, "sparse_attention_config": sparse_extra} if sparse_extra else native
    if layout != "released":
        raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
    # Legacy keys too: vLLM's loader reads moe_layer_freq / sparse_attention_config, HF the lists.
    text = {**carried, **text}
    text.update({
        "model_type": "minimax_m3", "architectures": ["MiniMaxM3SparseForCausalLM"],
        "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
        "moe_layer_freq": [int(t == MOE_MLP) for t in cfg.mlp_layer_types],
        "sparse_attention_config": {
            **sparse_extra,
            "sparse_attention_freq": [int(t == SPARSE_ATTENTION) for t in cfg.layer_types],
            "sparse_num_index_heads": cfg.index_n_heads, "sparse_index_dim": cfg.index_head_dim,
            "sparse_block_size": cfg.index_block_size, "sparse_topk_blocks": cfg.index_topk_blocks,
            "sparse_local_block": cfg.index_local_blocks, "sparse_init_block": 0,
        },
        "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True,
        "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
    })
    top = json.loads(cfg.vl_passthrough) if cfg.vl_passthrough else {}
    # vLLM's VL class builds its vision tower from vision_config even for text-only serving (it
    # reads the release-only img_token_compression_config); HF takes the same values when absent.
    top.setdefault("vision_config", copy.deepcopy(_DEFAULT_VISION))
    top.update({"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
                "tie_word_embeddings": False, "text_config": text})
    return top



def _check_hardcoded(d: dict, prefix: str, used: set | None = None) -> None:
    for key, want in _HARDCODED.items():
        if key in d:
            if used is not None:
                used.add(key)
            if d[key] != want:
                raise field_error(prefix + key, d[key], f"{want!r} (the only behaviour HF's MiniMax-M3 implements)")


def _read_rope(text: dict, take, head_dim: int) -> dict[str, Any]:
    """RoPE fields. HF reads the width only from partial_rotary_factor, never from rotary_dim. Where both
    rope_scaling and rope_parameters are set, rope_scaling is what transformers (and vLLM) apply: a yarn
    rope_scaling added beside a saved rope_parameters was read as the default RoPE here, while they served YaRN."""
    scaling, parameters = take("rope_scaling", None), take("rope_parameters", None)
    rp, key = (scaling, "rope_scaling") if scaling else (parameters or {}, "rope_parameters")
    if not isinstance(rp, dict):
        raise field_error(key, rp, "an object (rope_type, rope_theta, partial_rotary_factor)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise field_error(f"{key}.rope_type", rope_type, "'default' (M3 uses no RoPE scaling)")
    theta = rp.get("rope_theta", take("rope_theta", 5_000_000.0))
    prf = rp.get("partial_rotary_factor", take("partial_rotary_factor", None))
    rotary_dim = take("rotary_dim", None)
    if prf is None:
        if "rope_parameters" not in text and rotary_dim is not None and rotary_dim != head_dim \
                and isinstance(head_dim, int) and head_dim > 0:  # a bad head_dim is validate()'s to report
            # Released-form config with only rotary_dim: HF would rotate every channel, vLLM only
            # rotary_dim of them. Refuse rather than pick one silently.
            raise field_error("rotary_dim", rotary_dim,
                       f"a partial_rotary_factor too (= rotary_dim / head_dim = {rotary_dim / head_dim}): "
                       "HF ignores rotary_dim and would rotate all head_dim channels")
        prf = 1.0
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", prf)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # validate() judges the number's range
            raise field_error(name, value, "a number")
    return {"rope_theta": as_float(theta), "partial_rotary_factor": as_float(prf)}
