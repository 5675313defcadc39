"""The model FLOP rate and MFU of a step's passes (`rl.perf`, the perf/* metrics)."""

import numpy as np
import pytest

from m3jax.flops import model_flops
from m3jax.plan.flops import step_flops
from rl.perf import StepFlops, device_peak_flops, row_flops
from tests.test_plan import TINY


def test_a_forward_is_a_third_of_the_trained_matmuls_and_attention_and_the_whole_indexer():
    """Hand count on test_plan's TINY at S = 32 (test_flops_hand_count has each term): the indexer runs forward only
    in training too, so a logprob pass does all of its FLOPs and a third of the rest."""
    d, s = 64, 32
    matmul = 6 * 84480 * s
    attention = 12 * 4 * 16 * (32 * 33 // 2 + 16 * 17 // 2 + 16 * 16)
    indexer = 2 * (2 * 16 + 16) * d * s + 2 * 2 * 16 * (32 * 33 // 2)
    f = model_flops(TINY, 1, s)
    assert f["model_total"] == matmul + attention + indexer
    assert f["forward_total"] == (matmul + attention) / 3 + indexer
    assert {k: f[k] for k in ("matmul", "indexer_proj", "attention", "indexer_scores", "model_total")} == {
        k: v for k, v in step_flops(TINY, 1, s, remat=False, sparse_attention="masked").items()
        if k in ("matmul", "indexer_proj", "attention", "indexer_scores", "model_total")}


def test_rows_are_counted_at_their_own_lengths():
    """Attention grows with each row's own length: rows of 8 and 40 tokens are not two rows of 24."""
    train, forward = row_flops(TINY, [8, 40, 40, 0])  # a row of no token (padding alone) costs nothing
    assert train == model_flops(TINY, 1, 8)["model_total"] + 2 * model_flops(TINY, 1, 40)["model_total"]
    assert forward == model_flops(TINY, 1, 8)["forward_total"] + 2 * model_flops(TINY, 1, 40)["forward_total"]
    assert train != row_flops(TINY, [24, 24, 24, 24])[0] * 3 / 4


@pytest.mark.parametrize("kind, dtype, configured, tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", None, 989.0),
    ("NVIDIA H100 PCIe", "bfloat16", None, 756.0),  # not the SXM part's figure
    ("NVIDIA H200", "bfloat16", None, 989.0),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", None, 312.0),
    ("NVIDIA B200", "bfloat16", None, 2250.0),
    ("TPU v5 lite", "bfloat16", None, 197.0),
    ("NVIDIA H100 80GB HBM3", "float32", None, None),  # fp32 matmuls run at another rate: not guessed
    ("cpu", "bfloat16", None, None),
    ("cpu", "float32", 0.5, 0.5),  # logging.peak_tflops wins
    ("NVIDIA H100 80GB HBM3", "bfloat16", 700.0, 700.0),
])
def test_each_devices_peak(kind, dtype, configured, tflops):
    peak = device_peak_flops(kind, dtype, configured)
    assert peak == (None if tflops is None else tflops * 1e12)


def test_the_rates_divide_by_the_passes_time_less_the_sampled_diagnostics():
    mask = np.zeros((2, 3, 50), np.int32)  # [micro-batches, rows, width]
    lengths = [10, 20, 30, 40, 50, 0]
    for i, n in enumerate(lengths):
        mask.reshape(6, 50)[i, :n] = 1
    train, forward = row_flops(TINY, lengths)
    perf = StepFlops(TINY, devices=4, peak_flops=2e9)
    m = perf.metrics(mask, {"train": 3.0, "logprobs": 2.5}, {"time/indexer_recall": 0.25, "time/moe_drops": 0.25},
                     passes=2)
    assert m["perf/tflops_per_device/train"] == pytest.approx(train / 3.0 / 4 / 1e12)
    assert m["perf/tflops_per_device/logprobs"] == pytest.approx(2 * forward / 2.0 / 4 / 1e12)
    assert m["perf/mfu/train"] == pytest.approx(train / 3.0 / 4 / 2e9)
    assert m["perf/mfu/logprobs"] == pytest.approx(2 * forward / 2.0 / 4 / 2e9)
    # no logprob pass (grpo.old_logprobs: update, no KL): nothing said of one; no peak known: no MFU
    m = StepFlops(TINY, devices=4, peak_flops=None).metrics(mask, {"train": 3.0, "logprobs": 0.1}, {}, passes=0)
    assert sorted(m) == ["perf/tflops_per_device/train"]


@pytest.mark.slow  # ~15 s: one step of the tiny trainer
def test_the_trainer_logs_the_rate_of_its_passes(tmp_path, monkeypatch):
    """One step with a KL (two logprob passes: logp_old and logp_ref) and a peak given: the logged rates are the
    model FLOPs of the step's own train batch over its own phase times, on the one device the config uses (of the
    8 the tests simulate)."""
    from tests.tiny_runs import tiny_trainer
    seen = []
    metrics = StepFlops.metrics
    monkeypatch.setattr(StepFlops, "metrics", lambda self, mask, *a, **k: seen.append(np.asarray(mask))
                        or metrics(self, mask, *a, **k))
    trainer = tiny_trainer(tmp_path, "run", "grpo.kl=k3", "grpo.kl_coef=0.01", "logging.peak_tflops=0.001")
    try:
        m = trainer.step(0)
    finally:
        trainer.engine.shutdown()
    assert trainer.flops.devices == 1 and trainer.flops.model_cfg == trainer.policy.model_cfg
    lengths = seen[0].reshape(16, -1).sum(-1)  # 4 prompts x 4 samples: prompt + response tokens a row
    assert (lengths > m["response/length_mean"]).all()
    train, forward = row_flops(trainer.policy.model_cfg, lengths)
    assert m["perf/tflops_per_device/train"] == pytest.approx(train / m["time/train"] / 1e12, rel=1e-6)
    passes_s = m["time/logprobs"] - m["time/indexer_recall"]  # configs/tiny.yaml samples the recall at step 1
    assert m["perf/tflops_per_device/logprobs"] == pytest.approx(2 * forward / passes_s / 1e12, rel=1e-6)
    assert m["perf/mfu/train"] == pytest.approx(m["perf/tflops_per_device/train"] / 1e-3)
    assert m["perf/mfu/logprobs"] == pytest.approx(m["perf/tflops_per_device/logprobs"] / 1e-3)


def test_curves_draw_the_mfu_where_a_peak_was_known():
    from rl.observe import MFU_PANEL, panels
    assert panels([{"step": 1, "perf/mfu/train": 0.3, "perf/mfu/logprobs": 0.2}])[MFU_PANEL] == (
        "perf/mfu/train", "perf/mfu/logprobs")
    assert MFU_PANEL not in panels([{"step": 1, "perf/tflops_per_device/train": 0.01}])  # a CPU run
