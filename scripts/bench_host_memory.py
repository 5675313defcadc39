"""Peak host memory of every path that holds a whole model: build, HF load / save / convert, checkpoint save,
export, resume and checkpoint evaluation, against the parameters' bytes. A path whose peak is well over the
parameters (plus a fixed overhead) holds something twice.

A tiny-layer but wide model (configs/tiny.yaml's two layers at hidden 2048, vocab 32768, 8 experts of 1024:
0.95 GB of fp32 parameters, bf16 Adam moments) is saved as a HF checkpoint and as a run's step-1 checkpoint
in a work directory; then each path runs in a fresh process of its own (one at a time), which reports

    peak = VmHWM at its end - VmRSS after its imports (the same imports for every path, and jax.devices())

so a path's peak is its own. The parent imports no jax: a child's high-water mark starts at its exec.

    .venv/bin/python scripts/bench_host_memory.py                 # ~3 min on 2 cores; needs ~6 GB free
    .venv/bin/python scripts/bench_host_memory.py --paths export resume
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
WIDE = ["model.tiny.vocab_size=32768", "model.tiny.hidden_size=2048", "model.tiny.num_attention_heads=16",
        "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=128", "model.tiny.dense_intermediate_size=4096",
        "model.tiny.intermediate_size=1024", "model.tiny.shared_intermediate_size=1024",
        "model.tiny.num_local_experts=8", "precision.moment_dtype=bfloat16", "logging.tensorboard=false",
        "logging.plot=false", "logging.progress_bar=false", "logging.indexer_recall_every=0", "eval.every_steps=0",
        "eval.at_start=false", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=4",
        "checkpoint.export_hf_at_end=false"]
SETUP = ("save_hf", "make_checkpoint")  # they write what the others read
MESH = ["mesh.data=8", "grpo.prompts_per_step=4", "grpo.micro_batch_size=1"]  # for the paths that end in _mesh
PATHS = {
    "build_model": "M3ForCausalLM(cfg, rngs) (random init)",
    "save_hf": "build, then m3jax.save_pretrained (native, 400 MB shards)",
    "load": "m3jax.from_pretrained (native)",
    "convert": "python -m m3jax.convert --layout released",
    "build_policy": "rl.policy.build_policy (params + moments)",
    "build_policy_mesh": "rl.policy.build_policy on 8 CPU devices (mesh.data=8: the weights cut over them)",
    "make_checkpoint": "GRPOTrainer(cfg), then its checkpoint save of step 1",
    "export": "python -m m3jax.train --export",
    "resume": "python -m m3jax.train run.total_steps=1 (builds, resumes, stops)",
    "eval_checkpoint": "rl.eval_checkpoint.from_checkpoint (python -m m3jax.eval's read)",
}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child(path: str, work: str) -> None:
    """Run one path; print a JSON line {peak, held} (bytes)."""
    sys.path.insert(0, ROOT)
    import jax
    from flax import nnx

    import m3jax
    import m3jax.convert
    import m3jax.train
    import rl.trainer
    from rl.config import load_config
    from rl.eval_checkpoint import from_checkpoint
    from rl.policy import build_policy
    jax.numpy.zeros(4).block_until_ready()  # the backend started before the baseline
    base = _status_kb("VmRSS")
    args = [f"run.out_dir={os.path.join(work, 'run')}", *WIDE]
    hf = os.path.join(work, "hf_native")

    def nbytes(tree) -> int:  # once computed: a jitted initialisation returns before it has run
        return sum(x.nbytes for x in jax.block_until_ready(jax.tree.leaves(tree)))

    held = 0
    if path in ("build_model", "save_hf"):
        model = m3jax.M3ForCausalLM(load_config(TINY, args).model.m3_config(), rngs=nnx.Rngs(0))
        held = nbytes(nnx.state(model))
        if path == "save_hf":
            m3jax.save_pretrained(model, hf, max_shard_size="400MB")
    elif path == "load":
        held = nbytes(nnx.state(m3jax.from_pretrained(hf)))
    elif path == "convert":
        assert m3jax.convert.main([hf, os.path.join(work, "hf_released"), "--layout", "released"]) == 0
    elif path in ("build_policy", "build_policy_mesh"):
        extra = MESH if path.endswith("_mesh") else []
        held = nbytes(build_policy(load_config(TINY, [*args, *extra]), kernel_timing="off").state)
    elif path == "make_checkpoint":
        shutil.rmtree(os.path.join(work, "run"), ignore_errors=True)
        trainer = rl.trainer.GRPOTrainer(load_config(TINY, args))
        held = nbytes(trainer.state)
        trainer.save(1)
        trainer.checkpointer.close()
        trainer.engine.shutdown()
    elif path == "export":
        assert m3jax.train.main(["--config", TINY, *args, "--export", os.path.join(work, "export")]) == 0
    elif path == "resume":
        assert m3jax.train.main(["--config", TINY, *args, "run.total_steps=1"]) == 0
    elif path == "eval_checkpoint":
        got = from_checkpoint(load_config(TINY, args))
        held = nbytes((got.params, got.rest))
    else:
        raise SystemExit(f"unknown path {path!r}; allowed: {', '.join(PATHS)}")
    print(json.dumps({"peak": (_status_kb("VmHWM") - base) * 1024, "held": held}))


def measure(path: str, work: str) -> dict:
    env = dict(os.environ)
    if path.endswith("_mesh"):  # on CPU the 8 devices share the host's memory: the peak counts all of them
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, "--work", work],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parameter_bytes(hf: str) -> int:
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        return json.load(f)["metadata"]["total_size"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one, removed after)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.work)
    work = args.work or tempfile.mkdtemp(prefix="m3jax-host-memory-")
    try:
        needed = [p for p in SETUP if p not in args.paths]  # what the chosen paths read, made first
        if not os.path.exists(os.path.join(work, "hf_native")) or not os.path.isdir(os.path.join(work, "run")):
            for p in needed:
                measure(p, work)
        rows = [(p, measure(p, work)) for p in sorted(args.paths, key=lambda p: p not in SETUP)]
        params = parameter_bytes(os.path.join(work, "hf_native"))
        print(f"parameters: {params / 1e9:.3f} GB (fp32); peak = VmHWM at the end - VmRSS after the imports\n")
        print("| path | what it runs | held at the end, GB | peak, GB | peak / parameters |")
        print("|---|---|---|---|---|")
        for p, r in rows:
            print(f"| {p} | {PATHS[p]} | {r['held'] / 1e9:.2f} | {r['peak'] / 1e9:.2f} | {r['peak'] / params:.2f} |")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
