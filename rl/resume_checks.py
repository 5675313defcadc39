"""What a checkpoint records of the config it was trained under, and what a resume may change of it.

`rl.checkpoint` refuses a state of other shapes, but a model setting that keeps every shape (the experts per token,
RoPE's theta) or another dtype of the Adam moments would make a resume train another model, or read its optimizer
state otherwise, than the checkpoint was trained as. So each checkpoint's meta keeps the resolved config (`config`,
`--print-config`'s mapping, a few KB) and the model's own fields (`model`: model.tiny's defaults filled in, or
model.path's config.json); a resume refuses a change of those by name, and warns of every other setting changed
since that checkpoint. The comparison is with the checkpoint, not with `<run.out_dir>/config.yaml`: each start
rewrites that file, so a start that changed a setting and never saved would hide the change from the next one.
Checkpoints saved before these were recorded are compared with config.yaml, as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import yaml

from m3jax.config import PASSTHROUGH_FIELDS
from rl.checkpoint import CheckpointMismatch
from rl.config_record import differences

# M3Config fields that leave what the weights compute unchanged: the token ids (where generation stops), the
# longest position (a bound, no parameter holds it) and what a released model carries only for its export
NOT_THE_MODEL = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                           *PASSTHROUGH_FIELDS})
# run settings that give the checkpoint's state its meaning; the moments are cast to the run's dtype on restore
FIXED = ("precision.moment_dtype",)
# optimizer stages built only when set (sharding.optim_step.adamw): switching one on or off changes the optimizer
# state's layout, and the restore refused it as "another state" without naming the setting
STAGES = ("optim.weight_decay", "optim.clip_norm")
# The optimizer's schedule counts updates and reads step count // grpo.updates_per_step (rl.policy): with another
# updates_per_step the restored count maps to another step, so warm-up or decay would jump back (or ahead) and stay
# off by that factor. A flat schedule (constant, no warm-up) reads no count, so there the change only warns.
UPDATES = "grpo.updates_per_step"


def _schedule_counts(config: dict) -> bool:
    return _get(config, "optim.schedule") != "constant" or bool(_get(config, "optim.warmup_steps"))


def trained_under(cfg) -> dict:
    """{"config", "model"} of an `rl.config.RunConfig`, as a checkpoint's JSON meta stores them."""
    from rl.config import to_yaml
    model = {k: v for k, v in dataclasses.asdict(cfg.model.m3_config()).items() if k not in NOT_THE_MODEL}
    return json.loads(json.dumps({"config": yaml.safe_load(to_yaml(cfg)), "model": model}))


def _get(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _model_key(config: dict, field: str) -> str:
    model = config.get("model") or {}
    return f"model.tiny.{field}" if model.get("tiny") is not None else f"{field} of {model.get('path')}/config.json"


def _section_defaults() -> dict:
    """The run config's schema defaults by section, as a checkpoint's meta holds a config (the reward list and
    model.tiny's keys have none)."""
    from rl.config.run import RunConfig
    from rl.config.yaml_io import as_dict
    return json.loads(json.dumps({f.name: as_dict(f.default_factory()) for f in dataclasses.fields(RunConfig)
                                  if dataclasses.is_dataclass(f.default_factory)}))


def _as_saved_by_then(then: dict) -> dict:
    """`then` (a checkpoint's config) with each setting added to the schema since it was saved at its default: the
    version that saved it ran as the default describes (a new setting's default keeps what ran before it), so a
    resume that leaves it alone changed nothing (the warning named them, 'logging.moe_drops_every None -> 0')."""
    out = dict(then)
    for section, defaults in _section_defaults().items():
        saved = out.get(section)
        if isinstance(saved, dict):
            out[section] = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
        elif section not in out:
            out[section] = defaults
    return out


def check(meta: dict, now: dict, where: str) -> list[tuple[str, object, object]] | None:
    """The settings of `now` (`trained_under` of this run) changed since checkpoint `meta` was saved, as (dotted key,
    then, now); None where the checkpoint records no config. Raises CheckpointMismatch (one line, from `where`: the
    checkpoint's step and directory) naming every model or optimizer-state setting changed."""
    then = meta.get("config")
    if not isinstance(then, dict):
        return None
    then = _as_saved_by_then(then)
    fixed = _model_changes(meta, now)
    fixed += [(key, _get(then, key), _get(now["config"], key)) for key in FIXED
              if _get(then, key) != _get(now["config"], key)]
    fixed += [(f"{key} (on or off: the optimizer state holds its stage or not)", _get(then, key),
               _get(now["config"], key)) for key in STAGES
              if key.split(".")[0] in then and bool(_get(then, key)) != bool(_get(now["config"], key))]
    if _schedule_counts(now["config"]) and _get(then, UPDATES) != _get(now["config"], UPDATES):
        fixed.append((f"{UPDATES} (the learning-rate schedule counts its updates)", _get(then, UPDATES),
                      _get(now["config"], UPDATES)))
    if fixed:
        raise CheckpointMismatch(
            f"{where} was trained as another model or optimizer state than this run's config asks for: "
            + "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in fixed)
            + ": resume with the checkpoint's values, or start this run in another run.out_dir (or run.name)")
    # the model's identity is its fields above: model.tiny's own keys leave its defaults out
    return [c for c in differences(then, now["config"]) if not c[0].startswith("model.tiny")]


def _field_defaults() -> dict:
    """M3Config's defaults, as a checkpoint's JSON meta would hold them."""
    from m3jax.config import M3Config
    return json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(M3Config)
                                  if f.default is not dataclasses.MISSING}))


def _model_changes(meta: dict, now: dict) -> list[tuple[str, object, object]]:
    """The model fields of `now` (`trained_under`) that differ from checkpoint `meta`'s, as (key, then, now).

    A field the meta lacks was added to M3Config after the checkpoint was saved: that version built the model the
    field's default describes (a new field's default keeps what the model computed before it), so the default is
    what the checkpoint was trained as, not None (which refused every resume across the upgrade)."""
    saved_model = meta.get("model")
    if not isinstance(saved_model, dict):
        return []
    defaults = _field_defaults()
    then = {**{f: defaults[f] for f in now["model"] if f not in saved_model and f in defaults}, **saved_model}
    return [(_model_key(now["config"], field), then.get(field), now["model"].get(field))
            for field in [*then, *(f for f in now["model"] if f not in then)]
            if then.get(field) != now["model"].get(field)]


def check_model(meta: dict, cfg, where: str, doing: str) -> None:
    """Raise CheckpointMismatch when checkpoint `meta` was trained as another model than `cfg` builds: read with
    a setting that keeps every shape (the experts per token), an export wrote a config.json its weights were not
    trained under, and an evaluation scored another model than the run's. `doing`: "export", "evaluate"."""
    fixed = _model_changes(meta, trained_under(cfg))
    if fixed:
        raise CheckpointMismatch(
            f"{where} was trained as another model than this config builds: "
            + "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in fixed)
            + f": {doing} it with the checkpoint's values (the run's config.yaml)")
    # Another precision.master reads other weights from the same checkpoint (its exact fp32 master rounded to bf16, or
    # not): allowed (an fp32 export of a bf16 run's master is useful), but said, since it is not the policy the run
    # trained and evaluated (an audit: an fp32 export of a bf16 run, logits 3e-3 apart, silently)
    then = _get(meta.get("config") or {}, "precision.master")
    if then is not None and (then == "none") != (cfg.precision.master == "none"):  # fp32 and compact: the same
        dtypes = {"none": "fp32 params"}
        logging.getLogger(__name__).warning(
            "%s was trained with precision.master %r (%s); this %s reads it with %r (%s): not the weights the run "
            "trained and evaluated; precision.master=%s reads those", where, then, dtypes.get(then, "bf16 params"),
            "export" if doing == "export" else "evaluation", cfg.precision.master,
            dtypes.get(cfg.precision.master, "bf16 params"), then)


def restore_naming_changes(restore, checkpointer, now: dict):
    """`restore()` (a checkpointer's restore into this run's state); where it raises CheckpointMismatch (the newest
    checkpoint holds another state), the setting that changed it is named (`check` of that checkpoint's meta against
    `now`, this run's `trained_under`) where its meta shows one."""
    try:
        return restore()
    except CheckpointMismatch:
        steps = checkpointer.steps()
        meta = None
        if steps:
            try:
                meta = checkpointer.read_meta(max(steps))
            except Exception:  # noqa: BLE001 - the state's own mismatch is the error then
                meta = None
        if meta:
            check(meta, now, f"checkpoint step {max(steps)} in {checkpointer.directory}")
        raise


def changes_warning(step: int, since_checkpoint, since_config_yaml) -> str | None:
    """The warning of a run resumed from `step` (0: a fresh start, none) about the settings it changed: those since
    the checkpoint where it records its config, else those since config.yaml."""
    if not step:
        return None
    changed, since = ((since_checkpoint, "that checkpoint was saved") if since_checkpoint is not None
                      else (since_config_yaml, "config.yaml was last written"))
    if not changed:
        return None
    listed = "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed[:12])
    more = f"; and {len(changed) - 12} more" if len(changed) > 12 else ""
    return f"resumed from step {step} with settings changed since {since}, which apply from step {step + 1} on: " \
           f"{listed}{more}"
