"""The 32-node recipe in miniature (configs/recipes/m3-32node-miniature.yaml: the recipe's mesh shape, precision,
remat policy, kernels and loss on 8 CPU devices) trains through `python -m m3jax.train`, and a run stopped after
a checkpoint resumes to the uninterrupted run's final weights bit for bit, with its micro-batches cut to the
widths their rows need (grpo.micro_batch_widths).

Before this test, neither held for the recipe: its rows had a position count no context-parallel mesh can split
(tests/test_context_parallel_run.py), and a resumed compact master crashed its first step (tests/test_checkpoint.py,
`assert_donatable`)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/recipes/m3-32node-miniature.yaml"


def train(out_dir, steps: int) -> str:
    # tests/conftest.py's environment: 8 CPU devices, and the session's compilation cache, so that the second and
    # third runs load the first one's programs
    r = subprocess.run([sys.executable, "-m", "m3jax.train", "--config", CONFIG, f"run.out_dir={out_dir}",
                        f"run.total_steps={steps}", "logging.progress_bar=false"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.slow  # two runs of the trainer on 8 devices (~100 s, the second from the first one's compiled programs)
def test_the_recipe_in_miniature_trains_and_resumes_bitwise(tmp_path):
    run = tmp_path / "run"
    train(run, 3)  # checkpoints at steps 2 and 3 (checkpoint.every_steps 2, and the last step)
    want = load_file(os.path.join(run, "export", "model.safetensors"))
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    # as if the run had been killed after step 2's checkpoint: the same command resumes from it
    shutil.rmtree(run / "checkpoints" / "3")
    shutil.rmtree(run / "export")
    assert "resumed from step 2" in train(run, 3)

    got = load_file(os.path.join(run, "export", "model.safetensors"))
    assert sorted(got) == sorted(want) and any(".block_sparse_moe.experts.0.w1." in k for k in want)  # released layout
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)
    computed = [m["batch/computed_frac"] for m in metrics if "batch/computed_frac" in m]
    assert len(computed) == 3 and min(computed) < 1.0  # grpo.micro_batch_widths cut micro-batches
