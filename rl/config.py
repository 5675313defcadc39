"""The run config of a GRPO job: typed, frozen, validated before any work starts.

    python -m m3jax.train --config configs/tiny.yaml grpo.group_size=4 optim.lr=3e-4 logging.plot=false
    python -m rl.config --config configs/tiny.yaml run.name=try2        # print the resolved config

Resolution (later wins)
-----------------------
1. the defaults declared on the dataclasses below (`configs/base.yaml` restates them with comments; a
   test keeps the two equal);
2. the `base:` chain of the config file, root first. `base: other.yaml` is relative to the file that
   names it; chains are allowed, a cycle is an error;
3. the file itself (a *delta*: only what differs from its base);
4. the command-line overrides `a.b.c=value`, left to right. The value is parsed as YAML (`true`, `3`,
   `1e-6`, `[data, context]`, `{hidden_size: 64}`, `null`); the key must exist.

Merging: mappings merge key by key (so `model.tiny` can change one field of an inherited tiny model),
lists and scalars replace. A section left empty (`logging:`) keeps its defaults.

YAML dialect (files and override values alike; `load_yaml`): the safe loader, except that `1e-6` is a
float (YAML 1.1 would read a string), `23:30` is the string "23:30" (YAML 1.1 would read the base-60
integer 1410), a leading-zero number such as `010` is a string (not octal 8), and a key repeated in
one mapping is an error (YAML would keep the last silently).

Derived values
--------------
`run.out_dir` may contain `${name}`, replaced by `run.name` when the config is built (default
`runs/${name}`); a relative path is relative to the working directory of the job, not to the config
file. The resolved path is what `to_yaml` prints, so a printed config loads back unchanged.

Validation
----------
Each field declares its constraints once, in `dataclasses.field(metadata=...)` (see `_f`): `choices`,
`min` / `max` (inclusive), `gt` / `lt` (exclusive), `pattern`, `items` (constraints of list items),
`distinct`, `check` (a custom predicate). One generic validator walks the tree and reports, for every
problem at once: unknown keys at any depth (with a "did you mean"), wrong types (bool, int, float, str
and list are told apart; an int is accepted for a float), out-of-range values, bad choices, the `???`
placeholder left unset, and then the cross-field rules and reward names (`_cross_checks`; a custom reward
must be registered with `rl.rewards.register_reward` before the config is loaded). Every message names the full
dotted key, the bad value, what is allowed and the file or override that set it. A `RunConfig` built in
code is validated the same way in `__post_init__` (so `dataclasses.replace` re-validates); sections
built alone are not validated until they are put into a `RunConfig`.

Command line (what m3jax.train is expected to do)::

    parser = argparse.ArgumentParser(); rl.config.add_arguments(parser)
    args = parser.parse_intermixed_args(); cfg = rl.config.from_args(args)   # ConfigError: print it, exit 2
    if args.print_config: print(rl.config.to_yaml(cfg), end=""); return

What this module does not check: the mesh against the device count and the model's shapes
(`sharding.mesh.validate`, which needs the devices), the contents of `model.path` (read by
`M3Config.from_pretrained`) and data files (`rl.data.load_prompts`).
`load_config(check_paths=True)` only checks that the paths exist.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as _dt
import difflib
import json
import math
import os
import re
import sys
import types
import typing
from typing import Any, Callable

import yaml

__all__ = [
    "ConfigError", "RunConfig", "RunSection", "ModelSection", "MeshSection", "PrecisionSection",
    "OptimSection", "GrpoSection", "GenerationSection", "DataSection", "RewardSpec", "CheckpointSection",
    "LoggingSection", "load_config", "from_dict", "as_dict", "to_yaml", "load_yaml", "defaults_dict",
    "add_arguments", "from_args", "main", "MISSING",
]

MISSING = "???"  # a value the user must supply (e.g. the recipe's model.path); an error if left as is

# Mirrors of names defined in modules that import jax (kept here so that loading a config stays light);
# tests/test_run_config.py checks they stay equal to the originals.
TOKEN_AXES = ("data", "context", "expert")                     # sharding.rules.TOKEN_AXES
PRECISION_MODES = ("none", "fp32", "compact")                  # sharding.precision.MODES
ADVANTAGES = ("grpo", "dr_grpo", "rloo")                       # rl.grpo.advantages.ADVANTAGE_ESTIMATORS
IS_CORRECTIONS = ("truncate", "mask", "none")                  # rl.grpo.loss.IS_CORRECTIONS
IS_LEVELS = ("token", "sequence", "geometric")                 # rl.grpo.loss.IS_LEVELS
KL_TYPES = ("none", "k1", "k3")                                # rl.grpo.loss.KL_TYPES
AGGREGATIONS = ("token", "sequence_mean", "sequence_sum")      # rl.grpo.loss.AGGREGATIONS
DATA_TASKS = ("reverse", "copy", "sort", "addmod")             # rl.tasks.TASKS
DATA_FORMATS = ("auto", "jsonl", "json", "parquet")            # rl.data.FileFormat
DATA_LAYOUTS = ("auto", "dapo", "gsm8k", "plain")              # rl.data.Layout
DIGIT_VOCAB = 16                                               # rl.tasks.DigitTokenizer.vocab_size


class ConfigError(ValueError):
    """An invalid run config. `problems` holds one line per problem; str() lists them all."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"invalid run config: {self.problems[0]}"
        else:
            msg = f"invalid run config ({len(self.problems)} problems):\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(msg)


# ============================================================================== field declarations
def _f(default: Any, doc: str, **rules: Any) -> Any:
    """A config field: its default, one line of documentation and its constraints (module docstring)."""
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


def _out_dir_ok(v: Any) -> str | None:
    if "${" in v:
        return "has an unknown substitution (only ${name} is replaced)"
    return None if v.strip() else "must not be empty"


class _Section:
    """Normalises values after construction: list -> tuple for tuple fields, int -> float for float fields."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            tp = _non_none(_hints(type(self))[f.name])
            if tp is float and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))
            elif typing.get_origin(tp) is tuple and isinstance(v, list):
                item = typing.get_args(tp)[0]
                if item is float:
                    v = [float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in v]
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
    seed: int = _f(0, "seed of sampling and everything random in the step (not the model init)", min=0)
    total_steps: int = _f(200, "GRPO steps (one batch of prompts each)", min=1)
    max_wall_minutes: float | None = _f(None, "stop (after saving) once this much wall time has passed; "
                                              "null = no limit", gt=0)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.out_dir, str) and isinstance(self.name, str):
            object.__setattr__(self, "out_dir", self.out_dir.replace("${name}", self.name))


@dataclasses.dataclass(frozen=True)
class ModelSection(_Section):
    path: str | None = _f(None, "local Hugging Face model directory (either M3 layout); exclusive with tiny",
                          allowed="a local Hugging Face model directory, or null when model.tiny is set")
    tiny: dict[str, Any] | None = _f(None, "M3Config fields of a randomly initialised model; exclusive with path",
                                     allowed="a mapping of M3Config fields")
    init_seed: int = _f(0, "seed of the random initialisation of a tiny model", min=0)
    remat: bool = _f(False, "activation checkpointing (recompute each layer in the backward pass)")

    def m3_config(self):
        """The model's M3Config (tiny: built from the fields; path: read from its config.json)."""
        from m3jax.config import M3Config
        if self.tiny is not None:
            return M3Config(**self.tiny)
        return M3Config.from_pretrained(self.path)


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    data: int = _f(1, "batch and FSDP axis", min=1)
    context: int = _f(1, "sequence (context-parallel) axis", min=1)
    expert: int = _f(1, "extra batch axis that never shards weights (expert parallelism only)", min=1)
    tensor: int = _f(1, "attention heads / MLP width axis", min=1)
    expert_axes: tuple[str, ...] = _f(list(TOKEN_AXES), "mesh axes the experts are spread over",
                                      items={"choices": TOKEN_AXES}, distinct=True)
    coordinator_address: str | None = _f(None, "host:port of process 0 for jax.distributed; null = single "
                                               "process or from the environment (JAX_*, SLURM)")
    num_processes: int | None = _f(None, "processes in a multi-host job; null = from the environment", min=1)
    process_id: int | None = _f(None, "this process's index; null = from the environment", min=0)

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
                          self.coordinator_address, self.num_processes, self.process_id)


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
    weight_decay: float = _f(0.0, "decoupled weight decay (AdamW)", min=0)
    b1: float = _f(0.9, "Adam beta1", min=0, lt=1)
    b2: float = _f(0.999, "Adam beta2", min=0, lt=1)
    eps: float = _f(1e-8, "Adam epsilon", gt=0)
    clip_norm: float | None = _f(1.0, "global gradient-norm clip; null = off", gt=0)


@dataclasses.dataclass(frozen=True)
class GrpoSection(_Section):
    prompts_per_step: int = _f(32, "prompts sampled per step", min=1)
    group_size: int = _f(16, "samples (generations) per prompt, G", min=2)
    micro_batch_size: int = _f(1, "sequences per data-parallel rank (mesh.data x mesh.expert) in one "
                                  "forward/backward; gradients accumulate over micro-batches", min=1)
    updates_per_step: int = _f(1, "optimizer updates per step: the step's sequences are split into this "
                                  "many mini-batches (1 = on-policy)", min=1)
    advantage: str = _f("grpo", "grpo: (r - group mean) / group std; dr_grpo: no std; rloo: leave-one-out "
                                "baseline", choices=ADVANTAGES)
    eps_low: float = _f(0.2, "ratio clipped below at 1 - eps_low", min=0, lt=1)
    eps_high: float = _f(0.28, "ratio clipped above at 1 + eps_high (clip-higher when > eps_low)", min=0)
    dual_clip: float | None = _f(None, "dual clip c: for A < 0 the objective is bounded by c*A; null = off", gt=1)
    is_correction: str = _f("truncate", "trainer-vs-generator importance weight w = exp(logp_old - logp_gen): "
                                        "truncate (min(w, is_cap)), mask (0 outside [is_mask_low, is_mask_high]) "
                                        "or none", choices=IS_CORRECTIONS)
    is_level: str = _f("token", "importance weight per token, per sequence (product of ratios) or geometric "
                                "(exp of the mean log-ratio)", choices=IS_LEVELS)
    is_cap: float = _f(2.0, "truncation cap of the importance weight", gt=0)
    is_mask_low: float = _f(0.5, "lower edge of the kept band of is_correction=mask", min=0)
    is_mask_high: float = _f(2.0, "upper edge of the kept band of is_correction=mask", gt=0)
    kl: str = _f("none", "KL penalty to the reference policy: none, or the k1 / k3 estimator",
                 choices=KL_TYPES)
    kl_coef: float = _f(0.0, "KL penalty weight (0 with kl=none, > 0 otherwise)", min=0)
    kl_log_ratio_clamp: float | None = _f(20.0, "clamp of logp_ref - logp before the KL estimator; null = off", gt=0)
    kl_clamp: float | None = _f(10.0, "clamp of the per-token KL estimate; null = off", gt=0)
    aggregation: str = _f("token", "token: sum of token losses / valid tokens in the whole step; sequence_mean: "
                                   "mean over sequences of their token mean; sequence_sum: sum / (sequences x L)",
                          choices=AGGREGATIONS)
    sequence_sum_len: int | None = _f(None, "the constant L of aggregation=sequence_sum; null = "
                                            "generation.max_new_tokens", min=1)
    dynamic_sampling: bool = _f(False, "DAPO: drop groups whose rewards are all equal (zero advantage)")
    overlong_filter: bool = _f(False, "DAPO: no loss on responses cut at generation.max_new_tokens")

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def loss_config(self, max_new_tokens: int | None = None):
        """rl.grpo.loss.LossConfig of these settings."""
        from rl.grpo.loss import LossConfig
        return LossConfig(eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip,
                          is_correction=self.is_correction, is_level=self.is_level, is_cap=self.is_cap,
                          is_mask_low=self.is_mask_low, is_mask_high=self.is_mask_high, kl=self.kl,
                          kl_coef=self.kl_coef, kl_log_ratio_clamp=self.kl_log_ratio_clamp,
                          kl_clamp=self.kl_clamp, aggregation=self.aggregation,
                          sequence_sum_len=self.sequence_sum_len or max_new_tokens)


@dataclasses.dataclass(frozen=True)
class GenerationSection(_Section):
    backend: str = _f("jax", "jax: the in-process engine; vllm: vLLM servers (vllm_* fields)",
                      choices=("jax", "vllm"))
    max_new_tokens: int = _f(1024, "response length limit (tokens)", min=1)
    max_prompt_tokens: int = _f(1024, "prompt length limit (tokens)", min=1)
    temperature: float = _f(1.0, "sampling temperature (> 0: GRPO needs distinct samples per group)", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, max=1)
    top_k: int = _f(0, "keep the k most likely tokens (0 = off)", min=0)
    stop_token_ids: tuple[int, ...] = _f([], "token ids that end a response; empty = the model's eos_token_id",
                                         items={"min": 0})
    vllm_tensor_parallel: int = _f(1, "GPUs per vLLM server (tensor parallel)", min=1)
    vllm_expert_parallel: int = _f(1, "expert-parallel size inside one vLLM server", min=1)
    vllm_servers: int = _f(1, "number of vLLM servers", min=1)
    vllm_gpu_memory_utilization: float = _f(0.8, "fraction of GPU memory vLLM may take", gt=0, max=1)

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
    shuffle_seed: int = _f(0, "seed of the per-epoch shuffle of the prompts", min=0)


@dataclasses.dataclass(frozen=True)
class RewardSpec(_Section):
    name: str = _f("", "registered reward function", pattern=(r"\S+", "a non-empty name"))
    weight: float = _f(1.0, "weight of this reward in the sum")
    timeout_s: float = _f(10.0, "time limit per sample (a timeout scores 0 and is counted)", gt=0)


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
    every_steps: int = _f(50, "save every this many steps (0 = only at the end and at must_save_by)", min=0)
    keep: int = _f(3, "newest checkpoints kept on disk", min=1)
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    must_save_by: float | str | None = _f(None, "wall-clock deadline for a save: seconds after the start, or "
                                              "'HH:MM' (next occurrence, local time); null = none",
                                        check=_hhmm_or_seconds,
                                        allowed="null, a number of seconds > 0, or a time 'HH:MM' (24-hour)")
    resume: bool = _f(True, "continue from the newest checkpoint in run.out_dir when there is one")
    export_hf_at_end: bool = _f(False, "write a Hugging Face checkpoint to out_dir/hf at the end")
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
    tensorboard: bool = _f(True, "write TensorBoard events to out_dir/tb")
    progress_bar: bool = _f(True, "show a progress bar on the terminal")
    plot: bool = _f(True, "write metric plots (PNG) to out_dir at the end")


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    """The whole run: validated on construction (every problem at once, as ConfigError).

    run         name, out_dir, seed, total_steps, max_wall_minutes
    model       path | tiny (M3Config fields), init_seed, remat
    mesh        data, context, expert, tensor, expert_axes, coordinator_address, num_processes, process_id
    precision   master, moment_dtype
    optim       lr, schedule, warmup_steps, weight_decay, b1, b2, eps, clip_norm
    grpo        prompts_per_step, group_size, micro_batch_size, updates_per_step, advantage, eps_low,
                eps_high, dual_clip, is_correction, is_level, is_cap, is_mask_low, is_mask_high, kl, kl_coef,
                kl_log_ratio_clamp, kl_clamp, aggregation, sequence_sum_len, dynamic_sampling, overlong_filter
    generation  backend, max_new_tokens, max_prompt_tokens, temperature, top_p, top_k, stop_token_ids,
                vllm_tensor_parallel, vllm_expert_parallel, vllm_servers, vllm_gpu_memory_utilization
    data        kind, task, num_digits, path, format, layout, prompt_key, answer_key, chat_template, shuffle_seed
    reward      [{name, weight, timeout_s}, ...]
    checkpoint  every_steps, keep, async_save, must_save_by, resume, export_hf_at_end, export_layout
    logging     tensorboard, progress_bar, plot
    """

    run: RunSection = _f(RunSection, "the run")
    model: ModelSection = _f(ModelSection, "the policy model")
    mesh: MeshSection = _f(MeshSection, "device mesh of the trainer")
    precision: PrecisionSection = _f(PrecisionSection, "parameter and optimizer-state precision")
    optim: OptimSection = _f(OptimSection, "optimizer")
    grpo: GrpoSection = _f(GrpoSection, "batch and loss")
    generation: GenerationSection = _f(GenerationSection, "sampling")
    data: DataSection = _f(DataSection, "prompts")
    reward: tuple[RewardSpec, ...] = _f([], "reward functions, summed with their weights", min_items=1)
    checkpoint: CheckpointSection = _f(CheckpointSection, "checkpoints and export")
    logging: LoggingSection = _f(LoggingSection, "what to record")

    def __post_init__(self):
        super().__post_init__()
        if not _DEFER[0]:
            problems = _problems(self)
            if problems:
                raise ConfigError([p.text for p in problems])

    @property
    def micro_steps_per_update(self) -> int:
        """Forward/backward passes per optimizer update."""
        g, m = self.grpo, self.mesh
        return g.sequences_per_step // (g.updates_per_step * g.micro_batch_size * m.data * m.expert)


_DEFER = [False]  # True while from_dict builds a RunConfig, so that problems are reported with sources


# ============================================================================== type helpers
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _union(tp: Any) -> tuple[bool, list[Any]]:
    """(None allowed, the other member types)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        return type(None) in args, [a for a in args if a is not type(None)]
    return False, [tp]


def _non_none(tp: Any) -> Any:
    members = _union(tp)[1]
    return members[0] if len(members) == 1 else tp


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _item_type(tp: Any) -> Any | None:
    tp = _non_none(tp)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None


def _is(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if typing.get_origin(tp) is dict or tp is dict:
        return isinstance(value, dict)
    if typing.get_origin(tp) is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, tp)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _show(v: Any) -> str:
    """A value as the user would write it (JSON is YAML: null, true, "text", [1, 2])."""
    try:
        return json.dumps(_plain(v), ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(v)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _range_text(rules: dict) -> str:
    lo = ("[", rules["min"]) if "min" in rules else ("(", rules["gt"]) if "gt" in rules else None
    hi = ("]", rules["max"]) if "max" in rules else (")", rules["lt"]) if "lt" in rules else None
    if lo and hi:
        return f" in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f" {'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _scalar_allowed(tp: Any, rules: dict) -> str:
    if rules.get("choices"):
        return "one of " + ", ".join(_show(c) for c in rules["choices"])
    if "pattern" in rules:
        return rules["pattern"][1]
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer" + _range_text(rules)
    if tp is float:
        return "a number" + _range_text(rules)
    if tp is str:
        return "a string"
    if _is_section(tp):
        return "a mapping with keys " + ", ".join(_fields(tp))
    return getattr(tp, "__name__", str(tp))


def _allowed(tp: Any, meta: dict) -> str:
    """What a field accepts, in words."""
    if "allowed" in meta:
        return meta["allowed"]
    optional, members = _union(tp)
    tp = members[0]
    item = _item_type(tp)
    if item is not None:
        n = meta.get("min_items", 0)
        text = "a non-empty list" if n == 1 else f"a list of at least {n} items" if n else "a list"
        if _is_section(item):
            text += " of mappings with keys " + ", ".join(_fields(item))
        else:
            text += f" whose items are each {_scalar_allowed(item, meta.get('items', {}))}"
        if meta.get("distinct"):
            text += ", without repeats"
    else:
        text = _scalar_allowed(tp, meta)
    return f"null or {text}" if optional else text


# ============================================================================== validation
@dataclasses.dataclass
class _Problem:
    key: str
    text: str
    also: tuple[str, ...] = ()  # other keys the problem involves (their sources are named too)


def _bad(key: str, value: Any, problem: str, allowed: str) -> _Problem:
    return _Problem(key, f"{key} = {_show(value)}: {problem}; allowed: {allowed}")


def _check_scalar(key: str, value: Any, tp: Any, rules: dict, allowed: str, out: list[_Problem]) -> None:
    if not _is(value, tp):
        out.append(_bad(key, value, f"wrong type ({_kind(value)})", allowed))
        return
    if tp is float and not math.isfinite(value):
        out.append(_bad(key, value, "not a finite number", allowed))
        return
    choices = rules.get("choices")
    if choices and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {_show(close[0])}?)" if close else ""
        out.append(_bad(key, value, "not an allowed value" + hint, allowed))
        return
    if "pattern" in rules and not re.fullmatch(rules["pattern"][0], value):
        out.append(_bad(key, value, "not a valid value", allowed))
        return
    if tp in (int, float):
        if ("min" in rules and value < rules["min"]) or ("gt" in rules and value <= rules["gt"]) or \
                ("max" in rules and value > rules["max"]) or ("lt" in rules and value >= rules["lt"]):
            out.append(_bad(key, value, "out of range", allowed))


def _check_field(key: str, value: Any, tp: Any, meta: dict, out: list[_Problem]) -> None:
    allowed = _allowed(tp, meta)
    optional, members = _union(tp)
    if value is None:
        if not optional:
            out.append(_bad(key, value, "must not be null", allowed))
        return
    if value == MISSING and any(m is str for m in members):
        out.append(_bad(key, value, "must be set (this config leaves it to you: add the override "
                                    f"{key}=...)", allowed))
        return
    if len(members) > 1:  # a union such as int | str: the custom check decides
        if not any(_is(value, m) for m in members):
            out.append(_bad(key, value, f"wrong type ({_kind(value)})", allowed))
            return
    else:
        tp = members[0]
        item = _item_type(tp)
        if _is_section(tp):
            if isinstance(value, tp):
                _check_obj(value, key, out)
            else:
                out.append(_bad(key, value, f"wrong type ({_kind(value)})", allowed))
            return
        if item is not None:
            if not isinstance(value, (tuple, list)):
                out.append(_bad(key, value, f"wrong type ({_kind(value)})", allowed))
                return
            for i, v in enumerate(value):
                if _is_section(item):
                    if isinstance(v, item):
                        _check_obj(v, f"{key}[{i}]", out)
                    else:
                        out.append(_bad(f"{key}[{i}]", v, f"wrong type ({_kind(v)})", _scalar_allowed(item, {})))
                else:
                    rules = meta.get("items", {})
                    _check_scalar(f"{key}[{i}]", v, item, rules, _scalar_allowed(item, rules), out)
            if len(value) < meta.get("min_items", 0):
                out.append(_bad(key, value, f"needs at least {meta['min_items']} item(s)", allowed))
            if meta.get("distinct") and len({_show(v) for v in value}) != len(value):
                out.append(_bad(key, value, "has repeated items", allowed))
            return
        before = len(out)
        _check_scalar(key, value, tp, meta, allowed, out)
        if len(out) > before:
            return
    check: Callable[[Any], str | None] | None = meta.get("check")
    if check is not None:
        problem = check(value)
        if problem:
            out.append(_bad(key, value, problem, allowed))


def _check_obj(obj: Any, prefix: str, out: list[_Problem]) -> None:
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        _check_field(key, getattr(obj, f.name), hints[f.name], dict(f.metadata), out)


_M3_FIELD_RE = re.compile(r"config field '([^']+)'")


def _m3_field_names() -> tuple[list[str], list[str]]:
    """(all M3Config fields a tiny model may set, those without a default)."""
    from m3jax.config import M3Config
    fs = [f for f in dataclasses.fields(M3Config) if f.name != "vl_passthrough"]
    required = [f.name for f in fs if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return [f.name for f in fs], required


def _check_tiny(tiny: dict, out: list[_Problem]) -> None:
    """model.tiny must build an M3Config; its errors are reported under model.tiny.<field>."""
    names, required = _m3_field_names()
    before = len(out)
    for k in tiny:
        if k not in names:
            out.append(_unknown(f"model.tiny.{k}", names, "model.tiny (M3Config fields)"))
    missing = [k for k in required if k not in tiny]
    if missing:
        out.append(_Problem("model.tiny", f"model.tiny lacks {', '.join(missing)}: M3Config has no default for "
                                          f"{'them' if len(missing) > 1 else 'it'}; allowed: a mapping of M3Config "
                                          f"fields that sets at least {', '.join(required)}"))
    if len(out) > before:
        return
    from m3jax.config import ConfigError as M3ConfigError
    from m3jax.config import M3Config
    try:
        m3 = M3Config(**tiny)
    except M3ConfigError as e:
        msg = str(e)
        m = _M3_FIELD_RE.search(msg)
        field = m.group(1) if m else ""
        key = f"model.tiny.{field}" if field else "model.tiny"
        out.append(_Problem(key, _M3_FIELD_RE.sub(lambda mm: f"model.tiny.{mm.group(1)}", msg, count=1)
                            if m else f"model.tiny: {msg}"))
        return
    except (TypeError, ValueError) as e:
        out.append(_Problem("model.tiny", f"model.tiny = {_show(tiny)}: not a valid M3Config ({e}); allowed: "
                                          f"a mapping of M3Config fields"))
        return
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(m3, k)
        for tok in (v if isinstance(v, tuple) else (v,)):
            if tok is not None and (not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < m3.vocab_size):
                out.append(_bad(f"model.tiny.{k}", _plain(v), "not a token id of the model",
                                f"null or an integer in [0, vocab_size={m3.vocab_size})"))
                break


def _cross_checks(cfg: RunConfig) -> list[_Problem]:
    """Rules that tie fields together (run only when every field is valid on its own)."""
    out: list[_Problem] = []
    m, g, gen, d = cfg.model, cfg.grpo, cfg.generation, cfg.data

    if (m.path is None) == (m.tiny is None):
        both = "both are set" if m.path is not None else "neither is set"
        out.append(_Problem("model.path", f"model.path = {_show(m.path)} and model.tiny = "
                                     f"{'{...}' if m.tiny is not None else 'null'}: {both}; allowed: exactly one "
                                     "of model.path (a local HF model directory) or model.tiny (M3Config fields "
                                     "of a random model); set the other to null", ("model.tiny",)))

    dp = cfg.mesh.data * cfg.mesh.expert
    unit = g.updates_per_step * g.micro_batch_size * dp
    if g.sequences_per_step % unit:
        out.append(_Problem("grpo.micro_batch_size", (
            f"grpo.micro_batch_size = {g.micro_batch_size}: a step's {g.prompts_per_step} prompts x {g.group_size} "
            f"samples = {g.sequences_per_step} sequences do not divide into {g.updates_per_step} update(s) x {dp} "
            f"data-parallel rank(s) (mesh.data x mesh.expert = {dp}) x micro-batches of {g.micro_batch_size}; "
            f"allowed: values with prompts_per_step x group_size divisible by updates_per_step x mesh.data x "
            f"mesh.expert x micro_batch_size (here {unit})"),
            ("grpo.prompts_per_step", "grpo.group_size", "grpo.updates_per_step", "mesh.data", "mesh.expert")))

    if g.kl == "none" and g.kl_coef != 0:
        out.append(_Problem("grpo.kl_coef", f"grpo.kl_coef = {_show(g.kl_coef)}: has no effect with grpo.kl = "
                                            "\"none\"; allowed: 0, or set grpo.kl to \"k1\" or \"k3\"",
                            ("grpo.kl",)))
    if g.kl != "none" and g.kl_coef == 0:
        out.append(_Problem("grpo.kl_coef", f"grpo.kl_coef = 0 with grpo.kl = {_show(g.kl)}: the penalty is "
                                            "switched off; allowed: a number > 0, or grpo.kl = \"none\"",
                            ("grpo.kl",)))
    if g.is_correction == "mask" and g.is_mask_high <= g.is_mask_low:
        out.append(_Problem("grpo.is_mask_high", f"grpo.is_mask_high = {_show(g.is_mask_high)}: not above "
                                                 f"grpo.is_mask_low = {_show(g.is_mask_low)}; allowed: a number > "
                                                 "is_mask_low", ("grpo.is_mask_low",)))

    if d.kind == "file" and d.path is None:
        out.append(_Problem("data.path", "data.path = null: data.kind = \"file\" needs a prompt file; allowed: "
                                         "a path to a .jsonl, .json or .parquet file", ("data.kind",)))
    if d.kind == "synthetic" and d.path is not None:
        out.append(_Problem("data.path", f"data.path = {_show(d.path)}: data.kind = \"synthetic\" reads no file; "
                                         "allowed: null, or set data.kind = \"file\"", ("data.kind",)))
    if d.kind == "synthetic":
        digits = 2 if d.task == "addmod" else d.num_digits
        prompt_len = digits + 2 + (1 if d.task == "addmod" else 0)  # <bos> digits [+] <sep>
        answer_len = (1 if d.task == "addmod" else d.num_digits) + 1  # answer + <eos>
        if gen.max_prompt_tokens < prompt_len:
            out.append(_Problem("generation.max_prompt_tokens", (
                f"generation.max_prompt_tokens = {gen.max_prompt_tokens}: the {d.task} task's prompts are "
                f"{prompt_len} tokens; allowed: an integer >= {prompt_len}"), ("data.task", "data.num_digits")))
        if gen.max_new_tokens < answer_len:
            out.append(_Problem("generation.max_new_tokens", (
                f"generation.max_new_tokens = {gen.max_new_tokens}: the {d.task} task's answers need {answer_len} "
                f"tokens (with <eos>); allowed: an integer >= {answer_len}"), ("data.task", "data.num_digits")))
        if m.tiny is not None and m.tiny.get("vocab_size", 0) < DIGIT_VOCAB:
            out.append(_Problem("model.tiny.vocab_size", (
                f"model.tiny.vocab_size = {_show(m.tiny.get('vocab_size'))}: the synthetic tasks use a "
                f"{DIGIT_VOCAB}-token vocabulary; allowed: an integer >= {DIGIT_VOCAB}")))

    if m.tiny is not None:
        vocab = m.tiny["vocab_size"]
        for i, t in enumerate(gen.stop_token_ids):
            if t >= vocab:
                out.append(_Problem(f"generation.stop_token_ids[{i}]", (
                    f"generation.stop_token_ids[{i}] = {t}: not a token of the model; allowed: an integer in "
                    f"[0, model.tiny.vocab_size={vocab})"), ("model.tiny.vocab_size",)))

    names = [r.name for r in cfg.reward]
    registered = _registered_rewards()
    for i, n in enumerate(names):
        if registered is not None and n not in registered:
            close = difflib.get_close_matches(n, registered, n=1)
            hint = f" (did you mean {_show(close[0])}?)" if close else ""
            out.append(_Problem(f"reward[{i}].name", (
                f"reward[{i}].name = {_show(n)}: no reward is registered under this name{hint}; allowed: one of "
                f"{', '.join(_show(r) for r in registered)} (register custom rewards with "
                "rl.rewards.register_reward before loading the config)")))
        if n in names[:i]:
            out.append(_Problem(f"reward[{i}].name", f"reward[{i}].name = {_show(n)}: listed twice; allowed: "
                                                     "each reward once (combine weights)"))

    mp = cfg.mesh
    if mp.process_id is not None and mp.num_processes is not None and mp.process_id >= mp.num_processes:
        out.append(_Problem("mesh.process_id", f"mesh.process_id = {mp.process_id}: not below mesh.num_processes "
                                               f"= {mp.num_processes}; allowed: an integer in [0, {mp.num_processes})",
                                ("mesh.num_processes",)))
    return out


def _registered_rewards() -> list[str] | None:
    """Names in the reward registry (None when rl.rewards is not importable: the check is skipped)."""
    try:
        from rl.rewards import list_rewards
    except ImportError:
        return None
    return sorted(list_rewards())


def _problems(cfg: RunConfig) -> list[_Problem]:
    out: list[_Problem] = []
    _check_obj(cfg, "", out)
    tiny = cfg.model.tiny if isinstance(cfg.model, ModelSection) else None
    if isinstance(tiny, dict):
        _check_tiny(tiny, out)
    if not out:
        out = _cross_checks(cfg)
    return out


def _unknown(key: str, names: list[str], where: str) -> _Problem:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return _Problem(key, f"{key}: unknown key{hint}; allowed keys in {where}: {', '.join(names)}")


# ============================================================================== dict <-> dataclasses
def _build(cls: type, data: Any, prefix: str, out: list[_Problem]) -> Any:
    """A mapping -> an instance of `cls`; unknown keys and non-mappings are reported and skipped."""
    fields = _fields(cls)
    where = prefix or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        out.append(_bad(prefix, data, f"wrong type ({_kind(data)})", "a mapping with keys " + ", ".join(fields)))
        data = {}
    hints = _hints(cls)
    kwargs = {}
    for k, v in data.items():
        name = str(k)
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            out.append(_unknown(key, list(fields), where))
            continue
        tp = _non_none(hints[name])
        item = _item_type(tp)
        if _is_section(tp):
            kwargs[name] = _build(tp, v, key, out)
        elif item is not None and _is_section(item) and isinstance(v, list):
            # a non-mapping item stays as it is: the validator reports it once, as a wrong type
            kwargs[name] = tuple(_build(item, x, f"{key}[{i}]", out) if isinstance(x, dict) or x is None else x
                                 for i, x in enumerate(v))
        else:
            kwargs[name] = copy.deepcopy(v)
    return cls(**kwargs)


def from_dict(tree: dict, *, sources: dict[str, str] | None = None) -> RunConfig:
    """A validated RunConfig from a (merged) mapping; ConfigError lists every problem, each with its source."""
    out: list[_Problem] = []
    _DEFER[0] = True
    try:
        cfg = _build(RunConfig, tree, "", out)
    finally:
        _DEFER[0] = False
    out += _problems(cfg)
    if out:
        raise ConfigError([_with_source(p, sources or {}) for p in out])
    return cfg


def as_dict(cfg: Any) -> dict:
    """The config as plain YAML-ready data (tuples become lists)."""
    return _plain(cfg)


def defaults_dict() -> dict:
    """The dataclass defaults as a mapping (what configs/base.yaml restates)."""
    _DEFER[0] = True
    try:
        return as_dict(RunConfig())
    finally:
        _DEFER[0] = False


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (for --print-config); `load_config` of it gives back an equal config."""
    return yaml.dump(as_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110,
                     allow_unicode=True)


# ============================================================================== YAML dialect
_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                          |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
                          |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))$""", re.X)
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in (_INT_TAG, _FLOAT_TAG)]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader, node):
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text)


def _construct_map(loader, node):
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            dup = key in seen
            seen.add(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}",
                                                    key_node.start_mark) from None
        if dup:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping",
                                                    key_node.start_mark)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or this module's dialect would read as something else."""


_Dumper.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Dumper.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _represent_list(dumper, data):
    flow = all(not isinstance(x, (list, tuple, dict)) for x in data)  # [data, context] on one line
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def load_yaml(text_or_stream: Any) -> Any:
    """Parse YAML in this module's dialect (see the module docstring)."""
    return yaml.load(text_or_stream, Loader=_Loader)


# ============================================================================== files, merging, overrides
def _display(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _merge(dst: dict, src: dict, sources: dict[str, str], source: str, prefix: str = "") -> None:
    """Deep-merge `src` into `dst` (mappings merge, everything else replaces), noting who set each key."""
    for k, v in src.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            if not isinstance(dst.get(k), dict):
                dst[k] = {}
                for old in [s for s in sources if s == key or s.startswith(key + ".")]:
                    del sources[old]
            _merge(dst[k], v, sources, source, key)
            if not v:
                sources.setdefault(key, source)
        else:
            dst[k] = copy.deepcopy(v)
            for old in [s for s in sources if s == key or s.startswith(key + ".")]:
                del sources[old]
            sources[key] = source


def _sources_of(key: str, sources: dict[str, str]) -> list[str]:
    """Who set `key`: the nearest enclosing key that a file or override set, else whoever set keys below it."""
    key = re.sub(r"\[\d+\]", "", key)
    parts = key.split(".") if key else []
    for n in range(len(parts), 0, -1):
        src = sources.get(".".join(parts[:n]))
        if src:
            return [src]
    return [s for k, s in sources.items() if key and k.startswith(key + ".")]


def _with_source(p: _Problem, sources: dict[str, str]) -> str:
    found: list[str] = []
    for key in (p.key, *p.also):
        for s in _sources_of(key, sources):
            if s not in found:
                found.append(s)
    if found:
        return f"{p.text} [set by {'; '.join(found)}]"
    return p.text + (" [default]" if p.key else "")


def _read_file(path: str, chain: list[str]) -> dict:
    shown = _display(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = load_yaml(fh)
    except FileNotFoundError:
        if chain:
            raise ConfigError(f"base: {shown} (named by {_display(chain[-1])}) does not exist; allowed: a YAML "
                              "file path relative to the file that names it") from None
        raise ConfigError(f"config file {shown} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {shown} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"config file {shown} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark else shown
        what = getattr(e, "problem", None) or str(e)
        ctx = getattr(e, "context", None)
        raise ConfigError(f"{where}: malformed YAML: {what}" + (f" ({ctx})" if ctx else "")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: the top level is {_kind(data)}; allowed: a mapping of sections "
                          f"({', '.join(_fields(RunConfig))}) and an optional base")
    return data


def _load_tree(path: str, chain: list[str], sources: dict[str, str]) -> dict:
    path = os.path.abspath(path)
    if path in chain:
        cycle = " -> ".join(_display(p) for p in chain[chain.index(path):] + [path])
        raise ConfigError(f"base: cycle of config files: {cycle}; allowed: a chain that ends in a file without base")
    data = _read_file(path, chain)
    base = data.pop("base", None)
    tree: dict = {}
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"base = {_show(base)} in {_display(path)}: wrong type ({_kind(base)}); allowed: "
                              "the path of another YAML file, relative to this one")
        tree = _load_tree(os.path.join(os.path.dirname(path), base), chain + [path], sources)
    _merge(tree, data, sources, _display(path))
    return tree


def _override_target(parts: list[str], text: str) -> tuple[Any, dict] | _Problem:
    """The (type, metadata) an override key names, or the problem with the key."""
    cls: Any = RunConfig
    for i, part in enumerate(parts):
        key = ".".join(parts[:i + 1])
        fields = _fields(cls)
        if part not in fields:
            return _unknown(key, list(fields), ".".join(parts[:i]) or "the top level")
        tp, meta = _hints(cls)[part], dict(fields[part].metadata)
        if i == len(parts) - 1:
            return tp, meta
        inner = _non_none(tp)
        if _is_section(inner):
            cls = inner
        elif cls is ModelSection and part == "tiny":
            rest = parts[i + 1:]
            names, _ = _m3_field_names()
            if rest[0] not in names:
                return _unknown(f"{key}.{rest[0]}", names, "model.tiny (M3Config fields)")
            if len(rest) > 1:
                return _Problem(key, f"override {text!r}: {key}.{rest[0]} has no sub-keys; allowed: "
                                     f"{key}.{rest[0]}=<value>")
            return Any, {"allowed": f"a value for M3Config.{rest[0]}"}
        elif _item_type(inner) is not None:
            return _Problem(key, f"override {text!r}: {key} is a list, so it has no sub-keys; allowed: the whole "
                                 f"list, e.g. {key}='[...]' ({_allowed(tp, meta)})")
        else:
            return _Problem(key, f"override {text!r}: {key} is {_allowed(tp, meta)}, it has no sub-keys; "
                                 f"allowed: {key}=<value>")
    raise AssertionError("unreachable")


def _apply_overrides(tree: dict, overrides: list[str], sources: dict[str, str]) -> None:
    problems: list[str] = []
    for text in overrides:
        key, sep, raw = str(text).partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            problems.append(f"override {text!r}: expected key.sub=value (e.g. grpo.group_size=8)")
            continue
        target = _override_target(parts, text)
        if isinstance(target, _Problem):
            problems.append(target.text if target.text.startswith("override") else f"override {text!r}: "
                            + target.text)
            continue
        tp, meta = target
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            problems.append(f"override {text!r}: the value {raw!r} for {key} is not valid YAML ({what}); "
                            f"allowed: {_allowed(tp, meta)} (quote strings that contain YAML syntax)")
            continue
        node = tree
        for n, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):  # e.g. model.tiny.hidden_size=64 over model.tiny: null
                node[p] = {}
                here = ".".join(parts[:n + 1])
                for old in [s for s in sources if s == here or s.startswith(here + ".")]:
                    del sources[old]
            node = node[p]
        _merge(node, {parts[-1]: value}, sources, f"override {text!r}", ".".join(parts[:-1]))
    if problems:
        raise ConfigError(problems)


def _check_paths(cfg: RunConfig) -> None:
    problems = []
    p = cfg.model.path
    if p is not None and not os.path.isfile(os.path.join(p, "config.json")):
        problems.append(f"model.path = {_show(p)}: no config.json there; allowed: a local Hugging Face model "
                        "directory")
    if cfg.data.kind == "file" and not os.path.isfile(cfg.data.path):
        problems.append(f"data.path = {_show(cfg.data.path)}: no such file; allowed: an existing .jsonl, .json or "
                        ".parquet file")
    if problems:
        raise ConfigError(problems)


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
                check_paths: bool = True) -> RunConfig:
    """Read `path` (with its base chain), apply `overrides`, validate; raises ConfigError listing every problem.

    check_paths: also require model.path to hold a config.json and data.path (kind=file) to exist.
    """
    sources: dict[str, str] = {}
    tree = _load_tree(os.fspath(path), [], sources)
    _apply_overrides(tree, list(overrides), sources)
    cfg = from_dict(tree, sources=sources)
    if check_paths:
        _check_paths(cfg)
    return cfg


# ============================================================================== command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE, --print-config and the positional key.sub=value overrides."""
    parser.add_argument("--config", required=True, help="YAML run config (e.g. configs/tiny.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit (paths need not exist)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a config value; the value is YAML (true, 3, 1e-6, [a, b], null)")


def from_args(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, args.overrides, check_paths=not args.print_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl.config",
                                     description="Resolve a run config (base chain + overrides) and print it.")
    add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    args.print_config = True
    try:
        cfg = from_args(args)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
