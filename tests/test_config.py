"""M3Config reads both HF config.json forms into one config, writes both back, and rejects what it cannot run.

Forms (../shared/docs/m3-architecture.md §1): native `minimax_m3_vl_text` (what the text class's
`to_dict` / `save_pretrained` writes) and the released `minimax_m3_vl` (text part in `text_config`
with legacy keys). Every invalid or unsupported value must raise ConfigError naming the field and
the value; unused keys (MTP, future fields) are named in one INFO log line.
"""

import copy
import dataclasses
import json
import logging
import re

import pytest
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig, MiniMaxM3VLTextConfig

from m3jax.config import (DENSE_MLP, FULL_ATTENTION, MOE_MLP, PASSTHROUGH_FIELDS, SPARSE_ATTENTION, ConfigError,
                          M3Config)
from tests import reference as ref

N_RELEASE = 60

# The released text_config (legacy keys), as excerpted in the architecture notes §1.
RELEASE_TEXT = {
    "model_type": "minimax_m3", "architectures": ["MiniMaxM3SparseForCausalLM"],
    "vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": N_RELEASE,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "rotary_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 5000000,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
    "intermediate_size": 3072, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
    "num_local_experts": 128, "num_experts_per_tok": 4, "routed_scaling_factor": 2.0,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "hidden_act": "swigluoai",
    "moe_layer_freq": [0] * 3 + [1] * (N_RELEASE - 3),
    "sparse_attention_config": {
        "sparse_attention_freq": [0] * 3 + [1] * (N_RELEASE - 3),
        "sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
        "sparse_topk_blocks": 16, "sparse_local_block": 1, "sparse_init_block": 0,
        "sparse_score_type": "max",
    },
    "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
    "attention_output_gate": False, "scoring_func": "sigmoid", "use_routing_bias": True,
    "n_shared_experts": 1, "num_mtp_modules": 7, "num_nextn_predict_layers": 1,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
}
RELEASE_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def released_dict(text=None, **top):
    return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "text_config": copy.deepcopy(RELEASE_TEXT if text is None else text),
            "vision_config": dict(RELEASE_VISION), "image_token_index": 200025, **top}


def native_release_dict():
    """The native form of the release: what transformers' text config writes after reading the legacy keys."""
    kw = copy.deepcopy(RELEASE_TEXT)
    kw.pop("model_type"), kw.pop("architectures")
    return MiniMaxM3VLTextConfig(**kw).to_dict()


def tiny_native(variant="release_like", **overrides):
    return ref.tiny_config(variant, **overrides).to_dict()


def field_value(field, value):
    """Regex: the message names `field` and its bad `value` (as the error formats them)."""
    return re.escape(f"{field!r} = {value!r}")


def strip(cfg: M3Config) -> M3Config:
    return dataclasses.replace(cfg, **dict.fromkeys(PASSTHROUGH_FIELDS, ""))


def hf_text_fields(h) -> dict:
    return {"layer_types": list(h.layer_types), "mlp_layer_types": list(h.mlp_layer_types),
            "index_n_heads": h.index_n_heads, "index_head_dim": h.index_head_dim,
            "index_block_size": h.index_block_size, "index_topk_blocks": h.index_topk_blocks,
            "index_local_blocks": h.index_local_blocks, "head_dim": h.head_dim,
            "num_local_experts": h.num_local_experts, "num_experts_per_tok": h.num_experts_per_tok,
            "rope_parameters": {k: h.rope_parameters[k] for k in ("rope_type", "rope_theta", "partial_rotary_factor")}}


def m3_fields(c: M3Config) -> dict:
    return {"layer_types": list(c.layer_types), "mlp_layer_types": list(c.mlp_layer_types),
            "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim,
            "index_block_size": c.index_block_size, "index_topk_blocks": c.index_topk_blocks,
            "index_local_blocks": c.index_local_blocks, "head_dim": c.head_dim,
            "num_local_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor}}


# ------------------------------------------------------------------------------ both forms, release values
def test_release_values_from_both_forms():
    native = M3Config.from_hf_dict(native_release_dict())
    released = M3Config.from_hf_dict(released_dict())
    assert strip(released) == strip(native)
    assert native.vl_passthrough == ""
    assert json.loads(released.vl_passthrough)["vision_config"] == RELEASE_VISION

    c = native
    assert c.layer_types == (FULL_ATTENTION,) * 3 + (SPARSE_ATTENTION,) * (N_RELEASE - 3)
    assert c.mlp_layer_types == (DENSE_MLP,) * 3 + (MOE_MLP,) * (N_RELEASE - 3)
    assert c.segments() == [(FULL_ATTENTION, DENSE_MLP, [0, 1, 2]),
                            (SPARSE_ATTENTION, MOE_MLP, list(range(3, N_RELEASE)))]
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (200064, 6144, 60)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 128)
    assert (c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (5e6, 0.5, 64)
    assert (c.intermediate_size, c.dense_intermediate_size, c.shared_intermediate_size) == (3072, 12288, 3072)
    assert (c.num_local_experts, c.num_experts_per_tok, c.routed_scaling_factor) == (128, 4, 2.0)
    assert (c.index_n_heads, c.index_head_dim, c.index_block_size, c.index_topk_blocks,
            c.index_local_blocks) == (4, 128, 128, 16, 1)
    assert (c.swiglu_alpha, c.swiglu_limit, c.rms_norm_eps) == (1.702, 7.0, 1e-6)
    assert c.max_position_embeddings == 1048576


def test_released_form_read_as_transformers_reads_it():
    hf = MiniMaxM3VLConfig(**released_dict()).text_config
    assert m3_fields(M3Config.from_hf_dict(released_dict())) == hf_text_fields(hf)


@pytest.mark.parametrize("variant", list(ref.VARIANTS))
def test_tiny_variants_native_equals_released(variant):
    """The test fixtures' configs: the native dict of the HF text config and the released wrapping agree."""
    hf = ref.tiny_config(variant)
    native = M3Config.from_hf_dict(hf.to_dict())
    legacy = {**ref.TINY, **ref.VARIANTS[variant], "model_type": "minimax_m3"}
    released = M3Config.from_hf_dict(released_dict(legacy))
    assert strip(released) == strip(native)
    assert m3_fields(native) == hf_text_fields(hf)


def test_num_experts_alias():
    d = tiny_native()
    d["num_experts"] = d.pop("num_local_experts")
    assert M3Config.from_hf_dict(d).num_local_experts == 8


def test_native_lists_win_over_legacy_frequencies():
    """As in transformers: explicit layer_types / mlp_layer_types beat sparse_attention_freq / moe_layer_freq."""
    d = tiny_native()
    d["moe_layer_freq"] = [1, 1, 1, 1]
    d["sparse_attention_config"] = {"sparse_attention_freq": [0, 0, 0, 0]}
    c = M3Config.from_hf_dict(d)
    assert c.mlp_layer_types == (DENSE_MLP, MOE_MLP, MOE_MLP, MOE_MLP)
    assert c.layer_types == (FULL_ATTENTION,) + (SPARSE_ATTENTION,) * 3


# -------------------------------------------------------------------------------------- writing back
@pytest.mark.parametrize("layout", ["native", "released"])
@pytest.mark.parametrize("variant", list(ref.VARIANTS))
def test_to_hf_dict_read_back_by_m3jax_and_transformers(variant, layout):
    c = M3Config.from_hf_dict(tiny_native(variant))
    d = c.to_hf_dict(layout)
    json.dumps(d)  # a config.json must be JSON-serialisable
    assert d["model_type"] == ("minimax_m3_vl_text" if layout == "native" else "minimax_m3_vl")

    assert strip(M3Config.from_hf_dict(copy.deepcopy(d))) == strip(c)

    if layout == "native":
        kw = copy.deepcopy(d)
        kw.pop("model_type"), kw.pop("architectures")
        hf = MiniMaxM3VLTextConfig(**kw)
    else:
        hf = MiniMaxM3VLConfig(**copy.deepcopy(d)).text_config
        # vLLM reads the legacy keys: they must say the same as the lists.
        t = d["text_config"]
        assert t["moe_layer_freq"] == [int(x == MOE_MLP) for x in c.mlp_layer_types]
        assert t["sparse_attention_config"]["sparse_attention_freq"] == [int(x == SPARSE_ATTENTION)
                                                                         for x in c.layer_types]
        assert t["rotary_dim"] == c.rotary_dim and t["partial_rotary_factor"] == c.partial_rotary_factor
    assert hf_text_fields(hf) == m3_fields(c)
    assert hf.tie_word_embeddings is False
    assert strip(M3Config.from_hf_dict(hf.to_dict())) == strip(c)


def test_released_export_keeps_vision_part():
    c = M3Config.from_hf_dict(released_dict())
    d = c.to_hf_dict("released")
    assert d["vision_config"] == RELEASE_VISION and d["image_token_index"] == 200025
    again = M3Config.from_hf_dict(copy.deepcopy(d))
    assert strip(again) == strip(c)
    assert M3Config.from_hf_dict(again.to_hf_dict("released")) == again  # stable from then on
    vl = MiniMaxM3VLConfig(**copy.deepcopy(d))
    assert vl.vision_config.hidden_size == 32
    assert hf_text_fields(vl.text_config) == m3_fields(c)


def test_to_hf_dict_unknown_layout():
    with pytest.raises(ValueError, match="vllm"):
        M3Config.from_hf_dict(tiny_native()).to_hf_dict("vllm")


def test_from_pretrained_reads_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_dict()))
    assert M3Config.from_pretrained(tmp_path) == M3Config.from_hf_dict(released_dict())
    assert M3Config.from_pretrained(tmp_path / "config.json") == M3Config.from_hf_dict(released_dict())


# ---------------------------------------------------------------------------------- invalid configs
@pytest.mark.parametrize("field,value", [
    ("vocab_size", 0), ("hidden_size", -64), ("num_hidden_layers", 0), ("num_attention_heads", 0),
    ("num_key_value_heads", 0), ("head_dim", -16), ("head_dim", 0), ("intermediate_size", 0),
    ("dense_intermediate_size", -1), ("shared_intermediate_size", 0), ("num_local_experts", 0),
    ("num_experts_per_tok", 0), ("index_n_heads", 0), ("index_head_dim", -8), ("index_block_size", 0),
    ("index_topk_blocks", 0), ("hidden_size", 64.0), ("vocab_size", True),
])
def test_non_positive_sizes(field, value):
    d = tiny_native()
    d[field] = value
    with pytest.raises(ConfigError, match=field_value(field, value) + ".*positive integer"):
        M3Config.from_hf_dict(d)


def test_missing_head_dim_is_a_config_error():
    d = tiny_native()
    d.pop("head_dim")
    with pytest.raises(ConfigError, match="'head_dim' is missing.*128"):
        M3Config.from_hf_dict(d)


def test_zero_head_dim_with_rotary_dim_only_is_a_config_error():
    text = copy.deepcopy(RELEASE_TEXT)
    del text["partial_rotary_factor"]
    text["head_dim"] = 0
    with pytest.raises(ConfigError, match=field_value("head_dim", 0)):
        M3Config.from_hf_dict(released_dict(text))


def test_negative_local_blocks():
    d = tiny_native()
    d["index_local_blocks"] = -1
    with pytest.raises(ConfigError, match=field_value("index_local_blocks", -1)):
        M3Config.from_hf_dict(d)


def test_local_blocks_above_topk():
    d = tiny_native()
    d["index_local_blocks"] = 3
    with pytest.raises(ConfigError, match=field_value("index_local_blocks", 3) + ".*index_topk_blocks=2"):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("field", ["layer_types", "mlp_layer_types"])
@pytest.mark.parametrize("length", [3, 5])
def test_wrong_length_layer_lists(field, length):
    d = tiny_native()
    d[field] = (d[field] * 2)[:length]
    with pytest.raises(ConfigError, match=field_value(field, d[field]) + f".*num_hidden_layers=4.*got {length}"):
        M3Config.from_hf_dict(d)


def test_wrong_length_legacy_frequency():
    text = dict(RELEASE_TEXT, moe_layer_freq=[0, 1])
    with pytest.raises(ConfigError, match=r"'mlp_layer_types' = \['dense', 'sparse'\].*num_hidden_layers=60"):
        M3Config.from_hf_dict(released_dict(text))


@pytest.mark.parametrize("field,i,bad", [("layer_types", 2, "sliding_attention"), ("mlp_layer_types", 1, "moe")])
def test_unknown_layer_type(field, i, bad):
    d = tiny_native()
    d[field][i] = bad
    with pytest.raises(ConfigError, match=field_value(f"{field}[{i}]", bad)):
        M3Config.from_hf_dict(d)


def test_heads_not_divisible_by_kv_heads():
    d = tiny_native()
    d["num_key_value_heads"] = 3
    with pytest.raises(ConfigError, match=field_value("num_key_value_heads", 3) + ".*num_attention_heads=4"):
        M3Config.from_hf_dict(d)


def test_index_heads_not_dividing_heads():
    d = tiny_native()
    d["index_n_heads"] = 3
    with pytest.raises(ConfigError, match=field_value("index_n_heads", 3) + ".*num_attention_heads=4"):
        M3Config.from_hf_dict(d)
    # Without sparse layers there is no indexer, so the value is irrelevant.
    d["layer_types"] = [FULL_ATTENTION] * 4
    assert M3Config.from_hf_dict(d).index_n_heads == 3


def test_top_k_above_experts():
    d = tiny_native()
    d["num_experts_per_tok"] = 9
    with pytest.raises(ConfigError, match=field_value("num_experts_per_tok", 9) + ".*num_local_experts=8"):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("prf", [0.0, -0.5, 1.5])
def test_partial_rotary_factor_out_of_range(prf):
    d = tiny_native()
    d["rope_parameters"]["partial_rotary_factor"] = prf
    with pytest.raises(ConfigError, match=field_value("partial_rotary_factor", prf) + r".*\(0, 1\]"):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("prf,width", [(0.5625, 9), (0.0625, 1)])
def test_partial_rotary_factor_odd_width(prf, width):
    d = tiny_native()  # head_dim 16
    d["rope_parameters"]["partial_rotary_factor"] = prf
    with pytest.raises(ConfigError, match=field_value("partial_rotary_factor", prf) + f".*head_dim=16 gives {width}"):
        M3Config.from_hf_dict(d)


def test_partial_rotary_factor_out_of_range_released():
    text = dict(RELEASE_TEXT, partial_rotary_factor=2.0)
    with pytest.raises(ConfigError, match=field_value("partial_rotary_factor", 2.0)):
        M3Config.from_hf_dict(released_dict(text))


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_yarn_rope(key):
    d = tiny_native()
    d.pop("rope_parameters")
    d[key] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match=field_value(f"{key}.rope_type", "yarn")):
        M3Config.from_hf_dict(d)


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it():
    """transformers applies rope_scaling over rope_parameters; a yarn rope_scaling added to a saved config (which has a
    default rope_parameters) loaded here as the default RoPE, HF and vLLM serving YaRN (logits 15 apart)."""
    d = tiny_native()
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match=field_value("rope_scaling.rope_type", "yarn")):
        M3Config.from_hf_dict(d)
    d["rope_scaling"] = {"rope_type": "default", "rope_theta": 1234.0, "partial_rotary_factor": 0.5}
    assert M3Config.from_hf_dict(d).rope_theta == 1234.0  # transformers' rope_theta too


@pytest.mark.parametrize("where", ["native", "released_text", "released_top"])
def test_tied_embeddings(where):
    if where == "native":
        d = tiny_native()
        d["tie_word_embeddings"] = True
    elif where == "released_text":
        d = released_dict(dict(RELEASE_TEXT, tie_word_embeddings=True))
    else:
        d = released_dict(tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=field_value("tie_word_embeddings", True)):
        M3Config.from_hf_dict(d)


def test_hidden_act_gelu():
    d = tiny_native()
    d["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match=field_value("hidden_act", "gelu")):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("key,bad", [("scoring_func", "softmax"), ("use_gemma_norm", False),
                                     ("use_qk_norm", False), ("n_shared_experts", 2),
                                     ("attention_output_gate", True), ("use_routing_bias", False),
                                     ("qk_norm_type", "per_layer")])
def test_unsupported_release_behaviour(key, bad):
    with pytest.raises(ConfigError, match=field_value(key, bad)):
        M3Config.from_hf_dict(released_dict(dict(RELEASE_TEXT, **{key: bad})))


@pytest.mark.parametrize("key,bad", [("sparse_init_block", 1), ("sparse_score_type", "mean")])
def test_unsupported_sparse_attention_option(key, bad):
    text = copy.deepcopy(RELEASE_TEXT)
    text["sparse_attention_config"][key] = bad
    with pytest.raises(ConfigError, match=field_value(f"sparse_attention_config.{key}", bad)):
        M3Config.from_hf_dict(released_dict(text))


def test_rotary_dim_without_partial_rotary_factor():
    text = copy.deepcopy(RELEASE_TEXT)
    del text["partial_rotary_factor"]
    with pytest.raises(ConfigError, match=field_value("rotary_dim", 64) + ".*partial_rotary_factor"):
        M3Config.from_hf_dict(released_dict(text))
    # rotary_dim == head_dim is unambiguous (both readings rotate everything).
    text["rotary_dim"] = 128
    assert M3Config.from_hf_dict(released_dict(text)).rotary_dim == 128


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "dense_intermediate_size",
                                   "shared_intermediate_size", "num_experts_per_tok"])
def test_required_field_missing(field):
    d = tiny_native()
    del d[field]
    with pytest.raises(ConfigError, match=re.escape(f"{field!r} is missing")):
        M3Config.from_hf_dict(d)


def test_experts_missing():
    text = copy.deepcopy(RELEASE_TEXT)
    del text["num_local_experts"]
    with pytest.raises(ConfigError, match="'num_experts' is missing"):
        M3Config.from_hf_dict(released_dict(text))


def test_wrong_model_type():
    d = tiny_native()
    d["model_type"] = "llama"
    with pytest.raises(ConfigError, match=field_value("model_type", "llama")):
        M3Config.from_hf_dict(d)


def test_released_without_text_config():
    d = released_dict()
    del d["text_config"]
    with pytest.raises(ConfigError, match=field_value("text_config", None)):
        M3Config.from_hf_dict(d)


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 256,')
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + " is not valid JSON"):
        M3Config.from_pretrained(tmp_path)


def test_rope_values_that_are_not_numbers_and_no_positions_are_config_errors():
    raw = ref.tiny_config("release_like").to_dict()
    for key, bad, expected in (("rope_parameters", {"rope_type": "default", "rope_theta": "big"}, "'rope_theta'"),
                               ("max_position_embeddings", 0, "'max_position_embeddings'")):
        with pytest.raises(ConfigError, match=expected):
            M3Config.from_hf_dict({**raw, key: bad})


def test_a_weights_file_or_a_json_list_is_not_a_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x00\xff" * 10)
    with pytest.raises(ConfigError, match="model.safetensors is not JSON text \\(a weights file\\?\\)"):
        M3Config.from_pretrained(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json holds a JSON list: expected an object of config fields"):
        M3Config.from_pretrained(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json at " + re.escape(str(tmp_path / "config.json"))):
        M3Config.from_pretrained(tmp_path)
    # a path that does not exist is named as such ("no config.json at /typo/config.json" read as a directory's)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "typo")) + ": no such file or directory"):
        M3Config.from_pretrained(tmp_path / "typo")


# --------------------------------------------------------------------------------------- unknown keys
def _config_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "m3jax.config"]


def test_unknown_keys_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="m3jax.config")
    d = tiny_native()
    d.update(num_mtp_modules=7, some_future_key={"a": 1})
    M3Config.from_hf_dict(d)
    logs = _config_logs(caplog)
    assert len(logs) == 1
    assert "num_mtp_modules" in logs[0] and "some_future_key" in logs[0]
    assert "vocab_size" not in logs[0] and "layer_types" not in logs[0]


def test_unknown_keys_in_released_form_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="m3jax.config")
    text = copy.deepcopy(RELEASE_TEXT)
    text["sparse_attention_config"]["sparse_future_option"] = 3
    M3Config.from_hf_dict(released_dict(text))
    logs = _config_logs(caplog)
    assert len(logs) == 1
    assert "num_mtp_modules" in logs[0] and "num_nextn_predict_layers" in logs[0]
    assert "sparse_attention_config.sparse_future_option" in logs[0]
    # Keys that were read or checked are not reported as unused.
    for used in ("moe_layer_freq", "rotary_dim", "use_gemma_norm", "sparse_init_block", "rope_theta"):
        assert used not in logs[0]


@pytest.mark.parametrize("layout", ["native", "released"])
def test_own_export_has_no_unused_keys(layout, caplog):
    """What the writer adds is all read back (the source's other fields, carried, are the source's to explain)."""
    caplog.set_level(logging.INFO, logger="m3jax.config")
    c = strip(M3Config.from_hf_dict(tiny_native()))
    caplog.clear()
    M3Config.from_hf_dict(c.to_hf_dict(layout))
    assert _config_logs(caplog) == []
