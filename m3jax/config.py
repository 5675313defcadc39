"""M3Config: the MiniMax-M3 text model's hyper-parameters, read from either HF config.json form.

Two forms exist (../shared/docs/m3-architecture.md §1):
- native `minimax_m3_vl_text`: `layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`;
- released `minimax_m3_vl`: the text part nested in `text_config` with legacy keys
  (`moe_layer_freq`, `sparse_attention_config`, `rope_theta`, `partial_rotary_factor`, `rotary_dim`).

Both become one validated, frozen dataclass. Behaviour that HF hard-codes (Gemma norm, per-head QK
norm, sigmoid routing with a correction bias, one ungated shared expert, max-pooled indexer, no sink
block) is checked against the release keys that describe it, so a checkpoint that asks for something
else stops with an error instead of silently computing the wrong model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
from typing import Any

from m3jax.model.specs import (DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION,  # noqa: F401 (public here too)
                               layer_param_specs, top_param_specs)

log = logging.getLogger(__name__)

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


# What an M3Config holds only to write it back into an export: not the model (comparisons leave them out).
PASSTHROUGH_FIELDS = ("vl_passthrough", "text_passthrough")


class ConfigError(ValueError):
    """An invalid or unsupported config value: names the field, the value and what is allowed."""


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _err(field: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {field!r} = {value!r} is not supported: expected {allowed}")


@dataclasses.dataclass(frozen=True)
class M3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # per routed expert
    dense_intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    max_position_embeddings: int = 524288
    bos_token_id: int | None = 200034
    eos_token_id: int | tuple[int, ...] | None = 200020
    pad_token_id: int | None = None
    # Top-level fields of a released (VL) config that the text model does not use but an export
    # must carry back (vision_config, image token ids, ...), stored as a JSON string to stay hashable.
    vl_passthrough: str = ""
    # The text config's fields no field above holds (HF's bookkeeping, the release's MTP keys, a user's own;
    # `sparse_attention_config` keys beyond the ones read), carried unchanged into an export (JSON, as above).
    text_passthrough: str = ""

    def __post_init__(self):
        for name in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(self, name), str):  # tuple() would make a layer of each character
                raise _err(name, getattr(self, name), "a list of per-layer types, not one string")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ----------------------------------------------------------------------------------- derived
    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head, r = int(head_dim * partial_rotary_factor) (HF's rule)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_sparse_attention(self) -> bool:
        return SPARSE_ATTENTION in self.layer_types

    @property
    def has_moe(self) -> bool:
        return MOE_MLP in self.mlp_layer_types

    # ------------------------------------------------ what a mesh needs to know (sharding.mesh.ShardedModel)
    def param_specs(self) -> dict:
        """Every parameter's shape and logical axes, by name (per scanned stack: "{attn}/{mlp}/{param}")."""
        specs = dict(top_param_specs(self))
        for attn, mlp, _ in self.segments():
            specs.update({f"{attn}/{mlp}/{n}": s for n, s in layer_param_specs(self, attn, mlp).items()})
        return specs

    def mesh_fields(self) -> list[tuple[str, int, str]]:
        """(field, value, logical axis): fields that must divide into that axis's shards, named in errors."""
        fields = [("num_local_experts", self.num_local_experts, "experts")] if self.has_moe else []
        fields += [("num_key_value_heads", self.num_key_value_heads, "kv_heads"),  # then the query heads divide too
                   ("intermediate_size", self.intermediate_size, "expert_mlp"),
                   ("dense_intermediate_size", self.dense_intermediate_size, "mlp"),
                   ("shared_intermediate_size", self.shared_intermediate_size, "mlp"),
                   ("vocab_size", self.vocab_size, "vocab"),
                   ("hidden_size", self.hidden_size, "embed")]
        return fields

    def context_block_size(self) -> int:
        """Context shards hold whole indexer blocks (the indexer pools scores per block)."""
        return self.index_block_size if self.has_sparse_attention else 1

    def segments(self) -> list[tuple[str, str, list[int]]]:
        """Maximal runs of consecutive layers with the same (attention, mlp) kind.

        Each run is one scanned stack of identically shaped layers: the release gives two,
        layers 0-2 (full, dense) and 3-59 (sparse, MoE).
        """
        runs: list[tuple[str, str, list[int]]] = []
        for i, kind in enumerate(zip(self.layer_types, self.mlp_layer_types)):
            if runs and runs[-1][:2] == kind:
                runs[-1][2].append(i)
            else:
                runs.append((kind[0], kind[1], [i]))
        return runs

    # -------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "dense_intermediate_size",
                     "shared_intermediate_size", "num_local_experts", "num_experts_per_tok",
                     "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks"):
            v = getattr(self, name)
            if not _int(v) or v <= 0:
                raise _err(name, v, "a positive integer")
        if not _int(self.max_position_embeddings) or self.max_position_embeddings <= 0:
            raise _err("max_position_embeddings", self.max_position_embeddings, "a positive integer")
        if not _int(self.index_local_blocks) or self.index_local_blocks < 0:
            raise _err("index_local_blocks", self.index_local_blocks, "an integer >= 0")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise _err("layer_types", list(self.layer_types),
                       f"one entry per layer (num_hidden_layers={n}), got {len(self.layer_types)}")
        if len(self.mlp_layer_types) != n:
            raise _err("mlp_layer_types", list(self.mlp_layer_types),
                       f"one entry per layer (num_hidden_layers={n}), got {len(self.mlp_layer_types)}")
        for i, t in enumerate(self.layer_types):
            if t not in (FULL_ATTENTION, SPARSE_ATTENTION):
                raise _err(f"layer_types[{i}]", t, f"{FULL_ATTENTION!r} or {SPARSE_ATTENTION!r}")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE_MLP, MOE_MLP):
                raise _err(f"mlp_layer_types[{i}]", t, f"{DENSE_MLP!r} or {MOE_MLP!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _err("num_key_value_heads", self.num_key_value_heads,
                       f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.has_sparse_attention and self.num_attention_heads % self.index_n_heads:
            raise _err("index_n_heads", self.index_n_heads,
                       f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise _err("num_experts_per_tok", self.num_experts_per_tok,
                       f"at most num_local_experts={self.num_local_experts}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise _err("partial_rotary_factor", self.partial_rotary_factor, "a value in (0, 1]")
        r = self.rotary_dim
        if r < 2 or r % 2:
            raise _err("partial_rotary_factor", self.partial_rotary_factor,
                       f"a factor giving an even rotary width >= 2 (head_dim={self.head_dim} gives {r})")
        if self.has_sparse_attention and self.index_local_blocks > self.index_topk_blocks:
            raise _err("index_local_blocks", self.index_local_blocks,
                       f"at most index_topk_blocks={self.index_topk_blocks}")
        for name in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < _as_float(v) < math.inf:  # NaN too
                raise _err(name, v, "a positive finite number")
        # transformers' config takes these as ints only, so a wrong one failed later inside it, not here
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, v in (("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id),
                        *(("eos_token_id", e) for e in eos)):
            if v is not None and (not _int(v) or v < 0):
                raise _err(name, v, "a token id (an integer >= 0), a list of them for eos_token_id, or null")

    # ----------------------------------------------------------------------------------- reading
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "M3Config":
        """Build from a parsed config.json in either form; unused keys are reported in one log line."""
        raw = dict(raw)
        passthrough = {}
        if raw.get("model_type") == "minimax_m3_vl" or "text_config" in raw:
            if not isinstance(raw.get("text_config"), dict):
                raise _err("text_config", raw.get("text_config"), "a dict holding the text model's config")
            passthrough = {k: v for k, v in raw.items() if k != "text_config"}
            tie = passthrough.get("tie_word_embeddings")
            if tie not in (None, False):
                raise _err("tie_word_embeddings", tie, "false (M3 has an untied lm_head)")
            text = dict(raw["text_config"])
        else:
            text = raw
        mt = text.get("model_type")
        if mt not in (None, "minimax_m3_vl_text", "minimax_m3"):
            raise _err("model_type", mt, "'minimax_m3_vl_text' (native) or 'minimax_m3' inside a released "
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
            raise _err("sparse_attention_config", sparse_cfg, "a dict")
        n = kw["num_hidden_layers"]
        layer_types = take("layer_types", None)
        if layer_types is None:
            freq = sparse_cfg.get("sparse_attention_freq")
            if freq is None:
                layer_types = [FULL_ATTENTION] * n
            else:
                if not isinstance(freq, list):
                    raise _err("sparse_attention_config.sparse_attention_freq", freq, "a list with one 0/1 per layer")
                layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq]
        mlp_types = take("mlp_layer_types", None)
        if mlp_types is None:
            freq = take("moe_layer_freq", None)
            if freq is None:
                mlp_types = [MOE_MLP] * n
            else:
                if not isinstance(freq, list):
                    raise _err("moe_layer_freq", freq, "a list with one 0/1 per layer")
                mlp_types = [MOE_MLP if f else DENSE_MLP for f in freq]
        else:
            take("moe_layer_freq", None)
        for name, v in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
            if not isinstance(v, list):  # a string would become a tuple of its characters
                raise _err(name, v, "a list with one entry per layer")
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
            raise _err("tie_word_embeddings", tie, "false (M3 has an untied lm_head)")
        act = take("hidden_act", "silu")
        if act not in _HIDDEN_ACTS:
            raise _err("hidden_act", act, f"one of {_HIDDEN_ACTS} (SwiGLU-OAI is hard-coded)")
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
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "M3Config":
        f = os.path.join(path, "config.json") if os.path.isdir(path) else str(path)
        if not os.path.exists(f):
            raise ConfigError(f"no config.json at {f}: expected a Hugging Face model directory")
        if os.path.isdir(f):  # open() raised IsADirectoryError, a traceback
            raise ConfigError(f"{f} is a directory: expected the config.json file of a Hugging Face model directory")
        try:
            with open(f) as fh:
                raw = json.load(fh)
        except json.JSONDecodeError as e:
            if not os.path.isdir(path):  # a file given for the directory (a prompt file, say): say that first
                raise ConfigError(f"{f} is not a directory, nor a config.json (not valid JSON: {e}): expected a "
                                  "Hugging Face model directory") from None
            raise ConfigError(f"{f} is not valid JSON: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{f} is not JSON text (a weights file?): expected a Hugging Face model directory or "
                              "its config.json") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{f} holds a JSON {type(raw).__name__}: expected an object of config fields")
        return cls.from_hf_dict(raw)

    # ----------------------------------------------------------------------------------- writing
    def to_text_dict(self) -> dict[str, Any]:
        """Native `minimax_m3_vl_text` fields (what MiniMaxM3VLTextConfig reads)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope_theta", "partial_rotary_factor", *PASSTHROUGH_FIELDS)}
        d["layer_types"], d["mlp_layer_types"] = list(self.layer_types), list(self.mlp_layer_types)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor}
        d["rotary_dim"] = self.rotary_dim
        d["tie_word_embeddings"] = False
        return d

    def to_hf_dict(self, layout: str = "native") -> dict[str, Any]:
        """config.json for a `layout` export: "native" (AutoModelForCausalLM) or "released" (VL class)."""
        text = self.to_text_dict()
        carried = json.loads(self.text_passthrough) if self.text_passthrough else {}
        sparse_extra = carried.pop("sparse_attention_config", {})
        if layout == "native":  # partial_rotary_factor beside rope_parameters, as transformers' own save writes it
            native = {**carried, "architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text",
                      **text, "partial_rotary_factor": self.partial_rotary_factor}
            return {**native, "sparse_attention_config": sparse_extra} if sparse_extra else native
        if layout != "released":
            raise ValueError(f"layout={layout!r}: expected 'native' or 'released'")
        # Legacy keys too: vLLM's loader reads moe_layer_freq / sparse_attention_config, HF the lists.
        text = {**carried, **text}
        text.update({
            "model_type": "minimax_m3", "architectures": ["MiniMaxM3SparseForCausalLM"],
            "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor,
            "moe_layer_freq": [int(t == MOE_MLP) for t in self.mlp_layer_types],
            "sparse_attention_config": {
                **sparse_extra,
                "sparse_attention_freq": [int(t == SPARSE_ATTENTION) for t in self.layer_types],
                "sparse_num_index_heads": self.index_n_heads, "sparse_index_dim": self.index_head_dim,
                "sparse_block_size": self.index_block_size, "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_local_block": self.index_local_blocks, "sparse_init_block": 0,
            },
            "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True,
            "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
        })
        top = json.loads(self.vl_passthrough) if self.vl_passthrough else {}
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
                raise _err(prefix + key, d[key], f"{want!r} (the only behaviour HF's MiniMax-M3 implements)")


def _read_rope(text: dict, take, head_dim: int) -> dict[str, Any]:
    """RoPE fields. HF reads the width only from partial_rotary_factor, never from rotary_dim."""
    rp = take("rope_parameters", None) or take("rope_scaling", None) or {}
    if not isinstance(rp, dict):
        key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
        raise _err(key, rp, "an object (rope_type, rope_theta, partial_rotary_factor)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise _err("rope_parameters.rope_type", rope_type, "'default' (M3 uses no RoPE scaling)")
    theta = rp.get("rope_theta", take("rope_theta", 5_000_000.0))
    prf = rp.get("partial_rotary_factor", take("partial_rotary_factor", None))
    rotary_dim = take("rotary_dim", None)
    if prf is None:
        if "rope_parameters" not in text and rotary_dim is not None and rotary_dim != head_dim \
                and isinstance(head_dim, int) and head_dim > 0:  # a bad head_dim is validate()'s to report
            # Released-form config with only rotary_dim: HF would rotate every channel, vLLM only
            # rotary_dim of them. Refuse rather than pick one silently.
            raise _err("rotary_dim", rotary_dim,
                       f"a partial_rotary_factor too (= rotary_dim / head_dim = {rotary_dim / head_dim}): "
                       "HF ignores rotary_dim and would rotate all head_dim channels")
        prf = 1.0
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", prf)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # validate() judges the number's range
            raise _err(name, value, "a number")
    return {"rope_theta": _as_float(theta), "partial_rotary_factor": _as_float(prf)}


def _as_float(v: int | float) -> float:
    """float(v), an int past float's range as inf (which validate() refuses), not an OverflowError traceback."""
    try:
        return float(v)
    except OverflowError:
        return math.inf
