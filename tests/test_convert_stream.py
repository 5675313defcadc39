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
from m3jax.hf.convert import convert_checkpoint
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
    trip = m3jax.save_pretrained(model, tmp_path / "trip", layout=layout, max_shard_size=shard)
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
