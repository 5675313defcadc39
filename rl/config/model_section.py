"""The `model` section of a run config: the policy model (a Hugging Face directory, or a random model's M3Config
fields or preset) and the options it is built with.

Declared like the sections of `rl.config.schema` (`_f`); `model.tiny` is checked against M3Config by
`rl.config.validate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl.config.schema import MAX_SEED, _f, _Section


@dataclasses.dataclass(frozen=True)
class ModelSection(_Section):
    path: str | None = _f(None, "local Hugging Face model directory (either M3 layout); exclusive with tiny",
                          allowed="a local Hugging Face model directory, or null when model.tiny is set")
    tiny: dict[str, Any] | None = _f(None, "M3Config fields of a randomly initialised model, or {preset: release, "
                                           "...}: the released model's shapes (m3jax.presets; the keys beside it, and "
                                           "later ones, replace its fields; a num_hidden_layers gives its layer "
                                           "pattern at that depth to the layer lists not given; it replaces "
                                           "whatever model.tiny held before it, inherited or set by an earlier "
                                           "override, so give fields after it), written out in full when the "
                                           "config loads; exclusive with path",
                                     allowed="a mapping of M3Config fields, or {preset: release} with any of them")
    init_seed: int = _f(0, "seed of the random initialisation of a tiny model", min=0, max=MAX_SEED)
    remat: bool = _f(False, "activation checkpointing (recompute each layer in the backward pass)")
    # m3jax.model.remat.REMAT_POLICIES, listed here so that the schema needs no jax
    remat_policy: str = _f("full", "with remat, what each layer keeps for its backward: full (its input and "
                                   "its integer decisions, the indexer's block ids and the expert routing; the rest "
                                   "of the forward runs again), save_dots (also the token-sized projection "
                                   "outputs: q/k/v/o, indexer, router, shared-expert and dense-MLP gate/up; the "
                                   "backward then recomputes only norms, attention cores, dispatch and the "
                                   "routed experts) or save_dots_experts (also the routed experts' output rows, "
                                   "T * k * d per MoE layer, so their forward does not run again)",
                        choices=("full", "save_dots", "save_dots_experts"))
    scan_layers: bool = _f(True, "run each stack of same-kind layers as one loop over its stacked weights (compile "
                                 "time independent of depth); false = unrolled, one copy per layer (for "
                                 "shallow models on CPU a faster step without remat, a slower one with it; compile "
                                 "time grows with depth; same values)")
    attention_query_chunk: int = _f(0, "local queries per attention-scores block (a rematerialised scan): "
                                       "[chunk, S] scores live instead of [S_local, S]; 0 = all at once", min=0)
    # m3jax.model.attention.IMPLS, listed here so that the schema needs no jax
    attention_impl: str = _f("auto", "attention computation: dense (masked [chunk, S] scores blocks), flash "
                                     "(online softmax over key tiles, no scores block; attention_query_chunk is "
                                     "then unused), cudnn (full layers on cuDNN's fused attention where it "
                                     "applies: GPU, 16-bit, no decode cache or context sharding; else as auto "
                                     "off a GPU) or auto (cudnn on a GPU; elsewhere flash from 512 keys on, "
                                     "dense below and for decode steps)",
                             choices=("auto", "dense", "flash", "cudnn"))
    # m3jax.model.attention.SPARSE_IMPLS
    sparse_attention: str = _f("gather", "sparse (indexer) layers: gather (each query multiplies only the key "
                                         "blocks the indexer kept, a scan over query tiles), paged (gather, "
                                         "with passes that take no gradient on jax's Pallas paged-attention "
                                         "kernel on a GPU; not yet run on one) or masked (the selection as a mask "
                                         "on attention_impl's full attention: the reference)",
                               choices=("gather", "masked", "paged"))
    # Not an M3ForCausalLM option (the model returns hidden states or logits): the logprob pass and the
    # loss read it (rl.policy), so it stays out of model_options.
    logprob_chunk_tokens: int = _f(1024, "positions of each row whose [.., vocab] logits are computed at once "
                                         "by the logprob pass and the loss (a rematerialised loop over blocks; "
                                         "same values and gradients); 0 = the whole sequence's logits at once. "
                                         "A row's positions, spread over mesh.context: each block costs a device "
                                         "its whole [V, d] head gradient in fp32, so on a context mesh one block "
                                         "per row is often cheaper (python -m m3jax.plan shows both)",
                                   min=0)
    # Read by the loss (rl.policy), not an M3ForCausalLM option.
    indexer_loss_coef: float = _f(0.0, "weight of the indexer alignment KL (the full attention's block distribution "
                                       "-> the indexer's softmax over blocks, m3jax.model.indexer_align) added to "
                                       "the loss per response token; trains only the indexer; 0 = off (the "
                                       "indexer stays frozen)", min=0)
    moe_capacity_factor: float | None = _f(None, "bound on each device's expert receive buffer, x the balanced "
                                                 "load (tokens x top_k), one device included; overflowing (token, "
                                                 "expert) pairs are dropped, padding takes no capacity; generation "
                                                 "(a decode step, vLLM) stays dropless, so a drop is also a "
                                                 "train/inference mismatch; null = dropless (worst-case buffers)",
                                           gt=0)
    # sharding.grouped_matmul.KERNELS and "tune" (m3jax.model.expert_tuning), listed here so that the schema
    # needs no jax
    moe_kernel: str = _f("auto", "grouped matmul of the routed experts: tiled (walks only the filled rows of the "
                                 "receive buffer), bucketed (each expert's balanced share of rows in one batched "
                                 "matmul, the rest through the tiled walk), ragged_dot (jax.lax.ragged_dot: dense "
                                 "lowering on CPU and jaxlib 0.10 CUDA), pallas (a Pallas/Triton grouped GEMM for "
                                 "GPUs that stops at the filled rows; interpreted, slowly, elsewhere), mosaic "
                                 "(jax's Mosaic GPU ragged-dot kernels: Hopper GPUs, bf16 / fp16, widths multiples "
                                 "of 128; refused elsewhere), auto (bucketed on CPU; elsewhere the fastest of "
                                 "the kernels the device runs whose temporaries fit what the run's plan leaves "
                                 "free with tiled, timed at the run's micro-batch shapes when the trainer starts "
                                 "and recorded in <run.out_dir>/moe_kernel.json, which a restart "
                                 "reuses), tune (that timing on CPU too)",
                         choices=("auto", "tune", "ragged_dot", "tiled", "bucketed", "pallas", "mosaic"))

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.tiny, dict) and "preset" in self.tiny:
            from m3jax.presets import PresetError, expand_preset
            try:
                object.__setattr__(self, "tiny", expand_preset(self.tiny))
            except PresetError:
                pass  # kept as given: the validator reports it under model.tiny.preset

    def model_options(self) -> dict[str, Any]:
        """Keyword options of `M3ForCausalLM` / `m3jax.from_pretrained` this section sets."""
        return {"remat": self.remat, "remat_policy": self.remat_policy, "scan_layers": self.scan_layers,
                "attention_query_chunk": self.attention_query_chunk,
                "attention_impl": self.attention_impl, "sparse_attention": self.sparse_attention,
                "moe_capacity_factor": self.moe_capacity_factor,
                "moe_kernel": self.moe_kernel}

    def m3_config(self):
        """The model's M3Config (tiny: built from the fields; path: read from its config.json)."""
        from m3jax.config import M3Config
        if self.tiny is not None:
            return M3Config(**self.tiny)
        return M3Config.from_pretrained(self.path)
