"""rl.generation.host_copies: vLLM's loaders' `copy_` through numpy writes exactly what torch's copy would."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh installs it)")

from rl.generation import host_copies  # noqa: E402

BIG = host_copies.MIN_BYTES  # at the threshold: taken by numpy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_copies_equal_torch_and_run_through_numpy(dtype, monkeypatch):
    numel = BIG // torch.empty(0, dtype=dtype).element_size() + 3
    src = (torch.randn(numel) * 50).to(dtype)
    taken = []
    real = host_copies._copy
    monkeypatch.setattr(host_copies, "_copy", lambda d, s, pool: (taken.append(d.size), real(d, s, pool)))
    dst, want = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
    want.copy_(src)
    with torch.no_grad(), host_copies.memcpy_copies():
        out = dst.copy_(src)
    assert out is dst and torch.equal(dst.view(torch.uint8), want.view(torch.uint8)) and taken == [numel]


def test_strided_slices_are_copied_right_and_other_copies_stay_torchs(monkeypatch):
    taken = []
    real = host_copies._copy
    monkeypatch.setattr(host_copies, "_copy", lambda d, s, pool: (taken.append(d.shape), real(d, s, pool)))
    big = torch.zeros(1024, 1024)
    src = torch.randn(1024, 2048)
    with torch.no_grad(), host_copies.memcpy_copies():
        big[:, :512].copy_(src[:, ::4])  # both strided (a TP column shard): numpy's strided copy
        cast = torch.zeros(BIG, dtype=torch.bfloat16).copy_(torch.ones(BIG))  # a dtype cast: torch's
        row = torch.zeros(1024, 1024).copy_(torch.arange(1024.0))  # a broadcast: torch's
        small = torch.zeros(8).copy_(torch.ones(8))  # below MIN_BYTES: torch's
    assert torch.equal(big[:, :512], src[:, ::4]) and torch.equal(big[:, 512:], torch.zeros(1024, 512))
    assert taken == [(1024, 512)]
    assert torch.equal(cast, torch.ones(BIG, dtype=torch.bfloat16)) and torch.equal(row[5], torch.arange(1024.0))
    assert torch.equal(small, torch.ones(8))
    buf = torch.arange(2 * BIG, dtype=torch.float32)  # overlapping source and destination: numpy's, in one piece
    want = buf.clone()
    want[1:BIG + 1] = want[0:BIG].clone()
    with torch.no_grad(), host_copies.memcpy_copies():
        buf[1:BIG + 1].copy_(buf[0:BIG])
    assert torch.equal(buf, want)
    x = torch.zeros(BIG, requires_grad=True)  # autograd sees torch's copy, with grad mode on
    with host_copies.memcpy_copies():
        y = x.clone().copy_(torch.ones(BIG))
    assert taken == [(1024, 512), (BIG,)] and y.grad_fn is not None
