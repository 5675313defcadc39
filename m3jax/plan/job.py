"""The planner's job for a run and its plan: what `python -m m3jax.plan` prints, and what the trainer asks before it
builds (`fit_warning`, `planned_peak`). The command (`m3jax.plan.__main__`) prints, sweeps and compiles."""

from __future__ import annotations

import dataclasses

from m3jax.plan.activations import logprob_blocks
from m3jax.plan.flops import Hardware, comm_bytes, context_imbalance, expert_recompute, expert_rows_factor, \
    step_flops, step_time
from m3jax.plan.memory import GB, Batch, memory_phases
from m3jax.model.specs import SPARSE_ATTENTION
from m3jax.plan.models import m3_release
from sharding.expert import receive_rows
from sharding.mesh import JAX_DEFAULT_MEMORY_FRACTION, MeshConfig, MeshError, row_positions, validate

DEFAULT_DEVICE_GB = 80.0  # an H100's memory: the planner's device when neither the config nor --device-memory-gb names one


@dataclasses.dataclass(frozen=True)
class Job:
    model: object  # M3Config
    mesh: MeshConfig
    seq_len: int
    seqs_per_update: int
    updates: int
    micro_batch: int
    master: str
    moment_dtype: str
    remat: bool
    # M3ForCausalLM keywords besides remat (attention_query_chunk, moe_capacity_factor): what --compile
    # and --check-shardings build, as the trainer would.
    model_options: dict = dataclasses.field(default_factory=dict)
    ragged_dot: str = "dense"  # how the GPU's XLA lowers the grouped expert matmuls (m3jax.plan.memory.Batch)
    # model.sparse_attention where model_options does not carry it (m3jax.plan.memory.Batch); model_options wins
    sparse_attention: str = "gather"
    logprob_chunk_tokens: int = 0  # model.logprob_chunk_tokens: the loss's logits block (not a model option)
    entropy: bool = False  # the loss computes the sampling entropy (LossConfig.needs_entropy or logging.entropy)
    memory_fraction: float = JAX_DEFAULT_MEMORY_FRACTION  # mesh.device_memory_fraction: JAX's share of a device
    device_memory_gb: float = DEFAULT_DEVICE_GB  # mesh.device_memory_gb: each GPU's memory
    # prompt + response slots of a row (generation.max_seq_len); seq_len is then the trainer's positions on the
    # mesh (`sharding.mesh.row_positions`), recomputed for every mesh the sweep tries. None: seq_len as given.
    slots: int | None = None
    # forwards before the update: logp_old (grpo.old_logprobs: pass), and logp_ref when the loss has a KL term
    logprob_passes: int = 1
    # where the KL's reference policy lives between its passes (grpo.reference_memory); None: no KL term
    reference: str | None = None
    # the JAX engine's own copy of the params, which a draw ahead decodes with beside the train step
    generator_copy: bool = False
    # model.indexer_loss_coef > 0: the loss runs the indexer alignment's full-attention pass (not planned: a note)
    indexer_alignment: bool = False

    def on_mesh(self, mesh: MeshConfig, micro_batch: int) -> "Job":
        """This job on another mesh and micro-batch, with the positions the trainer would run there."""
        seq_len = self.seq_len if self.slots is None else row_positions(self.slots, mesh, self.model)
        return dataclasses.replace(self, mesh=mesh, micro_batch=micro_batch, seq_len=seq_len)

    @property
    def num_micro(self) -> int:
        return self.seqs_per_update // (self.micro_batch * self.mesh.data * self.mesh.expert)

    @property
    def batch(self) -> Batch:
        """The micro-batch as a GPU runs it: the ragged expert exchange unless the options say otherwise."""
        return Batch(self.micro_batch, self.seq_len, max(self.num_micro, 1), self.remat,
                     ragged_dot=self.ragged_dot, logprob_chunk_tokens=self.logprob_chunk_tokens,
                     logprob_entropy=self.entropy, platform="gpu",
                     **{"moe_exchange": "ragged", "sparse_attention": self.sparse_attention, **self.model_options})


def load_job(path: str, overrides: list[str], model: str | None) -> Job:
    return job_of(*load_run_config(path, overrides, model))


def job_of(cfg, m3) -> Job:
    """The planner's job for a run config (`rl.config.RunConfig`) and the model it trains (an M3Config)."""
    g = cfg.grpo
    mesh = cfg.mesh.to_mesh_config()
    slots = cfg.generation.max_seq_len
    return Job(m3, mesh, row_positions(slots, mesh, m3), g.sequences_per_step // g.updates_per_step,
               g.updates_per_step, g.micro_batch_size, cfg.precision.master, cfg.precision.moment_dtype,
               cfg.model.remat, {k: v for k, v in cfg.model.model_options().items() if k != "remat"},
               sparse_attention=getattr(cfg.model, "sparse_attention", "gather"),
               logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
               entropy=g.loss_config().needs_entropy or cfg.logging.entropy,
               memory_fraction=cfg.mesh.device_memory_fraction or JAX_DEFAULT_MEMORY_FRACTION, slots=slots,
               device_memory_gb=cfg.mesh.device_memory_gb or DEFAULT_DEVICE_GB,
               logprob_passes=(g.old_logprobs == "pass") + (g.kl != "none"),
               reference=None if g.kl == "none" else g.reference_memory,
               generator_copy=cfg.generation.backend == "jax" and g.max_trajectory_age_steps > 0,
               indexer_alignment=cfg.model.indexer_loss_coef > 0)


def load_run_config(path: str, overrides: list[str], model: str | None):
    """(the run config, the M3Config to plan): files the planner never reads may be left required (???), and
    model "release" (or a recipe whose model.path is left required) plans the released model."""
    from rl.config.build import from_dict
    from rl.config.errors import ConfigError
    from rl.config.yaml_io import apply_overrides, load_tree
    sources: dict = {}
    tree = load_tree(path, [], sources)
    apply_overrides(tree, list(overrides), sources)
    # a section that is missing or not a mapping is left as it is, for from_dict's error naming it (a KeyError
    # or AttributeError traceback before)
    sections = {name: tree[name] if isinstance(tree.get(name), dict) else None for name in ("model", "data", "eval")}
    if sections["model"] is None and model == "release" and "model" not in tree:
        sections["model"] = tree["model"] = {}
    if model == "config" and sections["model"] is not None and sections["model"].get("path") == "???":
        # it planned the released model, saying nothing of it
        raise ConfigError("--model config: this config's model.path is left required (???), so its model is not "
                          "known; give model.path=DIR (an HF model directory), or --model release")
    if sections["model"] is not None and (model == "release" or sections["model"].get("path") == "???"):
        sections["model"]["path"], sections["model"]["tiny"] = "unused-by-the-planner", None
    for section in ("data", "eval"):  # the planner reads neither file
        if sections[section] is not None and sections[section].get("path") == "???":
            sections[section]["path"] = "unused-by-the-planner"
    cfg = from_dict(tree, sources=sources)
    m3 = m3_release() if model == "release" or cfg.model.path == "unused-by-the-planner" else cfg.model.m3_config()
    return cfg, m3


def indexer_alignment_flops(job: Job) -> float:
    """FLOPs a step spends on the indexer alignment (`m3jax.model.indexer_align`, model.indexer_loss_coef > 0), all
    fp32 at HIGHEST precision: per sequence and sparse layer its full attention's scores over every key (not only
    the causal ones; 2 H D S S_k) run forward and again in the checkpointed backward, and the indexer's scores
    (2 Hi Di S S_k) forward, recomputed and differentiated: 4 H D S^2 + 6 Hi Di S^2 with S_k = S."""
    m, s = job.model, job.seq_len
    sparse = sum(t == SPARSE_ATTENTION for t in m.layer_types)
    per = 4 * m.num_attention_heads * m.head_dim * s * s + 6 * m.index_n_heads * m.index_head_dim * s * s
    return float(per * sparse * job.seqs_per_update * job.updates)


def invalid_reason(job: Job) -> str | None:
    """Why a mesh cannot run this job (MeshError text or a planner rule), or None."""
    try:
        validate(job.mesh, job.model, seq_len=job.seq_len)
    except MeshError as e:
        return str(e)
    ranks = job.mesh.data * job.mesh.expert
    if job.seqs_per_update % (job.micro_batch * ranks):
        return (f"sequences per update {job.seqs_per_update} not divisible by micro-batch {job.micro_batch} x "
                f"data x expert {ranks}")
    return None


def plan(job: Job, hw: Hardware) -> dict:
    b = job.batch
    phases = memory_phases(job.model, job.mesh, b, job.master, job.moment_dtype, reference=job.reference,
                           generator_copy=job.generator_copy)
    s_l = job.seq_len // job.mesh.context
    fl = step_flops(job.model, job.seqs_per_update * job.updates, job.seq_len, job.remat,
                    query_chunked=0 < b.attention_query_chunk < s_l,
                    expert_rows=expert_rows_factor(job.model, job.mesh, b), expert_recompute=expert_recompute(b),
                    attention=b.attention, sparse_attention=b.sparse_attention,
                    remat_policy=b.remat_policy, expert_matmul=b.expert_matmul)
    n_ep = job.mesh.expert_parallel
    sent = None if b.exchange == "ragged" else receive_rows(
        job.micro_batch * s_l, job.model.num_experts_per_tok, n_ep, job.model.num_local_experts // n_ep,
        b.moe_capacity_factor, b.exchange)
    head_blocks = logprob_blocks(job.seq_len, job.logprob_chunk_tokens)
    comm = comm_bytes(job.model, job.mesh, job.micro_batch, job.seq_len, job.batch.num_micro * job.updates,
                      job.master, job.remat, sent_rows=sent, head_blocks=head_blocks, remat_policy=b.remat_policy)
    # the step waits for the busiest context shard: with contiguous shards it holds more of the full layers' flash
    skew = context_imbalance(job.mesh) - 1.0
    st = step_time((fl["executed_total"] + skew * fl["full_flash_executed"]) / job.mesh.num_devices, comm, job.mesh,
                   hw)
    # the logprob pass(es) before the update: a forward over the step's sequences, micro-batch by micro-batch
    fwd_comm = comm_bytes(job.model, job.mesh, job.micro_batch, job.seq_len, job.batch.num_micro * job.updates,
                          job.master, job.remat, sent_rows=sent, backward=False)
    fwd = step_time((fl["forward_executed"] + skew * fl["full_flash_forward"]) / job.mesh.num_devices, fwd_comm,
                    job.mesh, hw)
    fwd = {k: v * job.logprob_passes for k, v in fwd.items() if k != "comm_share"}
    if job.reference == "host":  # the reference comes onto the devices for its pass, over each GPU's PCIe link
        fwd["reference_to_device_s"] = phases["reference_pass"]["reference_params"] / hw.pcie_bw
        fwd["total_s"] += fwd["reference_to_device_s"]
    binding = max(phases, key=lambda k: phases[k]["total"])
    return {"memory": phases[binding], "binding": binding, "phases": phases, "flops": fl, "comm": comm,
            "time": st, "logprob_pass": {"comm": fwd_comm, "time": fwd}}


def planned_peak(cfg, m3, moe_kernel: str | None = None, hw: Hardware = Hardware()) -> float:
    """The plan's peak bytes per device for this run (`job_of`), with `moe_kernel` in place of the config's when
    given (the trainer asks for the tiled kernel's: what a timed kernel's temporaries are weighed against)."""
    job = job_of(cfg, m3)
    if moe_kernel is not None:
        job = dataclasses.replace(job, model_options={**job.model_options, "moe_kernel": moe_kernel})
    return plan(job, hw)["memory"]["total"]


def fit_warning(cfg, m3, limit_bytes: float, hw: Hardware = Hardware()) -> str | None:
    """A warning when the plan of this run (`job_of`) needs more per device than `limit_bytes` (what JAX may use of
    a device: its `memory_stats()["bytes_limit"]`), or None: said before the first compile, where an OOM would
    otherwise come after minutes of it. The plan is analytic (within 30 % of XLA's on CPU), so a warning only."""
    p = plan(job_of(cfg, m3), hw)
    need = p["memory"]["total"]
    if need <= limit_bytes:
        return None
    largest = sorted(((v, k) for k, v in p["memory"].items() if k != "total"), reverse=True)[:3]
    return (f"the plan of this run needs {need / GB:.2f} GB per device at its {p['binding'].replace('_', ' ')} peak, more "
            f"than the {limit_bytes / GB:.2f} GB JAX may use of it (largest terms: "
            + ", ".join(f"{k} {v / GB:.2f} GB" for v, k in largest)
            + "); it may run out of device memory. `python -m m3jax.plan --config <this config>` shows the plan "
            "(analytic), mesh.device_memory_fraction what JAX takes")
