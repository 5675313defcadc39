"""The model FLOP rate and MFU of a step's passes (the `perf/*` metrics).

    perf/tflops_per_device/train    = F_train / (time/train x devices) / 1e12
    perf/tflops_per_device/logprobs = F_forward x passes / (logprob seconds x devices) / 1e12
    perf/mfu/train, perf/mfu/logprobs = those rates / each device's dense peak (where one is known)

F_train and F_forward are the model FLOPs (`m3jax.flops.model_flops`: what the maths needs) of the step's rows
at their real lengths (prompt + response, padding left out): forward and backward of the update, a forward alone
for each logprob pass (logp_old, logp_ref). As PaLM's MFU and the planner count them, remat's recomputation, padding,
the MoE receive pool's empty rows and the indexer alignment pass are not model FLOPs: they lower the MFU, which is
the point of it. The logprob seconds leave out the sampled diagnostics timed inside time/logprobs
(time/indexer_recall, time/moe_drops).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# (a substring of jax's device_kind, the vendor's dense bf16 TFLOP/s), the most specific name first: what MFU is
# measured against (no structured sparsity). A device not named here logs no perf/mfu unless logging.peak_tflops says.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("GB200", 2500.0), ("B200", 2250.0),
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0), ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
)
HALF_DTYPES = ("bfloat16", "float16")  # the dtypes the table's peaks are for
SAMPLED_DIAGNOSTICS = ("time/indexer_recall", "time/moe_drops")  # timed inside time/logprobs, not logprob passes


def device_peak_flops(device_kind: str, param_dtype: str, configured_tflops: float | None) -> float | None:
    """FLOP/s one device can do at most: `configured_tflops` (logging.peak_tflops) where set, else the table's dense
    bf16 peak for a model in 16-bit params on a device it names, else None (a CPU; an fp32 model, whose matmuls run
    at another rate per device and precision setting)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if param_dtype not in HALF_DTYPES:
        return None
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops * 1e12
    return None


def row_flops(model_cfg, lengths) -> tuple[float, float]:
    """(F_train, F_forward): the model FLOPs of a training pass and of a forward pass over rows of these real
    lengths, the sum of `model_flops(cfg, 1, L)` over the rows (attention grows with each row's own length)."""
    from m3jax.flops import model_flops
    train = forward = 0.0
    for length, count in zip(*np.unique(np.asarray(lengths, np.int64), return_counts=True)):
        if length > 0:
            f = model_flops(model_cfg, 1, int(length))
            train += int(count) * f["model_total"]
            forward += int(count) * f["forward_total"]
    return train, forward


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """What the perf metrics of a run need: its model, how many devices share a step's work, their peak."""
    model_cfg: object  # an M3Config
    devices: int
    peak_flops: float | None

    def metrics(self, attention_mask, seconds: dict, sampled: dict, passes: int) -> dict:
        """perf/* of one step: `attention_mask` its train batch's ([..., width]: a row's real tokens), `seconds`
        its phases' (time/train and time/logprobs, the latter less the `sampled` diagnostics' time/indexer_recall
        and time/moe_drops), `passes` its logprob passes (0, 1 or 2: logp_old, logp_ref)."""
        mask = np.asarray(attention_mask)
        f_train, f_forward = row_flops(self.model_cfg, mask.reshape(-1, mask.shape[-1]).sum(-1))
        rates = {"train": f_train / max(seconds["train"], 1e-9) / self.devices}
        if passes:
            logprob_s = seconds["logprobs"] - sum(sampled.get(k, 0.0) for k in SAMPLED_DIAGNOSTICS)
            rates["logprobs"] = passes * f_forward / max(logprob_s, 1e-9) / self.devices
        out = {f"perf/tflops_per_device/{k}": v / 1e12 for k, v in rates.items()}
        if self.peak_flops:
            out.update({f"perf/mfu/{k}": v / self.peak_flops for k, v in rates.items()})
        return out
