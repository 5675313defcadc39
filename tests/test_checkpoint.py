"""rl.checkpoint: a checkpoint restores into any precision mode and onto any mesh; damaged and interrupted
checkpoints fall back to the previous step; the JSON meta comes back unchanged.

One tiny model (one dense/full-attention layer, one MoE/sparse-attention layer, 8 experts) is trained 2
steps in each precision kind (param dtype x master mode x moment dtype); each run saves step 2 and keeps its
own step 3 (one more step from step 2) as "the original run continuing". The loss is linear in the params
with per-step random bf16-exact coefficients: every kind sees the same gradients, so a restored run's next
step can be compared with the saved run's across kinds, and a step compiles in seconds.
"""

import gc
import glob
import logging
import os
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax import M3Config, M3ForCausalLM
from rl.checkpoint import Checkpointer, CheckpointsUnreadable
from sharding import optim_step, precision
from sharding.mesh import MeshConfig, build_mesh
from sharding.train_step import init_state, make_train_step, state_shardings

CFG = M3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
               num_local_experts=8, num_experts_per_tok=2, partial_rotary_factor=0.5,
               layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"),
               index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2)
LR = 1e-3
# name: (param dtype, master mode, Adam moment dtype)
KINDS = {
    "fp32": (jnp.float32, "none", jnp.float32),
    "bf16_master": (jnp.bfloat16, "fp32", jnp.float32),
    "bf16_compact": (jnp.bfloat16, "compact", jnp.float32),
    "bf16_compact_bf16m": (jnp.bfloat16, "compact", jnp.bfloat16),
}
LOGGER = "rl.checkpoint"
# A failed orbax restore leaves its unfinished read coroutines to the garbage collector, which reports them
# as unraisable exceptions: the tests that damage checkpoints collect them at once, under this filter.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Run(NamedTuple):
    step: Any  # jitted train step of this kind
    fresh: Any  # freshly initialised TrainState (the `like` of a resuming run)
    s2: Any  # after 2 steps: saved as step 2 in `dir`
    s3: Any  # the original run continuing: s2 + one step on batches[2]
    dir: str


def meta_of(step: int) -> dict:
    return {"step": step, "data": {"seed": 7, "epoch": 1, "index": 5 * step + 3, "num_records": 40}, "seed": 3,
            "weight_version": step}


def coefficients(params, seed: int) -> list:
    """Per-step random gradients, exactly representable in bf16 (so fp32 and bf16 params get the same)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((1, *p.shape)).astype(jnp.bfloat16).astype(np.float32))
            for p in jax.tree.leaves(params)]


def linear_loss(model, batch):
    """sum over every param of param * coefficient: the gradient is the batch's coefficients whatever the
    param dtype, so runs of different precision kinds take the same optimizer steps (and a step compiles in
    a fraction of the model's forward/backward)."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(jnp.sum(p.astype(jnp.float32) * c) for p, c in zip(params, batch["coef"], strict=True)), {}


def make_batch(params, seed: int) -> dict:
    return {"coef": coefficients(params, seed), "loss_mask": jnp.ones((1, 1), jnp.float32)}


def build_model(dtype):
    """The model with random weights drawn on the host (the same values for both dtypes; the router and
    its bias stay fp32), including a non-trivial router correction bias in the non-trainable state."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: M3ForCausalLM(CFG, dtype=dtype, remat=False)))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray((0.05 * rng.standard_normal(s.shape)).astype(s.dtype)), state)
    return nnx.merge(graphdef, state)


def bits(x) -> np.ndarray:
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def assert_donatable(state):
    """No buffer appears twice among the leaves: the train step donates the whole state, and PJRT refuses a
    buffer donated twice (a resumed compact-master run with an fp32 router then crashed at its first step)."""
    buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state) if x.size]
    assert len(set(buffers)) == len(buffers)


def assert_bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(bits(x), bits(y))


# jitted once per state layout (eagerly, every op would compile once per parameter shape)
_master_of = jax.jit(precision.master_of)
params_from_master = jax.jit(precision.params_from_master)
cast_like = jax.jit(lambda tree, like: jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like))


def master(state):
    return _master_of(state.params, state.opt_state)


def adam(state) -> precision.ScaleByAdamState:
    (found,) = [s for s in state.opt_state.inner if isinstance(s, precision.ScaleByAdamState)]
    return found


def save(directory, step, state, meta=None):
    ck = Checkpointer(directory)
    ck.save(step, state, meta_of(step) if meta is None else meta)
    ck.close()


def restore(directory, like):
    """What a resuming run does: a fresh Checkpointer on the directory, restore_latest(like)."""
    ck = Checkpointer(directory)
    try:
        return ck.restore_latest(like)
    finally:
        ck.close()
        gc.collect()  # see pytestmark


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    """Three steps' batches."""
    shapes = nnx.state(nnx.eval_shape(lambda: M3ForCausalLM(CFG)), nnx.Param)
    return [make_batch(shapes, seed) for seed in range(3)]


class Runs(dict):
    """kind -> Run, each kind trained (one compile of its step) the first time a test asks for it."""

    def __init__(self, root, batches):
        super().__init__()
        self.root, self.batches, self.models = root, batches, {}

    def __missing__(self, name: str) -> Run:
        dtype, mode, moments = KINDS[name]
        if dtype not in self.models:
            self.models[dtype] = build_model(dtype)
        opt = optim_step.adamw(LR, weight_decay=0.1, moment_dtype=moments, master=mode)
        graphdef, fresh = init_state(self.models[dtype], opt)
        # committed to one device, like every restored array (else the step compiles again for those)
        fresh = jax.device_put(fresh, jax.devices()[0])
        step = make_train_step(graphdef, opt, linear_loss, donate=False)
        state = fresh
        for batch in self.batches[:2]:
            state, metrics = step(state, batch)
            assert not bool(metrics["skipped"])
        s3, _ = step(state, self.batches[2])
        save(str(self.root / name), 2, state)
        self[name] = Run(step, fresh, state, s3, str(self.root / name))
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, batches) -> dict[str, Run]:
    return Runs(tmp_path_factory.mktemp("runs"), batches)


# ------------------------------------------------------------------------------ precision changes
# (saved kind, restoring kind) -> how the restored run's next step compares with the saved run's own:
#   "bitwise": the same step (same kind, or fp32 master <-> compact, which are bitwise equal by design);
#   "same":    the same arithmetic in another compiled program (fp32 params <-> bf16 + master, bf16 moments
#              upcast to fp32): the master moves the same up to float rounding;
#   "cast":    fp32 moments restored as bf16: the master moves the same up to the moments' bf16 rounding.
PAIRS = {
    ("fp32", "fp32"): "bitwise",
    ("fp32", "bf16_master"): "same",
    ("fp32", "bf16_compact"): "same",
    ("bf16_compact", "fp32"): "same",
    ("bf16_master", "bf16_compact"): "bitwise",
    ("bf16_compact", "bf16_master"): "bitwise",
    ("bf16_compact", "bf16_compact"): "bitwise",
    ("bf16_compact", "bf16_compact_bf16m"): "cast",
    ("bf16_compact_bf16m", "bf16_compact"): "same",
    ("bf16_compact_bf16m", "bf16_compact_bf16m"): "bitwise",
}
# bounds on |master step of the restored run - master step of the saved run|, in units of the learning rate:
# (mean, max). Float rounding: a few ulps of the master; bf16 moments: ~2^-8 of a step (Adam steps are ~LR).
# A restarted optimizer (count 0, zero moments) from the same weights is off by ~0.4 on average.
TOLERANCE = {"same": (1e-5, 1e-3), "cast": (1e-2, 5e-2)}


# The fast loop restores fp32 params into the compact bf16 master; the other pairs (the way back, each mode
# into itself, an fp32 master copy, bf16 moments) run in the full suite.
FAST_PAIRS = {("fp32", "bf16_compact")}


# An fp32 master and the compact one restore into each other's step bit for bit: two programs, whose model part
# XLA:CPU compiles alike under its default fusion emitters (tests/conftest.py).
ACROSS_PROGRAMS = {("bf16_master", "bf16_compact"), ("bf16_compact", "bf16_master")}


def _pair_marks(pair) -> list:
    return ([] if pair in FAST_PAIRS else [pytest.mark.slow]) + ([pytest.mark.xla_defaults] if pair in ACROSS_PROGRAMS else [])


@pytest.mark.parametrize("src, dst", [pytest.param(*p, marks=_pair_marks(p)) for p in PAIRS],
                         ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_restore_into_another_precision_mode(runs, batches, src, dst):
    saved, target = runs[src], runs[dst]
    got, meta = restore(saved.dir, target.fresh)
    assert meta == meta_of(2)
    assert_donatable(got)

    # the layout of the restoring run (dtypes; remainder, master or nothing), filled from the saved master
    assert jax.tree.structure(got) == jax.tree.structure(target.fresh)
    assert [x.dtype for x in jax.tree.leaves(got)] == [x.dtype for x in jax.tree.leaves(target.fresh)]
    want_master = master(saved.s2)  # the fp32 params of a "none" run, the exact master of a bf16 run
    assert_bitwise(master(got), want_master)
    assert_bitwise(got.params, params_from_master(want_master, target.fresh.params))
    if KINDS[dst][1] == "fp32":
        assert_bitwise(got.opt_state.master, want_master)
    assert_bitwise(got.rest, saved.s2.rest)
    assert int(got.step) == 2 and int(got.skipped) == 0
    # moments and counters: the saved values cast to the restoring run's moment dtype
    assert_bitwise(got.opt_state.inner, cast_like(saved.s2.opt_state.inner, target.fresh.opt_state.inner))
    assert int(adam(got).count) == 2

    nxt, metrics = target.step(got, batches[2])
    assert not bool(metrics["skipped"]) and int(nxt.step) == 3 and int(adam(nxt).count) == 3
    how = PAIRS[(src, dst)]
    if how == "bitwise":
        assert_bitwise(nxt.params, saved.s3.params)
        assert_bitwise(master(nxt), master(saved.s3))
        assert_bitwise(nxt.opt_state.inner, saved.s3.opt_state.inner)
        assert_bitwise(nxt.rest, saved.s3.rest)
        return
    restart, _ = target.step(got._replace(opt_state=target.fresh.opt_state._replace(master=got.opt_state.master)),
                             batches[2])
    mean_tol, max_tol = TOLERANCE[how]
    for path, a, b, r, p in zip(jax.tree_util.tree_leaves_with_path(nxt.params), jax.tree.leaves(master(nxt)),
                                jax.tree.leaves(master(saved.s3)), jax.tree.leaves(master(restart)),
                                jax.tree.leaves(want_master), strict=True):
        name = jax.tree_util.keystr(path[0])
        step_got, step_want, step_restart = (np.asarray(x, np.float64) - np.asarray(p, np.float64) for x in (a, b, r))
        err = np.abs(step_got - step_want) / LR
        assert err.mean() <= mean_tol and err.max() <= max_tol, (name, err.mean(), err.max())
        assert np.mean(np.abs(step_restart - step_want)) / LR > 0.1, name  # the bounds would catch a restart


# ---------------------------------------------------------------------------------- mesh changes
@pytest.mark.slow  # restores onto an 8-device mesh and compiles there
def test_restore_onto_a_mesh_and_back(runs, tmp_path):
    """Saved on one device, restored onto a (2, 2, 2, 1) mesh in the layout of the new run's shardings
    (given by `like`), saved from there and restored onto one device. (fp32 "none" kind: the precision
    conversions are the tests above; on a mesh each eager conversion op would compile once per shape.)"""
    run = runs["fp32"]
    layout = build_mesh(MeshConfig(2, 2, 2, 1), CFG)
    mesh = layout.mesh
    shardings = state_shardings(layout, run.fresh)
    like = jax.device_put(jax.tree.map(np.asarray, run.fresh), shardings)  # the new run's state, placed
    got, meta = restore(run.dir, like)
    assert meta == meta_of(2)
    assert_bitwise(got, run.s2)
    for x, sh in zip(jax.tree.leaves(got), jax.tree.leaves(shardings), strict=True):
        assert x.sharding.is_equivalent_to(sh, x.ndim), (x.shape, x.sharding, sh)
    for tree in (got.params, adam(got).mu):  # experts spread over data x context x expert = 8 devices
        experts = tree["stacks"][1]["experts_gate_up"][...]
        assert len(experts.addressable_shards) == 8
        assert {s.device for s in experts.addressable_shards} == set(mesh.devices.flat)
        assert all(s.data.shape[1] == experts.shape[1] // 8 for s in experts.addressable_shards)

    # ... and back: saved from the mesh, restored onto one device
    save(str(tmp_path / "from_mesh"), 2, got)
    back, meta = restore(str(tmp_path / "from_mesh"), run.fresh)
    assert meta == meta_of(2)
    assert_bitwise(back, run.s2)
    device = jax.tree.leaves(run.fresh)[0].sharding.device_set
    assert all(x.sharding.device_set == device for x in jax.tree.leaves(back))


# ------------------------------------------------------------------- damaged and interrupted saves
@pytest.fixture(scope="module")
def two_steps(runs, tmp_path_factory) -> str:
    """A checkpoint directory with steps 2 (= fp32 s2) and 4 (= fp32 s3), saved synchronously."""
    d = str(tmp_path_factory.mktemp("two") / "ckpt")
    ck = Checkpointer(d, async_save=False)
    ck.save(2, runs["fp32"].s2, meta_of(2))
    ck.save(4, runs["fp32"].s3, meta_of(4))
    ck.close()
    return d


def copy_of(src, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    return dst


def damage(directory, step, how):
    """Truncate or delete the largest array data file orbax wrote for `step` (`<step>/state/.../d/<hash>`)."""
    files = [f for f in glob.glob(os.path.join(directory, str(step), "state", "**"), recursive=True)
             if os.path.isfile(f)]
    data = max(files, key=os.path.getsize)
    assert os.path.basename(os.path.dirname(data)) == "d" and os.path.getsize(data) > 100_000, data
    if how == "truncate":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    else:
        os.remove(data)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(runs, batches, two_steps, tmp_path, caplog, how):
    run = runs["fp32"]
    d = copy_of(two_steps, tmp_path)
    damage(d, 4, how)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, meta = restore(d, run.fresh)
    assert meta == meta_of(2)
    assert_bitwise(got, run.s2)
    warned = warnings_of(caplog)
    assert any("step 4" in w and "unreadable" in w for w in warned), warned
    # the reason names what could not be read (TensorStore's innermost error), not a pybind repr cut short
    assert any("Error reading" in w and "See full TensorStore" not in w for w in warned), warned
    assert not any("step 2" in w for w in warned), warned
    # set aside (kept for inspection, no longer a step); a read-only reader (eval, export) moves nothing
    assert sorted(os.listdir(d)) == ["2", "4.unreadable"]
    os.rename(os.path.join(d, "4.unreadable"), os.path.join(d, "4"))
    reader = Checkpointer(d, read_only=True)
    try:
        assert reader.restore_latest(run.fresh)[1] == meta_of(2)
    finally:
        reader.close()
    assert sorted(os.listdir(d)) == ["2", "4"]
    os.rename(os.path.join(d, "4"), os.path.join(d, "4.unreadable"))

    # The resumed run reaches step 4 again and saves it: the unreadable step must not be in the way.
    nxt, _ = run.step(got, batches[2])
    save(d, 4, nxt)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, meta = restore(d, run.fresh)
    assert meta == meta_of(4) and not warnings_of(caplog)
    assert_bitwise(got, run.s3)


def test_a_step_unreadable_on_another_process_is_skipped_by_this_one(runs, two_steps, tmp_path, caplog, monkeypatch):
    """A multi-host resume: step 4 reads here but not on the other process (each reads its own shards). Both must
    resume from step 2; a process deciding alone resumed from step 4 while the other took step 2, and a two-host
    job hung in its first collective. The other process's answers stand in for the job's all-gather."""
    import rl.checkpoint as checkpoint

    other = iter([False, True, False, False])  # step 4: same state, unreadable there; step 2: same state, reads
    monkeypatch.setattr(checkpoint, "_job_max", lambda flag: bool(flag) or next(other), raising=False)
    run = runs["fp32"]
    d = copy_of(two_steps, tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, meta = restore(d, run.fresh)
    assert meta == meta_of(2) and next(other, "none left") == "none left"
    assert_bitwise(got, run.s2)
    assert any("step 4" in w and "another process" in w for w in warnings_of(caplog)), warnings_of(caplog)
    assert sorted(os.listdir(d)) == ["2", "4.unreadable"]  # set aside for the job, as a damaged one is


def test_a_step_unreadable_here_takes_the_barrier_the_others_wait_in(runs, two_steps, tmp_path, monkeypatch):
    """The other side of the test above: step 4 is damaged here and reads on process 0. orbax's restore ends in a
    barrier ('Checkpointer:restore') that a process whose read raised never reaches: it must take it itself, or the
    others' barrier meets its next all-gather (a two-host run failed with "sync_global_devices name mismatch")."""
    import rl.checkpoint as checkpoint

    class TwoProcesses:  # this is process 1 of 2; everything else is jax's
        def __getattr__(self, name):
            return getattr(jax, name)

        process_count, process_index = staticmethod(lambda: 2), staticmethod(lambda: 1)

    barriers = []
    monkeypatch.setattr(checkpoint, "jax", TwoProcesses())
    monkeypatch.setattr(checkpoint, "_job_steps", lambda steps: steps)
    monkeypatch.setattr(checkpoint, "_job_max", bool)  # process 0 read both steps
    monkeypatch.setattr(checkpoint.ocp.multihost, "sync_global_processes", lambda name, **_: barriers.append(name))
    d = copy_of(two_steps, tmp_path)
    damage(d, 4, "truncate")
    assert restore(d, runs["fp32"].fresh)[1] == meta_of(2)
    # (orbax's own barriers, under the patched function too, aside: the restore of step 2 took its own)
    assert [b for b in barriers if b in ("Checkpointer:restore", "rl.checkpoint:set_aside")] == [
        "Checkpointer:restore", "rl.checkpoint:set_aside"], barriers


def test_every_checkpoint_damaged_returns_none_with_warnings(runs, two_steps, tmp_path, caplog):
    """Nothing readable: restore_latest returns None (the trainer then starts from step 0), never silently:
    each unreadable step is named in a warning. Nothing is moved or deleted: when no step reads, the cause
    may be this run's own layout rather than the files."""
    d = copy_of(two_steps, tmp_path)
    damage(d, 4, "truncate")
    damage(d, 2, "delete")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert restore(d, runs["fp32"].fresh) is None
    warned = warnings_of(caplog)
    assert any("step 4" in w for w in warned) and any("step 2" in w for w in warned), warned
    assert {"2", "4"} <= set(os.listdir(d))
    ck = Checkpointer(d)  # one step asked by number (`python -m m3jax.eval --step 4`): one error naming it
    try:
        with pytest.raises(CheckpointsUnreadable, match=f"checkpoint step 4 in {d} is unreadable"):
            ck.restore_step(4, runs["fp32"].fresh)
    finally:
        ck.close()
        gc.collect()


def test_an_interrupted_save_is_ignored_by_readers_and_deleted_by_the_next_run(runs, batches, two_steps, tmp_path, caplog):
    run = runs["fp32"]
    d = copy_of(two_steps, tmp_path)
    tmp = os.path.join(d, "6.orbax-checkpoint-tmp-1712345678901234")  # what a kill during an async save leaves
    os.makedirs(os.path.join(tmp, "state", "d"))
    with open(os.path.join(tmp, "_CHECKPOINT_METADATA"), "w") as f:
        f.write("{not json")
    with open(os.path.join(tmp, "state", "d", "0123abcd"), "wb") as f:
        f.write(os.urandom(4096))
    reader = Checkpointer(d, read_only=True)  # an evaluation or an export of the run deletes nothing
    reader.close()
    assert os.path.isdir(tmp)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, meta = restore(d, run.fresh)
    assert meta == meta_of(4) and not warnings_of(caplog)
    assert_bitwise(got, run.s3)
    # a resuming run deletes the unfinished save (orbax did only when it saved the same step again: one cut short by a
    # full disk held its bytes meanwhile, and for good where that step never came again)
    assert not os.path.exists(tmp) and sorted(os.listdir(d)) == sorted(os.listdir(two_steps))

    # the step the interrupted save was writing can be saved again, and is then the latest
    nxt, _ = run.step(got, batches[0])
    save(d, 6, nxt)
    got, meta = restore(d, run.fresh)
    assert meta == meta_of(6)
    assert_bitwise(got, nxt)


# ------------------------------------------------------------------------------------------ meta
def test_meta_round_trip(runs, tmp_path):
    meta = {"step": 12, "data": {"seed": 1234, "epoch": 3, "index": 0, "num_records": 7473}, "seed": 2 ** 40 + 1,
            "weight_version": 12, "note": "résumé", "ratio": 0.25, "flags": [True, None]}
    d = str(tmp_path / "ckpt")
    save(d, 12, runs["fp32"].s2, meta)
    got = restore(d, runs["fp32"].fresh)[1]
    assert got == meta
    assert all(type(got["data"][k]) is int for k in meta["data"]) and type(got["weight_version"]) is int


def test_keep_best_keeps_the_best_steps_beside_the_newest_across_a_restart(runs, tmp_path):
    """checkpoint.keep_best: the checkpoints of the k best evaluations stay, however old, beside `keep` newest; a
    resumed run (a new checkpointer) keeps them too once told the steps (from the checkpoint's meta)."""
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=1, keep_best=2, async_save=False)
    for step in range(1, 5):
        if step == 2:
            ck.keep_best_steps([2])
        ck.save(step, runs["fp32"].s2, meta_of(step))
    assert ck.steps() == [2, 4]
    ck.close()
    ck = Checkpointer(d, keep=1, keep_best=2, async_save=False)
    ck.keep_best_steps([2])
    ck.save(5, runs["fp32"].s2, meta_of(5))
    assert ck.steps() == [2, 5]
    ck.keep_best_steps([5, 2])  # step 5 entered the two best
    ck.save(6, runs["fp32"].s2, meta_of(6))
    assert ck.steps() == [2, 5, 6]
    ck.keep_best_steps([6, 5])  # and step 6: step 2 is pushed out, and goes at the next save
    ck.save(7, runs["fp32"].s2, meta_of(7))
    assert ck.steps() == [5, 6, 7]
    ck.close()
    ck = Checkpointer(d, keep=1, async_save=False)  # without keep_best: the newest only
    ck.save(8, runs["fp32"].s2, meta_of(8))
    assert ck.steps() == [8]
    ck.close()


def test_a_step_keep_n_removes_is_moved_whole_before_it_is_deleted(runs, tmp_path, monkeypatch):
    """orbax deleted an old step in place, file by file: a run killed meanwhile left it without its metadata, still
    listed as a checkpoint (and for good after the run's last save; a helper's kill fuzz). It is now moved whole into
    `deleted/` (one rename) and removed from there: once the save that moved it has ended (so `keep` checkpoints are
    on disk between saves, not keep + 1), at the run's end, or at the next start."""
    import rl.checkpoint as rc
    d = str(tmp_path / "ckpt")
    removed = []
    monkeypatch.setattr(rc.shutil, "rmtree", lambda path, ignore_errors=False: removed.append(path))  # killed first
    ck = Checkpointer(d, keep=2, async_save=False)
    for step in (1, 2, 3):
        ck.save(step, runs["fp32"].s2, meta_of(step))
    assert ck.steps() == [2, 3] and sorted(os.listdir(os.path.join(d, rc.DELETED))) == ["1"]
    assert sorted(os.listdir(os.path.join(d, rc.DELETED, "1"))) == sorted(os.listdir(os.path.join(d, "3")))
    ck.manager.close()  # the run dies here, its removal undone
    monkeypatch.undo()
    ck = Checkpointer(d, keep=2, async_save=True)  # the next start removes it
    for step in (4, 5):
        ck.save(step, runs["fp32"].s2, meta_of(step))
        ck.check_saves(wait=True)  # as the trainer's next step does: the save has ended, its old step goes
        while ck._remover is not None and ck._remover.is_alive():
            ck._remover.join()
        assert ck.steps() == [step - 1, step] and os.listdir(os.path.join(d, rc.DELETED)) == []
    ck.close()  # the run's end: nothing but the kept checkpoints
    assert sorted(os.listdir(d)) == ["4", "5"]
