"""`m3jax.from_pretrained` on broken checkpoints: one CheckpointError naming the tensor or file, before loading.

A tiny release-like HF model is saved once per module in three ways (native single file, native sharded,
released sharded with its vision tower); each test copies one, breaks it, and checks the error.
"""

import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy as stnp
from flax import nnx

import m3jax
import m3jax.hf.load as load_mod
from m3jax import CheckpointError, ConfigError, M3Config
from m3jax.hf import layouts
from tests import reference as ref

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cfg = ref.tiny_config("release_like")
    hf = ref.build_model(cfg)
    root = tmp_path_factory.mktemp("ckpts")
    dirs = {
        "native": ref.save(hf, str(root / "native"), "native"),
        "native_sharded": ref.save(hf, str(root / "native_sharded"), "native", max_shard_size="100KB"),
        "released": ref.save(hf, str(root / "released"), "released", max_shard_size="200KB"),
    }
    assert os.path.exists(os.path.join(dirs["native"], SINGLE))
    assert not os.path.exists(os.path.join(dirs["native"], INDEX))
    for k in ("native_sharded", "released"):
        assert os.path.exists(os.path.join(dirs[k], INDEX)) and len(shard_files(dirs[k])) > 2
    embed = hf.model.embed_tokens.weight.detach().numpy().copy()
    return {"dirs": dirs, "embed": embed}


def copy(ckpts, kind, tmp_path) -> str:
    dst = str(tmp_path / kind)
    shutil.copytree(ckpts["dirs"][kind], dst)
    return dst


def shard_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def read_index(d):
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)


def write_index(d, idx):
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(idx, f)


def file_of(d, name) -> str:
    if os.path.exists(os.path.join(d, INDEX)):
        return os.path.join(d, read_index(d)["weight_map"][name])
    return os.path.join(d, SINGLE)


def edit_file(path, fn):
    """Rewrite one safetensors file with fn(dict of arrays) applied."""
    tensors = stnp.load_file(path)
    fn(tensors)
    stnp.save_file(tensors, path, metadata={"format": "pt"})


def edit_tensor(d, name, fn):
    """Apply fn to the file holding `name` (and keep the index in step with what fn adds or drops)."""
    path = file_of(d, name)
    before = set(stnp.load_file(path))
    edit_file(path, fn)
    after = set(stnp.load_file(path))
    if os.path.exists(os.path.join(d, INDEX)):
        idx = read_index(d)
        for n in before - after:
            del idx["weight_map"][n]
        for n in after - before:
            idx["weight_map"][n] = os.path.basename(path)
        write_index(d, idx)


def checkpoint_names(d):
    if os.path.exists(os.path.join(d, INDEX)):
        return list(read_index(d)["weight_map"])
    return list(stnp.load_file(os.path.join(d, SINGLE)))


def esc(s):
    return re.escape(str(s))


# ------------------------------------------------------------------------------------------- good
@pytest.mark.parametrize("kind", ["native", "native_sharded", "released"])
def test_good_checkpoints_load(ckpts, kind):
    """The fixtures are valid: every failure below comes from the one thing each test breaks."""
    model = m3jax.from_pretrained(ckpts["dirs"][kind])
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    np.testing.assert_array_equal(np.asarray(flat[("embed",)].get_value()), ckpts["embed"])


# ---------------------------------------------------------------------------------------- missing
def test_missing_tensor_single_file(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)
    edit_tensor(d, "model.layers.2.mlp.experts.down_proj", lambda t: t.pop("model.layers.2.mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): " + esc("model.layers.2.mlp.experts.down_proj")):
        m3jax.from_pretrained(d)


def test_missing_tensor_sharded_released(ckpts, tmp_path):
    d = copy(ckpts, "released", tmp_path)
    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight"
    edit_tensor(d, name, lambda t: t.pop(name))
    assert name not in read_index(d)["weight_map"]
    with pytest.raises(CheckpointError, match=r"released layout.*1 missing tensor\(s\): " + esc(name)):
        m3jax.from_pretrained(d)


def test_missing_tensor_still_in_index(ckpts, tmp_path):
    d = copy(ckpts, "native_sharded", tmp_path)
    name = "model.layers.1.self_attn.indexer.k_proj.weight"
    path = file_of(d, name)
    edit_file(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=esc(INDEX) + r".*not in the file the index names: " + esc(name)):
        m3jax.from_pretrained(d)


# ------------------------------------------------------------------------------------- unexpected
def test_unexpected_tensor_single_file(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)
    extra = "model.layers.1.self_attn.extra_proj.weight"
    edit_tensor(d, "model.norm.weight", lambda t: t.__setitem__(extra, np.ones((4, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): " + esc(extra)):
        m3jax.from_pretrained(d)


def test_unexpected_tensor_released(ckpts, tmp_path):
    d = copy(ckpts, "released", tmp_path)
    extras = ["language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight",  # a dense layer has no experts
              "language_model.model.layers.9.input_layernorm.weight"]  # only 4 layers
    anchor = "language_model.model.norm.weight"

    def add(t):
        t[extras[0]] = np.ones((32, 64), np.float32)
        t[extras[1]] = np.ones((64,), np.float32)

    edit_tensor(d, anchor, add)
    with pytest.raises(CheckpointError, match=r"2 unexpected tensor\(s\): " + esc(", ".join(sorted(extras)))):
        m3jax.from_pretrained(d)


# --------------------------------------------------------------------------------- shape and dtype
@pytest.mark.parametrize("kind,name,shape,want", [
    ("native", "model.norm.weight", (65,), [64]),
    ("native", "model.layers.2.mlp.experts.gate_up_proj", (7, 64, 64), [8, 64, 64]),
    ("native_sharded", "model.layers.0.mlp.gate_up_proj.weight", (96, 64), [192, 64]),
    ("released", "language_model.model.layers.1.self_attn.index_q_proj.weight", (32, 64, 1), [32, 64]),
])
def test_wrong_shape(ckpts, tmp_path, kind, name, shape, want):
    d = copy(ckpts, kind, tmp_path)
    edit_tensor(d, name, lambda t: t.__setitem__(name, np.zeros(shape, np.float32)))
    with pytest.raises(CheckpointError,
                       match=f"tensor {esc(name)} has shape {esc(list(shape))}, the config implies {esc(want)}"):
        m3jax.from_pretrained(d)


@pytest.mark.parametrize("kind,name,dtype,code", [
    ("native", "model.layers.0.self_attn.q_proj.weight", np.int32, "I32"),
    ("released", "language_model.model.layers.2.block_sparse_moe.e_score_correction_bias", np.int64, "I64"),
    ("native_sharded", "model.embed_tokens.weight", np.uint8, "U8"),
])
def test_integer_dtype(ckpts, tmp_path, kind, name, dtype, code):
    d = copy(ckpts, kind, tmp_path)
    edit_tensor(d, name, lambda t: t.__setitem__(name, t[name].astype(dtype)))
    with pytest.raises(CheckpointError, match=f"tensor {esc(name)} has dtype {code}, expected a float type"):
        m3jax.from_pretrained(d)


def test_all_problems_in_one_error(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)

    def damage(t):
        t.pop("lm_head.weight")
        t["model.layers.0.bogus.weight"] = np.zeros((2,), np.float32)
        t["model.norm.weight"] = np.zeros((3,), np.float32)
        t["model.layers.3.self_attn.k_norm.weight"] = t["model.layers.3.self_attn.k_norm.weight"].astype(np.int16)

    edit_file(os.path.join(d, SINGLE), damage)
    with pytest.raises(CheckpointError) as e:
        m3jax.from_pretrained(d)
    msg = str(e.value)
    for part in ("missing tensor(s): lm_head.weight", "unexpected tensor(s): model.layers.0.bogus.weight",
                 "tensor model.norm.weight has shape [3]", "tensor model.layers.3.self_attn.k_norm.weight has dtype I16"):
        assert part in msg


# ---------------------------------------------------------------------------------- broken files
@pytest.mark.parametrize("kind", ["native", "released"])
def test_truncated_file(ckpts, tmp_path, kind):
    d = copy(ckpts, kind, tmp_path)
    path = os.path.join(d, SINGLE) if kind == "native" else os.path.join(d, shard_files(d)[1])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError,
                       match=esc(path) + r": truncated: tensor '[^']+' ends at byte \d+, file has " + str(size - 100)):
        m3jax.from_pretrained(d)


@pytest.mark.parametrize("keep,msg", [(4, r"truncated or not a safetensors file \(4 bytes\)"),
                                      (40, r"corrupt safetensors header \(declares \d+ header bytes, file has 40\)")])
def test_truncated_into_header(ckpts, tmp_path, keep, msg):
    d = copy(ckpts, "native", tmp_path)
    path = os.path.join(d, SINGLE)
    with open(path, "r+b") as f:
        f.truncate(keep)
    with pytest.raises(CheckpointError, match=esc(path) + ": " + msg):
        m3jax.from_pretrained(d)


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00garbage" * 8, b"}{not json at all" * 4])
def test_corrupt_header(ckpts, tmp_path, garbage):
    d = copy(ckpts, "native_sharded", tmp_path)
    path = os.path.join(d, shard_files(d)[0])
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(garbage)
    with pytest.raises(CheckpointError, match=esc(path) + r": corrupt safetensors header"):
        m3jax.from_pretrained(d)


def test_corrupt_header_length(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)
    path = os.path.join(d, SINGLE)
    with open(path, "r+b") as f:
        f.write((2 ** 62).to_bytes(8, "little"))
    with pytest.raises(CheckpointError, match=esc(path) + rf": corrupt safetensors header \(declares {2 ** 62} "):
        m3jax.from_pretrained(d)


def _rewrite_header(path, header_obj):
    """Replace a file's JSON header with `header_obj`, padded to the same length (data untouched)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    blob = json.dumps(header_obj, separators=(",", ":")).encode()
    assert len(blob) <= n
    with open(path, "wb") as f:
        f.write(raw[:8] + blob + b" " * (n - len(blob)) + raw[8 + n:])


@pytest.mark.parametrize("header", [[1, 2, 3], "a string", 42])
def test_header_not_an_object(ckpts, tmp_path, header):
    d = copy(ckpts, "native", tmp_path)
    path = os.path.join(d, SINGLE)
    _rewrite_header(path, header)
    with pytest.raises(CheckpointError, match=esc(path) + r": corrupt safetensors header"):
        m3jax.from_pretrained(d)


def test_header_entry_overruns_its_size(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)
    path = os.path.join(d, SINGLE)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header["model.norm.weight"]["shape"] = [128]  # 512 bytes claimed, 256 stored
    _rewrite_header(path, header)
    with pytest.raises(CheckpointError, match=esc(path) + r": tensor 'model.norm.weight' spans 256 bytes"):
        m3jax.from_pretrained(d)


# ------------------------------------------------------------------------------------------ index
def test_index_names_missing_file(ckpts, tmp_path):
    d = copy(ckpts, "native_sharded", tmp_path)
    idx = read_index(d)
    idx["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    write_index(d, idx)
    with pytest.raises(CheckpointError, match=esc(INDEX) + " names model-00099-of-00099.safetensors, which does not exist"):
        m3jax.from_pretrained(d)


def test_a_single_file_beside_an_index_of_other_shards_is_refused(ckpts, tmp_path):
    """A sharded export copied over a single-file one: transformers loads model.safetensors, vLLM (and m3jax) the
    index, so the tools trained and served two different models without a word."""
    d = copy(ckpts, "native_sharded", tmp_path)
    shutil.copy(os.path.join(ckpts["dirs"]["native"], SINGLE), os.path.join(d, SINGLE))
    with pytest.raises(CheckpointError, match=f"{esc(d)} holds two checkpoints, model.safetensors and the shards of "
                                              f"{esc(INDEX)}"):
        m3jax.from_pretrained(d)


def test_index_shard_deleted(ckpts, tmp_path):
    d = copy(ckpts, "released", tmp_path)
    victim = shard_files(d)[-1]
    os.remove(os.path.join(d, victim))
    with pytest.raises(CheckpointError, match=f"names {esc(victim)}, which does not exist"):
        m3jax.from_pretrained(d)


@pytest.mark.parametrize("kind,name", [("native_sharded", "lm_head.weight"),
                                       ("released", "language_model.model.layers.2.self_attn.q_norm.weight")])
def test_index_maps_tensor_to_wrong_file(ckpts, tmp_path, kind, name):
    d = copy(ckpts, kind, tmp_path)
    idx = read_index(d)
    right = idx["weight_map"][name]
    wrong = next(f for f in shard_files(d) if f != right)
    idx["weight_map"][name] = wrong
    write_index(d, idx)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) are not in the file the index names: " + esc(name) + "$"):
        m3jax.from_pretrained(d)


@pytest.mark.parametrize("text", ['{"weight_map": ', '{"metadata": {}}', '{"weight_map": ["a.safetensors"]}',
                                  '{"weight_map": {"lm_head.weight": null}}', '[]'])
def test_invalid_index(ckpts, tmp_path, text):
    d = copy(ckpts, "native_sharded", tmp_path)
    with open(os.path.join(d, INDEX), "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=esc(os.path.join(d, INDEX)) + ": not a valid safetensors index"):
        m3jax.from_pretrained(d)


def test_no_safetensors(ckpts, tmp_path):
    d = copy(ckpts, "released", tmp_path)
    for f in shard_files(d) + [INDEX]:
        os.remove(os.path.join(d, f))
    assert os.path.exists(os.path.join(d, "config.json"))
    with pytest.raises(CheckpointError, match=esc(d) + ": no model.safetensors or " + esc(INDEX)):
        m3jax.from_pretrained(d)


def test_no_config(ckpts, tmp_path):
    d = copy(ckpts, "native", tmp_path)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ConfigError, match="no config.json"):
        m3jax.from_pretrained(d)


def test_config_does_not_match_weights(ckpts, tmp_path):
    """A config edit (an extra layer) shows up as missing tensors of that layer."""
    d = copy(ckpts, "native", tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 5
    cfg["layer_types"].append("minimax_m3_sparse")
    cfg["mlp_layer_types"].append("sparse")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.4\.input_layernorm\.weight"):
        m3jax.from_pretrained(d)


# ----------------------------------------------------------------------------------------- skipped
def _load_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "m3jax.hf.load"]


def test_mtp_and_vision_tensors_skipped_in_released(ckpts, tmp_path, caplog):
    d = copy(ckpts, "released", tmp_path)
    extra = {"mtp.0.some.weight": np.ones((3, 64), np.float32),
             "vision_tower.x.weight": np.ones((5,), np.float32),
             "language_model.model.mtp.1.norm.weight": np.ones((64,), np.float32)}
    stnp.save_file(extra, os.path.join(d, "model-extra.safetensors"), metadata={"format": "pt"})
    idx = read_index(d)
    idx["weight_map"].update({n: "model-extra.safetensors" for n in extra})
    write_index(d, idx)
    names = checkpoint_names(d)
    n_skip = sum(bool(layouts.SKIPPED.search(n)) for n in names)
    assert n_skip == len([n for n in names if not n.startswith("language_model.")]) + 1 > len(extra)

    caplog.set_level(logging.INFO, logger="m3jax.hf.load")
    model = m3jax.from_pretrained(d)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    np.testing.assert_array_equal(np.asarray(flat[("embed",)].get_value()), ckpts["embed"])
    logs = _load_logs(caplog)
    assert len(logs) == 1, logs
    assert re.search(rf"skipping {n_skip} vision/MTP tensor", logs[0]), logs[0]


def test_mtp_tensor_skipped_in_native(ckpts, tmp_path, caplog):
    d = copy(ckpts, "native", tmp_path)
    edit_tensor(d, "model.norm.weight", lambda t: t.__setitem__("mtp.0.some.weight", np.ones((2, 2), np.float32)))
    caplog.set_level(logging.INFO, logger="m3jax.hf.load")
    m3jax.from_pretrained(d)
    assert _load_logs(caplog) == ["skipping 1 vision/MTP tensor(s) the text model does not use"]


def test_no_skip_line_without_skipped_tensors(ckpts, caplog):
    caplog.set_level(logging.INFO, logger="m3jax.hf.load")
    cfg = M3Config.from_pretrained(ckpts["dirs"]["native"])
    load_mod.plan_load(cfg, load_mod.checkpoint_files(ckpts["dirs"]["native"]))
    assert _load_logs(caplog) == []


# ------------------------------------------------------------------------------ checked before loading
def _spy_read_into(monkeypatch):
    """The tensors the load reads (`m3jax.hf.read_blocks.TensorReader.read`), in order."""
    from m3jax.hf import read_blocks
    calls = []
    real = read_blocks.TensorReader.read

    def spy(self, info, *a, **k):
        calls.append(info)
        return real(self, info, *a, **k)

    monkeypatch.setattr(read_blocks.TensorReader, "read", spy)
    return calls


def test_read_into_is_the_load_path(ckpts, monkeypatch):
    """The spy sees every tensor of a good load, once, so its silence below means nothing was read."""
    calls = _spy_read_into(monkeypatch)
    m3jax.from_pretrained(ckpts["dirs"]["native"])
    cfg = M3Config.from_pretrained(ckpts["dirs"]["native"])
    assert sorted(c.start for c in calls) == sorted(
        load_mod.checkpoint_files(ckpts["dirs"]["native"])[s.name].start for s in layouts.slots(cfg, "native"))


@pytest.mark.parametrize("kind,victim", [("native", "lm_head.weight"), ("released", "language_model.lm_head.weight")])
def test_error_raised_before_anything_is_loaded(ckpts, tmp_path, monkeypatch, kind, victim):
    d = copy(ckpts, kind, tmp_path)
    edit_tensor(d, victim, lambda t: t.pop(victim))  # the last tensor a lazy loader would reach
    calls = _spy_read_into(monkeypatch)

    def no_model(*a, **k):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(load_mod, "M3ForCausalLM", no_model)
    with pytest.raises(CheckpointError, match=esc(victim)):
        m3jax.from_pretrained(d)
    assert calls == []
