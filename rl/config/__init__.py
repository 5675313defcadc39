"""The run config of a GRPO job: typed, frozen, validated before any work starts.

    python -m m3jax.train --config configs/tiny.yaml grpo.group_size=4 optim.lr=3e-4 logging.plot=false
    python -m rl.config --config configs/tiny.yaml run.name=try2        # print the resolved config

Resolution (later wins)
-----------------------
1. the defaults declared on the dataclasses of `rl.config.schema` (`configs/base.yaml` restates them with comments; a
   test keeps the two equal);
2. the `base:` chain of the config file, root first. `base: other.yaml` is relative to the file that
   names it; chains are allowed, a cycle is an error;
3. the file itself (a *delta*: only what differs from its base);
4. the command-line overrides `a.b.c=value`, left to right. The value is parsed as YAML (`true`, `3`,
   `1e-6`, `[data, context]`, `{hidden_size: 64}`, `null`); the key must exist.

Merging: mappings merge key by key (so `model.tiny` can change one field of an inherited tiny model),
lists and scalars replace; a `model.tiny` mapping that names a `preset` (m3jax.presets), or a
`model.tiny.preset=` override, replaces whatever `model.tiny` held before it (an inherited mapping, earlier overrides).
A section left empty (`logging:`) keeps its defaults.

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
Each field declares its constraints once, in `dataclasses.field(metadata=...)` (see `schema._f`): `choices`,
`min` / `max` (inclusive), `gt` / `lt` (exclusive), `pattern`, `items` (constraints of list items),
`distinct`, `check` (a custom predicate). One generic validator walks the tree and reports, for every
problem at once: unknown keys at any depth (with a "did you mean"), wrong types (bool, int, float, str
and list are told apart; an int is accepted for a float), out-of-range values, bad choices, the `???`
placeholder left unset, and then the cross-field rules and reward names (`validate._cross_checks`; a custom reward
must be registered with `rl.rewards.register_reward` before the config is loaded). Every message names the full
dotted key, the bad value, what is allowed and the file or override that set it. A `RunConfig` built in
code is validated the same way in `__post_init__` (so `dataclasses.replace` re-validates); sections
built alone are not validated until they are put into a `RunConfig`.

Command line (what m3jax.train is expected to do)::

    parser = argparse.ArgumentParser(); rl.config.add_arguments(parser)
    args = parser.parse_intermixed_args(); cfg = rl.config.from_args(args)   # ConfigError: print it, exit 2
    if args.print_config: print(rl.config.to_yaml(cfg), end=""); return

What this package does not check: the mesh against the device count and the model's shapes
(`sharding.mesh.validate`, which needs the devices), the contents of `model.path` (read by
`M3Config.from_pretrained`) and data files (`rl.data.load_prompts`).
`load_config(check_paths=True)` only checks that the paths exist, and that a run with
`checkpoint.resume: false` would not start over checkpoints already in `run.out_dir/checkpoints`.

Modules
-------
schema     the section dataclasses: fields with default, doc and rules (`_f`), the mirrored choices
model_section  the `model` section (a model.tiny preset is expanded here: m3jax.presets)
eval_section  the `eval` section (held-out evaluation); validate_eval: its cross-field rules
grpo_section  the `grpo` section (batch, loss, DAPO, replay, off-policy) and the loss's mirrored choices
fields     type introspection of the fields; values and allowed values in words
errors     ConfigError and _Problem (one problem, with its dotted key)
validate   the generic field checker, model.tiny against M3Config, the cross-field rules
yaml_io    the YAML dialect, files and their base chain, deep merge, overrides, to_yaml / as_dict
build      merged mapping -> validated RunConfig, each problem with the file or override that set it
here       load_config and the command line (add_arguments, from_args, main; `python -m rl.config`)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from rl.config.build import defaults_dict, from_dict
from rl.config.errors import ConfigError
from rl.config.fields import _hints, _is_section, _item_type, _non_none, _show  # noqa: F401  (tests walk types)
from rl.config.schema import (  # noqa: F401  (tests check the mirrored choices against their originals)
    DATA_FORMATS, DATA_LAYOUTS, DATA_TASKS, DELETED_CHECKPOINTS, DIGIT_VOCAB, MISSING, PRECISION_MODES, TASK_REWARDS,
    TOKEN_AXES, WEIGHT_TRANSPORTS, CheckpointSection, DataSection, GenerationSection, LoggingSection, MeshSection,
    OptimSection, PrecisionSection, RewardSpec, RunSection)
from rl.config.grpo_section import (  # noqa: F401  (mirrored choices, as above)
    ADVANTAGES, AGGREGATIONS, IS_CORRECTIONS, IS_LEVELS, KL_TYPES, LOSSES, GrpoSection)
from rl.config.model_section import ModelSection
from rl.config.eval_section import EVAL_METRICS, EvalSection  # noqa: F401  (EVAL_METRICS: mirrored, tested)
from rl.config.run import RunConfig
from rl.config.yaml_io import apply_overrides, as_dict, load_tree, load_yaml, to_yaml

__all__ = [
    "ConfigError", "RunConfig", "RunSection", "ModelSection", "MeshSection", "PrecisionSection",
    "OptimSection", "GrpoSection", "GenerationSection", "DataSection", "RewardSpec", "EvalSection", "CheckpointSection",
    "LoggingSection", "load_config", "from_dict", "as_dict", "to_yaml", "load_yaml", "defaults_dict",
    "add_arguments", "from_args", "main", "MISSING",
]


def _not_a_file(path: str) -> str:
    if os.path.isdir(path):  # a Hugging Face dataset's folder, say: "no such file" sent the user looking for a typo
        return "a directory, not a file (a dataset folder: name one of its .jsonl / .json / .parquet files)"
    return "no such file"


def _check_paths(cfg: RunConfig, training: bool = True) -> None:
    """The paths `load_config(check_paths=True)` checks; `training` false for a command that reads a run's outputs
    (its evaluation, its export), which its checkpoints must not refuse and whose eval.path it reads."""
    problems = []
    p = cfg.model.path
    if p is not None and not os.path.isfile(os.path.join(p, "config.json")):
        problems.append(f"model.path = {_show(p)}: no config.json there; allowed: a local Hugging Face model "
                        "directory")
    problems += _reference_path_problems(cfg)
    if cfg.data.kind == "file" and not os.path.isfile(cfg.data.path):
        problems.append(f"data.path = {_show(cfg.data.path)}: {_not_a_file(cfg.data.path)}; allowed: an existing "
                        ".jsonl, .json or .parquet file")
    evaluates = cfg.eval.enabled or not training
    if evaluates and cfg.eval.kind == "file" and cfg.eval.path and not os.path.isfile(cfg.eval.path):
        problems.append(f"eval.path = {_show(cfg.eval.path)}: {_not_a_file(cfg.eval.path)}; allowed: an existing "
                        ".jsonl, .json or .parquet file of held-out prompts")
    held = _nearest_existing(checkpoint_dir(cfg))  # the run directory, or a file named like its checkpoints
    if held is not None and not os.path.isdir(held):
        problems.append(f"run.out_dir = {_show(cfg.run.out_dir)}: {held} is a file; allowed: a directory path (whose "
                        "checkpoints/ is a directory or absent)")
    if training and not cfg.checkpoint.resume:  # m3jax.eval / train --export read those checkpoints
        ckpt_dir = checkpoint_dir(cfg)
        found = sorted(set(os.listdir(ckpt_dir)) - {DELETED_CHECKPOINTS}) if os.path.isdir(ckpt_dir) else []
        if found:
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            problems.append(f"checkpoint.resume = false: {os.path.abspath(ckpt_dir)} already holds checkpoints "
                            f"({shown}), and a fresh run there would mix with them; allowed: true (continue from "
                            "the newest of them), or a run.name / run.out_dir without checkpoints (or delete that "
                            "directory first)")
    if problems:
        raise ConfigError(problems)


def _nearest_existing(path: str) -> str | None:
    """`path` or its nearest ancestor that exists (None if none does)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
    return path


def _reference_path_problems(cfg: RunConfig) -> list[str]:
    """grpo.reference_path: a HF directory whose model config is the policy's (the reference's logprobs are computed
    by the policy's model with the reference's weights, so every field counts, not only the shapes)."""
    r = cfg.grpo.reference_path
    if r is None:
        return []
    where = f"grpo.reference_path = {_show(r)}"
    if not os.path.isfile(os.path.join(r, "config.json")):
        return [f"{where}: no config.json there; allowed: a local Hugging Face model directory of the policy's "
                "architecture"]
    try:
        from m3jax.config import PASSTHROUGH_FIELDS, M3Config
        teacher, policy = M3Config.from_pretrained(r), cfg.model.m3_config()
    except Exception as e:  # noqa: BLE001  (an unreadable model.path / model.tiny has its own error)
        return [f"{where}: its config.json cannot be compared with the policy's ({type(e).__name__}: {e})"]
    differ = [f.name for f in dataclasses.fields(teacher)
              if f.name not in PASSTHROUGH_FIELDS and getattr(teacher, f.name) != getattr(policy, f.name)]
    if differ:
        shown = ", ".join(f"{k} {getattr(teacher, k)!r} (policy {getattr(policy, k)!r})" for k in differ[:4])
        return [f"{where}: its model config differs from the policy's in {shown}"
                + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
                + "; allowed: a checkpoint of the policy's architecture"]
    return []


def checkpoint_dir(cfg: RunConfig) -> str:
    """Where a run's checkpoints live (what `rl.trainer.GRPOTrainer` hands to its Checkpointer)."""
    return os.path.join(cfg.run.out_dir, "checkpoints")


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
                check_paths: bool = True, training: bool = True) -> RunConfig:
    """Read `path` (with its base chain), apply `overrides`, validate; raises ConfigError listing every problem.

    check_paths: also require model.path to hold a config.json, data.path (kind=file) to exist, run.out_dir not to
    be (or lie under) a file, and, with checkpoint.resume false and `training`, run.out_dir/checkpoints to hold no
    checkpoint (nothing is read or written there). training false: the config of a command that reads the run
    (m3jax.eval, train --export): its checkpoints are what it reads, and its eval.path is checked as if the run
    evaluated.
    """
    sources: dict[str, str] = {}
    tree = load_tree(os.fspath(path), [], sources)
    apply_overrides(tree, list(overrides), sources)
    cfg = from_dict(tree, sources=sources)
    if check_paths:
        _check_paths(cfg, training)
    return cfg


JOB_KEYS = ("mesh.coordinator_address", "mesh.num_processes", "mesh.process_id")


def job_settings(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> argparse.Namespace:
    """The multi-host job's settings (`JOB_KEYS`) as the files and `overrides` give them, unvalidated, each None where
    it is unset, unreadable or of the wrong type: what a process whose config was refused still knows of the job it
    was launched into (`sharding.launch.distributed_args` reads them beside the JAX_* environment)."""
    tree: dict = {}
    try:
        tree = load_tree(os.fspath(path), [], {})
        apply_overrides(tree, list(overrides), {})
    except ConfigError:  # the files are unreadable, or an override is: what was read stands
        pass
    mesh = tree.get("mesh") if isinstance(tree.get("mesh"), dict) else {}

    def whole(value):
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    address = mesh.get("coordinator_address")
    return argparse.Namespace(coordinator_address=address if isinstance(address, str) else None,
                              num_processes=whole(mesh.get("num_processes")), process_id=whole(mesh.get("process_id")))


# ============================================================================== command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE, --print-config and the positional key.sub=value overrides."""
    parser.add_argument("--config", required=True, help="YAML run config (e.g. configs/tiny.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit (paths need not exist)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a config value; the value is YAML (true, 3, 1e-6, [a, b], null)")


def from_args(args: argparse.Namespace, training: bool = True) -> RunConfig:
    """The config of a command's --config and overrides (`training`: as load_config's)."""
    return load_config(args.config, args.overrides, check_paths=not args.print_config, training=training)


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
