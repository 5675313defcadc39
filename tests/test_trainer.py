"""The main job: `python -m m3jax.train --config configs/tiny.yaml` learns, logs, checkpoints, exports."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "m3jax.train", "--config", "configs/tiny.yaml", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny") / "run")
    r = train(f"run.out_dir={out}", "logging.progress_bar=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return out, [r for r in rows if "reward/mean" in r], [r for r in rows if "val/pass@1" in r]


@pytest.mark.slow
def test_tiny_demo_learns_within_the_budget(tiny_run):
    _, rows, _ = tiny_run
    reward = np.array([r["reward/mean"] for r in rows])
    assert len(reward) == 200
    start = reward[:10].mean()
    assert reward[-10:].mean() >= max(3 * start, 0.5)
    assert sum(r["time/step"] for r in rows) < 600


@pytest.mark.slow
def test_on_policy_diagnostics_and_logged_metrics(tiny_run):
    _, rows, _ = tiny_run
    for r in rows:  # generator and trainer share the weights: no train/inference mismatch in fp32
        assert abs(r["gen_kl_error"]) < 1e-6 and abs(r["token_mult_prob_error"] - 1) < 1e-5
    for key in ("reward/std", "response/length_mean", "response/truncated_frac", "clip_frac", "kl", "grad_norm",
                "entropy_approx", "is_out_of_band_frac", "time/generate", "time/logprobs", "time/train",
                "time/other", "throughput/tokens_per_s", "lr"):
        assert all(key in r for r in rows), key


@pytest.mark.slow
def test_held_out_accuracy_rises(tiny_run):
    """Evaluated at the start and every eval.every_steps on prompts training never draws (DigitTask.held_out)."""
    _, _, val = tiny_run
    assert [r["step"] for r in val] == list(range(0, 201, 20))
    start, end = val[0]["val/pass@1"], val[-1]["val/pass@1"]
    assert end >= 0.9 and end >= 3 * start, (start, end)
    assert all(r["val/prompts"] == 64 and r["val/samples_per_prompt"] == 4 for r in val)


@pytest.mark.slow
def test_outputs_checkpoints_export_and_plot(tiny_run, tmp_path):
    out, _, _ = tiny_run
    assert sorted(os.listdir(os.path.join(out, "checkpoints")))[-1] == "200"
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000
    assert os.listdir(os.path.join(out, "tensorboard"))
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(os.path.join(out, "export"))  # the policy loads in transformers
    # on demand: export the latest checkpoint again, and re-plot
    r = train(f"run.out_dir={out}", "--export", str(tmp_path / "again"))
    assert r.returncode == 0, r.stderr[-3000:]
    a = open(os.path.join(out, "export", "model.safetensors"), "rb").read()
    assert open(tmp_path / "again" / "model.safetensors", "rb").read() == a
    r = subprocess.run([sys.executable, "-m", "m3jax.plot", out, "--out", str(tmp_path / "c.png")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and os.path.exists(tmp_path / "c.png")


def test_bad_config_fails_before_any_work(tmp_path):
    r = train(f"run.out_dir={tmp_path / 'x'}", "grpo.group_sise=4")
    assert r.returncode == 2 and "grpo.group_sise" in r.stderr
    assert not os.path.exists(tmp_path / "x")
