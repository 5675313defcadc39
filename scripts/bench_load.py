"""Checkpoint load benchmark: wall time and peak host memory of `m3jax.from_pretrained`.

A random M3-shaped fp32 checkpoint of a few hundred MB is built with HF/torch (fixed seed, via
m3jax.tiny) and saved by transformers, sharded (--shard-mb, default 100MB), in both the
native and the released layout, in a temporary directory. Each load then runs in a fresh
subprocess, so that the peak memory measured belongs to that load alone:

    baseline = ru_maxrss after the loader's imports (and `jax.devices()` for the JAX loaders)
    load     = ru_maxrss at the end - baseline          (the load's own peak resident memory)

and is reported as a ratio to the checkpoint's size on disk (its *.safetensors files). For
comparison the same is measured for a naive load (`safetensors.numpy.load_file` of every shard, all
tensors kept) and for transformers `from_pretrained` of the same directory; and for a conversion to the other
layout, streamed (`m3jax.hf.convert.convert_checkpoint`, `python -m m3jax.convert`) and through the model
(`from_pretrained` then `save_pretrained`), whose held bytes are 0. The page cache is warmed (every file read once)
before the first measurement, so every loader reads from memory.

    .venv/bin/python scripts/bench_load.py
    .venv/bin/python scripts/bench_load.py --layers 12 --experts 16 --shard-mb 100 --repeats 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------ the measured child process

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, ROOT)
mode, path = sys.argv[1], sys.argv[2]

def status_kb(key):  # VmRSS: resident now; VmHWM: this process image's own peak (reset at exec)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])

def rss_kb():
    return status_kb("VmRSS")

if mode.startswith("m3jax"):
    import jax, m3jax
    jax.devices()  # backend initialised before the baseline
elif mode == "safetensors_numpy":
    import numpy as np
    from safetensors.numpy import load_file
elif mode == "transformers":
    import torch
    from transformers import MiniMaxM3VLForCausalLM
base_peak, base_rss, base_hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rss_kb(), status_kb("VmHWM")

t0 = time.perf_counter()
if mode == "m3jax_convert":  # the streamed conversion to the other layout: nothing held at the end
    from m3jax.hf.convert import convert_checkpoint
    convert_checkpoint(path, path + "-converted", sys.argv[3])
    held = 0
elif mode == "m3jax_round_trip":  # the same conversion through the model: from_pretrained, then save_pretrained
    m3jax.save_pretrained(m3jax.from_pretrained(path), path + "-converted", layout=sys.argv[3])
    held = 0
elif mode.startswith("m3jax"):
    model = m3jax.from_pretrained(path)
    from flax import nnx
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    held = sum(x.nbytes for x in leaves)
elif mode == "safetensors_numpy":
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    held = sum(v.nbytes for v in tensors.values())
elif mode == "transformers":
    model = MiniMaxM3VLForCausalLM.from_pretrained(path)
    # transformers may leave tensors as views of the mmapped files; touch every value so that the
    # memory the model really occupies once used is resident (and counted), as for the other loaders
    with torch.no_grad():
        held = 0
        for t in model.state_dict().values():
            t.sum()
            held += t.numel() * t.element_size()
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT " + json.dumps(dict(wall_s=wall, base_peak_kb=base_peak, base_rss_kb=base_rss, base_hwm_kb=base_hwm,
                                  peak_kb=peak, hwm_kb=status_kb("VmHWM"), end_rss_kb=rss_kb(), held_bytes=held)))
"""


def run_child(mode: str, path: str, *extra: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), TOKENIZERS_PARALLELISM="false")
    code = CHILD.replace("ROOT", repr(ROOT), 1)
    p = subprocess.run([sys.executable, "-c", code, mode, path, *extra], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{mode} on {path} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


# ------------------------------------------------------------------ checkpoint generation
# Runs in its own subprocess (`--build DIR`): the parent must stay small, because a child's ru_maxrss
# starts from the RSS of the process that forked it (Linux carries the pre-exec high-water mark over).


def build_checkpoints(args, workdir: str) -> None:
    sys.path.insert(0, ROOT)
    import torch

    from m3jax import tiny

    n = args.layers
    moe = [0] * args.dense_layers + [1] * (n - args.dense_layers)
    cfg = tiny.hf_config(
        "release_like", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_mlp,
        dense_intermediate_size=3 * args.expert_mlp, shared_intermediate_size=args.expert_mlp,
        num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=2, head_dim=64, rotary_dim=32,
        partial_rotary_factor=0.5, num_local_experts=args.experts, num_experts_per_tok=4, moe_layer_freq=moe,
        sparse_attention_config=dict(sparse_num_index_heads=4, sparse_index_dim=64, sparse_block_size=64,
                                     sparse_topk_blocks=4, sparse_local_block=1, sparse_attention_freq=moe))
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    model = tiny.hf_model(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()
                                                                if b.is_floating_point())
    for layout in ("native", "released"):
        tiny.save_hf(model, os.path.join(workdir, layout), layout, max_shard_size=f"{args.shard_mb}MB")
    print(f"checkpoint: hidden {args.hidden}, {n} layers ({args.dense_layers} full-attention dense + "
          f"{n - args.dense_layers} sparse-attention MoE), {args.experts} experts (top-4) x {args.expert_mlp}, "
          f"vocab {args.vocab}: {n_params / 1e6:.1f}M fp32 text-model params; built and saved (both layouts, "
          f"seed {args.seed}) in {time.perf_counter() - t0:.1f} s")


def headers(path: str) -> dict[str, int]:
    """name -> byte size of every tensor in the directory's *.safetensors (stdlib only)."""
    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            for name, meta in json.loads(fh.read(n)).items():
                if name != "__metadata__":
                    out[name] = meta["data_offsets"][1] - meta["data_offsets"][0]
    return out


_NON_TEXT = re.compile(r"^(vision_tower|multi_modal_projector|patch_merge_mlp|model\.vision_tower|"
                       r"model\.multi_modal_projector|model\.patch_merge_mlp|visual)\.|(^|\.)mtp\.")


def disk_bytes(path: str) -> tuple[int, int, int, int]:
    """(bytes of all *.safetensors files, number of files, bytes of text-model tensors, largest tensor)."""
    files = glob.glob(os.path.join(path, "*.safetensors"))
    sizes = headers(path)
    text = sum(v for k, v in sizes.items() if not _NON_TEXT.search(k))
    return sum(os.path.getsize(f) for f in files), len(files), text, max(sizes.values())


def warm_cache(path: str) -> None:
    for f in glob.glob(os.path.join(path, "*")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dense-layers", type=int, default=1, help="leading full-attention dense layers")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-mlp", type=int, default=256, help="routed/shared expert intermediate size")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per loader (median wall, max peak reported)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the temporary checkpoint directory")
    ap.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)  # internal: the generator subprocess
    args = ap.parse_args()
    if args.build:
        build_checkpoints(args, args.build)
        return

    workdir = tempfile.mkdtemp(prefix="m3bench_load_")
    try:
        gen = [a for a in sys.argv[1:] if a not in ("--keep", "--skip-transformers")]
        subprocess.run([sys.executable, os.path.abspath(__file__), *gen, "--build", workdir], check=True,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), stderr=subprocess.DEVNULL)
        dirs = {layout: os.path.join(workdir, layout) for layout in ("native", "released")}
        cases = [("m3jax.from_pretrained", "m3jax", "native"),
                 ("m3jax.from_pretrained", "m3jax", "released"),
                 ("safetensors.numpy.load_file (all shards)", "safetensors_numpy", "native"),
                 ("safetensors.numpy.load_file (all shards)", "safetensors_numpy", "released")]
        if not args.skip_transformers:
            cases.append(("transformers from_pretrained", "transformers", "native"))
        for d in dirs.values():
            warm_cache(d)
        rows = []
        other = {"native": "released", "released": "native"}
        for layout in ("native", "released"):
            cases += [(f"convert to {other[layout]}: streamed", "m3jax_convert", layout),
                      (f"convert to {other[layout]}: via the model", "m3jax_round_trip", layout)]
        for label, mode, layout in cases:
            try:
                runs = [run_child(mode, dirs[layout], other[layout]) for _ in range(args.repeats)]
            except RuntimeError as e:
                print(f"  {label} [{layout}] FAILED: {str(e)[-600:]}", flush=True)
                continue
            size, nfiles, text, largest = disk_bytes(dirs[layout])
            rows.append(dict(label=label, layout=layout, size=size, nfiles=nfiles, text=text, largest=largest,
                             wall=statistics.median(r["wall_s"] for r in runs),
                             load=1024 * max(r["peak_kb"] - r["base_peak_kb"] for r in runs),
                             hwm=1024 * max(r["hwm_kb"] - r["base_rss_kb"] for r in runs),
                             extra=1024 * (runs[0]["end_rss_kb"] - runs[0]["base_rss_kb"]) - runs[0]["held_bytes"],
                             base=runs[0]["base_peak_kb"] * 1024, held=runs[0]["held_bytes"]))
            print(f"  measured {label} [{layout}]", flush=True)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    mb = 1 << 20
    print(f"\ncpus {len(os.sched_getaffinity(0))}, repeats {args.repeats}, warm page cache, "
          f"load average (1 min) {os.getloadavg()[0]:.2f}")
    hdr = (f"{'loader':<40} | {'layout':<8} | {'disk MB':>7} | {'text MB':>7} | {'files':>5} | {'wall s':>6} | "
           f"{'peak MB':>7} | {'peak/disk':>9} | {'peak/text':>9} | {'held MB':>7} | {'VmHWM-RSS0 MB':>13} | "
           f"{'baseline MB':>11} | {'max tensor MB':>13} | {'end-extra MB':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['label']:<40} | {r['layout']:<8} | {r['size'] / mb:7.1f} | {r['text'] / mb:7.1f} | "
              f"{r['nfiles']:>5} | {r['wall']:6.2f} | {r['load'] / mb:7.1f} | {r['load'] / r['size']:9.2f} | "
              f"{r['load'] / r['text']:9.2f} | {r['held'] / mb:7.1f} | {r['hwm'] / mb:13.1f} | "
              f"{r['base'] / mb:11.1f} | {r['largest'] / mb:13.1f} | {r['extra'] / mb:12.1f}")
    print("\npeak = ru_maxrss at the end - ru_maxrss after the loader's imports (and jax.devices()), in a fresh "
          "process\n(the load's own peak resident memory); disk = all *.safetensors bytes; text = bytes of the "
          "text-model tensors\n(the released layout also holds vision-tower/projector tensors, which the text "
          "loaders skip); held = bytes of the\narrays the loader returns; VmHWM-RSS0 = /proc high-water mark "
          "minus the RSS after imports (cross-check);\nbaseline = ru_maxrss after imports; end-extra = RSS at the end - RSS after imports - held (memory the "
          "loader keeps\nbeyond the arrays it returns: compiled executables, allocator caches, mapped code pages).")


if __name__ == "__main__":
    main()
