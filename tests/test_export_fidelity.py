"""An export with no training in between is its source: every tensor, dtype and config.json field comes back, in
both layouts, with the source given as `carry_from` or only as where the model was loaded from. The differences
that are right are asserted one by one, with the reason. Before, the config fields the model does not hold (HF's
bookkeeping such as `use_cache` and `initializer_range`, the release's `num_mtp_modules`, a user's own fields,
`sparse_attention_config` keys beyond the ones the model reads) were dropped, and a `dtype` the source's
`text_config` held was dropped, or left stale in the top level's `torch_dtype`."""

import json
import logging
import os
import shutil

import jax.numpy as jnp
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

import m3jax
from m3jax.hf import layouts
from m3jax.hf.convert import convert_checkpoint
from m3jax.tiny import m3_model
from tests import reference as ref

# The source's own fields no model reads: a user's, and the release's MTP and indexer-value keys.
EXTRA = {"my_field": {"note": "kept"}, "num_mtp_modules": 7, "use_sparse_attention": True}
SPARSE_EXTRA = {"sparse_disable_index_value": True, "sparse_score_type": "max"}
# Held by the model as the router's, fp32 whatever the parameter dtype: the release stores them fp32 and vLLM
# holds them fp32 (GateLinear(params_dtype=float32), e_score_correction_bias float32), upcasting what it reads,
# while transformers casts every tensor to the config's dtype, so the stored dtype changes nothing either computes;
# a bf16 source's values are exact in fp32, and after training fp32 keeps the router's updates that bf16 would round.
ROUTER = (".gate.weight", "e_score_correction_bias")
# What the released layout's writer states as the release does, where transformers' VL class saved others: vLLM
# reads the legacy keys (moe_layer_freq, sparse_attention_config, the hard-coded behaviour flags) and matches the
# release's architecture string; transformers derives the same model from either (`test_hf_reads_the_same_config`).
RELEASED_WRITES = {"model_type": ("minimax_m3_vl_text", "minimax_m3")}
RELEASED_ADDS = {"architectures": ["MiniMaxM3SparseForCausalLM"], "moe_layer_freq": [0, 1, 1, 1], "rope_theta": 5e6,
                 "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True, "use_gemma_norm": True,
                 "use_qk_norm": True, "qk_norm_type": "per_head"}


def read_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                out.update((layouts.canonical_name(k), st.get_tensor(k)) for k in st.keys())
    return out


def read_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def text_part(config):
    return config["text_config"] if "text_config" in config else config


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A bf16 tiny checkpoint as transformers saves it, in each layout, its config given fields no model reads."""
    hf = ref.build_model(ref.tiny_config(), seed=3).to(torch.bfloat16)
    root = tmp_path_factory.mktemp("fidelity")
    dirs = {}
    for layout, model in (("native", hf), ("released", ref.released_model(hf).to(torch.bfloat16))):
        path = str(root / layout)
        model.save_pretrained(path)
        config = read_config(path)
        text_part(config).update(EXTRA, sparse_attention_config=dict(SPARSE_EXTRA))
        # dtype fields other writers leave: transformers 4's torch_dtype, a VL config's text part's own dtype
        config["torch_dtype"] = text_part(config)["dtype"] = config["dtype"]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        dirs[layout] = path
    return dirs


def assert_tensors_come_back(src, out):
    theirs, ours = read_tensors(src), read_tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():
        got = ours[name]
        assert got.shape == want.shape, name
        if name.endswith(ROUTER):  # see ROUTER: the values are the source's, in the dtype the model holds
            assert want.dtype == torch.bfloat16 and got.dtype == torch.float32, name
            assert torch.equal(got, want.float()), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("layout", ["native", "released"])
@pytest.mark.parametrize("given", ["carry_from", "model_path"])
def test_an_export_without_training_is_its_source(sources, tmp_path, layout, given):
    src = sources[layout]
    out = m3jax.save_pretrained(m3jax.from_pretrained(src), tmp_path / "out", layout=layout,
                                carry_from=src if given == "carry_from" else None)
    if given == "carry_from" or layout == "native":  # a released export without a source holds no vision tower
        assert_tensors_come_back(src, out)
    theirs, ours = read_config(src), read_config(out)
    if layout == "released":
        text, text_out = theirs.pop("text_config"), ours.pop("text_config")
        if given == "model_path":  # no vision tower carried: the model's own source's VL fields still are
            assert ours.pop("vision_config") == theirs.pop("vision_config")
        assert ours == theirs  # the top level, beside the text config, as the source had it
        for key, (was, written) in RELEASED_WRITES.items():
            assert (text.pop(key), text_out.pop(key)) == (was, written), key
        assert {k: text_out.pop(k) for k in RELEASED_ADDS} == RELEASED_ADDS
        sparse, sparse_out = text.pop("sparse_attention_config"), text_out.pop("sparse_attention_config")
        assert {k: sparse_out[k] for k in sparse} == sparse  # the source's keys kept, the release's added
        theirs, ours = text, text_out
    assert ours == theirs


@pytest.mark.parametrize("layout", ["native", "released"])
def test_hf_reads_the_same_config(sources, tmp_path, layout):
    """transformers builds the same config from the export as from its source (its AutoConfig's every field)."""
    src = sources[layout]
    out = m3jax.save_pretrained(m3jax.from_pretrained(src), tmp_path / "out", layout=layout, carry_from=src)
    theirs, ours = AutoConfig.from_pretrained(src).to_dict(), AutoConfig.from_pretrained(out).to_dict()
    assert (theirs.pop("_name_or_path"), ours.pop("_name_or_path")) == (src, str(out))
    if layout == "released":
        text, text_out = theirs.pop("text_config"), ours.pop("text_config")
        # HF folds moe_layer_freq into mlp_layer_types and rope_theta into rope_parameters (equal to the source's);
        # the others it keeps as attributes its model never reads
        kept = {k: v for k, v in RELEASED_ADDS.items() if k not in ("moe_layer_freq", "rope_theta")}
        assert text_out == {**text, **kept}
    assert ours == theirs


@pytest.mark.parametrize("layout", ["native", "released"])
def test_an_export_in_another_dtype_states_it_wherever_the_source_did(sources, tmp_path, layout):
    """A bf16 source exported in fp32 says float32 in each dtype field the source held, the text config's too."""
    src = sources[layout]
    model = m3jax.from_pretrained(src, dtype=jnp.float32)
    config = read_config(m3jax.save_pretrained(model, tmp_path / "out", layout=layout, carry_from=src))
    assert (config["dtype"], config["torch_dtype"], text_part(config)["dtype"]) == ("float32",) * 3
    source = read_config(src)
    assert (source["dtype"], source["torch_dtype"], text_part(source)["dtype"]) == ("bfloat16",) * 3


def test_a_models_source_config_comes_from_carry_from(sources, tmp_path):
    """A model that did not come from a checkpoint (random weights) exported with `carry_from` holds that
    checkpoint's fields it does not model; without one it holds only its own."""
    src = sources["native"]
    fresh = m3_model(m3jax.M3Config.from_hf_dict({k: v for k, v in read_config(src).items() if k not in EXTRA}))
    carried = read_config(m3jax.save_pretrained(fresh, tmp_path / "carried", carry_from=src))
    assert {k: carried[k] for k in EXTRA} == EXTRA
    bare = read_config(m3jax.save_pretrained(fresh, tmp_path / "bare"))
    assert not set(EXTRA) & set(bare)


@pytest.mark.parametrize("layout", ["native", "released"])
def test_a_conversion_writes_the_config_an_export_does(sources, tmp_path, layout):
    src = sources[layout]
    converted = convert_checkpoint(src, tmp_path / "converted", layout=layout)
    exported = m3jax.save_pretrained(m3jax.from_pretrained(src), tmp_path / "exported", layout=layout, carry_from=src)
    assert read_config(converted) == read_config(exported)
    assert {k: text_part(read_config(converted))[k] for k in EXTRA} == EXTRA


def test_a_load_that_rounds_wider_tensors_says_so(tmp_path, caplog):
    """A bf16 checkpoint with fp32 norms loads them as bf16 (the embedding's dtype): rounded, and so is any export
    of it. Loading warns, naming them; the release's own mix (fp32 router and bias, kept fp32) is not warned of."""
    hf = ref.build_model(ref.tiny_config(), seed=3)
    tensors = read_tensors(ref.save(hf, str(tmp_path / "fp32"), "native"))
    for name, wide in (("release_mix", ROUTER), ("norms_fp32", ROUTER + ("norm.weight",))):
        path = tmp_path / name
        path.mkdir()
        save_file({k: v if k.endswith(wide) else v.to(torch.bfloat16) for k, v in tensors.items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(tmp_path / "fp32" / "config.json", path)
        # a conversion without a dtype rounds them too, and said nothing
        for what, run in (("load", lambda: m3jax.from_pretrained(path)),
                          ("the conversion", lambda: convert_checkpoint(path, tmp_path / f"{name}-converted"))):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="m3jax.hf.load"):
                run()
            warned = [r.getMessage() for r in caplog.records if "rounded" in r.getMessage()]
            if name == "release_mix":
                assert warned == [], what
            else:
                assert len(warned) == 1 and "dtype=float32" in warned[0] and f"{what} rounded" in warned[0]
                assert "model.layers.0.input_layernorm.weight" in warned[0]
                n = sum(k.endswith("norm.weight") for k in tensors)
                assert f"{n} tensor(s)" in warned[0]
        assert m3jax.from_pretrained(path).dtype == jnp.bfloat16
