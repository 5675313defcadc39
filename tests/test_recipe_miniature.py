"""The 32-node recipe in miniature (configs/recipes/m3-32node-miniature.yaml: the recipe's mesh shape, precision,
remat policy, kernels and loss on 8 CPU devices) trains through `python -m m3jax.train`, and a run stopped after
a checkpoint resumes to the uninterrupted run's final weights bit for bit.

Before this test, neither held for the recipe: its rows had a position count no context-parallel mesh can split
(tests/test_context_parallel_run.py), and a resumed compact master crashed its first step (tests/test_checkpoint.py,
`assert_donatable`)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/recipes/m3-32node-miniature.yaml"


def train(out_dir, steps: int, cache) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           # the three runs compile the same programs: once, then from this cache
           "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    r = subprocess.run([sys.executable, "-m", "m3jax.train", "--config", CONFIG, f"run.out_dir={out_dir}",
                        f"run.total_steps={steps}", "logging.progress_bar=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.slow  # three runs of the trainer on 8 devices (~75 s)
def test_the_recipe_in_miniature_trains_and_resumes_bitwise(tmp_path):
    cache = tmp_path / "jax-cache"
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(straight, 3, cache)
    train(stopped, 2, cache)  # checkpoint.every_steps 2: the last checkpoint is step 2
    log = train(stopped, 3, cache)
    assert "resumed from step 2" in log

    want = load_file(os.path.join(straight, "export", "model.safetensors"))
    got = load_file(os.path.join(stopped, "export", "model.safetensors"))
    assert sorted(got) == sorted(want) and any(".block_sparse_moe.experts.0.w1." in k for k in want)  # released layout
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)
