"""The expert kernel chosen by timing (`moe_kernel: tune`, and `auto` off a CPU): the shapes it times are the ones
the model runs, the fastest is kept, a failing kernel is left out, the choice is recorded and a restart reads it."""

import json
import logging
import os
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import tiny
from m3jax.model import expert_tuning
from m3jax.model.expert_tuning import ExpertWork, expert_work, needs_timing, tune_moe_kernel
from sharding import kernel_tuning
from sharding.layout import Layout
from sharding.mesh import MeshConfig, build_mesh

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _traced_work(cfg, layout, batch, seq, **options):
    """(rows, gate_up, down shapes, expected_rows) of each grouped_experts call the model's forward traces."""
    from m3jax.model import moe
    seen = []
    real = moe.grouped_experts

    def spy(rows, group_sizes, gate_up, down, **kw):
        seen.append((rows.shape, gate_up.shape, down.shape, rows.dtype, kw["expected_rows"]))
        return real(rows, group_sizes, gate_up, down, **kw)

    moe.grouped_experts = spy
    try:
        model = tiny.m3_model(cfg, layout=layout, **options)
        ids = jnp.asarray(tiny.random_ids(cfg, batch, seq))
        jax.eval_shape(lambda: model(ids))
    finally:
        moe.grouped_experts = real
    return seen


@pytest.mark.parametrize("mesh,capacity", [(None, None), ((2, 1, 2, 2), None), ((1, 2, 4, 1), None),
                                           ((2, 2, 2, 1), 1.5)])
def test_the_work_is_what_the_model_runs(mesh, capacity):
    """Rows of the receive buffer, local experts and their width per device, as traced inside routed_experts."""
    cfg = tiny.m3_config(num_local_experts=8, num_experts_per_tok=2)
    batch, seq = 4, 32
    layout = Layout() if mesh is None else build_mesh(MeshConfig(*mesh), cfg, seq_len=seq, batch=batch)
    seen = _traced_work(cfg, layout, batch, seq, moe_capacity_factor=capacity)
    assert seen
    rows_per_rank = batch // (layout.size("act_batch") if layout.mesh is not None else 1)
    work = expert_work(cfg, layout, rows_per_rank, seq, jnp.float32, capacity_factor=capacity)
    for rows, gate_up, down, dtype, balanced in seen:
        assert rows == (work.rows, work.hidden)
        assert gate_up == (work.experts, 2, work.width, work.hidden) and down == (work.experts, work.hidden, work.width)
        assert dtype == jnp.float32 and balanced == pytest.approx(work.filled / work.experts)


def test_which_settings_are_timed():
    assert needs_timing("tune", "cpu") and needs_timing("auto", "gpu") and needs_timing("auto", "tpu")
    assert not needs_timing("auto", "cpu") and not needs_timing("tiled", "gpu") and not needs_timing("bucketed", "cpu")


def test_candidates_follow_the_device():
    cpu = types.SimpleNamespace(platform="cpu")
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    assert kernel_tuning.candidate_kernels(cpu) == ("ragged_dot", "tiled", "bucketed")
    assert kernel_tuning.candidate_kernels(ampere) == ("ragged_dot", "tiled", "bucketed", "pallas")
    assert kernel_tuning.candidate_kernels(hopper) == ("ragged_dot", "tiled", "bucketed", "pallas", "mosaic")
    assert kernel_tuning.candidate_kernels(jax.local_devices()[0]) == kernel_tuning.PORTABLE


def test_the_fastest_is_kept_and_a_failing_kernel_left_out():
    """Two computations far apart in cost (one product against a chain of 64) and one that cannot compile."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((128, 128)), jnp.float32)

    def make(kernel):
        if kernel == "broken":
            return lambda x: x @ jnp.ones((3, 3))  # shapes that do not contract: fails while tracing
        steps = 1 if kernel == "fast" else 64
        return lambda x: jax.lax.fori_loop(0, steps, lambda _, y: jnp.tanh(y @ x), x)

    for backward in ((), (0,)):
        ms, errors, temps = kernel_tuning.time_candidates(make, [x], ("slow", "fast", "broken"),
                                                          diff_argnums=backward, rounds=3)
        assert set(ms) == set(temps) == {"slow", "fast"} and set(errors) == {"broken"}
        assert "TypeError" in errors["broken"]
        assert kernel_tuning.fastest(ms) == "fast"
    with pytest.raises(ValueError, match="no kernel ran"):
        kernel_tuning.fastest({})


WORK = ExpertWork(rows=256, filled=96, experts=4, hidden=32, width=16, dtype="float32")


def test_timed_once_recorded_then_read(tmp_path, monkeypatch, caplog):
    cfg = tiny.m3_config()
    record = str(tmp_path / "run" / expert_tuning.RECORD_FILE)
    calls = []
    real = expert_tuning.time_expert_kernels

    def counted(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(expert_tuning, "time_expert_kernels", counted)
    first = tune_moe_kernel(cfg, WORK, record, rounds=2)
    saved = json.load(open(record))
    assert first in kernel_tuning.PORTABLE and saved["kernel"] == first and len(calls) == 1
    assert set(saved["ms"]) == set(kernel_tuning.PORTABLE) and saved["errors"] == {}
    assert all(saved["temp_bytes"][k] > 0 for k in kernel_tuning.PORTABLE)  # XLA:CPU says what each allocates
    assert saved["key"]["work"]["rows"] == 256 and saved["key"]["device_kind"] == jax.local_devices()[0].device_kind
    # a restart of the same run: read, not timed, even where another timing could have come out differently
    saved["kernel"] = next(k for k in kernel_tuning.PORTABLE if k != first)
    json.dump(saved, open(record, "w"))
    assert tune_moe_kernel(cfg, WORK, record) == saved["kernel"] and len(calls) == 1
    # other shapes: timed again; without save the record stays as it was
    other = ExpertWork(rows=128, filled=64, experts=4, hidden=32, width=16, dtype="float32")
    with caplog.at_level(logging.WARNING, logger=expert_tuning.__name__):
        tune_moe_kernel(cfg, other, record, save=False, rounds=1)
    assert len(calls) == 2 and json.load(open(record)) == saved
    assert "was measured for" in caplog.text and "'rows': 256" in caplog.text  # why the kernel may change
    assert not [f for f in os.listdir(tmp_path / "run") if f != expert_tuning.RECORD_FILE]  # no temporary left


def test_no_kernel_that_runs_is_an_error_and_an_unwritable_record_a_warning(tmp_path, monkeypatch, caplog):
    cfg = tiny.m3_config()
    monkeypatch.setattr(expert_tuning, "time_expert_kernels", lambda *a, **k: kernel_tuning.Timings(
        {}, {"tiled": "XlaRuntimeError: OOM"}, {}))
    with pytest.raises(RuntimeError, match="no grouped-matmul kernel ran on .*XlaRuntimeError: OOM"):
        tune_moe_kernel(cfg, WORK, str(tmp_path / "r.json"))
    monkeypatch.setattr(expert_tuning, "time_expert_kernels", lambda *a, **k: kernel_tuning.Timings(
        {"tiled": 1.0, "bucketed": 2.0}, {}, {"tiled": None, "bucketed": None}))
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / expert_tuning.RECORD_FILE).mkdir()  # a directory where the record's file should go
    with caplog.at_level(logging.WARNING):
        assert tune_moe_kernel(cfg, WORK, str(tmp_path / "ro" / expert_tuning.RECORD_FILE)) == "tiled"
    assert "unreadable" in caplog.text and "could not record the choice" in caplog.text
    (tmp_path / "bad.json").write_text("{not json")
    assert kernel_tuning.read_record(str(tmp_path / "bad.json")) is None


def test_a_kernel_whose_temporaries_the_plan_cannot_hold_is_left_out(tmp_path, monkeypatch, caplog):
    """The fastest kernel holding 9 GB more than tiled is not chosen where the run's plan leaves 2 GB free with
    tiled; with no plan it is; where the plan is over the device whatever runs, the kernel adding the least is."""
    cfg = tiny.m3_config()
    monkeypatch.setattr(expert_tuning, "time_expert_kernels", lambda *a, **k: kernel_tuning.Timings(
        {"ragged_dot": 1.0, "tiled": 3.0, "bucketed": 2.0}, {},
        {"ragged_dot": 10 * 10**9, "tiled": 10**9, "bucketed": int(1.5e9)}))
    record = tmp_path / expert_tuning.RECORD_FILE
    with caplog.at_level(logging.WARNING, logger=expert_tuning.__name__):
        assert tune_moe_kernel(cfg, WORK, str(record), headroom=2 * 10**9) == "bucketed"
    assert "left out for memory: ragged_dot (its temporaries (10.00 GB) exceed tiled's (1.00 GB)" in caplog.text
    saved = json.load(open(record))
    assert saved["headroom"] == 2 * 10**9 and list(saved["over_memory"]) == ["ragged_dot"]
    assert set(saved["ms"]) == {"tiled", "bucketed"} and set(saved["ms_process_0"]) == set(kernel_tuning.PORTABLE)
    assert tune_moe_kernel(cfg, WORK, headroom=None) == "ragged_dot"  # no plan: speed alone
    assert tune_moe_kernel(cfg, WORK, headroom=10 * 10**9) == "ragged_dot"
    assert tune_moe_kernel(cfg, WORK, headroom=-10**9) == "tiled"  # over the device anyway: the fewest temporaries


def test_the_headroom_is_the_devices_limit_less_the_plan_with_tiled(tmp_path, monkeypatch, caplog):
    from m3jax import train  # the command asks the planner; rl builds with the headroom it is given
    from m3jax.plan.job import planned_peak
    cfg = _cfg(tmp_path)
    m3 = cfg.model.m3_config()
    assert train.kernel_headroom(cfg, m3, None) is None  # XLA:CPU reports no limit: speed alone
    peak = planned_peak(cfg, m3, "tiled")
    assert 0 < peak != planned_peak(cfg, m3, "ragged_dot")  # the kernel changes the plan's memory
    assert train.kernel_headroom(cfg, m3, 80 * 10**9) == int(80 * 10**9 - peak)

    # the command weighs memory where the device reports a limit and the kernel is timed (tune; auto off a CPU)
    gpu_like = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 80 * 10**9})
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [gpu_like])
    assert train._kernel_headroom(_cfg(tmp_path, "model.moe_kernel=tune")) == int(80 * 10**9 - peak)
    assert train._kernel_headroom(cfg) is None  # auto on a CPU: the measured rule, nothing timed

    def unplannable(*a, **k):
        raise ValueError("a config the planner cannot model")
    monkeypatch.setattr("m3jax.plan.job.planned_peak", unplannable)
    with caplog.at_level(logging.WARNING):
        assert train.kernel_headroom(cfg, m3, 80 * 10**9) is None
    assert "no memory plan for this run (a config the planner cannot model)" in caplog.text


def test_every_candidate_computes_the_same_rows():
    """What is timed is the model's expert MLP, and every candidate computes ragged_dot's rows and gradients."""
    make, args = expert_tuning.expert_problem(tiny.m3_config(), WORK)
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((WORK.rows, WORK.hidden)), jnp.float32)
    outs = {k: jax.value_and_grad(lambda *a, k=k: jnp.sum(make(k)(*a) * cot), argnums=(0, 1, 2))(*args)
            for k in kernel_tuning.PORTABLE}
    rows = np.asarray(make("ragged_dot")(*args))
    assert rows.shape == (WORK.rows, WORK.hidden) and rows[:WORK.filled].all() and not rows[WORK.filled:].any()
    for kernel in ("tiled", "bucketed"):
        for got, want in zip(jax.tree.leaves(outs[kernel]), jax.tree.leaves(outs["ragged_dot"])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_model_refuses_tune_unresolved():
    from m3jax.config import ConfigError
    with pytest.raises(ConfigError, match="chosen by timing the kernels before the model is built"):
        tiny.m3_model(tiny.m3_config(), moe_kernel="tune")


def _cfg(tmp_path, *overrides):
    from rl.config import load_config
    return load_config(str(TINY), [f"run.out_dir={tmp_path}", "logging.tensorboard=false", *overrides])


def test_the_trainer_builds_the_timed_kernel(tmp_path):
    from rl.policy import build_policy, training_positions
    cfg = _cfg(tmp_path, "model.moe_kernel=tune")
    policy = build_policy(cfg)
    record = json.load(open(tmp_path / expert_tuning.RECORD_FILE))
    assert policy.model_options["moe_kernel"] == record["kernel"] in kernel_tuning.PORTABLE
    assert {stack.moe_kernel for stack in policy.model().stacks} == {record["kernel"]}
    # the record's work: tiny.yaml's micro-batch on one device (T = rows x positions, T k rows, 4 experts)
    work = record["key"]["work"]
    tokens = cfg.grpo.micro_batch_size * training_positions(cfg, policy.model_cfg)
    assert work["experts"] == 4 and work["rows"] == work["filled"] == tokens * 2
    # an export times nothing and builds the static rule; auto on a CPU is the rule, untimed
    os.remove(tmp_path / expert_tuning.RECORD_FILE)
    assert build_policy(cfg, kernel_timing="off").model_options["moe_kernel"] == "auto"
    assert build_policy(_cfg(tmp_path)).model_options["moe_kernel"] == "auto"
    assert not os.path.exists(tmp_path / expert_tuning.RECORD_FILE)


@pytest.mark.slow  # two processes of a CPU "cluster" (~15 s)
def test_every_process_times_and_the_median_over_them_decides(tmp_path):
    """Hosts timing for themselves could pick different kernels and then compile different programs: every process
    times (here faked: tiled fastest on process 0, ragged_dot on process 1, bucketed second on both) and the median
    over the processes decides, the same on each (bucketed: neither host's own pick). Process 0 writes the record.
    A kernel that failed on one process is never chosen; where none ran everywhere, every process raises."""
    from tests.test_multihost import two_processes
    procs, logs = two_processes("-", "-", "--tune", str(tmp_path))
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    assert all("TUNED: bucketed after 1 timings" in log for log in logs), "\n".join(logs)[-4000:]
    record = json.load(open(tmp_path / expert_tuning.RECORD_FILE))
    assert record["kernel"] == "bucketed" and record["ms"] == {"ragged_dot": 3.5, "tiled": 3.5, "bucketed": 3.0}
    assert all("RAN EVERYWHERE: ragged_dot" in log for log in logs), "\n".join(logs)[-4000:]
    assert "NO KERNEL: moe_kernel: no grouped-matmul kernel ran on every process" in logs[0], logs[0][-3000:]
    assert "another process's log says why" in logs[0] and "ran on every process" in logs[1], logs[1][-3000:]


@pytest.mark.slow  # a subprocess that starts jax (~10 s)
def test_the_script_times_a_config_and_records_the_choice_the_run_reads(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "moe_kernel_choice.py"), "--config", str(TINY),
                          f"run.out_dir={tmp_path}", "--rounds", "2", "--record"],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    choice = next(line.split()[1].rstrip(";") for line in out.stdout.splitlines() if line.startswith("choice:"))
    record = json.load(open(tmp_path / expert_tuning.RECORD_FILE))
    assert choice in kernel_tuning.PORTABLE and f"recorded {record['kernel']}" in out.stdout
    # the trainer finds the script's record for its own work (the same key), and reads it rather than timing
    record["kernel"] = next(k for k in kernel_tuning.PORTABLE if k != record["kernel"])
    json.dump(record, open(tmp_path / expert_tuning.RECORD_FILE, "w"))
    from rl.policy import model_options
    cfg = _cfg(tmp_path, "model.moe_kernel=tune")
    assert model_options(cfg, cfg.model.m3_config(), Layout(), "read")["moe_kernel"] == record["kernel"]


def test_the_planner_plans_a_timed_kernel_by_its_bound_and_says_so():
    """On a GPU the timed kernel is at most as slow as tiled and holds at most the plan's margin more: planned as
    tiled (before: as the static auto, ragged_dot's dense E x rows). On a CPU tune plans the measured rule."""
    from m3jax.plan.__main__ import _expert_matmuls
    from m3jax.plan.memory import Batch
    for kernel in ("auto", "tune"):
        batch = Batch(1, 64, moe_kernel=kernel, platform="gpu")
        assert batch.expert_kernel == "tiled" == batch.expert_matmul and batch.model_options()["moe_kernel"] == "tiled"
        assert "the trainer times the kernels when it starts" in _expert_matmuls(batch)
        assert "planned as tiled" in _expert_matmuls(batch)
    assert "times" not in _expert_matmuls(Batch(1, 64, moe_kernel="tiled", platform="gpu"))
    assert "times" not in _expert_matmuls(Batch(1, 64, moe_kernel="auto", platform="cpu"))
    assert Batch(1, 64, moe_kernel="tune", platform="cpu").expert_kernel == "bucketed"
