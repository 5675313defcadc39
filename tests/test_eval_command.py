"""`python -m m3jax.eval` on a short tiny run: it prints what the run logged for the same step (latest,
--step N, and the HF export), remembers the best value, and reads the run directory without writing."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = ["eval.every_steps=2", "eval.at_start=true", "eval.max_prompts=16", "eval.samples_per_prompt=2"]


def command(module, out, *args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", module, "--config", "configs/tiny.yaml", f"run.out_dir={out}",
                           *EVAL, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def printed(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("val/"):
            key, value = line.split()
            out[key] = float(value)
    return out


def snapshot(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, files in os.walk(root) for f in files) + sorted(
        os.path.relpath(d, root) for d, _, _ in os.walk(root))


@pytest.mark.slow
def test_eval_command_prints_what_the_run_logged(tmp_path):
    out = str(tmp_path / "run")
    r = command("m3jax.train", out, "run.total_steps=4", "checkpoint.every_steps=2", "logging.progress_bar=false",
                "logging.tensorboard=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out pass@1" in r.stdout
    rows = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        row = json.loads(line)
        rows[row["step"]] = row
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert "reward/mean" not in rows[0] and "val/pass@1" in rows[0]  # the initial policy, a row of its own
    assert [s for s in rows if "val/pass@1" in rows[s]] == [0, 2, 4]
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000

    meta = json.load(open(os.path.join(out, "checkpoints", "4", "meta", "metadata")))
    vals = {s: rows[s]["val/pass@1"] for s in (0, 2, 4)}
    best_step = min(s for s in vals if vals[s] == max(vals.values()))
    assert meta["best"] == {"metric": "val/pass@1", "value": vals[best_step], "step": best_step}

    before = snapshot(out)
    for args, step in (((), 4), (("--step", "2"), 2), (("--hf", os.path.join(out, "export")), 4)):
        r = command("m3jax.eval", out, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        got = printed(r.stdout)
        want = {k: v for k, v in rows[step].items() if k.startswith("val/")}
        assert got == pytest.approx(want, rel=0, abs=0), (args, got, want)
    assert snapshot(out) == before  # nothing created, changed or removed in the run directory

    r = command("m3jax.eval", out, "--step", "3")
    assert r.returncode == 1 and "no checkpoint of step 3" in r.stderr
    r = command("m3jax.eval", str(tmp_path / "none"))
    assert r.returncode == 1 and "no checkpoints" in r.stderr and not (tmp_path / "none").exists()
