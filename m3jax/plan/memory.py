"""Analytic per-device memory of one training step (pure Python: no jax arrays are built).

Everything is derived from the model's parameter specs (`m3jax.model.decoder.layer_param_specs` /
`top_param_specs`: shape + logical axes) and from how `sharding.rules` maps each logical axis onto the
mesh (`logical_to_spec` with the mesh shape, so a row changed in the rules table changes the plan).

Notation: d hidden, H/KV/D heads, Hi/Di indexer heads/dim, E experts, k top-k, I/Id/Is expert/dense/
shared widths, V vocab, L layers; mesh sizes n_d (data), n_c (context), n_x (expert), n_t (tensor);
n_ep = product of the expert axes; micro-batch b = sequences per data-parallel rank (data x expert)
per forward/backward; S sequence length, S_l = S / n_c the local sequence; T_l = b * S_l tokens per
device; a = activation bytes (the param dtype: 2 for bf16, 4 for fp32).
"""

from __future__ import annotations

import dataclasses
import math

from m3jax.config import M3Config
from m3jax.model.specs import layer_param_specs, top_param_specs
from sharding.mesh import MeshConfig
from m3jax.plan.activations import head_terms, layer_phases
from m3jax.plan.remat import saved_residuals
from sharding import rules as rules_table
from sharding.rules import MESH_AXES, logical_to_spec, rules_for

GB = 1e9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    fp32: bool
    buffer: bool
    layers: int  # layers in its stack (1 for top-level params)
    kind: str  # "top", or "<attn>/<mlp>" of its stack


def param_table(cfg: M3Config) -> list[Param]:
    """Every parameter as the model stores it: top-level, then per stack with the leading "layers" axis."""
    out = [Param(n, s.shape, s.axes, s.fp32, s.buffer, 1, "top") for n, s in top_param_specs(cfg).items()]
    for attn, mlp, ids in cfg.segments():
        for n, s in layer_param_specs(cfg, attn, mlp).items():
            out.append(Param(f"{attn}/{mlp}/{n}", (len(ids), *s.shape), ("layers", *s.axes), s.fp32, s.buffer,
                             len(ids), f"{attn}/{mlp}"))
    return out


def mesh_sizes(mesh: MeshConfig) -> dict[str, int]:
    return dict(zip(MESH_AXES, mesh.shape))


def default_rules(mesh: MeshConfig):
    """The rules table with the experts on `mesh.expert_axes`, FSDP on `mesh.fsdp_axes` (`sharding.rules.rules_for`)."""
    return rules_for(mesh.expert_axes, mesh.fsdp_axes)


def shard_axes(p: Param, mesh: MeshConfig, rules=None) -> list[tuple[str, ...]]:
    """Mesh axes each dimension of p is split over (size-1 axes dropped), per `logical_to_spec`."""
    spec = logical_to_spec(p.axes, rules or default_rules(mesh), mesh_sizes(mesh))
    return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]


def local_elems(p: Param, mesh: MeshConfig, rules=None) -> int:
    """Elements of p on one device: prod_i ceil(shape_i / prod(sizes of the mesh axes of dim i))."""
    sizes = mesh_sizes(mesh)
    return math.prod(-(-dim // math.prod(sizes[a] for a in axes))
                     for dim, axes in zip(p.shape, shard_axes(p, mesh, rules)))


def param_bytes_each(p: Param, master: str) -> int:
    """Storage bytes per element: fp32 for master='none' and for fp32-kept params (router), else bf16."""
    return 4 if (master == "none" or p.fp32) else 2


def state_bytes(cfg: M3Config, mesh: MeshConfig, master: str = "fp32", moment_dtype: str = "float32",
                rules=None) -> dict[str, float]:
    """Per-device bytes of the train state, summed over parameters of their local element count n_loc:

        params            = n_loc * p        p = 4 (master 'none' or fp32-kept router) else 2
        master            = n_loc * 4  ('fp32');  n_loc * (2 if bf16 param else 4)  ('compact');  0  ('none')
        moments           = n_loc * 2 * m    m = 4 (float32) | 2 (bfloat16)   (Adam mu and nu)
        grad_accumulator  = n_loc * 4        fp32, carried over the micro-batches
        micro_gradient    = n_loc * p        one micro-batch's gradient (param dtype), during the backward
        buffers           = n_loc * 4        non-trainable (router correction bias), fp32
    With `mesh.fsdp_step_axes` the micro-batches read the step's copy (`step_copy_rules`) of n_copy elements:
        step_copy         = (n_copy - n_loc) * p    the copy, beside the state's own shards (backward peak only)
        micro_gradient    = n_copy * p        the gradient comes out on the copy's shards
    (BENCHMARKS.md issue 3 measured params+master+moments: 12 / 14 / 10 / 12 / 8 / 6 B per param.)
    """
    m = _DTYPE_BYTES[moment_dtype]
    copy_rules = step_copy_rules(mesh, rules)
    out = dict.fromkeys(("params", "master", "moments", "grad_accumulator", "micro_gradient", "buffers"), 0.0)
    if copy_rules is not None:
        out["step_copy"] = 0.0
    for p in param_table(cfg):
        n = local_elems(p, mesh, rules)
        if p.buffer:
            out["buffers"] += 4 * n
            continue
        pb = param_bytes_each(p, master)
        out["params"] += n * pb
        out["master"] += 0 if master == "none" else n * (4 if master == "fp32" or pb == 4 else 2)
        out["moments"] += n * 2 * m
        out["grad_accumulator"] += n * 4
        n_read = n if copy_rules is None else local_elems(p, mesh, copy_rules)
        out["micro_gradient"] += n_read * pb
        if copy_rules is not None:
            out["step_copy"] += (n_read - n) * pb
    return out


def step_copy_rules(mesh: MeshConfig, rules=None):
    """The rules of the step's copy of the weights (`sharding.layout.Layout.step_copy`), or None without one."""
    return rules_table.step_copy_rules(rules or default_rules(mesh), mesh.fsdp_step_axes, mesh_sizes(mesh))


# XLA:CPU's temporaries of the optimizer step (`sharding.optim_step`), bytes per element, the largest of
# four precision modes measured on an M3-shaped model (BENCHMARKS.md, scripts/bench_update_memory.py):
# leaves updated whole, and the largest layer slice of a sliced leaf.
UPDATE_BYTES_WHOLE, UPDATE_BYTES_SLICE = 12, 28


def update_temporaries(cfg: M3Config, mesh: MeshConfig, rules=None) -> float:
    """Temporaries of the in-place optimizer step (`sharding.optim_step`), per device:

        12 * (local elements of the leaves updated whole) + 28 * (local elements of the largest layer
        slice of a sliced leaf)
    A leaf is sliced when it belongs to a layer stack of >= 2 layers and has >= SLICE_MIN_ELEMS elements.
    """
    from sharding.optim_step import SLICE_MIN_ELEMS
    whole, largest = 0.0, 0.0
    for p in param_table(cfg):
        if p.buffer:
            continue
        n = local_elems(p, mesh, rules)
        if p.kind != "top" and p.layers >= 2 and math.prod(p.shape) >= SLICE_MIN_ELEMS:
            largest = max(largest, n / p.layers)
        else:
            whole += n
    return UPDATE_BYTES_WHOLE * whole + UPDATE_BYTES_SLICE * largest


def param_counts(cfg: M3Config) -> dict[str, int]:
    """Total parameters (trainable + buffers) and the experts' share."""
    total = sum(math.prod(p.shape) for p in param_table(cfg))
    experts = sum(math.prod(p.shape) for p in param_table(cfg) if p.name.endswith(("experts_gate_up", "experts_down")))
    return {"total": total, "experts": experts, "non_expert": total - experts}


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch's forward/backward as the model runs it.

    micro_batch: sequences per data-parallel rank (data x expert); num_micro: micro-batches per optimizer
    update; seq_len: tokens per sequence; remat, attention_query_chunk, attention_impl, moe_capacity_factor: the model
    options (`M3ForCausalLM`); moe_exchange: "padded" | "ragged", None = `platform`'s default
    (`sharding.expert.default_exchange`: padded on CPU, ragged on GPU); moe_kernel: the experts'
    grouped-matmul kernel (`sharding.grouped_matmul`), "auto" resolved for `platform` like the exchange and
    attention_impl; platform: where the batch runs ("gpu" for `m3jax.plan.job.Job.batch` and the compile
    check on compile-only GPUs), None = the planning process's default backend; ragged_dot: how XLA lowers
    the ragged_dot kernel: "dense" (rows zero-padded per local expert into one batched matmul: XLA's
    GPU default and the CPU reference) or "grouped" (a grouped-GEMM kernel that touches real rows only);
    sparse_attention: the sparse layers' attention, "gather" (the model's default: query tiles over the
    gathered top-K key blocks) or "masked" (they follow attention_impl with a block mask);
    logprob_chunk_tokens: positions per row of one logits block of the loss (`model.logprob_chunk_tokens`,
    `rl.logprobs.chunked_token_logprobs`), 0 = the whole sequence's logits at once (what `--compile`'s
    token cross-entropy step builds). remat_policy: what a rematerialised layer keeps for its backward
    (`model.remat_policy`, `m3jax.plan.remat`). logprob_entropy: the loss also computes the sampling
    distribution's entropy from its logits (`grpo.entropy_coef` > 0 or `logging.entropy`). scan_layers:
    `model.scan_layers`, passed to the model `--compile` builds; not modelled (unrolled layers do the same work).
    """
    micro_batch: int
    seq_len: int
    num_micro: int = 1
    remat: bool = True
    attention_query_chunk: int = 0
    attention_impl: str = "auto"
    moe_capacity_factor: float | None = None
    moe_exchange: str | None = None
    ragged_dot: str = "dense"
    moe_kernel: str = "auto"
    sparse_attention: str = "gather"
    logprob_chunk_tokens: int = 0
    remat_policy: str = "full"
    logprob_entropy: bool = False
    platform: str | None = None
    scan_layers: bool = True

    @property
    def exchange(self) -> str:
        from sharding.expert import default_exchange
        return self.moe_exchange or default_exchange(self.platform)

    @property
    def attention(self) -> str:
        """The full layers' attention as it runs over seq_len keys ("auto" resolved: cudnn on a GPU, else dense
        or flash)."""
        from m3jax.model.attention import resolve_impl
        return resolve_impl(self.attention_impl, self.seq_len, self.platform)

    @property
    def expert_matmul(self) -> str:
        """How the grouped expert matmuls execute: "tiled" (the tiled kernel: filled rows rounded up to
        tiles), "bucketed" (balanced buckets in one batched matmul), "grouped" for the Pallas and Mosaic kernels
        (real rows, the expert hidden held as under ragged_dot), else the ragged_dot lowering `ragged_dot` ("dense"
        or "grouped")."""
        kernel = self.expert_kernel
        return kernel if kernel in ("tiled", "bucketed") else "grouped" if kernel in ("pallas", "mosaic") \
            else self.ragged_dot

    @property
    def model_kernel(self) -> str:
        """The kernel this plan plans for `moe_kernel`. A kernel the trainer times at its start
        (`m3jax.model.expert_tuning`: "auto" off a CPU, "tune") is planned on a GPU as "tiled": there the trainer
        keeps the fastest of the kernels whose temporaries exceed tiled's by no more than the plan leaves free with
        tiled (tiled always among them), so tiled bounds its time and the device's memory bounds its peak. On a CPU,
        which reports no memory limit, "tune" is planned as "auto" (the measured rule)."""
        from m3jax.model.expert_tuning import needs_timing
        if self.platform == "gpu" and needs_timing(self.moe_kernel, self.platform):
            return "tiled"
        return "auto" if self.moe_kernel == "tune" else self.moe_kernel

    @property
    def expert_kernel(self) -> str:
        """`model_kernel` resolved for the platform (`sharding.grouped_matmul.resolve_kernel`)."""
        from sharding.grouped_matmul import resolve_kernel
        return resolve_kernel(self.model_kernel, self.platform)

    def model_options(self) -> dict:
        """M3ForCausalLM keywords of this batch's model options besides remat (sparse_attention only where the
        model takes that keyword)."""
        out = {"attention_query_chunk": self.attention_query_chunk, "attention_impl": self.attention_impl,
               "remat_policy": self.remat_policy, "scan_layers": self.scan_layers,
               "moe_capacity_factor": self.moe_capacity_factor, "moe_exchange": self.moe_exchange,
               "moe_kernel": self.model_kernel}
        import inspect

        from m3jax.model.decoder import M3ForCausalLM
        if "sparse_attention" in inspect.signature(M3ForCausalLM.__init__).parameters:
            out["sparse_attention"] = self.sparse_attention
        return out


def _shard_dims(mesh: MeshConfig, rules):
    return lambda name, spec: shard_axes(Param(name, spec.shape, spec.axes, spec.fp32, spec.buffer, 1, ""), mesh,
                                         rules)


def activation_bytes(cfg: M3Config, mesh: MeshConfig, batch: Batch, act_bytes: int = 2, rules=None
                     ) -> dict[str, float]:
    """Per-device activation memory at the peak of one micro-batch's forward + backward (the terms of the
    binding phase, `m3jax.plan.activations`):

        checkpoints   = L * T_l * d * a       each layer's input, saved by the scan (remat)
        saved_residuals   what each rematerialised layer keeps besides its input, all layers
                      (`m3jax.plan.remat.saved_residuals`; every policy: the gather sparse layers' block ids;
                      save_dots: the token-sized projection outputs;
                      save_dots_experts: and the routed experts' output rows, T_l * k * d * a per MoE layer)
        batch_inputs  = 3 arrays * num_micro * T_l * 4 B   (ids, targets, loss mask)
        + the larger of the worst layer's phases (`layer_phases`) and the head's (`head_terms`)
    Without remat every layer's forward residuals live (half of each phase's terms) beside the worst
    layer's cotangents.
    """
    sz = mesh_sizes(mesh)
    t_l = batch.micro_batch * (batch.seq_len // sz["context"])
    a, dims = act_bytes, _shard_dims(mesh, rules)
    kinds = {(attn, mlp): len(ids) for attn, mlp, ids in cfg.segments()}
    phases = {k: layer_phases(cfg, mesh, *k, batch, a, batch.exchange, dims) for k in kinds}
    out: dict[str, float] = {"checkpoints": cfg.num_hidden_layers * t_l * cfg.hidden_size * a if batch.remat else 0.0,
                             "batch_inputs": 3 * batch.num_micro * t_l * 4}
    if batch.remat:
        out["saved_residuals"] = saved_residuals(cfg, t_l, sz["tensor"], a, batch.remat_policy,
                                                 batch.sparse_attention)
    candidates = [terms for ph in phases.values() for terms in ph.values()]
    candidates.append(head_terms(cfg, mesh, batch.micro_batch, batch.seq_len, a, dims, batch.logprob_chunk_tokens,
                                 batch.logprob_entropy))
    worst = max(candidates, key=lambda t: sum(t.values()))
    if not batch.remat:
        for k, n in kinds.items():
            out["layer_residuals"] = out.get("layer_residuals", 0.0) + n * max(
                sum(t.values()) for t in phases[k].values()) / 2
    out.update(worst)
    return out


def memory_phases(cfg: M3Config, mesh: MeshConfig, batch: Batch, master: str = "fp32",
                  moment_dtype: str = "float32", rules=None, act_bytes: int | None = None,
                  reference: str | None = None, generator_copy: bool = False) -> dict[str, dict[str, float]]:
    """Per-device terms (bytes) of the peaks of a step, each with its 'total':

        backward  the train state with one micro-batch's gradient + `activation_bytes`
        update    the train state without it + `update_temporaries` (the optimizer step)
    Activations are in the param dtype (bf16 unless master='none'); act_bytes overrides that (4 for
    XLA:CPU, which computes bf16 arithmetic in fp32 and so holds fp32-sized activations).
    `reference`: where the KL's reference policy (`grpo.kl` set; a copy of the params, cut as they are) lives
    between its passes (`grpo.reference_memory`): "device" puts the copy in both peaks; "host" (pinned host
    memory, `rl.reference`) in neither, but adds the reference pass's peak:
        reference_pass  the train state without gradients + the copy on the devices + its step copy
                        + `activation_bytes` (an upper bound: a forward keeps no checkpoints or residuals)
    `generator_copy`: the JAX engine keeps its own copy of the params while a draw ahead decodes beside the train
    step (`grpo.max_trajectory_age_steps` with `generation.backend: jax`): one more params term in every peak (the
    draw's KV cache is not counted)."""
    a = act_bytes or (4 if master == "none" else 2)
    state = state_bytes(cfg, mesh, master, moment_dtype, rules)
    acts = {f"act:{k}": v for k, v in activation_bytes(cfg, mesh, batch, a, rules).items()}
    backward = {**state, **acts}
    update = {**{k: v for k, v in state.items() if k not in ("micro_gradient", "step_copy")},
              "update_temporaries": update_temporaries(cfg, mesh, rules)}
    phases = {"backward": backward, "update": update}
    if reference == "device":
        backward["reference_params"] = update["reference_params"] = state["params"]
    elif reference == "host":
        phases["reference_pass"] = {**{k: v for k, v in state.items()
                                       if k not in ("micro_gradient", "grad_accumulator")},
                                    "reference_params": state["params"], **acts}
    elif reference is not None:
        raise ValueError(f"reference = {reference!r}: expected None, 'device' or 'host'")
    if generator_copy:
        for terms in phases.values():
            terms["generator_params"] = state["params"]
    for terms in phases.values():
        terms["total"] = sum(terms.values())
    return phases


def memory_plan(cfg: M3Config, mesh: MeshConfig, batch: Batch, master: str = "fp32",
                moment_dtype: str = "float32", rules=None, act_bytes: int | None = None) -> dict[str, float]:
    """The terms of the largest of the step's peaks (`memory_phases`); they sum to 'total'."""
    phases = memory_phases(cfg, mesh, batch, master, moment_dtype, rules, act_bytes)
    return max(phases.values(), key=lambda t: t["total"])
