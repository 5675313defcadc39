"""Prompts that fit the generation width: every record of a prompt file rendered once at load, and the ones
longer than `generation.max_prompt_tokens` refused by row or dropped (`data.overlong_prompts`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from rl.data import DatasetError, PromptRecord, has_chat_template, render_prompt

log = logging.getLogger(__name__)

OVERLONG_PROMPTS = ("error", "drop")


def fit_prompt_lengths(records: Sequence[PromptRecord], tokenizer, limit: int, *, chat_template: bool,
                       overlong: str = "error", limit_key: str = "generation.max_prompt_tokens",
                       vocab_size: int | None = None) -> tuple[list[PromptRecord], list[list[int]]]:
    """(records, their rendered prompt ids) that fit in `limit` tokens, rendered as `render_prompt` renders
    them for generation, checked once at load rather than at the step that draws an overlong prompt (which
    then fails after its generation, or runs past the training row's width).

    overlong "error": raise one DatasetError naming the first overlong row (its file and row), its length, how
    many rows are overlong and the longest; "drop": leave them out (an error if none is left), as verl's
    filter_overlong_prompts does. Returns the kept records and ids, in order.
    vocab_size (the model's): a prompt rendering to an id past it raises DatasetError naming the row: the tokenizer
    is not the model's (the engine would refuse that request at the step that drew it). So does a prompt that
    renders to no tokens.
    """
    if overlong not in OVERLONG_PROMPTS:
        raise ValueError(f"overlong={overlong!r}: expected one of {OVERLONG_PROMPTS}")
    chats = sum(not isinstance(r.prompt, str) for r in records)
    if chats and not chat_template and getattr(tokenizer, "chat_template", None):
        log.warning("%d of %d prompts are chat messages and are rendered without the tokenizer's chat template "
                    "(data.chat_template: false): their contents joined by blank lines, roles and template dropped; "
                    "set data.chat_template=true to render them as the model was tuned to read them",
                    chats, len(records))
    if records and chat_template and not has_chat_template(tokenizer):
        log.warning("data.chat_template is true but the tokenizer has no chat template: the %d prompts are rendered "
                    "as plain text (a chat's contents joined by blank lines, its roles dropped)", len(records))
    _warn_if_rendered_already(records, tokenizer, chat_template and has_chat_template(tokenizer))
    ids = [_rendered(r, tokenizer, chat_template) for r in records]
    for r, x in zip(records, ids):  # the engine refuses an empty request: at the step that drew it, hours in
        if not x:
            raise DatasetError(r.meta.get("source", "<records>"), (
                "the prompt renders to no tokens (its text, or every message's content, is empty); expected a "
                "prompt with text"), row=r.meta.get("row"))
    if vocab_size is not None:
        for r, x in zip(records, ids):
            if x and max(x) >= vocab_size:
                raise DatasetError(r.meta.get("source", "<records>"), (
                    f"the prompt renders to token id {max(x)}, past the model's vocab_size {vocab_size}; expected "
                    "the model's own tokenizer (its directory's tokenizer files), which this one is not"),
                    row=r.meta.get("row"))
    over = [i for i, x in enumerate(ids) if len(x) > limit]
    if not over:
        return list(records), ids
    first = records[over[0]]
    source, row = first.meta.get("source", "<records>"), first.meta.get("row")
    longest = max(len(ids[i]) for i in over)
    if overlong == "error":
        raise DatasetError(source, (
            f"the prompt renders to {len(ids[over[0]])} tokens, over {limit_key} = {limit} ({len(over)} of "
            f"{len(records)} prompts are, the longest {longest} tokens); expected prompts of at most {limit} "
            f"tokens: raise {limit_key}, shorten them, or set data.overlong_prompts: drop"), row=row)
    keep = sorted(set(range(len(records))) - set(over))
    if not keep:
        raise DatasetError(source, f"every one of the {len(records)} prompts renders to more than {limit_key} = "
                                   f"{limit} tokens (the shortest {min(map(len, ids))}); expected at least one "
                                   "prompt that fits")
    log.warning("%s: dropped %d of %d prompts longer than %s = %d tokens (data.overlong_prompts: drop; the "
                "longest %d)", source, len(over), len(records), limit_key, limit, longest)
    return [records[i] for i in keep], [ids[i] for i in keep]


def _warn_if_rendered_already(records: Sequence[PromptRecord], tokenizer, templated: bool) -> None:
    """A warning where string prompts already hold the tokenizer's special tokens (its BOS, a chat template's turn
    markers): exported datasets often store prompts a chat template rendered. Through the template again the whole
    rendering became one user message inside another; encoded plainly it gained a second BOS (now dropped,
    `rl.data.render_prompt`). Said, not refused: a prompt may quote such tokens."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str) and len(t) > 1
                and t != getattr(tokenizer, "pad_token", None) and t != getattr(tokenizer, "unk_token", None)]
    if not specials:
        return
    held = [r for r in records if isinstance(r.prompt, str) and any(t in r.prompt for t in specials)]
    if not held:
        return
    first = held[0]
    found = sorted({t for t in specials if t in first.prompt})
    what = ("data.chat_template: true renders each inside the chat template again (a rendered conversation "
            "inside a user message); set data.chat_template=false to read them as they are" if templated else
            "they are encoded as they are (a BOS they start with is not doubled)")
    log.warning("%d of %d string prompts already hold the tokenizer's special tokens (%s in %s row %s): they look "
                "rendered by a chat template; %s", len(held), len(records), ", ".join(found),
                first.meta.get("source", "<records>"), first.meta.get("row"), what)


def _rendered(record: PromptRecord, tokenizer, chat_template: bool) -> list[int]:
    """`render_prompt`, its failure (a chat template that refuses the messages' roles or order, text that does not
    encode) raised as the DatasetError of the record's file and row: it escaped the load as a bare traceback."""
    try:
        return render_prompt(record, tokenizer, chat_template=chat_template)
    except Exception as e:  # noqa: BLE001 - jinja2's, the tokenizer's: the row is what the user needs
        _raise_if_the_template_is_broken(e, tokenizer)
        how = "with the tokenizer's chat template" if chat_template and has_chat_template(tokenizer) else "as text"
        raise DatasetError(record.meta.get("source", "<records>"), (
            f"the prompt does not render {how} ({type(e).__name__}: {str(e)[:200]}); expected messages the "
            "template takes (its roles, in its order) and text that encodes as UTF-8"),
            row=record.meta.get("row")) from None


def _raise_if_the_template_is_broken(error: Exception, tokenizer) -> None:
    """A chat template that is not Jinja at all fails on every row alike: it was reported as a fault of the prompt
    file's first row. It is the model directory's tokenizer that needs the fix."""
    jinja2 = sys.modules.get("jinja2")  # not imported: no template was compiled (and jinja2 may not be installed)
    if jinja2 is not None and isinstance(error, jinja2.TemplateSyntaxError):
        from m3jax.hf.safetensors_io import CheckpointError
        raise CheckpointError(
            f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}: its chat template is not valid Jinja "
            f"({error.message}, line {error.lineno} of the template); expected a template transformers' "
            "apply_chat_template compiles (chat_template.jinja or tokenizer_config.json's chat_template), or "
            "data.chat_template=false to encode the prompts as text") from None
