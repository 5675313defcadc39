"""The weight path's two checksums side by side: XXH3 on host memory (`transfer_base.checksum`, the gloo path's)
and the word checksum (`rl.generation.word_checksum`, an NCCL group's, computed where the bucket lives), on
the CPU and, where torch sees one, on a CUDA device; beside a host memcpy of the same bytes.

    .venv/bin/python scripts/bench_checksum.py [--mb 256] [--repeats 5]

Each figure is the best of --repeats over one bucket of --mb MB cut into tensors of 4 MB + 2 bytes (so each
has a word tail), in GB/s of checksummed bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl.generation.transfer_base import checksum  # noqa: E402
from rl.generation.word_checksum import word_checksums  # noqa: E402


def best_seconds(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    nbytes = a.mb << 20
    host = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    spans = [(o, min(nbytes - o, (4 << 20) + 2)) for o in range(0, nbytes, (4 << 20) + 64)]
    total = sum(n for _, n in spans)
    dst = np.empty_like(host)
    rows = {"host memcpy": best_seconds(lambda: np.copyto(dst, host), a.repeats),
            "xxh3, host (1 core)": best_seconds(lambda: [checksum(host[o:o + n]) for o, n in spans], a.repeats),
            f"word checksum, cpu ({torch.get_num_threads()} torch threads)":
                best_seconds(lambda: word_checksums(torch.from_numpy(host), spans), a.repeats)}
    if torch.cuda.is_available():
        dev = torch.from_numpy(host).cuda()
        rows[f"word checksum, {torch.cuda.get_device_name()}"] = best_seconds(
            lambda: word_checksums(dev, spans), a.repeats, torch.cuda.synchronize)
    else:
        print("no CUDA device visible to torch: the word checksum's GPU row needs one (scripts/gpu_check.py check 9)")
    copy = rows["host memcpy"]
    print(f"{a.mb} MB in {len(spans)} tensors")
    for name, s in rows.items():
        gb = (nbytes if name == "host memcpy" else total) / s / 1e9
        print(f"  {name:<45} {gb:8.2f} GB/s  ({s / copy:6.2f} x a memcpy's time)")


if __name__ == "__main__":
    main()
