"""python -m m3jax.convert on bad destinations and sources: one error line naming what was given. A destination
inside the source was written into it; one under a file was reported by its temporary name; a file given as the
source was "not valid JSON"; a mesh larger than the machine said "1 are available"."""

import os

import pytest

from m3jax import ConfigError, M3Config
from m3jax.hf.convert import convert_checkpoint
from m3jax.hf.save import check_destination
from sharding.mesh import MeshConfig, MeshError, validate
from tests.test_bad_checkpoints import ckpts, copy  # noqa: F401  (ckpts: the module fixture)


def test_a_destination_inside_the_source_is_refused(ckpts, tmp_path):  # noqa: F811
    d = copy(ckpts, "native", tmp_path)
    before = sorted(os.listdir(d))
    with pytest.raises(FileExistsError, match=f"destination {d}/sub lies inside the checkpoint being read"):
        convert_checkpoint(d, os.path.join(d, "sub"), "released")
    assert sorted(os.listdir(d)) == before


def test_a_destination_under_a_file_names_the_file(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileExistsError, match=f"destination {tmp_path}/afile/sub/x: {tmp_path}/afile is a file"):
        check_destination(tmp_path / "afile" / "sub" / "x")


def test_a_file_given_as_the_source_says_it_is_not_a_directory(tmp_path):
    (tmp_path / "good.jsonl").write_text('{"prompt": "1", "answer": "1"}\n{"prompt": "2", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=f"{tmp_path}/good.jsonl is not a directory, nor a config.json"):
        M3Config.from_pretrained(tmp_path / "good.jsonl")


def test_one_device_is_singular():
    with pytest.raises(MeshError, match="2 devices, but 1 is available"):
        validate(MeshConfig(2, 1, 1, 1), num_devices=1)
