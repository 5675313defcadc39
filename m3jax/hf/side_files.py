"""The files of a checkpoint directory beside its weights and its config: the tokenizer, the chat template, the
generation and processor configs, the model card and license. An export or a conversion carries them from the
checkpoint it came from, so the result loads and serves as its source did (`AutoTokenizer.from_pretrained`,
`vllm serve`): before, a trained policy's export held config.json and safetensors only, and every tool that
reads the tokenizer from the model's directory failed on it."""

from __future__ import annotations

import logging
import os
import shutil

log = logging.getLogger(__name__)

# Weights in any format (the writer writes its own safetensors; another format's weights are the source's, not
# the new model's) and the files the writer itself writes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz", ".pkl")
WRITTEN = ("config.json",)
# A side file is text-sized: a release's tokenizer.json is ~15 MB. Anything larger is weights under a name this
# list does not know, and copying it into a new model's checkpoint would be wrong, so it is left out (said).
MAX_SIDE_FILE_BYTES = 256 * 2**20


def side_files(src: str | os.PathLike | None) -> list[str]:
    """Paths of the files directly in checkpoint directory `src` that a checkpoint written from it carries: every
    regular file (a link is followed, as in a hub cache's snapshot) but weights, safetensors indexes, config.json,
    hidden files and files over MAX_SIDE_FILE_BYTES; subdirectories are not carried. [] without `src`."""
    if src is None:
        return []
    src = os.fspath(src)
    out = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if (name.startswith(".") or name in WRITTEN or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")
                or not os.path.isfile(path)):
            continue
        size = os.path.getsize(path)
        if size > MAX_SIDE_FILE_BYTES:
            log.warning("%s: %.0f MB, not carried into the checkpoint written from %s (a side file such as a "
                        "tokenizer is smaller than %d MB; this looks like weights)", path, size / 2**20, src,
                        MAX_SIDE_FILE_BYTES // 2**20)
            continue
        out.append(path)
    return out


def copy_side_files(paths: list[str], directory: str) -> None:
    """Copy `paths` (from `side_files`) into `directory`, contents and modes (a link's target's)."""
    for path in paths:
        shutil.copy2(path, os.path.join(directory, os.path.basename(path)))
