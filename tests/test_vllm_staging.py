"""An update staged for vLLM's worker processes (rl.generation.vllm_staging): written whole, read back as views
of the staged pages (what a worker writes its slice from), a damaged file refused before any tensor is handed out."""

import os

import ml_dtypes
import numpy as np
import pytest

from m3jax.hf.safetensors_io import CheckpointError
from rl.generation.vllm_staging import staged_checkpoint, staged_tensors

torch = pytest.importorskip("torch")

ITEMS = [("model.a", np.arange(7, dtype=np.float32)),
         ("model.b", (np.arange(15, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(3, 5)),
         ("model.c", np.arange(6, dtype=np.float32).reshape(2, 3))]  # starts 2 bytes past a 4-byte boundary


def test_staged_tensors_read_back_every_tensor_bit_for_bit(tmp_path):
    with staged_checkpoint(ITEMS, root=str(tmp_path)) as path:
        got = list(staged_tensors(path))
        assert [name for name, _ in got] == [name for name, _ in ITEMS]
        for (_, t), (_, a) in zip(got, ITEMS):
            assert tuple(t.shape) == a.shape
            if a.dtype == ml_dtypes.bfloat16:
                assert t.dtype == torch.bfloat16
                np.testing.assert_array_equal(t.view(torch.uint16).numpy(), a.view(np.uint16))
            else:
                np.testing.assert_array_equal(t.numpy(), a)
        t = got[0][1]
        t.add_(1)  # copy on write: a loader that writes into its input changes neither the file nor others
        assert next(iter(staged_tensors(path)))[1][0].item() == 0.0
    assert not os.listdir(tmp_path)  # removed on exit


def test_a_truncated_staged_file_is_refused_before_any_tensor(tmp_path):
    with staged_checkpoint(ITEMS, root=str(tmp_path)) as path:
        f = os.path.join(path, "model.safetensors")
        os.truncate(f, os.path.getsize(f) - 4)
        with pytest.raises(CheckpointError, match="truncated: tensor 'model.c'"):
            next(iter(staged_tensors(path)))
