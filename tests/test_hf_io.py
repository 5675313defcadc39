"""HF import/export: bitwise round trips in both layouts, transformers loads our exports, atomic writes."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

import m3jax
from m3jax.hf import layouts, save
from tests import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_all(path):
    """name (canonical spelling) -> numpy array, over every safetensors file in a directory."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for k in st.keys():
                    out[layouts.canonical_name(k)] = st.get_tensor(k)
    return out


def assert_bitwise_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    cfg = ref.tiny_config("mixed_kinds")
    hf = ref.build_model(cfg, seed=7)
    root = tmp_path_factory.mktemp("src")
    return hf, {layout: ref.save(hf, str(root / layout), layout) for layout in ("native", "released")}


def test_native_round_trip_is_bitwise_and_loads_in_transformers(src, tmp_path):
    hf, dirs = src
    out = m3jax.save_pretrained(m3jax.from_pretrained(dirs["native"]), tmp_path / "out", layout="native")
    assert_bitwise_equal(read_all(out), read_all(dirs["native"]))
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = ref.random_ids(hf.config, 2, 48, seed=1)
    np.testing.assert_array_equal(ref.hf_logits(reloaded, ids), ref.hf_logits(hf, ids))


def test_released_round_trip_is_bitwise_and_loads_as_multimodal_class(src, tmp_path):
    hf, dirs = src
    model = m3jax.from_pretrained(dirs["released"])
    text_only = m3jax.save_pretrained(model, tmp_path / "text", layout="released")
    theirs = read_all(dirs["released"])
    assert_bitwise_equal(read_all(text_only), {k: v for k, v in theirs.items() if k.startswith("language_model.")})
    # carried from the checkpoint the model came from, the vision tower makes the export the whole VL checkpoint
    out = m3jax.save_pretrained(model, tmp_path / "out", layout="released", max_shard_size="200KB",
                                carry_from=dirs["released"])
    assert len(theirs) > len(read_all(text_only)) and any(k.startswith("vision_tower.") for k in theirs)
    assert_bitwise_equal(read_all(out), theirs)
    _, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(text_only, output_loading_info=True)
    assert any("vision" in k for k in info["missing_keys"])  # what a text-only export leaves a VL loader to invent
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    # vLLM reads the legacy keys; the vision config of the source is carried over.
    assert cfg["model_type"] == "minimax_m3_vl" and "moe_layer_freq" in cfg["text_config"]
    assert cfg["vision_config"]["hidden_size"] == 32
    vl = MiniMaxM3SparseForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    ids = ref.random_ids(hf.config, 2, 48, seed=2)
    np.testing.assert_array_equal(ref.hf_logits(vl, ids), ref.hf_logits(hf, ids))


def test_cross_layout_round_trip(src, tmp_path):
    _, dirs = src
    rel = m3jax.save_pretrained(m3jax.from_pretrained(dirs["native"]), tmp_path / "rel", layout="released")
    back = m3jax.save_pretrained(m3jax.from_pretrained(rel), tmp_path / "nat", layout="native")
    assert_bitwise_equal(read_all(back), read_all(dirs["native"]))


@pytest.mark.slow  # places the model on 8 devices
def test_sharded_export_and_bf16(src, tmp_path):
    _, dirs = src
    model = m3jax.from_pretrained(dirs["native"], dtype=jnp.bfloat16)
    out = m3jax.save_pretrained(model, tmp_path / "sharded", max_shard_size="100KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files
    tensors = read_all(out)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays fp32
    again = m3jax.from_pretrained(out)
    ids = jnp.asarray(ref.random_ids(model.cfg, 1, 16))
    forward = jax.jit(lambda m, x: m(x))  # one compile serves both (same structure and dtypes)
    np.testing.assert_array_equal(np.asarray(forward(again, ids)), np.asarray(forward(model, ids)))


def test_tensors_of_a_sharded_model_leave_no_host_copy_behind(src):
    """On CPU a one-device parameter is read as a numpy view of its buffer; a parameter sharded over devices is
    cut slice by slice (export) or gathered from its shards (weight push), not turned into numpy whole: jax would
    cache that gathered copy on the parameter, a second host copy for as long as the parameters live."""
    from jax.sharding import NamedSharding, PartitionSpec

    from m3jax.hf.tensors import hf_tensors, host_view, host_views
    _, dirs = src
    model = m3jax.from_pretrained(dirs["native"])
    one_device = {name: np.array(t) for name, t in hf_tensors(model, "released")}
    embed = model.embed.get_value()
    view = host_view(embed)
    assert isinstance(view, np.ndarray) and view.ctypes.data == embed.unsafe_buffer_pointer()  # no copy
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    state = nnx.state(model)
    def spread(x):  # cut over the two devices along the first axis where it divides, else replicated on both
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec("x" if x.ndim and x.shape[0] % 2 == 0 else None)))
    nnx.update(model, jax.tree.map(spread, state))
    params = [leaf for leaf in jax.tree.leaves(nnx.state(model)) if isinstance(leaf, jax.Array)]
    assert params and all(len(p.devices()) == 2 for p in params)
    graphdef, state = nnx.split(model)
    for tensors in (hf_tensors(model, "released"),  # the export's path: each slice fetched alone
                    hf_tensors(nnx.merge(graphdef, host_views(state)), "released")):  # the weight push's
        sharded = dict(tensors)
        assert sorted(sharded) == sorted(one_device)
        for name, tensor in sharded.items():
            np.testing.assert_array_equal(tensor, one_device[name], err_msg=name)
        assert not [p for p in params if p._npy_value is not None]  # jax's cached numpy form of the whole array


def test_a_destination_holding_anything_but_a_checkpoint_is_refused_untouched(src, tmp_path):
    """save_pretrained and convert replace their destination whole: a new or empty directory, or an earlier
    checkpoint, is written; a file, a directory holding other things, or one holding the source is refused
    before anything is written, and left as it was."""
    from m3jax.hf.convert import convert_checkpoint
    _, dirs = src
    model = m3jax.from_pretrained(dirs["native"])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("precious")
    (tmp_path / "file").write_text("x")
    for dst in (notes, tmp_path / "file"):
        with pytest.raises(FileExistsError, match=f"destination {dst} exists and is not a"):
            m3jax.save_pretrained(model, dst)
        with pytest.raises(FileExistsError, match=f"destination {dst} exists and is not a"):
            convert_checkpoint(dirs["native"], dst, "released")
    assert (notes / "notes.txt").read_text() == "precious" and os.listdir(notes) == ["notes.txt"]
    assert (tmp_path / "file").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["file", "notes"]
    source_dir = os.path.dirname(dirs["native"])
    for dst in (dirs["native"], source_dir):  # the source itself, or its parent
        with pytest.raises(FileExistsError, match="is or holds the checkpoint being read"):
            convert_checkpoint(dirs["native"], dst, "released")
    with pytest.raises(FileExistsError, match="is or holds the checkpoint being read"):
        m3jax.save_pretrained(model, source_dir, layout="released", carry_from=dirs["released"])
    assert sorted(os.listdir(source_dir)) == ["native", "released"]
    empty = tmp_path / "empty"
    empty.mkdir()
    m3jax.save_pretrained(model, empty)  # an empty directory, then the checkpoint now in it, are written
    convert_checkpoint(dirs["native"], empty, "released")
    assert_bitwise_equal(read_all(empty), read_all(convert_checkpoint(dirs["native"], tmp_path / "fresh", "released")))


def test_a_parameter_dtype_that_is_not_a_float_type_is_refused(src):
    from m3jax.config import ConfigError
    _, dirs = src
    for dtype in (jnp.int32, "floaty", jnp.float8_e4m3fn):  # int32 used to load every weight truncated
        with pytest.raises(ConfigError, match="not a parameter dtype; allowed: a float type"):
            m3jax.from_pretrained(dirs["native"], dtype=dtype)


def test_failed_save_leaves_previous_directory_untouched(src, tmp_path, monkeypatch):
    _, dirs = src
    model = m3jax.from_pretrained(dirs["native"])
    out = m3jax.save_pretrained(model, tmp_path / "out")
    before = read_all(out)
    real = save.hf_tensors

    def dies_midway(*a, **k):
        for i, item in enumerate(real(*a, **k)):
            if i == 5:
                raise RuntimeError("disk full")
            yield item

    monkeypatch.setattr(save, "hf_tensors", dies_midway)
    with pytest.raises(RuntimeError, match="disk full"):
        m3jax.save_pretrained(model, out, layout="released")
    assert_bitwise_equal(read_all(out), before)
    assert os.listdir(tmp_path) == ["out"]  # no half-written directory left behind


@pytest.mark.slow  # a subprocess that imports jax and torch
def test_convert_cli(src, tmp_path):
    _, dirs = src
    dst = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "m3jax.convert", dirs["native"], str(dst), "--layout", "released",
                        "--threads", "2", "--carry-from", dirs["released"]], capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})  # as a user runs it
    assert r.returncode == 0, r.stderr
    assert "Unable to initialize backend" not in r.stderr  # jax's probe of the TPU is no news to a conversion
    assert_bitwise_equal(read_all(dst), read_all(dirs["released"]))  # the release's vision tower carried
    bad = subprocess.run([sys.executable, "-m", "m3jax.convert", str(tmp_path / "nowhere"), str(dst)],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and f"{tmp_path / 'nowhere'}: no such file or directory" in bad.stderr
    from m3jax.convert import main
    for size in ("5XB", "0"):  # one error line, before anything is read
        assert main([dirs["native"], str(tmp_path / "x"), "--max-shard-size", size]) == 2
        assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main([dirs["native"], str(tmp_path / "x"), "--threads", "0"])


def test_release_size_model_is_created_abstractly():
    """The real 426B-parameter shape builds with nnx.eval_shape in seconds: nothing is materialised."""
    raw = {"model_type": "minimax_m3_vl", "text_config": {
        "vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": 60, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64, "partial_rotary_factor": 0.5,
        "rope_theta": 5e6, "intermediate_size": 3072, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "num_local_experts": 128, "num_experts_per_tok": 4,
        "moe_layer_freq": [0] * 3 + [1] * 57,
        "sparse_attention_config": {"sparse_attention_freq": [0] * 3 + [1] * 57, "sparse_num_index_heads": 4,
                                    "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                    "sparse_local_block": 1}}}
    cfg = m3jax.M3Config.from_hf_dict(raw)
    abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    total = sum(int(np.prod(x.shape)) for x in leaves)
    assert 4.2e11 < total < 4.35e11
    assert len(list(layouts.slots(cfg, "released"))) > 57 * 128 * 3


def test_the_trainers_released_export_carries_the_vision_tower_of_its_model_path(src, tmp_path):
    from rl.config import load_config
    from rl.policy import build_policy
    from tests.test_run_config import TINY
    _, dirs = src
    cfg = load_config(TINY, ["model.tiny=null", f"model.path={dirs['released']}", f"run.out_dir={tmp_path / 'run'}",
                             "checkpoint.export_layout=released", "logging.tensorboard=false"])
    out = build_policy(cfg, kernel_timing="off").export(str(tmp_path / "export"))
    assert_bitwise_equal(read_all(out), read_all(dirs["released"]))


def test_a_large_load_logs_its_progress(src, tmp_path, monkeypatch, caplog):
    from m3jax.hf import load
    _, dirs = src
    with caplog.at_level(logging.INFO, logger=load.__name__):
        m3jax.from_pretrained(dirs["native"])
    assert "of parameters in place" not in caplog.text  # a small load says nothing
    monkeypatch.setattr(load, "PROGRESS_BYTES", 0)
    with caplog.at_level(logging.INFO, logger=load.__name__):
        m3jax.from_pretrained(dirs["native"])
    lines = [r.getMessage() for r in caplog.records if "of parameters in place" in r.getMessage()]
    assert lines and "100% of" in lines[-1] and len(lines) <= 10


def test_a_conversion_logs_its_progress_as_lines_where_stderr_is_a_file(src, tmp_path, caplog, capsys):
    """A conversion in a job log: a line per tenth of the bytes, not a bar redrawn with carriage returns."""
    from m3jax.hf import convert
    _, dirs = src
    with caplog.at_level(logging.INFO, logger=convert.__name__):  # pytest's stderr is no terminal
        convert.convert_checkpoint(dirs["native"], tmp_path / "out", "released", progress=True)
    lines = [r.getMessage() for r in caplog.records if r.name == convert.__name__]
    assert lines and all(m.startswith("converting: ") and " GB written after " in m for m in lines), lines
    assert lines[-1].startswith("converting: 100% of ") and len(lines) <= 10
    assert "\r" not in capsys.readouterr().err


def test_an_export_and_a_conversion_carry_the_files_beside_the_weights(src, tmp_path):
    """The tokenizer, chat template and generation config of the checkpoint a model came from are in its export and
    in a conversion of it (a tokenizer loads from the result); weights of other formats, hidden files and
    subdirectories are not carried, and an export without a source carries nothing."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from m3jax.hf.convert import convert_checkpoint
    _, dirs = src
    source = tmp_path / "source"
    shutil.copytree(dirs["native"], source)
    words = ["<eos>", "<unk>", "hello", "world"]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", unk_token="<unk>",
                                  chat_template="{{ messages[0]['content'] }}")
    tok.save_pretrained(source)
    (source / "generation_config.json").write_text('{"eos_token_id": [0, 3]}')
    (source / "pytorch_model.bin").write_bytes(b"old weights")
    (source / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (source / "figures").mkdir()
    (source / "figures" / "logo.png").write_bytes(b"png")
    side = sorted(f for f in os.listdir(source) if f != "config.json" and not f.endswith(".safetensors") and f not in
                  ("model.safetensors.index.json", "pytorch_model.bin", ".gitattributes", "figures"))
    assert "tokenizer.json" in side and "generation_config.json" in side

    model = m3jax.from_pretrained(source)
    results = [m3jax.save_pretrained(model, tmp_path / "export", carry_from=source),
               convert_checkpoint(source, tmp_path / "converted", layout="released")]
    for out in results:
        for name in side:
            assert (source / name).read_bytes() == open(os.path.join(out, name), "rb").read(), (out, name)
        assert not {"pytorch_model.bin", ".gitattributes", "figures"} & set(os.listdir(out)), out
        assert AutoTokenizer.from_pretrained(out)("hello world").input_ids == [2, 3]
    assert_bitwise_equal(read_all(results[0]), read_all(dirs["native"]))
    bare = m3jax.save_pretrained(model, tmp_path / "bare")
    assert sorted(os.listdir(bare)) == ["config.json", "model.safetensors"]


def test_saving_over_the_source_without_carry_from_names_the_files_it_drops(src, tmp_path, caplog):
    """save_pretrained(from_pretrained(p), p) replaced p whole and its tokenizer was gone, without a word."""
    import shutil
    _, dirs = src
    here = tmp_path / "ckpt"
    shutil.copytree(dirs["native"], here)
    for name in ("tokenizer.json", "generation_config.json"):
        (here / name).write_text("{}")
    model = m3jax.from_pretrained(str(here))
    with caplog.at_level(logging.WARNING, logger=save.__name__):
        m3jax.save_pretrained(model, here)
    assert f"{here} is replaced whole, and its generation_config.json, tokenizer.json are not in the new " \
           "checkpoint (no carry_from)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=save.__name__):
        m3jax.save_pretrained(model, here)  # nothing left to drop: no word
    assert "replaced whole" not in caplog.text


def test_a_swap_cut_between_its_renames_gets_its_previous_checkpoint_back(tmp_path, caplog):
    """Killed between the swap's renames: DST absent, the previous checkpoint in DST.old-*, the new one in DST.tmp-*.
    The next write used to remove both before its own space check; a write failing then left no checkpoint."""
    dst = tmp_path / "export"
    previous, unfinished, users = f"{dst}.old-5e6f7a8b", f"{dst}.tmp-1a2b3c4d", f"{dst}.old-mybackup"
    for d in (users, previous, unfinished):  # the user's backup, newest, is no swap's: neither restored nor removed
        os.makedirs(d)
        open(os.path.join(d, "config.json"), "w").write(d)
    os.utime(users, (2e9, 2e9))
    with caplog.at_level(logging.WARNING, logger=save.__name__):
        save.clear_leftovers(str(dst))
    assert open(dst / "config.json").read() == previous and not os.path.exists(unfinished)
    assert open(os.path.join(users, "config.json")).read() == users
    assert f"restored {dst} from {previous}" in caplog.text


def test_a_write_clears_what_an_interrupted_one_left(src, tmp_path, caplog):
    """A killed export or conversion leaves `DST.tmp-*` (up to the whole checkpoint) and, cut between the two
    renames of a swap, `DST.old-*`: the next write of DST removes them (a rerun was refused for want of space)."""
    from m3jax.hf.convert import convert_checkpoint
    _, dirs = src
    model = m3jax.from_pretrained(dirs["native"])
    for dst, write in ((tmp_path / "export", lambda d: m3jax.save_pretrained(model, d)),
                       (tmp_path / "converted", lambda d: convert_checkpoint(dirs["native"], d))):
        left = [f"{dst}.tmp-1a2b3c4d", f"{dst}.old-5e6f7a8b"]
        # not this destination's, or not a name a write gives (a user's backup was restored over DST, or removed)
        kept = [f"{dst}.tmpfiles", f"{dst}2.tmp-1a2b3c4d", f"{dst}.old-mybackup", f"{dst}.tmp-keepme"]
        for d in left + kept:
            os.makedirs(d)
            open(os.path.join(d, "model.safetensors"), "wb").write(b"x" * 1000)
        with caplog.at_level(logging.WARNING, logger=save.__name__):
            out = write(dst)
        assert not any(os.path.exists(d) for d in left) and all(os.path.exists(d) for d in kept)
        assert f"removed {left[0]} (0.00 GB), left by an interrupted write of {dst}" in caplog.text
        assert_bitwise_equal(read_all(out), read_all(dirs["native"]))
