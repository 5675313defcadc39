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


# ------------------------------------------------------------------------------------------- reading ahead
def test_reads_ahead_in_order_within_the_budget():
    import threading
    import time

    from m3jax.hf.read_blocks import read_ahead
    lock, running, most, started = threading.Lock(), [0], [0], []

    def read(job):
        with lock:
            started.append(job)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01 * (job % 3))  # out-of-order completion
        with lock:
            running[0] -= 1
        return job * 10

    sizes = {j: 1 + j % 4 for j in range(20)}  # bytes per job
    handed = []
    for job, out in read_ahead(range(20), read, sizes.__getitem__, threads=3, ahead_bytes=6):
        handed.append((job, out))
        with lock:  # read or reading, not yet handed over: within the budget
            assert sum(sizes[j] for j in started if j > job) <= 6
        time.sleep(0.005)  # a slow consumer: the reads run ahead until the budget stops them
    assert handed == [(j, 10 * j) for j in range(20)]
    assert 2 <= most[0] <= 3
    # a budget smaller than any job still reads one at a time
    assert [j for j, _ in read_ahead(range(5), read, lambda j: 100, threads=3, ahead_bytes=1)] == list(range(5))


def test_reading_ahead_stops_when_closed_or_failing():
    import threading
    import time

    from m3jax.hf.read_blocks import read_ahead
    started, lock = [], threading.Lock()

    def read(job):
        with lock:
            started.append(job)
        time.sleep(0.02)
        if job == 3:
            raise OSError(5, "Input/output error")
        return job

    ahead = read_ahead(range(100), read, lambda j: 1, threads=2, ahead_bytes=4)
    assert next(ahead) == (0, 0)
    ahead.close()  # what the loader does on its first non-finite tensor: every read ends before it returns
    count = len(started)
    time.sleep(0.1)
    assert len(started) == count <= 6  # the first job and at most the budget's more
    with pytest.raises(OSError, match="Input/output"):
        list(read_ahead(range(100), read, lambda j: 1, threads=2, ahead_bytes=4))


@pytest.mark.parametrize("layout", ["native", "released"])
def test_a_load_cut_into_many_parallel_reads_is_the_same_load(tmp_path, monkeypatch, layout):
    """Every slot its own read (chunks of 1 byte), three threads, a budget of 1 byte: the same parameters, bit for
    bit, as the default load, on one device and on a mesh whose blocks repeat on replicas."""
    import functools

    import jax
    from flax import nnx

    import m3jax
    from m3jax import tiny
    from m3jax.hf import load, read_blocks
    from sharding.mesh import MeshConfig, build_mesh
    path = tiny.save_hf(tiny.hf_model(tiny.hf_config("release_like"), seed=3), str(tmp_path / "ckpt"), layout)
    for mesh in (None, build_mesh(MeshConfig(2, 1, 2, 2))):
        want = nnx.to_flat_state(nnx.state(m3jax.from_pretrained(path, mesh=mesh), nnx.Param))
        monkeypatch.setattr(load, "build_params", functools.partial(read_blocks.build_params, threads=3,
                                                                     ahead_bytes=1, chunk_bytes=1))
        got = nnx.to_flat_state(nnx.state(m3jax.from_pretrained(path, mesh=mesh), nnx.Param))
        monkeypatch.undo()
        for (k, a), (k2, b) in zip(want, got):
            a, b = a.get_value(), b.get_value()
            assert k == k2 and a.sharding == b.sharding
            assert np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))), k


def test_a_block_its_parallel_reads_leave_short_is_an_error(tensors):
    """The completeness check holds across a block's reads: slots that cover half the parameter raise."""
    from m3jax.hf.read_blocks import ParamBlocks, build_params
    arrays, infos = tensors
    slots = [Slot("wide", (6, 4096), ("p",), (layer,)) for layer in range(2)]  # 2 of the parameter's 4 layers
    with TensorReader() as reader, pytest.raises(RuntimeError, match="fill 49152 of the 98304 elements"):
        list(build_params([ParamBlocks((4, 6, 4096), np.float32, None, slots)], infos, reader, True, chunk_bytes=1))
