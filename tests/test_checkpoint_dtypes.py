"""The dtype of what an export or a conversion writes: config.json's `dtype` is the dtype of its tensors, and a
dtype that is not a parameter dtype is refused before anything is written. A float64 checkpoint's export and
conversion declared float64 over float32 tensors (JAX holds float32 without x64), which transformers loaded upcast;
`convert_checkpoint(dtype=int32)` wrote every weight truncated, into a checkpoint the loader then refused."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import m3jax
from m3jax import ConfigError
from m3jax.hf.convert import convert_checkpoint
from tests.test_bad_checkpoints import ckpts  # noqa: F401  (ckpts: the module fixture)


def written_dtypes(path):
    """(config.json's dtype, the dtypes of the tensors other than the router's, which stays fp32)."""
    with open(os.path.join(path, "config.json")) as f:
        declared = json.load(f)["dtype"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return declared, {str(v.dtype) for k, v in tensors.items() if ".gate." not in k and "e_score" not in k}


@pytest.fixture
def float64_checkpoint(ckpts, tmp_path):  # noqa: F811
    src = ckpts["dirs"]["native"]
    dst = tmp_path / "f64"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.astype(np.float64) for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def test_a_float64_checkpoint_loads_and_exports_as_float32(float64_checkpoint, tmp_path):
    model = m3jax.from_pretrained(float64_checkpoint)
    assert np.dtype(model.dtype) == np.float32
    out = m3jax.save_pretrained(model, tmp_path / "out")
    assert written_dtypes(out) == ("float32", {"float32"})


def test_a_float64_checkpoint_converts_to_float32(float64_checkpoint, tmp_path):
    for layout in ("native", "released"):
        out = convert_checkpoint(float64_checkpoint, tmp_path / layout, layout)
        assert written_dtypes(out) == ("float32", {"float32"}), layout


@pytest.mark.parametrize("dtype", [np.int32, "int8", np.float64, "floaty"])
def test_a_conversion_to_a_dtype_that_is_not_a_parameter_dtype_is_refused(ckpts, tmp_path, dtype):  # noqa: F811
    with pytest.raises(ConfigError, match="not a parameter dtype; allowed: a float type"):
        convert_checkpoint(ckpts["dirs"]["native"], tmp_path / "out", "native", dtype=dtype)
    assert os.listdir(tmp_path) == []
