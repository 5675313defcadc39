"""Each pass of one `shm` weight update alone, in one process: the floor of `scripts/bench_weight_transfer.py`.

An update on the `shm` transport makes these passes over the model's bytes (rl.generation.shared_segments,
rl.generation.transfer, rl.generation.inplace):

    convert     the trainer's params as HF-named host arrays (`model_tensors`; views, no copy on CPU)
    copy+hash   the sender's copy into the segment files and its XXH3 of each tensor (two threads)
    verify      the engine's XXH3 of what it maps, with name, shape and dtype (`StagedUpdate.stage`)
    apply       the engine's `load_weights`: its checks, the loaders' one copy into place, the oneDNN re-pack

Here they run one after another in this process, on an in-process engine (vLLM's uni executor), with no Ray call
and nothing sharing the cores: what is left of an update when transport, scheduling and the other process are
taken away. The apply is also split into the loaders' copy alone and the rest (the re-pack, the checks). The
process restarts itself once with the engine's glibc tunables (rl.generation.host_memory: an engine actor starts
with them), so its copies and allocations behave as the engine's.

    .venv/bin/python scripts/bench_weight_passes.py [--large] [--repeats 6]

Prints, per repeat, each pass in seconds, and the ratio the sum of the passes allows: memcpy time / sum, the
most any transport could reach per update on this machine without removing a pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _with_engine_tunables() -> None:
    """Re-execute this script once with the engine processes' GLIBC_TUNABLES (glibc reads them at start)."""
    from rl.generation.host_memory import TUNABLES, engine_malloc_env
    if os.environ.get("M3JAX_WEIGHT_PASSES_CHILD"):
        return
    env = dict(os.environ, M3JAX_WEIGHT_PASSES_CHILD="1", **engine_malloc_env(os.environ))
    print(f"{TUNABLES}={env[TUNABLES]}", flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", action="store_true", help="the 1.03 GB bench model instead of 287 MB")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--bucket-mb", type=int, default=64)
    a = ap.parse_args()
    _with_engine_tunables()

    import jax
    from flax import nnx

    import m3jax
    from bench_weight_transfer import config, large_config, memcpy_gb_per_s
    from m3jax.tiny import m3_model
    from rl.generation.shared_segments import SegmentWriter
    from rl.generation.torch_arrays import to_torch
    from rl.generation.transfer import StagedUpdate, model_tensors
    from rl.generation.vllm_engine import VLLMEngine

    model = m3_model(large_config() if a.large else config(), seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    copy_s = nbytes / 1e9 / memcpy_gb_per_s(nbytes)
    print(f"model {nbytes / 1e6:.0f} MB; host memcpy of it {copy_s * 1e3:.1f} ms; 0.25x memcpy = {copy_s / 0.25 * 1e3:.1f} ms"
          " per update", flush=True)
    versions = [jax.tree.map(lambda x: x * 1.01, params), params]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model")
        m3jax.save_pretrained(model, path, layout="released")
        engine = VLLMEngine(path, max_model_len=256, dtype="float32", executor="uni")
        if engine.apply_mode != "inplace":
            raise SystemExit(f"the engine applies with {engine.apply_mode} ({engine.apply_fallback}): nothing to split")
        applier = engine._applier  # the in-place applier the engine's load_weights runs
        writer, staged = SegmentWriter(a.bucket_mb << 20), StagedUpdate()
        sums = []
        try:
            for rep in range(a.repeats):
                version = rep + 1
                t = [time.perf_counter()]
                named = list(model_tensors(graphdef, versions[rep % 2], rest))
                t.append(time.perf_counter())
                buckets = list(writer.buckets(named, version))
                t.append(time.perf_counter())
                for b in buckets:
                    staged.stage(b, engine.check)
                t.append(time.perf_counter())
                items = list(staged.tensors(version, len(buckets)))
                s = time.perf_counter()  # the loaders' copy alone, as the apply runs it
                _, replaced = applier.write((n, to_torch(x)) for n, x in items)
                loaders_s = time.perf_counter() - s
                applier._restore(replaced)
                t.append(time.perf_counter())
                engine.load_weights(items)  # the whole apply (it copies again, and re-packs)
                t.append(time.perf_counter())
                staged.clear()
                convert, send, verify, _, apply = (b - a_ for a_, b in zip(t, t[1:]))
                total = convert + send + verify + apply
                sums.append(total)
                print(f"  update {version}: convert {convert * 1e3:.1f} ms, copy+hash {send * 1e3:.1f}, verify "
                      f"{verify * 1e3:.1f}, apply {apply * 1e3:.1f} (loaders' copy alone {loaders_s * 1e3:.1f}, "
                      f"the rest {(apply - loaders_s) * 1e3:.1f}); sum {total * 1e3:.1f} ms = {copy_s / total:.3f}x "
                      "memcpy", flush=True)
        finally:
            writer.close()
            engine.shutdown()
    later = sums[1:] or sums
    print(f"sum of the passes, updates 2-{len(sums)}: best {min(later) * 1e3:.1f} ms ({copy_s / min(later):.3f}x memcpy), "
          f"median {statistics.median(later) * 1e3:.1f} ms ({copy_s / statistics.median(later):.3f}x)", flush=True)


if __name__ == "__main__":
    main()
