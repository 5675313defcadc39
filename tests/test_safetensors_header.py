"""`read_header` on headers whose offsets break the format: one CheckpointError naming the tensor, where a
TypeError's traceback came (string or float offsets) or another tensor's bytes loaded silently (a negative start,
overlapping spans). The `safetensors` library is the oracle of what the format allows."""

import json
import struct

import numpy as np
import pytest
import safetensors.numpy as stnp

from m3jax.hf.safetensors_io import CheckpointError, read_header, read_into

TENSORS = {"a": np.arange(4, dtype=np.float32), "b": np.full((2, 2), 7, np.float32)}


def write(path, header: dict, data: bytes) -> str:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


def good(tmp_path):
    path = str(tmp_path / "good.safetensors")
    stnp.save_file(TENSORS, path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def test_a_file_the_library_wrote_reads_back(tmp_path):
    header, data = good(tmp_path)
    infos = read_header(write(tmp_path / "x.safetensors", header, data))
    for name, want in TENSORS.items():
        np.testing.assert_array_equal(read_into(infos[name]), want)


@pytest.mark.parametrize("offsets", [["0", "16"], [0.0, 16.0], [True, 16]], ids=["strings", "floats", "bool"])
def test_offsets_that_are_not_integers_are_refused(tmp_path, offsets):
    header, data = good(tmp_path)
    header["a"]["data_offsets"] = offsets
    with pytest.raises(CheckpointError, match=r"corrupt header entry for tensor 'a'.*integers, 0 <= start <= end"):
        read_header(write(tmp_path / "x.safetensors", header, data))


def test_a_negative_start_is_refused(tmp_path):
    header, data = good(tmp_path)
    a0, a1 = header["a"]["data_offsets"]
    header["a"]["data_offsets"] = [a0 - 16, a1 - 16]  # the 16 bytes before the data: the header's own text
    with pytest.raises(CheckpointError, match=r"corrupt header entry for tensor 'a'"):
        read_header(write(tmp_path / "x.safetensors", header, data))


@pytest.mark.parametrize("case", ["overlap", "gap", "trailing"])
def test_spans_that_do_not_tile_the_data_are_refused_as_the_library_does(tmp_path, case):
    header, data = good(tmp_path)
    first, second = sorted(TENSORS, key=lambda k: header[k]["data_offsets"][0])
    if case == "overlap":  # the second tensor reads the first's last 8 bytes and its own first 8
        s, e = header[second]["data_offsets"]
        header[second]["data_offsets"] = [s - 8, e - 8]
        data = data[:-8]
        match = rf"tensor '{second}' starts at byte {s - 8} of the data, after tensor '{first}'.*overlap"
    elif case == "gap":
        s, e = header[second]["data_offsets"]
        header[second]["data_offsets"] = [s + 8, e + 8]
        data = data[:s] + bytes(8) + data[s:]
        match = rf"tensor '{second}' starts at byte {s + 8}.*leave a gap"
    else:
        data = data + bytes(8)
        match = r"8 bytes after the last tensor's data"
    path = write(tmp_path / "x.safetensors", header, data)
    with pytest.raises(Exception):
        stnp.load_file(path)
    with pytest.raises(CheckpointError, match=match):
        read_header(path)
