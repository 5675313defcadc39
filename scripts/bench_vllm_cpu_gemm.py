"""vLLM's CPU GEMM paths side by side: the oneDNN handle every linear layer is packed into at load (and again by
the in-place weight apply after each update, rl.generation.inplace) vs plain `torch.nn.functional.linear` on the
loaded weight, which needs no pack. The question it answers: would skipping the re-pack pay for itself?

Shapes: the 1.03 GB weight-transfer bench model's GEMMs (scripts/bench_weight_transfer.py --large): LM head
32768 x 1536, gate_up 12288 x 1536, down 1536 x 6144, qkv 4608 x 1536; fp32 (the pool's dtype); M = rows per
call (1 and 8: decode, 64 and 256: prefill). Mean ms of 20 calls after one warm-up, on --threads threads.

    .venv/bin/python scripts/bench_vllm_cpu_gemm.py
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from vllm import _custom_ops as ops

    torch.set_num_threads(a.threads)
    if not ops._supports_onednn:
        raise SystemExit("this vLLM build has no oneDNN GEMM")

    def timed(f, n=20):
        f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e3

    print("| weight [N, K] | pack ms | M | oneDNN ms | F.linear ms | F.linear / oneDNN |\n|---|---|---|---|---|---|")
    for n, k in ((32768, 1536), (12288, 1536), (1536, 6144), (4608, 1536)):
        w = torch.randn(n, k)
        t = time.perf_counter()
        handle = ops.create_onednn_mm(w.t(), 32)
        pack = (time.perf_counter() - t) * 1e3
        for m in (1, 8, 64, 256):
            x = torch.randn(m, k)
            dnn = timed(lambda: ops.onednn_mm(handle, x, None))
            lin = timed(lambda: torch.nn.functional.linear(x, w))
            print(f"| {n} x {k} | {pack:.1f} | {m} | {dnn:.2f} | {lin:.2f} | {lin / dnn:.2f} |")


if __name__ == "__main__":
    main()
