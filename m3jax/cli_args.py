"""Argument types the user commands share."""

from __future__ import annotations

import argparse


def path_argument(text: str) -> str:
    """A file or directory argument: an empty one (a shell variable that was not set, `--export ""`) is refused
    by argparse with one line. Taken as "no value", it made `m3jax.train --export ""` train the run, and
    `m3jax.eval --hf ""` score the run's checkpoint instead."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an empty path; expected a file or directory")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: a path with a NUL byte; expected a file or directory")
    return text


def description(doc: str) -> str:
    """What a command does, for its --help: the first paragraph of its module docstring after the usage lines
    (argparse prints the usage itself; repeated as the description, it said nothing of what the command does)."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    return paragraphs[1] if len(paragraphs) > 1 else paragraphs[0]
