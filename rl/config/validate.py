"""The generic validator: every field against its declared type and rules, model.tiny against M3Config,
then the cross-field rules and the reward registry. Problems come back as a list (all at once)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
from typing import Any, Callable

from m3jax.config_errors import FLOAT32_MAX, FLOAT32_SMALLEST, INT32_MAX
from rl.config.errors import _bad, _Problem, _unknown
from rl.config.fields import _allowed, _hints, _is, _is_section, _item_type, _kind, _plain, _scalar_allowed, \
    _show, _union
from rl.config.model_section import ModelSection
from rl.config.schema import DIGIT_VOCAB, MIN_TEMPERATURE, MISSING
from rl.config.model_checks import model_checks
from rl.config.reward_checks import reward_problems
from rl.generation.pool_config import VLLM_MIN_TEMPERATURE
from rl.config.validate_eval import eval_problems, file_only_problems

# Checks take the whole `rl.config.run.RunConfig` (named in annotations only: that module imports this one).


def _check_scalar(key: str, value: Any, tp: Any, rules: dict, allowed: str, out: list[_Problem]) -> None:
    if not _is(value, tp):
        # YAML reads 2024, 1.5, on / yes as numbers and booleans: a text field needs them quoted
        quote = "" if tp is not str or not isinstance(value, (bool, int, float)) else \
            ": YAML reads on / off / yes / no as one; quote the word for the text" if isinstance(value, bool) else \
            ": quote it, as you wrote it, for the text"  # str(1e3) is 1000.0, not what was typed
        out.append(_bad(key, value, f"wrong type ({_kind(value)}{quote})", allowed))
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
        elif tp is int and "max" not in rules and abs(value) > INT32_MAX:
            # a step count of 2^31 passed and overflowed in the learning-rate schedule after the run had started
            out.append(_bad(key, value, f"past {INT32_MAX} (2^31 - 1): counts, sizes and steps are int32 in the "
                                        "compiled programs", allowed))
        elif tp is float and (abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_SMALLEST):
            # lr = 1e300 trained NaN weights from step 1 (reported as a non-finite gradient); lr = 1e-300 was 0
            out.append(_bad(key, value, f"outside float32's range ({FLOAT32_SMALLEST:.4g} to {FLOAT32_MAX:.4g} in "
                                        "magnitude, or 0): the programs compute in float32", allowed))


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
    from m3jax.config import PASSTHROUGH_FIELDS, M3Config
    fs = [f for f in dataclasses.fields(M3Config) if f.name not in PASSTHROUGH_FIELDS]
    required = [f.name for f in fs if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return [f.name for f in fs], required


def _check_tiny(tiny: dict, out: list[_Problem]) -> None:
    """model.tiny must build an M3Config; its errors are reported under model.tiny.<field>."""
    names, required = _m3_field_names()
    if "preset" in tiny:  # ModelSection expands a good one: this one names no preset, or sets its depth wrongly
        from m3jax.presets import PresetError, expand_preset
        try:
            expand_preset(tiny)
        except PresetError as e:
            field = "num_hidden_layers" if str(e).startswith("num_hidden_layers") else "preset"
            out.append(_Problem(f"model.tiny.{field}", f"model.tiny.{e}"))
        return
    before = len(out)
    for k in tiny:
        if k not in names:  # preset: m3jax.presets, expanded by ModelSection (a misspelt one is told of it)
            out.append(_unknown(f"model.tiny.{k}", [*names, "preset"], "model.tiny (M3Config fields, preset)"))
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

    if cfg.logging.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        out.append(_Problem("logging.wandb_project", f"logging.wandb_project = {_show(cfg.logging.wandb_project)}: "
                                                     "the wandb package is not installed (pip install wandb); "
                                                     "allowed: null, or install it"))
    if (m.path is None) == (m.tiny is None):
        both = "both are set" if m.path is not None else "neither is set"
        out.append(_Problem("model.path", f"model.path = {_show(m.path)} and model.tiny = "
                                     f"{'{...}' if m.tiny is not None else 'null'}: {both}; allowed: exactly one "
                                     "of model.path (a local HF model directory) or model.tiny (M3Config fields "
                                     "of a random model); set the other to null", ("model.tiny",)))

    if cfg.checkpoint.keep_best and not cfg.eval.every_steps:
        out.append(_Problem("checkpoint.keep_best", f"checkpoint.keep_best = {cfg.checkpoint.keep_best} with "
                                                    "eval.every_steps = 0: no evaluation during the run ranks its "
                                                    "checkpoints; allowed: 0, or set eval.every_steps",
                            ("eval.every_steps",)))

    widths = list(g.micro_batch_widths)
    if widths != sorted(set(widths)) or any(w < 1 for w in widths):
        out.append(_Problem("grpo.micro_batch_widths", f"grpo.micro_batch_widths = {widths}: allowed: positive "
                                                       "widths in strictly increasing order (or [] for none)"))
    elif widths and cfg.mesh.context > 1 and cfg.model.moe_capacity_factor is not None:
        # A cut moves positions between context shards, and the capacity bounds each device's own assignments:
        # the cut micro-batch dropped other (token, expert) pairs (real tokens' logits 0.38 apart, an audit).
        out.append(_Problem("grpo.micro_batch_widths", (
            f"grpo.micro_batch_widths = {widths} with mesh.context = {cfg.mesh.context} and model.moe_capacity_factor "
            f"= {cfg.model.moe_capacity_factor:g}: a micro-batch cut to a width puts other positions on each context "
            "shard, so the capacity would drop other expert assignments than at the full width (the cut is no longer "
            "exact); allowed: [] (no cut), mesh.context = 1, or model.moe_capacity_factor = null (dropless)"),
            ("mesh.context", "model.moe_capacity_factor")))

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
    if g.loss in ("kl_cov", "clip_cov") and g.micro_batch_size * dp == 1:
        # the advantage is constant along one response, so every token's covariance is 0 up to rounding: kl_cov
        # penalised the tokens the rounding ranked first, clip_cov drew none and trained as ppo_clip (an audit)
        out.append(_Problem("grpo.micro_batch_size", (
            f"grpo.loss = {_show(g.loss)} with one sequence in each loss micro-batch (grpo.micro_batch_size x "
            f"mesh.data x mesh.expert = 1): its covariance of logp and advantage is taken over a micro-batch's tokens, "
            "and along one response the advantage is constant, so it is 0 at every token; allowed: "
            "grpo.micro_batch_size >= 2 (rows of several groups in a micro-batch), or another grpo.loss"),
            ("grpo.loss", "mesh.data", "mesh.expert")))

    if g.kl == "none" and g.kl_coef != 0:
        out.append(_Problem("grpo.kl_coef", f"grpo.kl_coef = {_show(g.kl_coef)}: has no effect with grpo.kl = "
                                            "\"none\"; allowed: 0, or set grpo.kl to \"k1\", \"k2\" or \"k3\"",
                            ("grpo.kl",)))
    if g.kl != "none" and g.kl_coef == 0:
        out.append(_Problem("grpo.kl_coef", f"grpo.kl_coef = 0 with grpo.kl = {_show(g.kl)}: the penalty is "
                                            "switched off; allowed: a number > 0, or grpo.kl = \"none\"",
                            ("grpo.kl",)))
    if g.is_correction == "mask" and g.is_mask_high <= g.is_mask_low:
        out.append(_Problem("grpo.is_mask_high", f"grpo.is_mask_high = {_show(g.is_mask_high)}: not above "
                                                 f"grpo.is_mask_low = {_show(g.is_mask_low)}; allowed: a number > "
                                                 "is_mask_low", ("grpo.is_mask_low",)))
    out += _loss_checks(g)
    if g.indexer_replay == "rollout" and gen.backend != "jax":
        out.append(_Problem("grpo.indexer_replay", (
            f"grpo.indexer_replay = \"rollout\" with generation.backend = {_show(gen.backend)}: this vLLM version "
            "does not return the indexer's block selection (vLLM has an open RFC for it; the Generator / "
            "Rollout interface carries block_ids for a backend that does); allowed: \"none\", or "
            "generation.backend = \"jax\""), ("generation.backend",)))
    if g.overlong_buffer >= gen.max_new_tokens:  # the ramp must start after at least one unpunished token
        out.append(_Problem("grpo.overlong_buffer", (
            f"grpo.overlong_buffer = {g.overlong_buffer}: not below generation.max_new_tokens = "
            f"{gen.max_new_tokens} (every response would be punished); allowed: 0 (off) or an integer in "
            f"[1, {gen.max_new_tokens - 1}]"), ("generation.max_new_tokens",)))

    out += model_checks(cfg)

    if d.kind == "file" and d.path is None:
        out.append(_Problem("data.path", "data.path = null: data.kind = \"file\" needs a prompt file; allowed: "
                                         "a path to a .jsonl, .json or .parquet file", ("data.kind",)))
    if d.kind == "file" and cfg.model.path is None:  # not a path's check: --print-config, which skips those, says it
        out.append(_Problem("data.kind", "data.kind = \"file\" with model.tiny: a prompt file is read with the model's "
                                         "tokenizer, and a tiny model has none; allowed: model.path (a HF directory "
                                         "with its tokenizer), or data.kind = \"synthetic\"", ("model.tiny",)))
    if d.kind == "synthetic" and d.path is not None:
        out.append(_Problem("data.path", f"data.path = {_show(d.path)}: data.kind = \"synthetic\" reads no file; "
                                         "allowed: null, or set data.kind = \"file\"", ("data.kind",)))
    if d.kind == "synthetic":
        out += file_only_problems(d, "data")
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

    for key, temperature in (("generation.temperature", gen.temperature),
                             *((("eval.temperature", cfg.eval.temperature),) if cfg.eval.enabled else ())):
        if 0 < temperature < MIN_TEMPERATURE:
            out.append(_Problem(key, (
                f"{key} = {temperature:g}: logits / temperature overflow float32 (every log-prob NaN); allowed: 0 "
                f"(greedy, eval only) or >= {MIN_TEMPERATURE:g}")))
        elif gen.backend == "vllm" and 0 < temperature < VLLM_MIN_TEMPERATURE:
            out.append(_Problem(key, (
                f"{key} = {temperature:g} with generation.backend = \"vllm\": vLLM raises a temperature below "
                f"{VLLM_MIN_TEMPERATURE:g} to {VLLM_MIN_TEMPERATURE:g}, so it would sample at another temperature "
                f"than the trainer scores; allowed: 0 (greedy, eval only) or >= {VLLM_MIN_TEMPERATURE:g}"),
                ("generation.backend",)))
    if gen.top_k == 1:  # greedy in all but name, which temperature 0 is refused for
        out.append(_Problem("generation.top_k", (
            "generation.top_k = 1: sampling keeps the one most likely token, so a group's samples are all the same "
            "and every log-prob under the sampling transform is 0 (no gradient, whatever the advantages): GRPO needs "
            "distinct samples per group; allowed: 0 (off) or an integer >= 2")))
    if gen.vllm_executor == "ray" and (gen.backend != "vllm" or gen.vllm_tensor_parallel < 2):
        out.append(_Problem("generation.vllm_executor", (
            f"generation.vllm_executor = \"ray\" with backend {_show(gen.backend)} and vllm_tensor_parallel = "
            f"{gen.vllm_tensor_parallel}: the Ray executor places the ranks of a vLLM server that has several "
            "(a one-rank server runs in its own actor); allowed: auto or mp, or ray with generation.backend = vllm "
            "and generation.vllm_tensor_parallel >= 2"), ("generation.backend", "generation.vllm_tensor_parallel")))

    if gen.backend == "vllm" and gen.vllm_expert_parallel not in (1, gen.vllm_tensor_parallel):
        # vLLM's expert parallelism spans an engine's tensor-parallel ranks (rl.generation.vllm_ray.engine_ranks):
        # found when the pool started, after the model was built
        out.append(_Problem("generation.vllm_expert_parallel", (
            f"generation.vllm_expert_parallel = {gen.vllm_expert_parallel} with vllm_tensor_parallel = "
            f"{gen.vllm_tensor_parallel}: vLLM's expert parallelism spans an engine's tensor-parallel ranks; "
            f"allowed: 1 or {gen.vllm_tensor_parallel}"), ("generation.vllm_tensor_parallel",)))
    if gen.verify_max_abs_diff is not None and (gen.backend == "jax" or not gen.verify_probes):
        out.append(_Problem("generation.verify_max_abs_diff", (
            f"generation.verify_max_abs_diff = {gen.verify_max_abs_diff}: there is nothing to compare "
            f"(backend {_show(gen.backend)}, verify_probes = {gen.verify_probes}); allowed: null, or a bound with "
            "generation.backend = vllm and generation.verify_probes >= 1"), ("generation.verify_probes",)))

    out += reward_problems(cfg.reward, "reward")

    if g.old_logprobs == "update" and g.updates_per_step != 1:
        out.append(_Problem("grpo.old_logprobs", (
            f"grpo.old_logprobs = \"update\" with grpo.updates_per_step = {g.updates_per_step}: the second and later "
            "updates would take logp_old from weights the first already changed; allowed: \"pass\", or "
            "updates_per_step 1"), ("grpo.updates_per_step",)))
    mp = cfg.mesh
    step, fsdp = tuple(mp.fsdp_step_axes), tuple(mp.fsdp_axes)
    if step and (fsdp[len(fsdp) - len(step):] != step or len(step) == len(fsdp)):
        out.append(_Problem("mesh.fsdp_step_axes", (
            f"mesh.fsdp_step_axes = {_show(list(step))}: "
            + ("all of" if step == fsdp else "not the last entries of") + f" mesh.fsdp_axes = {_show(list(fsdp))}; "
            "allowed: [] or a proper tail of fsdp_axes (the axes gathered once per step listed last, e.g. fsdp_axes "
            "[context, data] with fsdp_step_axes [data])"), ("mesh.fsdp_axes",)))
    if mp.num_processes is not None and mp.num_processes > mp.num_devices:
        out.append(_Problem("mesh.num_processes", (
            f"mesh.num_processes = {mp.num_processes} with a mesh of {mp.num_devices} device(s): every process "
            "holds devices of the mesh (a one-device mesh trains alone, without joining the job); allowed: at most "
            "mesh.data x context x expert x tensor"), ("mesh.data", "mesh.context", "mesh.expert", "mesh.tensor")))
    if mp.process_id is not None and mp.num_processes is not None and mp.process_id >= mp.num_processes:
        out.append(_Problem("mesh.process_id", f"mesh.process_id = {mp.process_id}: not below mesh.num_processes "
                                               f"= {mp.num_processes}; allowed: an integer in [0, {mp.num_processes})",
                                ("mesh.num_processes",)))
    return out


def _loss_checks(g) -> list[_Problem]:
    """Loss options that would silently do nothing with the chosen objective / correction / KL."""
    out: list[_Problem] = []
    if g.dual_clip is not None and g.loss != "ppo_clip":
        out.append(_Problem("grpo.dual_clip", f"grpo.dual_clip = {_show(g.dual_clip)}: has no effect with grpo.loss "
                                              f"= {_show(g.loss)} (only ppo_clip has a dual clip); allowed: null, or "
                                              "grpo.loss = \"ppo_clip\"", ("grpo.loss",)))
    # cispo's lower weight clip and sequence_sum's length are read by that objective / aggregation alone: set
    # with another, a user believes a bound or normaliser is in force that the loss never applies
    if g.cispo_eps_low is not None and g.loss != "cispo":
        out.append(_Problem("grpo.cispo_eps_low", f"grpo.cispo_eps_low = {_show(g.cispo_eps_low)}: has no effect "
                                                  f"with grpo.loss = {_show(g.loss)}; allowed: null, or grpo.loss = "
                                                  "\"cispo\"", ("grpo.loss",)))
    if g.sequence_sum_len is not None and g.aggregation != "sequence_sum":
        out.append(_Problem("grpo.sequence_sum_len", f"grpo.sequence_sum_len = {_show(g.sequence_sum_len)}: has no "
                                                     f"effect with grpo.aggregation = {_show(g.aggregation)}; "
                                                     "allowed: null, or grpo.aggregation = \"sequence_sum\"",
                            ("grpo.aggregation",)))
    if g.clip_cov_ub <= g.clip_cov_lb:
        out.append(_Problem("grpo.clip_cov_ub", f"grpo.clip_cov_ub = {_show(g.clip_cov_ub)}: not above "
                                                f"grpo.clip_cov_lb = {_show(g.clip_cov_lb)}; allowed: a number > "
                                                "clip_cov_lb (the band of covariance clip_cov draws from)",
                            ("grpo.clip_cov_lb",)))
    if g.is_floor is not None and g.is_correction != "truncate":
        out.append(_Problem("grpo.is_floor", f"grpo.is_floor = {_show(g.is_floor)}: has no effect with "
                                             f"grpo.is_correction = {_show(g.is_correction)}; allowed: null, or "
                                             "grpo.is_correction = \"truncate\"", ("grpo.is_correction",)))
    elif g.is_floor is not None and g.is_floor >= g.is_cap:
        out.append(_Problem("grpo.is_floor", f"grpo.is_floor = {_show(g.is_floor)}: not below grpo.is_cap = "
                                             f"{_show(g.is_cap)}; allowed: null or a number in [0, is_cap)",
                            ("grpo.is_cap",)))
    if g.reference_reset_every_steps and g.kl == "none":
        out.append(_Problem("grpo.reference_reset_every_steps", f"grpo.reference_reset_every_steps = "
                                                                f"{g.reference_reset_every_steps}: there is no KL "
                                                                "reference to reset (grpo.kl = \"none\"); allowed: 0, "
                                                                "or a KL estimator", ("grpo.kl",)))
    if g.reference_path is not None and g.kl == "none":
        out.append(_Problem("grpo.reference_path", f"grpo.reference_path = {_show(g.reference_path)}: there is no KL "
                                                   "term to use it (grpo.kl = \"none\"); allowed: null, or a KL "
                                                   "estimator (k2 for on-policy distillation)", ("grpo.kl",)))
    elif g.reference_path is not None and g.reference_reset_every_steps:
        out.append(_Problem("grpo.reference_reset_every_steps", (
            f"grpo.reference_reset_every_steps = {g.reference_reset_every_steps} with grpo.reference_path set: a "
            "reset would replace the reference checkpoint by the policy; allowed: 0, or grpo.reference_path null"),
            ("grpo.reference_path",)))
    if g.kl_on_policy and g.kl == "none":
        out.append(_Problem("grpo.kl_on_policy", "grpo.kl_on_policy = true: there is no KL term to weight "
                                                 "(grpo.kl = \"none\"); allowed: false, or a KL estimator",
                            ("grpo.kl",)))
    return out


def _problems(cfg: RunConfig) -> list[_Problem]:
    out: list[_Problem] = []
    _check_obj(cfg, "", out)
    tiny = cfg.model.tiny if isinstance(cfg.model, ModelSection) else None
    if isinstance(tiny, dict):
        _check_tiny(tiny, out)
    if not out:
        out = _cross_checks(cfg) + eval_problems(cfg)
    return out
