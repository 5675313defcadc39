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

from m3jax.config import MOE_MLP, SPARSE_ATTENTION, M3Config
from m3jax.model.decoder import layer_param_specs, top_param_specs
from sharding.mesh import MeshConfig
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
    """The rules table with the experts on `mesh.expert_axes` (`sharding.rules.rules_for`)."""
    return rules_for(mesh.expert_axes)


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

        params    = n_loc * p            p = 4 (master 'none' or fp32-kept router) else 2
        master    = n_loc * 4  ('fp32');  n_loc * (2 if bf16 param else 4)  ('compact');  0  ('none')
        moments   = n_loc * 2 * m        m = 4 (float32) | 2 (bfloat16)   (Adam mu and nu)
        gradients = n_loc * (4 + p)      the fp32 accumulator carried over micro-batches + one
                                         micro-batch's gradient in the param dtype
        buffers   = n_loc * 4            non-trainable (router correction bias), fp32
    (BENCHMARKS.md issue 3 measured params+master+moments: 12 / 14 / 10 / 12 / 8 / 6 B per param.)
    """
    m = _DTYPE_BYTES[moment_dtype]
    out = dict.fromkeys(("params", "master", "moments", "gradients", "buffers"), 0.0)
    for p in param_table(cfg):
        n = local_elems(p, mesh, rules)
        if p.buffer:
            out["buffers"] += 4 * n
            continue
        pb = param_bytes_each(p, master)
        out["params"] += n * pb
        out["master"] += 0 if master == "none" else n * (4 if master == "fp32" or pb == 4 else 2)
        out["moments"] += n * 2 * m
        out["gradients"] += n * (4 + pb)
    return out


def param_counts(cfg: M3Config) -> dict[str, int]:
    """Total parameters (trainable + buffers) and the experts' share."""
    total = sum(math.prod(p.shape) for p in param_table(cfg))
    experts = sum(math.prod(p.shape) for p in param_table(cfg) if p.name.endswith(("experts_gate_up", "experts_down")))
    return {"total": total, "experts": experts, "non_expert": total - experts}


@dataclasses.dataclass(frozen=True)
class Batch:
    """micro_batch: sequences per data-parallel rank (data x expert) per forward/backward;
    num_micro: micro-batches per optimizer update; seq_len: tokens per sequence."""
    micro_batch: int
    seq_len: int
    num_micro: int = 1
    remat: bool = True


def _layer_working_set(cfg: M3Config, mesh: MeshConfig, attn: str, mlp: str, b: int, s: int, a: int,
                       rules=None) -> dict[str, float]:
    """Bytes one layer holds at its peak, per device: the backward of a rematerialised layer holds the
    recomputed forward intermediates and their cotangents (same shapes), hence the factor 2:

        attention scores  2 * b * H/n_t * S_l * S * (3*4 + a + mk)   three fp32 [S_l, S] tensors per head (logits,
                          masked logits, softmax), the probabilities in a, and mk = 1 for the per-head bool
                          token mask of sparse layers (full layers: a [b,1,S_l,S] mask, negligible). The model
                          materialises the full [S_l, S] block per head (no flash attention): masked, not skipped
        gathered K/V      2 * 2 * b * S * KV/n_t * D * a   (context all-gather of keys and values, + cotangents)
        indexer           2 * b * Hi * S_l * S * 4          fp32 scores and their block-padded copy (sparse layers)
        MoE dispatch      2 * 6 * n_ep * cap * d * a,  cap = T_l * min(k, E / n_ep): the padded worst case of the
                          send, receive, regrouped, expert-output, return-send and return-receive buffers
        expert hidden     2 * n_ep * cap * 3 * I / n_t * a  (gate_up output and activation of the received rows)
        token rows        2 * T_l * k * d * (2a + 4)   the routed copies of the tokens, their outputs, fp32 weighted
        MLP hidden        2 * T_l * 3 * W / n_t * a  (W = Id, dense, or Is, shared expert)
        gathered weights  2 * (this layer's non-expert weights with the data (FSDP) shard undone) * p
                          (the weights and their gradient before the reduce-scatter)
    """
    sz = mesh_sizes(mesh)
    nt, nc = sz["tensor"], sz["context"]
    s_l = s // nc
    t_l = b * s_l
    h, kv, dd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    sparse, moe = attn == SPARSE_ATTENTION, mlp == MOE_MLP
    ws = {"attention_scores": 2 * b * (h / nt) * s_l * s * (12 + a + (1 if sparse else 0)),
          "gathered_kv": 2 * 2 * b * s * (kv / nt) * dd * a,
          "indexer_scores": 2 * b * cfg.index_n_heads * s_l * s * 8 if sparse else 0.0}
    if moe:
        n_ep = mesh.expert_parallel
        k = cfg.num_experts_per_tok
        cap = t_l * min(k, cfg.num_local_experts // n_ep)
        ws["moe_dispatch"] = 2 * 6 * n_ep * cap * d * a
        ws["expert_hidden"] = 2 * n_ep * cap * 3 * cfg.intermediate_size / nt * a
        ws["token_rows"] = 2 * t_l * k * d * (2 * a + 4)
        ws["mlp_hidden"] = 2 * t_l * 3 * cfg.shared_intermediate_size / nt * a
    else:
        ws["mlp_hidden"] = 2 * t_l * 3 * cfg.dense_intermediate_size / nt * a
    gathered = 0.0
    for name, spec in layer_param_specs(cfg, attn, mlp).items():
        if name.startswith("experts_"):
            continue
        p = Param(name, spec.shape, spec.axes, spec.fp32, spec.buffer, 1, "")
        dims = shard_axes(p, mesh, rules)
        n = math.prod(-(-dim // math.prod(sz[x] for x in axes if x != "data")) for dim, axes in zip(spec.shape, dims))
        gathered += n * (4 if spec.fp32 else a)
    ws["gathered_weights"] = 2 * gathered
    return ws


def activation_bytes(cfg: M3Config, mesh: MeshConfig, batch: Batch, act_bytes: int = 2, rules=None
                     ) -> dict[str, float]:
    """Per-device activation memory of one micro-batch's forward + backward:

        with remat:    checkpoints = L * T_l * d * a     (each layer's input, saved by the scan)
                       layer       = max over layer kinds of the working set (`_layer_working_set`)
        without remat: layer       = sum over layers of the working set (every layer's intermediates live)
        head           = T_l * V/n_t * (a + 4 + 4)   logits, fp32 log-softmax and its gradient
        batch inputs   = 4 arrays * num_micro * T_l * 4 B   (ids, targets, mask, attention mask; int32/f32)
    """
    sz = mesh_sizes(mesh)
    s_l = batch.seq_len // sz["context"]
    t_l = batch.micro_batch * s_l
    a = act_bytes
    kinds = {(attn, mlp): len(ids) for attn, mlp, ids in cfg.segments()}
    per_kind = {k: _layer_working_set(cfg, mesh, *k, batch.micro_batch, batch.seq_len, a, rules) for k in kinds}
    out: dict[str, float] = {}
    if batch.remat:
        out["checkpoints"] = cfg.num_hidden_layers * t_l * cfg.hidden_size * a
        worst = max(per_kind, key=lambda k: sum(per_kind[k].values()))
        for name, v in per_kind[worst].items():
            out[name] = v
    else:
        for k, n in kinds.items():
            for name, v in per_kind[k].items():
                out[name] = out.get(name, 0.0) + n * v
    out["head"] = t_l * (cfg.vocab_size / sz["tensor"]) * (a + 8)
    out["batch_inputs"] = 4 * batch.num_micro * t_l * 4
    return out


def memory_plan(cfg: M3Config, mesh: MeshConfig, batch: Batch, master: str = "fp32",
                moment_dtype: str = "float32", rules=None) -> dict[str, float]:
    """All per-device terms (bytes): the train state (`state_bytes`) + activations (`activation_bytes`),
    with 'total' their sum. Activations are in the param dtype (bf16 unless master='none')."""
    a = 4 if master == "none" else 2
    out = {**state_bytes(cfg, mesh, master, moment_dtype, rules),
           **{f"act:{k}": v for k, v in activation_bytes(cfg, mesh, batch, a, rules).items()}}
    out["total"] = sum(out.values())
    return out
