"""M3Config: the MiniMax-M3 text model's hyper-parameters, read from either HF config.json form.

Two forms exist (../shared/docs/m3-architecture.md §1):
- native `minimax_m3_vl_text`: `layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`;
- released `minimax_m3_vl`: the text part nested in `text_config` with legacy keys
  (`moe_layer_freq`, `sparse_attention_config`, `rope_theta`, `partial_rotary_factor`, `rotary_dim`).

Both become one validated, frozen dataclass (the reading and writing of the two forms: m3jax/hf_config.py).
Behaviour that HF hard-codes (Gemma norm, per-head QK norm, sigmoid routing with a correction bias, one ungated
shared expert, max-pooled indexer, no sink block) is checked against the release keys that describe it, so a
checkpoint that asks for something else stops with an error instead of silently computing the wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from m3jax.config_errors import ConfigError, as_float, field_error, is_int  # noqa: F401 (ConfigError: public here)
from m3jax.config_errors import FLOAT32_MAX, FLOAT32_SMALLEST, INT32_MAX
from m3jax.hf_config import PASSTHROUGH_FIELDS, fields_from_hf, hf_dict, text_dict  # noqa: F401 (public here too)
from m3jax.model.specs import (DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION,  # noqa: F401 (public here too)
                               layer_param_specs, top_param_specs)


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
                raise field_error(name, getattr(self, name), "a list of per-layer types, not one string")
            if not isinstance(getattr(self, name), (list, tuple)):  # tuple(None) was a TypeError naming no field
                raise field_error(name, getattr(self, name), "a list of per-layer types")
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
            if not is_int(v) or v <= 0:
                raise field_error(name, v, "a positive integer")
        if not is_int(self.max_position_embeddings) or self.max_position_embeddings <= 0:
            raise field_error("max_position_embeddings", self.max_position_embeddings, "a positive integer")
        if not is_int(self.index_local_blocks) or self.index_local_blocks < 0:
            raise field_error("index_local_blocks", self.index_local_blocks, "an integer >= 0")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
                     "num_local_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim",
                     "index_block_size", "index_topk_blocks", "max_position_embeddings", "index_local_blocks"):
            if getattr(self, name) > INT32_MAX:  # past it, MLIR refused a shape with a traceback naming nothing
                raise field_error(name, getattr(self, name), f"at most {INT32_MAX} (shapes and ids are int32)")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise field_error("layer_types", list(self.layer_types),
                       f"one entry per layer (num_hidden_layers={n}), got {len(self.layer_types)}")
        if len(self.mlp_layer_types) != n:
            raise field_error("mlp_layer_types", list(self.mlp_layer_types),
                       f"one entry per layer (num_hidden_layers={n}), got {len(self.mlp_layer_types)}")
        for i, t in enumerate(self.layer_types):
            if t not in (FULL_ATTENTION, SPARSE_ATTENTION):
                raise field_error(f"layer_types[{i}]", t, f"{FULL_ATTENTION!r} or {SPARSE_ATTENTION!r}")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE_MLP, MOE_MLP):
                raise field_error(f"mlp_layer_types[{i}]", t, f"{DENSE_MLP!r} or {MOE_MLP!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise field_error("num_key_value_heads", self.num_key_value_heads,
                       f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.has_sparse_attention and self.num_attention_heads % self.index_n_heads:
            raise field_error("index_n_heads", self.index_n_heads,
                       f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise field_error("num_experts_per_tok", self.num_experts_per_tok,
                       f"at most num_local_experts={self.num_local_experts}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise field_error("partial_rotary_factor", self.partial_rotary_factor, "a value in (0, 1]")
        r = self.rotary_dim
        if r < 2 or r % 2:
            raise field_error("partial_rotary_factor", self.partial_rotary_factor,
                       f"a factor giving an even rotary width >= 2 (head_dim={self.head_dim} gives {r})")
        if self.has_sparse_attention and self.index_local_blocks > self.index_topk_blocks:
            raise field_error("index_local_blocks", self.index_local_blocks,
                       f"at most index_topk_blocks={self.index_topk_blocks}")
        for name in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < as_float(v) < math.inf:  # NaN too
                raise field_error(name, v, "a positive finite number")
            if not FLOAT32_SMALLEST <= v <= FLOAT32_MAX:  # rope_theta = 1e300 was inf in the float32 model
                raise field_error(name, v, f"a number from {FLOAT32_SMALLEST:.4g} to {FLOAT32_MAX:.4g} "
                                           "(float32's range)")
        # transformers' config takes these as ints only, so a wrong one failed later inside it, not here
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, v in (("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id),
                        *(("eos_token_id", e) for e in eos)):
            if v is not None and (not is_int(v) or v < 0):
                raise field_error(name, v, "a token id (an integer >= 0), a list of them for eos_token_id, or null")

    # ----------------------------------------------------------------------------------- reading
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "M3Config":
        """Build from a parsed config.json in either form; unused keys are reported in one log line."""
        return cls(**fields_from_hf(raw))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "M3Config":
        f = os.path.join(path, "config.json") if os.path.isdir(path) else str(path)
        if not os.path.exists(path):  # "no config.json at /typo" sent the user looking inside a directory
            raise ConfigError(f"{path}: no such file or directory; expected a Hugging Face model directory")
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
        return text_dict(self)

    def to_hf_dict(self, layout: str = "native") -> dict[str, Any]:
        """config.json for a `layout` export: "native" (AutoModelForCausalLM) or "released" (VL class)."""
        return hf_dict(self, layout)

