"""One-copy weight apply for an in-process vLLM engine (issue 12 item 3).

vLLM's `reload_weights` restores every layer onto the meta device, materialises fresh tensors, copies
each checkpoint tensor into them, re-runs the layer's post-load processing and copies the result back
into the live storage: two copies and a fresh allocation (page faults) per tensor, then the repack.

Why a bare second `model.load_weights` corrupts a CPU model: on CPU the post-load processing of every
unquantized linear layer (`UnquantizedLinearMethod`, `dispatch_cpu_unquantized_gemm(remove_weight=True)`)
packs the [N, K] weight into a oneDNN matmul handle (or an sgl/zentorch packed tensor) and replaces
`layer.weight` with an empty Parameter; `forward` reads only the packed copy. A second load_weights then
writes into that empty Parameter (a shape error, or nothing) and the handle keeps the old weights. The
embedding and lm_head keep their weight but also carry a packed copy for the logits matmul.

What this module does instead, once per engine:
  - every CPU-dispatched GEMM layer gets one persistent weight buffer in vLLM's *loaded* layout (built
    from the meta tensor vLLM recorded for reloading, so it carries the layer's own `weight_loader`,
    shard offsets and TP slicing);
  - an update swaps those buffers in, runs the model's own `load_weights` (vLLM's name mapping: q/k/v ->
    qkv_proj shard, gate/up -> gate_up_proj, expert e -> w13/w2 slot e), which copies each received
    tensor once into its final place, and re-runs only the post-processing that depends on the values:
    the GEMM dispatch (the oneDNN pack) of each linear / embedding layer;
  - everything else (norms, router bias, the MoE expert stacks of the torch experts kernel, which reads
    `w13_weight` / `w2_weight` at every forward and never repacks) is written in place by its loader;
  - the input embedding's packed copy is dropped, not re-made: vLLM packs every embedding layer at load, but
    runs an embedding's GEMM (`quant_method.apply`) only for the LM head (the logits processor), while the
    input embedding's forward is a lookup of `weight` (`quant_method.embedding`). Tied embeddings do not
    change that: `ParallelLMHead.tie_weights` shares the weight, and the head packs a copy of its own. In
    its place a function that raises, so that a vLLM which did use it fails loudly rather than serving the
    old weights. On the 1.03 GB bench model this was 201 MB of the 570 MB the apply re-packed.
A layer whose post-processing this does not know (another quantisation method, a MoE kernel that
repacks, a GPU platform's layouts) makes `uncovered()` non-empty: the engine then keeps `reload_weights`
and says which layer (`VLLMEngine.apply_mode`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os

from rl.generation.host_copies import memcpy_copies

log = logging.getLogger(__name__)

# MoE experts kernels that read the loaded w13/w2 storage directly at every forward (no repack).
_PLAIN_MOE_EXPERTS = ("M3TorchExperts",)


class InplaceApplier:
    def __init__(self, model):
        import torch
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                         UnquantizedEmbeddingMethod,
                                                                         VocabParallelEmbedding)
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.platforms import current_platform

        self.model = model
        self.gemm: dict[str, tuple[torch.nn.Module, torch.nn.Parameter, bool]] = {}  # name -> (layer, buffer, drop)
        self.lookup_only: list[torch.nn.Module] = []  # input embeddings: their packed GEMM copy is never read
        self._uncovered: list[str] = []
        cpu = current_platform.is_cpu()
        for name, layer in model.named_modules():
            if not any(True for _ in layer.parameters(recurse=False)):
                continue
            qm = getattr(layer, "quant_method", None)
            if qm is None:
                continue  # norms, router bias: plain parameters written in place by their loader
            if isinstance(qm, UnquantizedFusedMoEMethod):
                kernel = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
                if type(kernel).__name__ not in _PLAIN_MOE_EXPERTS:
                    self._uncovered.append(f"{name} (MoE experts kernel {type(kernel).__name__} may repack)")
                continue
            if not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                self._uncovered.append(f"{name} ({type(qm).__name__} post-processing is not modelled)")
                continue
            if not cpu:
                continue  # CUDA: unquantized linear / embedding weights are used as loaded
            if getattr(layer, "_cpu_skip_gemm_dispatch", False) or not hasattr(layer, "cpu_linear"):
                continue
            if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
                self.lookup_only.append(layer)  # its loader writes the live weight; nothing to re-pack
                continue
            drop = isinstance(qm, UnquantizedLinearMethod)  # linear layers drop their weight after packing
            if drop:
                info = LAYERWISE_INFO.get(layer)
                meta = None if info is None else info.restore_metadata[0].get("weight")
                if meta is None:
                    self._uncovered.append(f"{name} (vLLM recorded no loaded layout for its weight)")
                    continue
                with info.restore_device:
                    buf = restore_layer_refs(materialize_meta_tensor(meta), layer)
                buf.requires_grad_(False)
                # Fault its pages in now, while the engine starts, not in the first update: on this VM a fresh
                # page costs ~60x a used one (0.2-0.4 GB/s), and these buffers were most of the first update's
                # extra 0.6 s (BENCHMARKS.md, issue 12, session 16).
                with torch.no_grad():
                    buf.zero_()
            else:
                buf = layer.weight  # the embedding keeps its weight: the buffer is the live parameter
            self.gemm[name] = (layer, buf, drop)

    def uncovered(self) -> list[str]:
        """Layers whose post-load processing an in-place write would not reproduce."""
        return list(self._uncovered)

    def read_boxes(self, manifest: dict, names) -> dict:
        """The box of each of `names` this rank's loaders read only part of (rl.generation.weight_slices),
        probed on the loaded-layout buffers; nothing is written."""
        from rl.generation.weight_slices import read_boxes

        with self._loaded_layout():
            targets = [*self.model.parameters(), *self.model.buffers()]
            return read_boxes(self.model.load_weights, manifest, names, targets)

    @contextlib.contextmanager
    def _loaded_layout(self):
        """The GEMM layers' loaded-layout buffers registered as their weights (vLLM's loaders write there),
        the packed layers' empty weights back afterwards."""
        removed = self._register_buffers()
        try:
            yield
        finally:
            self._restore(removed)

    def _register_buffers(self) -> dict:
        """Register each packed layer's loaded-layout buffer as its weight, so that load_weights finds it;
        returns the weights it replaced."""
        removed = {}
        for name, (layer, buf, drop) in self.gemm.items():
            if drop:
                removed[name] = layer.weight
                layer.weight = buf
        return removed

    def _restore(self, removed: dict) -> None:
        for name, w in removed.items():
            self.gemm[name][0].weight = w

    def write(self, named_tensors) -> tuple:
        """The loaders' one copy of each tensor into place (the GEMM layers' loaded-layout buffers registered as
        their weights): (what vLLM loaded, the weights the buffers replaced). Nothing is re-packed: until
        `apply` re-packs, or `_restore(replaced)` puts the packed layers' weights back, the GEMM layers serve
        the old packed copies. On failure the weights are put back."""
        import torch

        removed = self._register_buffers()
        try:
            with torch.no_grad(), memcpy_copies():  # the loaders' copies at memcpy speed (host_copies says why)
                loaded = self.model.load_weights(named_tensors)
        except BaseException:
            self._restore(removed)  # the packed handles still hold the old weights
            raise
        return loaded, removed

    def apply(self, named_tensors) -> set[str]:
        """Write HF-named tensors into the model once; returns the parameter names vLLM loaded.

        The caller has checked the set complete (every layer gets every tensor), so every GEMM buffer
        is fully rewritten before it is packed again.
        """
        import torch
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        if self._uncovered:
            raise RuntimeError(f"in-place apply does not cover {self._uncovered}")
        loaded, _ = self.write(named_tensors)
        # The old packed copies go before the new ones are made: their memory is then free for the new
        # (same-sized) ones, which with the engine's allocator settings (rl.generation.host_memory) means no
        # fresh pages to fault in, and the packed weights are never held twice. Nothing serves in between:
        # the engine applies while no generation runs (the actor's single work group).
        for layer, _, _ in self.gemm.values():
            layer.cpu_linear = None
        for layer in self.lookup_only:
            layer.cpu_linear = _stale_packed_copy

        def pack(entry):  # the one piece of post-processing that depends on the values: the oneDNN / sgl pack
            layer, _, drop = entry
            with torch.no_grad():  # grad mode is per thread
                dispatch_cpu_unquantized_gemm(layer, remove_weight=drop)

        # Layers pack independently and the packing ops release the GIL: on this process's cores (vLLM binds
        # a worker to its own), largest first (BENCHMARKS.md, issue 12 item 3, session 10).
        layers = sorted(self.gemm.values(), key=lambda e: -e[1].numel())
        workers = min(len(layers), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        if workers <= 1:
            for entry in layers:
                pack(entry)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="m3jax-repack") as ex:
                list(ex.map(pack, layers))
        return set(loaded or ())


def _stale_packed_copy(x, weight, bias):
    raise RuntimeError("m3jax's in-place weight apply does not re-pack an input embedding for a GEMM (vLLM used "
                       "only the LM head's): this vLLM multiplies by the input embedding, so rl.generation.inplace "
                       "must re-pack it again (add it to the applier's GEMM layers)")


def covering_applier(model) -> tuple[InplaceApplier | None, str | None]:
    """(the applier, None) when it covers every layer of `model`, else (None, why not): an uncovered layer,
    or vLLM internals it reads (the reload layout records) missing on another platform."""
    try:
        applier = InplaceApplier(model)
    except Exception as e:  # noqa: BLE001 - a reason to keep reload_weights, not a failed engine start
        return None, f"no in-place applier ({type(e).__name__}: {e})"
    missing = applier.uncovered()
    return (None, f"layers not covered: {missing}") if missing else (applier, None)
