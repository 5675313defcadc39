"""rl.generation.word_checksum: the per-tensor checksum the NCCL path computes where its buckets live.

Checked against a plain-Python evaluation of its formula, for every chunking; every single-bit change inside
a span is caught and none outside it matters. Which checksum a sender picks (`resolve_checksum`) and the
torch pieces a receiver hands on (`expand`) are checked here too; the round trip through a group is
tests/test_weight_transfer_protocol.py (both kinds)."""

import numpy as np
import pytest
import torch

from rl.generation.bucket_sender import resolve_checksum
from rl.generation.weight_slices import expand
from rl.generation.word_checksum import KIND, word_checksums

GOLDEN = 0x9E3779B97F4A7C15


def reference(buf: np.ndarray, offset: int, nbytes: int) -> int:
    total = 0
    for j in range(offset // 4, (offset + nbytes) // 4):
        total += int(buf[4 * j:4 * j + 4].view(np.int32)[0]) * (2 * j + 1) * GOLDEN
    for b in range(offset + nbytes - nbytes % 4, offset + nbytes):
        total += int(buf[b]) * (2 * ((1 << 40) + b) + 1) * GOLDEN
    return total % (1 << 64)


SPANS = [(0, 14), (64, 3), (128, 400), (576, 0), (640, 357), (1024, 4)]


@pytest.mark.parametrize("chunk_words", [1, 7, 64, 1 << 24])
def test_equals_the_formula_for_every_chunking(chunk_words):
    buf = np.random.default_rng(0).integers(0, 256, 1100, dtype=np.uint8)
    want = [reference(buf, o, n) for o, n in SPANS]
    assert word_checksums(torch.from_numpy(buf), SPANS, chunk_words=chunk_words) == want
    assert word_checksums(torch.from_numpy(buf), SPANS[::-1], chunk_words=chunk_words) == want[::-1]


def test_every_single_bit_inside_a_span_is_caught_and_none_outside():
    buf = np.random.default_rng(1).integers(0, 256, 96, dtype=np.uint8)
    span = (8, 70)  # 17 words and a 2-byte tail
    base = word_checksums(torch.from_numpy(buf), [span])[0]
    for byte in range(buf.size):
        for bit in (0, 3, 7):
            flipped = buf.copy()
            flipped[byte] ^= 1 << bit
            changed = word_checksums(torch.from_numpy(flipped), [span])[0] != base
            assert changed == (span[0] <= byte < span[0] + span[1]), (byte, bit)


def test_swapped_words_are_caught():
    buf = np.arange(64, dtype=np.uint8)
    swapped = buf.copy()
    swapped[0:4], swapped[4:8] = buf[4:8], buf[0:4]
    assert word_checksums(torch.from_numpy(buf), [(0, 64)]) != word_checksums(torch.from_numpy(swapped), [(0, 64)])


def test_refuses_what_it_cannot_checksum():
    payload = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        word_checksums(payload, [(2, 8)])
    with pytest.raises(ValueError, match="inside it"):
        word_checksums(payload, [(0, 65)])
    with pytest.raises(ValueError, match="1-D uint8"):
        word_checksums(payload.view(torch.int32), [(0, 4)])
    assert word_checksums(payload, []) == []


def test_auto_hashes_host_buckets_with_xxh3_and_device_ones_on_the_device():
    assert resolve_checksum("auto", "cpu") == "xxh3"
    assert resolve_checksum("auto", "cuda") == KIND == resolve_checksum("auto", "cuda:3")
    assert resolve_checksum(KIND, "cpu") == KIND
    with pytest.raises(ValueError, match="checksum 'crc32'"):
        resolve_checksum("crc32", "cpu")


def test_a_torch_slice_is_expanded_into_a_torch_tensor_and_reused():
    piece = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    full = expand(piece, ((2, 4), (0, 3)), (4, 3))
    assert isinstance(full, torch.Tensor) and full.dtype == torch.bfloat16 and torch.equal(full[2:4], piece)
    assert expand(piece + 1, ((2, 4), (0, 3)), (4, 3), out=full) is full and torch.equal(full[2:4], piece + 1)
    host = expand(np.ones((2, 3), np.float32), ((0, 2), (0, 3)), (4, 3), out=full)  # a numpy piece: numpy again
    assert isinstance(host, np.ndarray) and (host[:2] == 1).all()


def test_the_group_device_picks_the_backend_and_the_checksum():
    from rl.generation.collective_receiver import receive_device
    from rl.generation.transfer import make_transport

    gpu = make_transport("collective", [], 1 << 20, device="cuda")  # nothing is allocated before a push
    assert (gpu.sender.backend, gpu.sender.checksum_kind) == ("nccl", KIND)
    host = make_transport("collective", [], 1 << 20)
    assert (host.sender.backend, host.sender.checksum_kind) == ("gloo", "xxh3")
    assert receive_device("gloo") == "cpu"  # an NCCL group's receivers take their current CUDA device
