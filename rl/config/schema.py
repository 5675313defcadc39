"""The sections of a run config: frozen dataclasses whose fields declare default, doc and constraints.

`_f` declares a field (its rules are listed in the `rl.config` docstring); `_Section` normalises values
after construction; `RunConfig` validates itself on construction (`rl.config.validate`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import math
import os
import re
import typing
from typing import Any

from rl.config.errors import ConfigError
from rl.config.fields import _hints, _non_none

MISSING = "???"  # a value the user must supply (e.g. the recipe's model.path); an error if left as is

# Mirrors of names defined in modules that import jax (kept here so that loading a config stays light);
# tests/test_run_config.py checks they stay equal to the originals.
TOKEN_AXES = ("data", "context", "expert")                     # sharding.rules.TOKEN_AXES
PRECISION_MODES = ("none", "fp32", "compact")                  # sharding.precision.MODES
DATA_TASKS = ("reverse", "copy", "sort", "addmod")             # rl.tasks.TASKS
TASK_REWARDS = {"reverse": "reverse_digits", "copy": "copy_digits",  # each task's own reward (rl.tasks: .reward)
                "sort": "sort_digits", "addmod": "exact_digits"}
DATA_FORMATS = ("auto", "jsonl", "json", "parquet")            # rl.data.FileFormat
DATA_LAYOUTS = ("auto", "dapo", "gsm8k", "plain")              # rl.data.Layout
OVERLONG_PROMPTS = ("error", "drop")                           # rl.prompt_lengths.OVERLONG_PROMPTS
DIGIT_VOCAB = 16                                               # rl.tasks.DigitTokenizer.vocab_size
LOG_LEVELS = ("info", "debug")                                 # rl.logs.LEVELS
WEIGHT_TRANSPORTS = ("ray", "shm", "collective")                 # rl.generation.transfer.TRANSPORTS
WEIGHT_GROUP_DEVICES = ("auto", "cpu", "cuda")                # rl.generation.bucket_sender.GROUP_DEVICES
VLLM_EXECUTORS = ("auto", "mp", "ray")                         # rl.generation.vllm_ray.EXECUTORS
DELETED_CHECKPOINTS = "deleted"                                # rl.checkpoint.DELETED (old steps being removed)
# rl.generation.base.sampling_logits divides fp32 logits by the temperature: below ~1e-37 even a logit of 10
# overflows and every log-prob is NaN; 1e-30 leaves logits up to 3e8 finite
MIN_TEMPERATURE = 1e-30


def _f(default: Any, doc: str, **rules: Any) -> Any:
    """A config field: its default, one line of documentation and its constraints (`rl.config` docstring)."""
    meta = {"doc": doc, **rules}
    if isinstance(default, type):  # a section: built when needed
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hhmm_or_seconds(v: Any) -> str | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return None if math.isfinite(v) and v > 0 else "must be a finite number of seconds > 0"
    if isinstance(v, str) and re.fullmatch(r"([01]?\d|2[0-3]):[0-5]\d", v):
        return None
    return "not a number of seconds > 0 nor a 24-hour clock time HH:MM"


MAX_SEED = 2 ** 63 - 1  # jax's keys and numpy's generators take a signed 64-bit seed
# A watchdog's wait must fit the platform's timer (threading.TIMEOUT_MAX, ~1.5e8 minutes): past it the watchdog's
# thread died with an OverflowError and the run went on unwatched. 1e6 minutes is about two years.
MAX_WATCH_MINUTES = 1e6


def _not_empty(v: str) -> str | None:
    """An empty text was taken as unset (`if value:`) where null is the way to say it, so a W&B project "" opened no
    run and the warnings named null."""
    return None if v.strip() else "must not be empty (null leaves it unset)"


def _out_dir_ok(v: Any) -> str | None:
    if "${" in v:
        return "has an unknown substitution (only ${name} is replaced)"
    if "\0" in v:  # os.makedirs raised "embedded null byte" after the config had passed
        return "holds a NUL byte"
    return None if v.strip() else "must not be empty"


def _as_float(v: int) -> float:
    """float(v); an int past float's range is inf, which the checks refuse as not finite (float() raised an
    OverflowError traceback from the loader)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Section:
    """Normalises values after construction: list -> tuple for tuple fields, int -> float for float fields (and
    for fields that take a float among other types, an int beyond float's range -> inf)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            tp = _non_none(_hints(type(self))[f.name])
            if tp is float and _is_int(v):
                object.__setattr__(self, f.name, _as_float(v))
            elif float in typing.get_args(tp) and _is_int(v) and math.isinf(_as_float(v)):
                object.__setattr__(self, f.name, _as_float(v))
            elif typing.get_origin(tp) is tuple and isinstance(v, list):
                item = typing.get_args(tp)[0]
                if item is float:
                    v = [_as_float(x) if _is_int(x) else x for x in v]
                object.__setattr__(self, f.name, tuple(v))


@dataclasses.dataclass(frozen=True)
class RunSection(_Section):
    """`out_dir` is resolved when the section is built: `dataclasses.replace(run, name=...)` keeps the old
    out_dir (load the config again, or replace both)."""

    name: str = _f("m3jax", "run name: used in out_dir, logs and checkpoints",
                   pattern=(r"[A-Za-z0-9][A-Za-z0-9._-]*", "letters, digits, '.', '_' or '-', not starting with "
                                                            "'.', '_' or '-'"))
    out_dir: str = _f("runs/${name}", "where checkpoints, metrics and exports go; ${name} = run.name; "
                                      "relative to the job's working directory", check=_out_dir_ok,
                      allowed="a directory path (may contain ${name})")
    seed: int = _f(0, "seed of sampling and everything random in the step (not the model init)", min=0, max=MAX_SEED)
    total_steps: int = _f(200, "GRPO steps (one batch of prompts each)", min=1)
    max_wall_minutes: float | None = _f(None, "stop (after saving) once this much wall time has passed; "
                                              "null = no limit", gt=0)
    hang_timeout_minutes: float | None = _f(None, "a step (generation, update, evaluation, save) or the initial "
                                                  "evaluation not finished after this long is taken as hung: the "
                                                  "threads' stacks go to the run log and the process exits with "
                                                  "status 124, for the job to be restarted (the rerun resumes); the "
                                                  "first step also compiles; null = never (rl.watchdog)", gt=0,
                                          max=MAX_WATCH_MINUTES)
    start_timeout_minutes: float | None = _f(None, "the start (the prompts read, the model built or its checkpoint "
                                                   "restored, the generator started with its weights) not finished "
                                                   "after this long is taken as hung, as hang_timeout_minutes takes a "
                                                   "step; apart from it since a large model's start can take longer "
                                                   "than its steps; null = never", gt=0, max=MAX_WATCH_MINUTES)
    compilation_cache: str | None = _f(None, "directory of JAX's persistent compilation cache (a relative path is "
                                             "under out_dir; ${name} is run.name): a restart or resume loads "
                                             "each compiled program instead of compiling it again; null = JAX's "
                                             "default (the "
                                             "JAX_COMPILATION_CACHE_DIR environment variable, else none)",
                                       check=lambda v: None if v.strip() else "must not be empty",
                                       allowed="a directory path, or null")

    def __post_init__(self):
        super().__post_init__()
        # no shell expands a ~ inside key=value (or in YAML): it made a directory named ~ in the working one. A name
        # YAML read as a number or a date is refused on its own (quote it): the paths are not a second error for it.
        named = self.name is not None and not isinstance(self.name, (dict, list, tuple))
        if isinstance(self.out_dir, str) and named:
            object.__setattr__(self, "out_dir", os.path.expanduser(self.out_dir.replace("${name}", str(self.name))))
        if isinstance(self.compilation_cache, str):  # ${name} as in out_dir (it made a directory named ${name})
            cache = self.compilation_cache.replace("${name}", str(self.name)) if named else self.compilation_cache
            object.__setattr__(self, "compilation_cache", os.path.expanduser(cache))


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    data: int = _f(1, "batch axis (and FSDP's, with the default fsdp_axes)", min=1)
    context: int = _f(1, "sequence (context-parallel) axis", min=1)
    expert: int = _f(1, "extra batch axis (expert parallelism; it shards weights only if in fsdp_axes)", min=1)
    tensor: int = _f(1, "attention heads / MLP width axis", min=1)
    expert_axes: tuple[str, ...] = _f(list(TOKEN_AXES), "mesh axes the experts are spread over ([] = every "
                                                         "device holds every expert: no expert parallelism)",
                                      items={"choices": TOKEN_AXES}, distinct=True)
    fsdp_axes: tuple[str, ...] = _f(["data"], "mesh axes that shard the non-expert weights (FSDP: gathered per "
                                              "layer, gradients reduce-scattered); [] = replicated",
                                    items={"choices": TOKEN_AXES}, distinct=True)
    fsdp_step_axes: tuple[str, ...] = _f([], "the last entries of fsdp_axes that a step gathers once, into a copy "
                                             "of the weights every micro-batch reads (then each micro-batch "
                                             "gathers over the other fsdp_axes only: on NVLink when those stay "
                                             "inside a node); [] = every micro-batch gathers over all fsdp_axes",
                                         items={"choices": TOKEN_AXES}, distinct=True)
    context_balance: bool = _f(True, "context-parallel flash on full layers: mirror context shards swap their "
                                     "queries' second halves, so every shard does the same causal work (false = "
                                     "contiguous shards, the last doing 2 x context - 1 times the first's); sparse "
                                     "layers stay contiguous either way")
    coordinator_address: str | None = _f(None, "host:port of process 0 for jax.distributed; null = single "
                                               "process or from the environment (JAX_*, SLURM)",
                                         check=_not_empty, allowed="host:port, or null")
    num_processes: int | None = _f(None, "processes in a multi-host job; null = from the environment", min=1)
    process_id: int | None = _f(None, "this process's index; null = from the environment", min=0)
    device_memory_fraction: float | None = _f(None, "share of each GPU's memory JAX takes for the trainer "
                                                    "(XLA_PYTHON_CLIENT_MEM_FRACTION, set by the commands before "
                                                    "JAX starts unless the environment has it); the rest is left to "
                                                    "CUDA, NCCL and the weight push's buckets; null = JAX's 0.75. "
                                                    "The planner checks the plan against this share",
                                              gt=0, max=1)
    device_memory_gb: float | None = _f(None, "memory of each GPU the run is planned for, in GB (80: H100, 141: "
                                              "H200): what `python -m m3jax.plan` checks the plan against, times "
                                              "device_memory_fraction (its --device-memory-gb overrides); null = 80",
                                        gt=0)

    @property
    def num_devices(self) -> int:
        return self.data * self.context * self.expert * self.tensor

    @property
    def expert_parallel(self) -> int:
        sizes = {"data": self.data, "context": self.context, "expert": self.expert}
        return math.prod(sizes[a] for a in self.expert_axes)

    def to_mesh_config(self):
        from sharding.mesh import MeshConfig
        return MeshConfig(self.data, self.context, self.expert, self.tensor, tuple(self.expert_axes),
                          self.coordinator_address, self.num_processes, self.process_id,
                          fsdp_axes=tuple(self.fsdp_axes), fsdp_step_axes=tuple(self.fsdp_step_axes),
                          context_balance=self.context_balance)


@dataclasses.dataclass(frozen=True)
class PrecisionSection(_Section):
    master: str = _f("fp32", "'none': params in fp32, updated in place; 'fp32': bf16 params + fp32 master "
                             "in the optimizer; 'compact': bf16 params + 16-bit remainder (same numbers)",
                     choices=PRECISION_MODES)
    moment_dtype: str = _f("float32", "dtype of Adam's two moments", choices=("float32", "bfloat16"))

    @property
    def param_dtype(self) -> str:
        """Storage dtype of the params (the load-dtype rule: bf16 iff the optimizer owns a master)."""
        return "float32" if self.master == "none" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class OptimSection(_Section):
    lr: float = _f(1e-6, "peak learning rate (Adam)", gt=0)
    schedule: str = _f("constant", "after warm-up: constant, or linear / cosine decay to 0 at run.total_steps",
                       choices=("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "linear warm-up from 0 to lr over this many steps", min=0)
    weight_decay: float = _f(0.0, "decoupled weight decay (AdamW); never applied to the indexer, which the LM "
                                   "loss gives no gradient (m3jax.model.specs.weight_decay_mask)", min=0)
    b1: float = _f(0.9, "Adam beta1", min=0, lt=1)
    b2: float = _f(0.999, "Adam beta2", min=0, lt=1)
    eps: float = _f(1e-8, "Adam epsilon", gt=0)
    clip_norm: float | None = _f(1.0, "global gradient-norm clip; null = off", gt=0)
    stop_after_skipped_steps: int = _f(10, "a run whose updates were all skipped for a non-finite gradient in this "
                                           "many steps in a row stops with an error (its weights no longer change: "
                                           "a diverged run); each step with a skipped update is warned of; 0 = never",
                                       min=0)


@dataclasses.dataclass(frozen=True)
class GenerationSection(_Section):
    backend: str = _f("jax", "jax: the in-process engine; vllm: vLLM servers (vllm_* fields)",
                      choices=("jax", "vllm"))
    max_new_tokens: int = _f(1024, "response length limit (tokens)", min=1)
    max_prompt_tokens: int = _f(1024, "prompt length limit (tokens)", min=1)
    temperature: float = _f(1.0, "sampling temperature (> 0: GRPO needs distinct samples per group)", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, max=1)
    top_k: int = _f(0, "keep the k most likely tokens (0 = off)", min=0)
    stop_token_ids: tuple[int, ...] = _f([], "token ids that end a response; empty = the model's end tokens "
                                             "(model.path's generation_config.json eos_token_id, else config.json's, "
                                             "and its tokenizer's eos token, as vLLM stops)",
                                         items={"min": 0})
    vllm_tensor_parallel: int = _f(1, "GPUs per vLLM server (tensor parallel)", min=1)
    vllm_expert_parallel: int = _f(1, "expert-parallel size inside one vLLM server", min=1)
    vllm_servers: int = _f(1, "number of vLLM servers", min=1)
    vllm_gpu_memory_utilization: float = _f(0.8, "fraction of GPU memory vLLM may take", gt=0, max=1)
    vllm_dtype: str = _f("auto", "dtype the vLLM engines compute in; auto = the trainer's parameter dtype",
                         choices=("auto", "float32", "bfloat16"))
    vllm_ray_address: str | None = _f(None, "Ray cluster to place the vLLM engines on (e.g. ray://head:10001); "
                                            "null = start a local Ray",
                                      check=_not_empty, allowed="a Ray address, or null")
    vllm_executor: str = _f("auto", "how one vLLM server runs its ranks: mp = worker processes on one host "
                                    "(in-process for one rank); ray = vLLM's Ray executor, ranks placed by a "
                                    "placement group of the server's own, across hosts if needed; auto = ray only "
                                    "when vllm_tensor_parallel exceeds the largest Ray node's devices",
                            choices=VLLM_EXECUTORS)
    vllm_request_timeout_s: float = _f(600.0, "an engine that has not answered a rollout chunk for this long is "
                                              "killed and its rows re-sent", gt=0)
    vllm_max_restarts: int = _f(4, "dead or hung engines the pool replaces over a run before dropping them", min=0)
    vllm_malloc_tuning: bool = _f(True, "start CPU engine processes with glibc malloc tunables (huge pages, one "
                                        "never-trimmed heap) so that each in-place weight update's re-pack reuses "
                                        "the memory of the last instead of faulting in fresh pages "
                                        "(rl.generation.host_memory)")
    vllm_object_store_warmup: bool = _f(True, "a pool that starts its own Ray fills its object store (sized to two "
                                              "updates, rl.generation.local_ray) once while the engines start, so "
                                              "that no update's put waits for fresh shared-memory pages; that "
                                              "memory (~2.6x the checkpoint) then stays in use; on the shm "
                                              "transport the pool makes its files (one update's bytes) the same "
                                              "way. false: pages are faulted in as updates first use them")
    weight_transport: str = _f("ray", "how new weights reach the vLLM engines (rl.generation.transfer.TRANSPORTS): "
                                      "ray = HF-named buckets through the Ray object store (CPU and GPU); "
                                      "shm = the buckets written once into /dev/shm files that engines on the "
                                      "trainer's machine map (CPU engines colocated with the trainer); "
                                      "collective = the same buckets broadcast over a torch.distributed group "
                                      "of the trainer and the engines (gloo on CPU, NCCL on GPU)",
                               choices=WEIGHT_TRANSPORTS)
    weight_group_device: str = _f("auto", "where the collective transport's buckets live on every rank: cuda = an "
                                          "NCCL group, checksummed on the device (nothing goes through the "
                                          "host); cpu = a gloo group of host buffers, XXH3; auto = cuda when the "
                                          "trainer runs on GPUs and torch sees CUDA, else cpu",
                                  choices=WEIGHT_GROUP_DEVICES)
    weight_bucket_mb: int = _f(256, "size of one weight-transfer bucket (MB); conversion of the next bucket "
                                    "overlaps sending this one", min=1)
    verify_probes: int = _f(0, "after each weight transfer, score this many fixed sequences on every engine and "
                               "compare with the trainer (0 = off)", min=0)
    verify_max_abs_diff: float | None = _f(None, "fail the run when a probe's per-token logprob differs by more "
                                                 "than this between an engine and the trainer (null = only log)",
                                           gt=0)

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class DataSection(_Section):
    kind: str = _f("synthetic", "synthetic: a generated digit task (task, num_digits); file: prompts from path",
                   choices=("synthetic", "file"))
    task: str = _f("reverse", "synthetic task (rl.tasks): reverse / copy / sort digits (partial credit) or "
                              "addmod ((a+b) mod 10, exact match)", choices=DATA_TASKS)
    num_digits: int = _f(4, "digits per synthetic prompt (addmod always uses 2)", min=1)
    path: str | None = _f(None, "prompt file for kind=file (.jsonl, .json or .parquet)",
                          allowed="a .jsonl, .json or .parquet file, or null when data.kind is synthetic")
    format: str = _f("auto", "file format; auto = from the extension", choices=DATA_FORMATS)
    layout: str = _f("auto", "record layout (rl.data): auto-detected, dapo, gsm8k or plain", choices=DATA_LAYOUTS)
    prompt_key: str | None = _f(None, "record field holding the prompt (dots reach into nested objects); "
                                      "null = from the layout")
    answer_key: str | None = _f(None, "record field holding the reference answer; null = from the layout")
    chat_template: bool = _f(False, "render prompts with the tokenizer's chat template")
    shuffle_seed: int = _f(0, "seed of the per-epoch shuffle of the prompts; for a synthetic task also of which "
                              "prompts it makes", min=0, max=MAX_SEED)
    overlong_prompts: str = _f("error", "a file prompt that renders to more than generation.max_prompt_tokens "
                                        "tokens (checked at load, every prompt): error = refuse the file, naming "
                                        "the row; drop = leave such prompts out (logged)", choices=OVERLONG_PROMPTS)


@dataclasses.dataclass(frozen=True)
class RewardSpec(_Section):
    name: str = _f("", "registered reward function", pattern=(r"\S+", "a non-empty name"))
    # bounded so that a weighted sum of rewards (each within +-1e30, rl.rewards.outcome) stays finite in float32
    weight: float = _f(1.0, "weight of this reward in the sum", min=-1e6, max=1e6)
    # a process-mode reward's wait is in milliseconds that must fit a C int (about 2.1e6 s)
    timeout_s: float = _f(10.0, "time limit per sample (a timeout scores 0 and is counted)", gt=0, max=1e6)
    workers: int = _f(0, "samples scored at once: a thread-mode reward's lanes, a process-mode one's processes, a "
                         "batch-mode one's chunks called at once (0: 1 lane, min(cores, 8) processes, 1 call; an "
                         "inline reward runs one at a time)", min=0)
    args: dict[str, Any] = _f({}, "keyword arguments of every call (e.g. the judge's url and model); checked against "
                                  "the function's parameters at load", allowed="a mapping of keyword arguments")


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
    every_steps: int = _f(50, "save every this many steps (0 = only at the end and at must_save_by)", min=0)
    keep: int = _f(3, "newest checkpoints kept on disk", min=1)
    keep_best: int = _f(0, "also keep the checkpoints of this many best held-out evaluations (eval.best_metric), "
                           "however old, saving each step whose evaluation enters them (needs evaluation; 0 = none)",
                        min=0)
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    must_save_by: float | str | None = _f(None, "wall-clock deadline for a save: seconds after the start, or "
                                              "'HH:MM' (next occurrence, local time); null = none",
                                        check=_hhmm_or_seconds,
                                        allowed="null, a number of seconds > 0, or a time 'HH:MM' (24-hour)")
    resume: bool = _f(True, "true: continue from the newest checkpoint in run.out_dir/checkpoints when there is "
                            "one; false: a fresh run only, refused at load when that directory holds checkpoints")
    export_hf_at_end: bool = _f(False, "write a Hugging Face checkpoint to run.out_dir/export at the end")
    export_layout: str = _f("native", "native (minimax_m3_vl_text) or released (minimax_m3_vl, what vLLM loads)",
                            choices=("native", "released"))

    def deadline_seconds(self, start: _dt.datetime) -> float | None:
        """Seconds from `start` to the must-save-by deadline (None when there is none)."""
        v = self.must_save_by
        if v is None:
            return None
        if not isinstance(v, str):
            return float(v)
        hh, mm = map(int, v.split(":"))
        target = start.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if target <= start:
            target += _dt.timedelta(days=1)
        return (target - start).total_seconds()


@dataclasses.dataclass(frozen=True)
class LoggingSection(_Section):
    tensorboard: bool = _f(True, "write TensorBoard events to run.out_dir/tensorboard")
    progress_bar: bool = _f(True, "show the run's progress: a bar where stderr is a terminal, dated lines where it "
                                  "is a file (a job log): the first step, each evaluation, the last step, and at most "
                                  "one more per 30 s")
    plot: bool = _f(True, "write the metric curves to run.out_dir/curves.png at the end")
    entropy: bool = _f(False, "log `entropy`: the exact mean entropy of the sampling distribution over the step's "
                              "response tokens, computed in the train step from the loss's own logits (on with "
                              "grpo.entropy_coef > 0; `entropy_approx`, the mean -log p of the sampled tokens, is "
                              "logged always)")
    indexer_recall_every: int = _f(0, "log indexer/recall (and indexer/recall/layer_j per sparse layer) at steps 1, "
                                      "1 + N, 1 + 2N, ...: the share of each sparse layer's full-attention "
                                      "probability mass (no indexer mask) in the key blocks its indexer selects, on "
                                      "the step's first micro-batch (real tokens), by a forward of its own outside "
                                      "the train step; 0 = off", min=0)
    moe_drops_every: int = _f(0, "log moe/dropped_frac (and moe/dropped_frac/layer_j per MoE layer) at steps 1, 1 + N, "
                                 "1 + 2N, ...: the share of the real tokens' (token, expert) assignments that "
                                 "model.moe_capacity_factor drops, on the step's first micro-batch, by a forward of "
                                 "its own outside the train step; 0 = off", min=0)
    peak_tflops: float | None = _f(None, "each device's dense peak in TFLOP/s at the model's dtype, what "
                                         "perf/mfu/train and perf/mfu/logprobs divide the model FLOP rate by; null = "
                                         "the vendor's bf16 figure for the GPUs and TPUs rl.perf names (H100/H200 "
                                         "989), none on a CPU or for an fp32 model (perf/tflops_per_device/* is "
                                         "logged always)", gt=0)
    rollouts_every: int = _f(0, "write the rollouts of steps 1, 1 + N, 1 + 2N, ... to run.out_dir/rollouts.jsonl: "
                                "prompt and response text, answer, reward (and each reward's own), advantage, "
                                "length, truncation, mean generator log-prob, weight version (rl.rollout_log); "
                                "0 = off", min=0)
    rollouts_groups: int = _f(2, "groups (prompts, each with its grpo.group_size responses) written per such step",
                              min=1)
    eval_rollouts: int = _f(0, "at each evaluation, write the samples of the first N held-out prompts as text to "
                               "run.out_dir/eval_rollouts.jsonl (prompt, response, answer, rewards, correct); 0 = off",
                            min=0)
    wandb_project: str | None = _f(None, "mirror every metrics row to Weights & Biases under this project (null = "
                                         "off; needs the wandb package): one W&B run named run.name, configured with "
                                         "the resolved config; a resumed run (same run.out_dir) continues it",
                                   check=_not_empty, allowed="a W&B project name, or null")
    wandb_entity: str | None = _f(None, "the W&B entity (user or team); null = the account's default",
                                  check=_not_empty, allowed="a W&B entity, or null")
    wandb_mode: str = _f("online", "online, or offline: the W&B run is written under run.out_dir/wandb without a "
                                   "network, for `wandb sync` later (compute nodes without internet)",
                         choices=("online", "offline"))
    level: str = _f("info", "info: the terminal shows the progress bar, the project's INFO lines and anyone's "
                            "warnings, while third-party INFO (absl/orbax, jax, Ray, vLLM) goes to run.out_dir/run.log "
                            "only; debug: the terminal shows everything, and DEBUG records are logged too",
                    choices=LOG_LEVELS)
