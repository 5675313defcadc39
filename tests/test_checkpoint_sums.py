"""rl.checkpoint_sums: every array of a checkpoint is checksummed at its save and checked at its restore, so bytes
changed on disk (bit rot, a bad copy), which orbax restores without a word, make the checkpoint unreadable: the
resume falls back to the one before, as for a file that does not read."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl.checkpoint import Checkpointer, CheckpointsUnreadable
from rl.checkpoint_sums import KEY, checksums, problem
from sharding import optim_step
from sharding.train_step import init_state
from tests.test_checkpoint import LOGGER, assert_bitwise, build_model, meta_of, warnings_of

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as test_checkpoint's


def numpy_checksum(x) -> list:
    """The module docstring's formula, in numpy."""
    a = np.asarray(x)
    words = (a.astype(np.uint8) if a.dtype == np.bool_ else a).view(
        {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.uint64).ravel()
    index = np.arange(words.size, dtype=np.uint64)
    return [int(words.sum() % 2**32), int((words * (2 * index + 1)).sum() % 2**32), str(a.dtype)]


def arrays() -> dict:
    rng = np.random.default_rng(0)
    return {"f32": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
            "bf16": jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.bfloat16),
            "i32": jnp.asarray(rng.integers(-2**31, 2**31 - 1, (16,)), jnp.int32),
            "u8": jnp.asarray(rng.integers(0, 255, (8, 3)), jnp.uint8),
            "flag": jnp.asarray(rng.random((8,)) < 0.5), "count": jnp.int32(12345)}


def test_the_checksums_are_the_formula_on_any_layout():
    x = arrays()
    want = {f"state/{k}": numpy_checksum(v) for k, v in x.items()}
    assert checksums({"state": x}) == want
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    specs = {"f32": P("a", "b"), "bf16": P(None, "b", "a"), "i32": P(("a", "b")), "u8": P("a"), "flag": P("b"),
             "count": P()}
    sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in x.items()}
    assert checksums({"state": sharded}) == want
    # a KL reference held in host memory (grpo.reference_memory: host)
    host = {k: jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for k, v in sharded.items()}
    assert checksums({"state": host}) == want


def test_a_changed_element_or_two_swapped_are_named():
    x = arrays()
    kept = checksums({"state": x})
    assert problem(kept, {"state": x}) is None
    assert problem(None, {"state": x}) is None  # a checkpoint saved before checksums were kept
    one_bit = dict(x, f32=jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x["f32"], jnp.uint32).at[3, 4].add(1 << 20), jnp.float32))
    assert problem(kept, {"state": one_bit}).startswith("state/f32 does not match the checksum taken when it was saved")
    swapped = dict(x, i32=x["i32"].at[2].set(x["i32"][9]).at[9].set(x["i32"][2]))
    assert problem(kept, {"state": swapped}).startswith("state/i32 does not match")
    # restored into another dtype (Adam's moments under another precision.moment_dtype): not the saved bytes
    assert problem(kept, {"state": dict(x, f32=x["f32"].astype(jnp.bfloat16))}) is None
    assert problem({}, {"state": x}) is None
    assert problem({"state/f32": kept["state/f32"]}, {"state": x}) == "its meta keeps no checksum of state/bf16"


@pytest.fixture(scope="module")
def states():
    """Two fp32 states of the test_checkpoint model (steps 2 and 4 of a run) and a fresh one to restore into."""
    opt = optim_step.adamw(1e-3, weight_decay=0.1, master="none")
    _, fresh = init_state(build_model(jnp.float32), opt)
    fresh = jax.device_put(fresh, jax.devices()[0])
    s4 = jax.tree.map(lambda v: v * 1.5 + 0.25 if jnp.issubdtype(v.dtype, jnp.floating) else v + 4, fresh)
    return fresh, jax.tree.map(lambda v: v + 0, fresh), s4


def flip_a_bit(directory: str, step: int, item: str) -> str:
    """One bit flipped in the middle of the largest data file of `item` in checkpoint `step`; returns the file."""
    files = [f for f in glob.glob(os.path.join(directory, str(step), item, "**"), recursive=True) if os.path.isfile(f)]
    data = max(files, key=os.path.getsize)
    assert os.path.basename(os.path.dirname(data)) == "d" and os.path.getsize(data) > 100_000, data
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)[0]
        f.seek(os.path.getsize(data) // 2)
        f.write(bytes([byte ^ 0x10]))
    return data


def test_a_bit_flipped_on_disk_falls_back_to_the_checkpoint_before(states, tmp_path, caplog):
    fresh, s2, s4 = states
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, async_save=False)
    ck.save(2, s2, meta_of(2))
    ck.save(4, s4, meta_of(4))
    ck.close()
    flip_a_bit(d, 4, "state")
    reader = Checkpointer(d, read_only=True)
    try:
        with pytest.raises(CheckpointsUnreadable, match=r"checkpoint step 4 in .* is unreadable \(state/.* does not "
                                                        r"match the checksum taken when it was saved .*: its bytes "
                                                        r"changed on disk\)"):
            reader.restore_step(4, fresh)
        got, meta = reader.restore_step(2, fresh)
        assert meta == meta_of(2)  # the checksums are the checkpointer's own: not in the meta it gives back
        assert reader.read_meta(2) == meta_of(2)
    finally:
        reader.close()
    ck = Checkpointer(d)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            got, meta = ck.restore_latest(fresh)
    finally:
        ck.close()
    assert meta == meta_of(2)
    assert_bitwise(got, s2)
    assert any("step 4" in w and "changed on disk" in w and "trying the previous one" in w
               for w in warnings_of(caplog)), warnings_of(caplog)
    assert sorted(os.listdir(d)) == ["2", "4.unreadable"]


def test_a_damaged_reference_stops_the_resume_with_its_name(states, tmp_path):
    """The KL reference (saved after a reset) is checked when it is restored, after its step's state."""
    fresh, s2, s4 = states
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, async_save=False)
    ck.save(2, s2, meta_of(2), reference=s4.params)
    ck.close()
    ck = Checkpointer(d)
    try:
        _, meta = ck.restore_latest(fresh)
        assert meta == meta_of(2)
        assert_bitwise(ck.restore_reference(2, fresh.params), s4.params)
        flip_a_bit(d, 2, "reference")
        ck.restore_latest(fresh)  # the state is intact
        with pytest.raises(CheckpointsUnreadable, match=r"checkpoint step 2 in .* is damaged \(reference/.* does "
                                                        r"not match the checksum .*\): move it aside \(to "
                                                        r".*2\.unreadable\) to resume from the checkpoint before it"):
            ck.restore_reference(2, fresh.params)
    finally:
        ck.close()
    assert KEY not in meta
