"""What the checkpoint checksums (rl.checkpoint_sums) add to a save and a restore, side by side in one run: orbax's
synchronous save and restore of a tree of arrays, and the checksums of the same tree, on this machine's devices.

    .venv/bin/python scripts/bench_checkpoint_sums.py [--gb 1.0] [--arrays 16] [--repeats 3]

The tree: --arrays fp32 and bf16 arrays (alternating) of --gb in all, random. Each figure is the best of --repeats;
the checksums are timed warm (their programs compiled by a first call, as after a run's first save). Also printed:
the growth of this process's peak RSS during the checksums, against the largest array (they hold one array's
temporaries at a time).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from rl.checkpoint_sums import checksums  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    key = jax.random.key(0)
    per = int(args.gb * 1e9 / args.arrays)
    tree = {}
    for i in range(args.arrays):
        dtype = jnp.float32 if i % 2 == 0 else jnp.bfloat16
        rows = max(1, per // (jnp.dtype(dtype).itemsize * 4096))
        tree[f"a{i:02d}"] = jax.random.normal(jax.random.fold_in(key, i), (rows, 4096), dtype)
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())
    largest = max(x.nbytes for x in tree.values())
    work = tempfile.mkdtemp(prefix="bench-ckpt-sums-")
    try:
        checkpointer = ocp.StandardCheckpointer()
        n = [0]

        def save():
            n[0] += 1
            checkpointer.save(os.path.join(work, str(n[0])), tree)
            checkpointer.wait_until_finished()

        def restore():
            checkpointer.restore(os.path.join(work, "1"), jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))

        t_save = best(save, args.repeats)
        t_restore = best(restore, args.repeats)
        checksums({"state": tree})  # compiles its programs
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t_sums = best(lambda: checksums({"state": tree}), args.repeats)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"tree: {args.arrays} arrays, {gb:.2f} GB (largest {largest / 1e6:.0f} MB) on {jax.devices()[0].platform}")
    print(f"orbax save (sync)     {t_save:7.3f} s  {gb / t_save:6.2f} GB/s")
    print(f"orbax restore         {t_restore:7.3f} s  {gb / t_restore:6.2f} GB/s")
    print(f"checksums             {t_sums:7.3f} s  {gb / t_sums:6.2f} GB/s   "
          f"= {t_sums / t_save:.2f}x the save, {t_sums / t_restore:.2f}x the restore")
    print(f"peak RSS growth during the checksums: {grew / 1e6:.0f} MB (largest array {largest / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
