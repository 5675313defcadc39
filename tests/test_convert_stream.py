"""`m3jax.hf.convert.convert_checkpoint` writes, one tensor at a time, exactly what the model's round trip
(`from_pretrained` then `save_pretrained`) writes: the same files, tensors, index and config, bit for bit."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import m3jax
from m3jax import CheckpointError
from m3jax.hf.convert import convert_checkpoint, overlap
from tests.test_bad_checkpoints import ckpts, copy, edit_tensor, esc  # noqa: F401  (ckpts: the module fixture)


def contents(d):
    files = sorted(f for f in os.listdir(d))
    tensors = {f: load_file(os.path.join(d, f)) for f in files if f.endswith(".safetensors")}
    texts = {f: json.load(open(os.path.join(d, f))) for f in files if f.endswith(".json")}
    return files, tensors, texts


@pytest.mark.parametrize("kind,layout,dtype,shard", [
    ("native", "released", None, "5GB"),
    ("released", "native", None, "150KB"),
    ("native_sharded", "native", jnp.bfloat16, "300KB"),  # a cast on the way: the router stays fp32
    ("released", "released", jnp.float16, "5GB"),
])
def test_streamed_conversion_equals_the_models_round_trip(ckpts, tmp_path, kind, layout, dtype, shard):  # noqa: F811
    src = ckpts["dirs"][kind]
    streamed = convert_checkpoint(src, tmp_path / "streamed", layout, dtype=dtype, max_shard_size=shard)
    model = m3jax.from_pretrained(src, dtype=dtype)
    trip = m3jax.save_pretrained(model, tmp_path / "trip", layout=layout, max_shard_size=shard, carry_from=src)
    (f1, t1, j1), (f2, t2, j2) = contents(streamed), contents(trip)
    assert f1 == f2 and j1 == j2 and t1.keys() == t2.keys()
    for f in t1:
        assert t1[f].keys() == t2[f].keys()
        for name in t1[f]:
            a, b = t1[f][name], t2[f][name]
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


def test_a_nonfinite_tensor_stops_the_conversion_and_leaves_nothing(ckpts, tmp_path):  # noqa: F811
    d = copy(ckpts, "native", tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def poison(t):
        t[name] = t[name].copy()
        t[name].reshape(-1)[7] = np.inf
    edit_tensor(d, name, poison)
    with pytest.raises(CheckpointError, match=f"tensor {esc(name)} .* holds 1 NaN or Inf value"):
        convert_checkpoint(d, tmp_path / "out", "released")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
    convert_checkpoint(d, tmp_path / "out", "released", check_finite=False)  # the opt-out converts it as it is


@pytest.mark.parametrize("kind,layout,dtype", [("native", "released", jnp.bfloat16), ("released", "native", None)])
def test_small_parts_on_threads_write_the_same_files(ckpts, tmp_path, kind, layout, dtype):  # noqa: F811
    """Parts of 1,000 bytes on 3 threads (runs cut inside tensors, written out of order): the default's files."""
    src = ckpts["dirs"][kind]
    default = convert_checkpoint(src, tmp_path / "default", layout, dtype=dtype, max_shard_size="150KB")
    small = convert_checkpoint(src, tmp_path / "small", layout, dtype=dtype, max_shard_size="150KB", threads=3,
                               chunk_bytes=1000)
    names = sorted(os.listdir(default))
    assert names == sorted(os.listdir(small))
    for name in names:
        with open(os.path.join(default, name), "rb") as a, open(os.path.join(small, name), "rb") as b:
            assert a.read() == b.read(), name


def test_overlap_is_the_shared_run_of_both_tensors():
    """`overlap` against numpy: the elements two leading-index slots share, as runs of each one's flat tensor."""
    shape = (3, 4, 2, 5)
    param = np.arange(np.prod(shape)).reshape(shape)
    indices = [(), (1,), (2,), (1, 3), (1, 2), (0, 3, 1), (2, 0, 0)]
    for s in indices:
        for t in indices:
            met = overlap(s, t, shape)
            shared = np.intersect1d(param[s].ravel(), param[t].ravel())
            if met is None:
                assert shared.size == 0, (s, t)
                continue
            source_at, target_at, count = met
            np.testing.assert_array_equal(param[s].ravel()[source_at:source_at + count], shared)
            np.testing.assert_array_equal(param[t].ravel()[target_at:target_at + count], shared)


def test_nonfinite_values_are_counted_over_every_part(ckpts, tmp_path):  # noqa: F811
    d = copy(ckpts, "released", tmp_path)
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name].reshape(-1)[[0, -1]] = [np.nan, np.inf]
    edit_tensor(d, name, poison)
    with pytest.raises(CheckpointError, match=f"tensor {esc(name)} .* holds 2 NaN or Inf value"):
        convert_checkpoint(d, tmp_path / "out", "native", chunk_bytes=256, threads=2)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_a_full_filesystem_is_refused_before_anything_is_written(ckpts, tmp_path, monkeypatch):  # noqa: F811
    real = os.statvfs

    def full(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0) + tuple(st)[5:])
    monkeypatch.setattr(os, "statvfs", full)
    with pytest.raises(OSError, match=r"needs [0-9.]+ GB and its filesystem has 0.00 GB free"):
        convert_checkpoint(ckpts["dirs"]["native"], tmp_path / "sub" / "out", "released")
    model = m3jax.from_pretrained(ckpts["dirs"]["native"])
    with pytest.raises(OSError, match=r"needs [0-9.]+ GB and its filesystem has 0.00 GB free"):
        m3jax.save_pretrained(model, tmp_path / "export", "released")  # an export checks too
    assert os.listdir(tmp_path) == []
    # a filesystem that reports no size (a FUSE mount without statfs: every field 0) is not judged
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096,) + (0,) * 9))
    m3jax.save_pretrained(model, tmp_path / "export", "released")


def test_a_native_checkpoint_takes_the_vision_tower_of_another(ckpts, tmp_path):  # noqa: F811
    """native -> released carrying the release's vision tower: what converting the release itself writes."""
    d = ckpts["dirs"]
    carried = convert_checkpoint(d["native"], tmp_path / "carried", "released", carry_from=d["released"])
    itself = convert_checkpoint(d["released"], tmp_path / "itself", "released")
    (_, t1, j1), (_, t2, j2) = contents(carried), contents(itself)
    assert j1["config.json"] == j2["config.json"]  # the vision config of the tower it carries
    merged = lambda t: {k: v for shard in t.values() for k, v in shard.items()}  # noqa: E731
    a, b = merged(t1), merged(t2)
    assert a.keys() == b.keys() and any(k.startswith("vision_tower.") for k in a)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert not any(k.startswith("vision_tower.") for k in merged(contents(
        convert_checkpoint(d["native"], tmp_path / "text", "released"))[1]))  # nothing to carry in a native source



def test_another_models_vision_tower_is_refused(ckpts, tmp_path):  # noqa: F811
    from tests import reference as ref
    other = ref.save(ref.build_model(ref.tiny_config("mixed_kinds")), str(tmp_path / "other"), "released")
    with pytest.raises(CheckpointError, match="its text model differs from the one written"):
        convert_checkpoint(ckpts["dirs"]["native"], tmp_path / "out", "released", carry_from=other)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_another_models_tokenizer_and_fields_are_refused_in_the_native_layout_too(ckpts, tmp_path):  # noqa: F811
    """The text models were compared only where a vision tower was carried: a native conversion with another
    model's --carry-from wrote that model's tokenizer and config fields beside these weights, exit 0 (an audit)."""
    from tests import reference as ref
    other = ref.save(ref.build_model(ref.tiny_config("mixed_kinds")), str(tmp_path / "other"), "native")
    (tmp_path / "other" / "tokenizer_config.json").write_text('{"who": "the other model"}')
    with pytest.raises(CheckpointError, match="its config fields, tokenizer and vision tower are not carried"):
        convert_checkpoint(ckpts["dirs"]["native"], tmp_path / "out", "native", carry_from=other)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
