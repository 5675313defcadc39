"""A checkpoint whose weights hold NaN or Inf is refused at load, naming the tensor (`check_finite`)."""

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import m3jax
import m3jax.hf.safetensors_io as sio
from m3jax import CheckpointError
from tests.test_bad_checkpoints import ckpts, copy, edit_tensor, esc  # noqa: F401  (ckpts: the module fixture)

FLOATS = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", FLOATS)
def test_count_nonfinite_counts_nan_and_both_infinities_only(dtype, monkeypatch):
    monkeypatch.setattr(sio, "_SCAN_ELEMENTS", 7)  # several scan chunks, the last one partial
    info = ml_dtypes.finfo(dtype)
    edge = np.array([0.0, -0.0, float(info.max), -float(info.max), float(info.smallest_subnormal), 1.0, -2.5],
                    dtype)
    assert sio.count_nonfinite(edge) == 0
    a = np.tile(edge, 5)
    a[[3, 11, 12, 34]] = np.array([np.nan, np.inf, -np.inf, -np.nan], np.float32).astype(dtype)
    assert sio.count_nonfinite(a) == 4
    assert sio.count_nonfinite(a.reshape(5, 7)[:, ::2]) == int((~np.isfinite(a.reshape(5, 7)[:, ::2]
                                                                             .astype(np.float64))).sum())


def test_count_nonfinite_is_zero_for_integers():
    assert sio.count_nonfinite(np.full(9, -1, np.int32)) == 0
    assert sio.count_nonfinite(np.array([True, False])) == 0


@pytest.mark.parametrize("kind,name,value,dtype", [
    ("native", "model.layers.0.self_attn.q_proj.weight", np.nan, np.float32),
    ("native_sharded", "model.layers.2.mlp.experts.down_proj", np.inf, np.float32),
    ("released", "language_model.model.layers.1.self_attn.index_k_norm.weight", -np.inf, np.float16),
])
def test_a_nonfinite_weight_is_refused_naming_it(ckpts, tmp_path, kind, name, value, dtype):  # noqa: F811
    d = copy(ckpts, kind, tmp_path)

    def poison(t):
        a = t[name].astype(dtype)
        a.reshape(-1)[[1, -1]] = value
        t[name] = a
    edit_tensor(d, name, poison)
    with pytest.raises(CheckpointError, match=f"tensor {esc(name)} .* holds 2 NaN or Inf value"):
        m3jax.from_pretrained(d)
    # Opting out loads it as it is.
    model = m3jax.from_pretrained(d, check_finite=False)
    leaves = [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert sum(int((~np.isfinite(leaf.astype(np.float32))).sum()) for leaf in leaves) == 2
