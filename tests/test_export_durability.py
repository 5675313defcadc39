"""An export or a conversion is on disk when it returns: every file it wrote and the directory's entries are
synced before the directory is renamed into place, and its parent after. Before, only the shards were: a crash
soon after could leave the directory in place with an empty config.json or index (nothing loads it)."""

import os

import pytest

import m3jax
from m3jax.hf.convert import convert_checkpoint
from tests.test_bad_checkpoints import ckpts, copy  # noqa: F401  (ckpts: the module fixture)


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync is called on, in order (read back from the descriptor)."""
    got = []
    real = os.fsync

    def record(fd):
        got.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", record)
    return got


@pytest.mark.parametrize("how", ["save", "convert"])
def test_every_file_and_the_directory_are_synced_before_the_rename(ckpts, tmp_path, synced, how):  # noqa: F811
    src = copy(ckpts, "native", tmp_path)
    open(os.path.join(src, "tokenizer_config.json"), "w").close()  # a side file the export carries
    dst = str(tmp_path / "out")
    if how == "save":
        m3jax.save_pretrained(m3jax.from_pretrained(src), dst, max_shard_size="100KB", carry_from=src)
    else:
        convert_checkpoint(src, dst, "native", max_shard_size="100KB")
    written = sorted(os.listdir(dst))
    assert "model.safetensors.index.json" in written and "tokenizer_config.json" in written
    tmp = {os.path.dirname(p) for p in synced if os.path.basename(p) == "config.json"}
    assert len(tmp) == 1  # synced where it was written, before the rename
    tmp = tmp.pop()
    assert tmp.startswith(dst + ".tmp-") and tmp in synced  # and the directory's entries
    assert {os.path.basename(p) for p in synced if os.path.dirname(p) == tmp} == set(written)
    assert synced[-1] == str(tmp_path)  # the rename, made durable last
