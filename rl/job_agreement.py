"""What every process of a multi-host job must hold alike, compared before the first step: the resolved config,
m3jax's own source and the libraries that compile its programs, the tokenizer, the training prompts and the
held-out ones.

Each process reads its config, prompt files, tokenizer and code from its own host. A host with a stale copy (the
config before an edit, a prompt file rewritten on one node, a checkout of another commit) did not fail: its devices
took their share of the same programs, so a step trained on rows drawn from different files, scored answers that
another host's prompts never asked, or hung in a collective that the other programs did not issue. Each process
now publishes its facts through jax's distributed key-value store (no device, no collective: a process that differs
leaves no one waiting in one) and reads every other process's; where any differ, every process raises the same
`JobDisagrees` naming the facts and the processes, before the policy is built.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Sequence

# Settings that name something on this process's own host, or this process itself: they may differ.
PER_PROCESS_SETTINGS = ("mesh.process_id", "run.compilation_cache")


class JobDisagrees(ValueError):
    """The processes of one job hold different configs, code, tokenizers or prompts."""


def digest(value) -> str:
    """sha256 of `value`'s JSON (sorted keys; what JSON cannot say, by its str), 16 hex digits."""
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def config_settings(cfg) -> dict[str, object]:
    """The resolved config's settings by dotted key, less `PER_PROCESS_SETTINGS`."""
    import yaml

    from rl.config import to_yaml

    flat: dict[str, object] = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" not in PER_PROCESS_SETTINGS:
                flat[f"{prefix}{key}"] = value
    walk(yaml.safe_load(to_yaml(cfg)), "")
    return flat


def code_digest(packages: Sequence[str] = ("m3jax", "rl", "sharding"),
                libraries: Sequence[str] = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")) -> str:
    """One digest of the Python source of m3jax's packages and the installed versions of the libraries its programs
    are built with (another jax lowers other programs: the processes' collectives would not match)."""
    from importlib import import_module, metadata

    h = hashlib.sha256()
    for package in packages:
        root = os.path.dirname(import_module(package).__file__)
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    for library in libraries:
        try:
            version = metadata.version(library)
        except metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{library}=={version}\0".encode())
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer's whole definition where it has one (a fast HF tokenizer's JSON), else its vocabulary; with its
    chat template and special ids either way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return digest([body, getattr(tokenizer, "chat_template", None), tokenizer.pad_token_id,
                   getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)])


def records_digest(records) -> str:
    """`records` (rl.data.PromptRecord) in order: the loader's fingerprint of their prompts, answers and metadata
    (`rl.prompt_loader.records_fingerprint`, a file's path and row left out), and the ids rendered at load
    (`PromptRecord.ids`: a chat template that writes the date renders other ids on a host that loaded on another
    day)."""
    import numpy as np

    from rl.prompt_loader import records_fingerprint
    h = hashlib.sha256(records_fingerprint(records).encode())
    for r in records:
        h.update(b"-" if r.ids is None else np.asarray(r.ids, np.int32).tobytes() + b"\0")
    return h.hexdigest()[:16]


def start_facts(cfg, tokenizer, records) -> dict[str, object]:
    """What the processes compare once the prompts are read."""
    return {"config": config_settings(cfg), "code": code_digest(), "tokenizer": tokenizer_digest(tokenizer),
            "prompts": [len(records), records_digest(records)]}


def eval_facts(eval_set) -> list:
    """The held-out prompts of an `rl.evaluate.EvalSet`: their count and digest (records and rendered ids)."""
    return [len(eval_set.records), digest([records_digest(eval_set.records), eval_set.prompt_ids])]


def disagreements(facts: Sequence[dict], described: dict[str, str] | None = None) -> list[str]:
    """One phrase per fact that some process holds differently from process 0 (`facts[i]`: process i's), naming the
    processes; the config, each setting that differs with every process's value. `described`: a fact's words in
    place of its name."""
    described = described or {}
    said = []
    for name, zero in facts[0].items():
        others = [i for i in range(1, len(facts)) if facts[i].get(name) != zero]
        if not others:
            continue
        if name == "config":
            keys = list(zero) + sorted({k for i in others for k in facts[i][name]} - set(zero))
            said += [_setting(key, [facts[i][name] for i in range(len(facts))]) for key in keys
                     if any(facts[i][name].get(key, ABSENT) != zero.get(key, ABSENT) for i in others)]
        elif name.endswith("prompts") and all(facts[i][name][0] != zero[0] for i in others):
            counts = ", ".join(f"process {i} {facts[i][name][0]}" for i in others)
            said.append(f"{described.get(name, name)}: process 0 holds {zero[0]}, {counts}")
        else:
            said.append(f"{described.get(name, name)}: process{'es' if len(others) > 1 else ''} {_listed(others)} "
                        "differ from process 0's")
    return said


ABSENT = "(absent)"


def _setting(key: str, settings: Sequence[dict]) -> str:
    """`key: process 0 <value>, process i <value>` for each process whose value differs from process 0's."""
    zero = settings[0].get(key, ABSENT)
    values = ", ".join(f"process {i} {s.get(key, ABSENT)!r}" for i, s in enumerate(settings)
                       if i and s.get(key, ABSENT) != zero)
    return f"{key}: process 0 {zero!r}, {values}"


def _listed(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices)


DESCRIBED = {"code": "m3jax's source or its jax / flax / optax / orbax versions",
             "tokenizer": "the tokenizer (model.path's, or the synthetic task's)",
             "prompts": "the training prompts (data.*)", "eval_prompts": "the held-out prompts (eval.*)"}


START = "its config, code, tokenizer and prompts"  # the stage every process reports before the policy is built
FAILED = "failed at its start"  # the one fact a process that could not gather its own publishes


def _key(stage: str, process_index: int) -> str:
    return f"m3jax:agree:{stage}:{process_index}"


def _store(client):
    """`client`, or jax's key-value store of the joined job (`sharding.mesh.key_value_client`)."""
    if client is not None:
        return client
    from sharding.mesh import key_value_client
    return key_value_client()


def report_failure(stage: str, error: BaseException, *, process_index: int, process_count: int, client=None) -> None:
    """Publish, in place of this process's facts, that gathering them failed (its prompt file missing, say), so that
    the others stop at once naming it instead of waiting out `agree`'s timeout (5 minutes)."""
    if process_count == 1:
        return
    said = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    _store(client).key_value_set(_key(stage, process_index), json.dumps({FAILED: said}))


def agree(stage: str, facts: dict[str, object], *, process_index: int, process_count: int, client=None,
          timeout_s: float = 300.0) -> None:
    """Publish this process's `facts` under `stage`, read every other process's, and raise `JobDisagrees` (on every
    process alike) where any differ. A process that has not published within `timeout_s` (it failed to start: its
    log says why) is named in the error. `client`: jax's key-value store (`sharding.mesh.key_value_client`)."""
    if process_count == 1:
        return
    client = _store(client)
    client.key_value_set(_key(stage, process_index), json.dumps(facts, default=str))
    everyone, silent = [], []
    for i in range(process_count):
        if i == process_index:
            everyone.append(json.loads(json.dumps(facts, default=str)))
            continue
        try:
            everyone.append(json.loads(client.blocking_key_value_get(_key(stage, i), int(timeout_s * 1000))))
        except RuntimeError as e:  # jax's JaxRuntimeError: "DEADLINE_EXCEEDED: GetKeyValue() timed out ..."
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            silent.append(i)
            everyone.append(None)
    if silent:
        raise JobDisagrees(
            f"process{'es' if len(silent) > 1 else ''} {_listed(silent)} of this job did not report {stage} within "
            f"{timeout_s:.0f} s (each process compares its config, code, tokenizer and prompts with the others' "
            "before the first step): it failed or hangs at its start; its own log says why")
    failed = [(i, f[FAILED]) for i, f in enumerate(everyone) if FAILED in f]
    if failed:
        raise JobDisagrees("; ".join(f"process {i} of this job {FAILED} ({why}); its own log says more"
                                     for i, why in failed))
    said = disagreements(everyone, DESCRIBED)
    if said:
        raise JobDisagrees("the processes of this job differ, where every process must hold the same (the same "
                           "config, code, tokenizer and prompt files on each host): " + "; ".join(said))


def agree_in_job(stage: str, facts: Callable[[], dict[str, object]]) -> None:
    """`agree` for this process of a joined job (`facts` computed only when there are several processes)."""
    import jax
    if jax.process_count() > 1:
        agree(stage, facts(), process_index=jax.process_index(), process_count=jax.process_count())


def failed_in_job(stage: str, error: BaseException) -> None:
    """`report_failure` for this process of a joined job (nothing alone)."""
    import jax
    if jax.process_count() > 1:
        report_failure(stage, error, process_index=jax.process_index(), process_count=jax.process_count())
