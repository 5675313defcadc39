"""A HF checkpoint on two CPU processes joined with jax.distributed (slow: subprocesses): each exports the tensors
its devices hold, a host that cannot write stops the export everywhere, and a NaN only one host reads stops both."""

import glob
import json
import os
import re

import numpy as np
import pytest

import m3jax
from tests import reference as ref
from tests.test_multihost import tiny_checkpoint, two_processes


@pytest.mark.slow
def test_two_hosts_export_what_they_hold_side_by_side(tmp_path):
    """Each process writes the tensors its devices hold, into shard files of its own; the directory holds the
    same tensors, config and index as one process's export of the same weights."""
    from safetensors.numpy import load_file
    ckpt = tiny_checkpoint(tmp_path)
    out = tmp_path / "export"
    released = ref.save(ref.build_model(ref.tiny_config("release_like"), seed=3), str(tmp_path / "rel"), "released")
    procs, logs = two_processes(ckpt, str(tmp_path / "logits.npy"), "--export", str(out),
                                "--export-released", str(tmp_path / "export-rel"), released)
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    wrote = [re.search(r"process (\d) wrote (\d+) bytes in (\d+) of the (\d+) shard files", log) for log in logs]
    assert all(wrote), "\n".join(logs)[-4000:]
    share = [int(m.group(2)) for m in wrote]
    assert all(s > 0.3 * sum(share) for s in share), share  # both hosts wrote, about half each
    assert sum(int(m.group(3)) for m in wrote) == int(wrote[0].group(4)) == len(list(out.glob("*.safetensors")))
    one = m3jax.save_pretrained(m3jax.from_pretrained(ckpt), str(tmp_path / "one"))
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    want = load_file(os.path.join(one, "model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(want) and index["metadata"]["total_size"] == sum(share)
    with open(out / "config.json") as f, open(os.path.join(one, "config.json")) as g:
        assert json.load(f) == json.load(g)
    assert not list(tmp_path.glob("export.tmp-*"))
    # the released export carries the source's vision tower (written by process 0): one process's export, bitwise
    one = m3jax.save_pretrained(m3jax.from_pretrained(released), str(tmp_path / "one-rel"), layout="released",
                                carry_from=released)
    got, want = ({k: v for f in glob.glob(os.path.join(d, "*.safetensors")) for k, v in load_file(f).items()}
                 for d in (str(tmp_path / "export-rel"), one))
    vision = {k for f in glob.glob(os.path.join(released, "*.safetensors")) for k in load_file(f)
              if k.startswith("vision_tower.")}
    assert vision and vision <= set(want)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_host_that_cannot_write_its_shards_stops_the_export_everywhere(tmp_path):
    """One host's disk is full: both processes raise (neither waits for the other), and no directory, whole or
    temporary, is left behind."""
    ckpt = tiny_checkpoint(tmp_path)
    procs, logs = two_processes(ckpt, "-", "--export", str(tmp_path / "export"), "--export-fails-on", "1")
    assert all(p.returncode != 0 for p in procs), "\n".join(logs)[-4000:]
    assert "process(es) 1 failed at writing the shards" in logs[0], logs[0][-3000:]
    assert "No space left on device" in logs[1], logs[1][-3000:]
    assert not list(tmp_path.glob("export*"))


@pytest.mark.slow
def test_a_nonfinite_expert_read_by_one_host_stops_both(tmp_path):
    """Each process reads only its own experts, so only the host holding the poisoned one sees it; both must
    refuse the checkpoint (the other one would wait at its first collective), the holder naming the tensor."""
    from tests.test_bad_checkpoints import edit_tensor
    ckpt = tiny_checkpoint(tmp_path)
    name = "model.layers.2.mlp.experts.down_proj"

    def poison(t):  # the last expert's last weight: on the second process's devices
        t[name] = t[name].copy()
        t[name].reshape(-1)[-1] = np.nan
    edit_tensor(ckpt, name, poison)
    procs, logs = two_processes(ckpt, "-", "--refused")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    refused = [re.search(r"REFUSED: (.*)", log).group(1) for log in logs]
    assert "process(es) 1 read weights holding NaN or Inf" in refused[0] and name not in refused[0]
    assert f"tensor {name}" in refused[1] and "holds 1 NaN or Inf value" in refused[1]
