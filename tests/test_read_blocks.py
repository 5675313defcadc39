"""Reading the blocks of a parameter its devices hold (`m3jax.hf.read_blocks`): the bytes read are exactly the
slice's, whatever the slice cuts, and each block equals the same slice of the whole tensor."""

import ml_dtypes
import numpy as np
import pytest

from m3jax.hf.read_blocks import TensorReader, fill_block
from m3jax.hf.layouts import Slot
from m3jax.hf.safetensors_io import StreamingWriter, read_header


@pytest.fixture
def tensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"wide": rng.standard_normal((6, 4096)).astype(np.float32),  # rows wider than a page
              "narrow": rng.standard_normal((5, 3, 7)).astype(ml_dtypes.bfloat16),
              "vector": rng.standard_normal(9).astype(np.float32)}
    path = str(tmp_path / "t.safetensors")
    w = StreamingWriter(path, [(n, a.dtype, a.shape) for n, a in arrays.items()])
    for n, a in arrays.items():
        w.write(n, a)
    w.close()
    return arrays, read_header(path)


@pytest.mark.parametrize("name,region", [
    ("wide", ((0, 6), (0, 4096))),  # the whole tensor
    ("wide", ((2, 5), (0, 4096))),  # whole rows
    ("wide", ((1, 4), (2048, 4096))),  # the rows' second half: cut columns
    ("narrow", ((1, 3), (0, 3), (2, 6))),
    ("narrow", ((4, 5), (1, 2), (0, 7))),
    ("vector", ((3, 8),)),
])
@pytest.mark.parametrize("into", [None, np.float32, ml_dtypes.bfloat16])
def test_a_region_reads_its_own_bytes(tensors, name, region, into):
    arrays, infos = tensors
    want = arrays[name][tuple(slice(a, b) for a, b in region)]
    with TensorReader() as reader:
        out = None if into is None else np.full(want.shape, 7, into)
        got = reader.read(infos[name], arrays[name].shape, region, out)
        assert reader.bytes_read == want.nbytes
    assert got.shape == want.shape and (out is None or got is out)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(got.dtype), np.float32))


def test_a_reshaped_tensor_is_read_in_the_parameters_shape(tensors):
    """A slot reads its tensor as the parameter's trailing dims ([6, 4096] as [6, 2, 2048]) at its leading index;
    the slots must fill the whole block, which starts uninitialised."""
    arrays, infos = tensors
    out = np.zeros((2, 3, 2, 1024), np.float32)  # the block layers 1..2, rows 2..4, the second half of each half
    region = ((1, 3), (2, 5), (0, 2), (1024, 2048))
    slots = [Slot("wide", (6, 4096), ("p",), (layer,)) for layer in range(4)]  # one tensor for every layer
    with TensorReader() as reader:
        assert fill_block(out, region, (4, 6, 2, 2048), slots, infos, reader, True) == []
        for layer in (0, 1):
            np.testing.assert_array_equal(out[layer], arrays["wide"].reshape(6, 2, 2048)[2:5, :, 1024:2048])
        with pytest.raises(RuntimeError, match="fill 6144 of the 12288 elements"):  # layer 2 has no slot
            fill_block(out, region, (4, 6, 2, 2048), slots[:2], infos, reader, True)


def test_a_nonfinite_value_is_counted_where_it_was_read(tensors):
    arrays, infos = tensors
    slots = [Slot("vector", (9,), ("p",))]
    with TensorReader() as reader:
        a = np.empty(9, np.float32)
        assert fill_block(a, ((0, 9),), (9,), slots, infos, reader, True) == []
    poisoned = dict(infos)
    arrays["vector"][4] = np.nan  # a copy in memory: write it to a file of its own
    path = infos["vector"].file.replace("t.safetensors", "nan.safetensors")
    w = StreamingWriter(path, [("vector", np.dtype(np.float32), (9,))])
    w.write("vector", arrays["vector"])
    w.close()
    poisoned.update(read_header(path))
    with TensorReader() as reader:
        (line,) = fill_block(np.empty(4, np.float32), ((3, 7),), (9,), slots, poisoned, reader, True)
        assert "tensor vector" in line and "holds 1 NaN or Inf value(s) of 9 (in the 4 of them this process read)" \
            in line
        assert fill_block(np.empty(3, np.float32), ((5, 8),), (9,), slots, poisoned, reader, True) == []
