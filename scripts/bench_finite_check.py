"""What `from_pretrained`'s finite check costs: `count_nonfinite` against reading the same tensor from a file.

For each float dtype a tensor of --mb MB is written to a temporary safetensors file; then, --iters times each,
interleaved: `read_into` (the load's own read, here from the page cache: the fastest a read can be),
`count_nonfinite` on the array read, and `np.isfinite(a).all()` (numpy's own, for comparison). Prints GB/s
(medians) and the check's time as a share of the read's.

    .venv/bin/python scripts/bench_finite_check.py
    .venv/bin/python scripts/bench_finite_check.py --mb 1024 --iters 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3jax.hf.safetensors_io import StreamingWriter, count_nonfinite, read_header, read_into  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    print(f"{'dtype':>9} | {'MB':>5} | read GB/s | count_nonfinite GB/s | np.isfinite GB/s | check / read")
    for dtype in (np.float32, ml_dtypes.bfloat16):
        dtype = np.dtype(dtype)
        a = np.random.default_rng(0).standard_normal(args.mb * 2**20 // dtype.itemsize).astype(dtype)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.safetensors")
            w = StreamingWriter(path, [("t", dtype, a.shape)])
            w.write("t", a)
            w.close()
            info = read_header(path)["t"]
            out = np.empty(a.shape, dtype)
            times = {"read": [], "count": [], "isfinite": []}
            for _ in range(args.iters):
                times["read"].append(timed(lambda: read_into(info, out)))
                times["count"].append(timed(lambda: count_nonfinite(out)))
                times["isfinite"].append(timed(lambda: np.isfinite(out).all()))
        med = {k: statistics.median(v) for k, v in times.items()}
        gbs = {k: a.nbytes / v / 1e9 for k, v in med.items()}
        print(f"{dtype.name:>9} | {args.mb:5d} | {gbs['read']:9.2f} | {gbs['count']:20.2f} | {gbs['isfinite']:16.2f} | "
              f"{med['count'] / med['read']:.2f}")


if __name__ == "__main__":
    main()
