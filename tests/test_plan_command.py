"""The planner as a command: the mesh sweep's exclusions, the verdict against the device's share, the hints, and the
warning `python -m m3jax.train` gives before it compiles a run its plan says will not fit."""

import os

import jax
import pytest

from m3jax.plan.__main__ import sweep
from m3jax.plan.flops import Hardware
from m3jax.plan.job import Job, invalid_reason, load_job, plan
from m3jax.plan.memory import GB
from sharding.mesh import MeshConfig
from tests.test_plan import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sweep_excludes_every_invalid_mesh_with_a_reason(tmp_path, capsys):
    job = Job(TINY, MeshConfig(), 64, 16, 1, 1, "fp32", "float32", True)
    rows, excluded = sweep(job, 16, Hardware(), 80.0, str(tmp_path / "s.png"))
    assert rows and excluded and (tmp_path / "s.png").exists()
    for shape, mb, why in excluded:
        assert why
    # every tried (mesh, micro-batch) is either planned or excluded; each planned one is valid
    assert all(invalid_reason(Job(TINY, MeshConfig(*s), 64, 16, 1, mb, "fp32", "float32", True)) is None
               for s, mb, *_ in rows)
    reasons = " ".join(w for *_, w in excluded)
    for rule in ("num_key_value_heads", "num_local_experts", "sequences per update"):
        assert rule in reasons


def test_sweep_plans_each_mesh_at_the_trainers_positions(tmp_path):
    """A row of 61 slots trains on 60 positions, rounded up to whole context shards of indexer blocks: the
    sweep must validate and plan each mesh at those, not reject every context-parallel mesh because 61 slots
    do not divide (as it did before it asked `row_positions`)."""
    from sharding.mesh import row_positions
    job = Job(TINY, MeshConfig(), row_positions(61, MeshConfig(), TINY), 16, 1, 1, "fp32", "float32", True, slots=61)
    assert job.seq_len == 60
    rows, excluded = sweep(job, 8, Hardware(), 80.0, str(tmp_path / "s.png"))
    assert any(shape[1] > 1 for shape, *_ in rows)
    assert not any("sequence length" in why for *_, why in excluded)
    on_ctx2 = job.on_mesh(MeshConfig(2, 2, 2, 1), 1)
    assert on_ctx2.seq_len == row_positions(61, MeshConfig(2, 2, 2, 1), TINY) and on_ctx2.seq_len % 2 == 0
    assert plan(on_ctx2, Hardware())["memory"]["total"] > 0


def test_the_verdict_is_against_jax_share_of_the_device(capsys):
    """mesh.device_memory_fraction (JAX's 0.75 when null) scales --device-memory-gb: the 32-node recipe fits only
    with the share it sets, and the planner says which share it used."""
    from m3jax.plan.__main__ import main

    job = load_job("configs/recipes/m3-32node.yaml", [], "release")
    assert job.memory_fraction == 0.92
    assert load_job("configs/recipes/m3-32node.yaml", ["mesh.device_memory_fraction=null"], "release").memory_fraction == 0.75
    assert main(["--config", "configs/recipes/m3-32node.yaml", "--model", "release"]) == 0
    out = capsys.readouterr().out
    assert "0.92 x 80 GB = 73.60 GB" in out and "FITS with 6.17 GB margin (67.43 of 73.6 GB)" in out
    main(["--config", "configs/recipes/m3-32node.yaml", "--model", "release", "mesh.device_memory_fraction=null"])
    out = capsys.readouterr().out
    assert "JAX default" in out and "DOES NOT FIT: needs 67.43 GB of 60 GB" in out


def test_the_planner_points_to_one_logits_block_where_blocks_cost_more():
    """On the 32-node mesh (context 8) blocks of 1024 positions are 128 per GPU, each paying a whole fp32 head
    gradient: the planner says one block per row plans less of both. Without context parallelism it does not."""
    from m3jax.plan.__main__ import one_block_hint
    blocks = load_job("configs/recipes/m3-32node.yaml", ["model.logprob_chunk_tokens=1024"], "release")
    hint = one_block_hint(blocks, plan(blocks, Hardware()), Hardware())
    assert hint.startswith("hint: model.logprob_chunk_tokens=8192 (one logits block per row: 1024 positions per "
                           "device) plans 67.43 GB and 31.4 s") and "(0.37 GB and 2.4 s less than blocks of 1024)" in hint
    recipe = load_job("configs/recipes/m3-32node.yaml", [], "release")
    assert one_block_hint(recipe, plan(recipe, Hardware()), Hardware()) is None  # one block already
    flat = load_job("configs/recipes/m3-1node-h200.yaml", ["model.logprob_chunk_tokens=1024", "mesh.context=1",
                                                           "mesh.data=8"], None)
    assert one_block_hint(flat, plan(flat, Hardware()), Hardware()) is None  # no per-block reduction to save


def test_a_run_that_its_plan_says_will_not_fit_is_warned_before_it_compiles():
    """python -m m3jax.train asks the planner where a device reports its memory limit (a GPU): the 32-node recipe
    (67.43 GB) is warned on 60 GB, with the binding peak and its largest terms, and not on 73.6 GB."""
    from m3jax.plan.job import fit_warning, load_run_config
    cfg, m3 = load_run_config("configs/recipes/m3-32node.yaml", [], "release")
    warning = fit_warning(cfg, m3, 60 * GB)
    assert warning.startswith("the plan of this run needs 67.43 GB per device at its backward peak, more than the "
                              "60.00 GB JAX may use of it (largest terms: moments 13.59 GB, grad_accumulator 13.59 GB")
    assert fit_warning(cfg, m3, 73.6 * GB) is None


def test_the_train_command_asks_the_plan_only_where_a_device_reports_its_limit(monkeypatch, caplog):
    import logging

    from m3jax import train
    from m3jax.plan.job import load_run_config
    cfg, m3 = load_run_config("configs/tiny.yaml", [], None)

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    for stats, warned in ((None, False), ({"bytes_limit": 10 * GB}, False), ({"bytes_limit": 1000}, True)):
        monkeypatch.setattr(jax, "local_devices", lambda stats=stats: [Device(stats)])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="m3jax.train"):
            train._warn_if_the_plan_does_not_fit(cfg, m3)
        assert any("the plan of this run needs" in r.message for r in caplog.records) == warned, stats


def test_the_verdict_is_against_the_gpu_the_config_names(capsys):
    """mesh.device_memory_gb (an H200's 141 in the one-node recipes) is the planner's device unless
    --device-memory-gb says otherwise; a config that names none is planned for 80 GB."""
    from m3jax.plan.__main__ import main
    assert main(["--config", "configs/recipes/m3-1node-h200-128e.yaml"]) == 0
    out = capsys.readouterr().out
    assert "0.75 x 141 GB = 105.75 GB" in out and "FITS with 13.90 GB margin (91.85 of 105.75 GB)" in out
    main(["--config", "configs/recipes/m3-1node-h200-128e.yaml", "--device-memory-gb", "80"])
    assert "DOES NOT FIT: needs 91.85 GB of 60 GB" in capsys.readouterr().out
    main(["--config", "configs/tiny.yaml"])
    assert "0.75 x 80 GB = 60.00 GB" in capsys.readouterr().out


def test_the_memory_fraction_reaches_jax_unless_the_environment_has_one():
    from sharding.mesh import MEMORY_FRACTION_ENV, set_memory_fraction

    env = {}
    assert set_memory_fraction(None, env) is None and env == {}  # JAX's own default
    assert set_memory_fraction(0.92, env) is None and env == {MEMORY_FRACTION_ENV: "0.92"}
    assert set_memory_fraction(0.92, env) is None  # the same value: nothing to say
    note = set_memory_fraction(0.8, env)
    assert env[MEMORY_FRACTION_ENV] == "0.92" and "0.92 from the environment is used" in note


def test_a_bad_config_or_flag_is_one_error_line(capsys):
    """As `python -m m3jax.train` reports them: a config error on its own lines (was a traceback), and a flag out of
    range refused by argparse (--device-memory-gb 0 planned for the default device)."""
    from m3jax.plan.__main__ import main
    assert main(["--config", "configs/tiny.yaml", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:\n") and "optim.lrr: unknown key (did you mean 'lr'?)" in err
    assert main(["--config", "configs/tiny.yaml", "model.tiny=null", "model.path=/nonexistent"]) == 2
    assert "/nonexistent: no such file or directory; expected a Hugging Face model directory" in capsys.readouterr().err
    for flags in (["--device-memory-gb", "0"], ["--mfu", "nan"], ["--mfu", "5"], ["--top", "0"]):
        with pytest.raises(SystemExit):
            main(["--config", "configs/tiny.yaml", *flags])
        assert f"{flags[0]} " in capsys.readouterr().err


def test_actions_that_cannot_run_together_are_refused_and_the_check_lowers_the_runs_layout(capsys):
    """--sweep returned before --compile / --check-shardings ran, and --check-shardings before --compile, each with
    status 0 (an audit); the check's layout dropped the step copy (fsdp_step_axes) and the context balance."""
    from m3jax.plan.__main__ import main
    from m3jax.plan.check import abstract_layout
    from rl.config import load_config
    for flags in (["--sweep", "8", "--compile"], ["--sweep", "8", "--check-shardings"]):
        with pytest.raises(SystemExit):
            main(["--config", "configs/tiny.yaml", *flags])
        assert "--sweep plans every mesh of N devices" in capsys.readouterr().err
    mesh = load_config("configs/recipes/m3-32node-miniature.yaml", ["mesh.context_balance=false"],
                       check_paths=False).mesh.to_mesh_config()
    layout = abstract_layout(mesh)
    assert (layout.fsdp_step_axes, layout.context_balance) == (tuple(mesh.fsdp_step_axes), False)
    assert layout.fsdp_step_axes  # the miniature recipe copies its weights once a step


@pytest.mark.parametrize("command", ["train", "eval", "convert", "plan", "demo", "plot"])
def test_each_command_says_what_it_does_in_its_help(command, capsys):
    """A helper's audit: train's, eval's, convert's and plan's --help repeated their usage line as the description."""
    import importlib
    module = importlib.import_module("m3jax.plan.__main__" if command == "plan" else f"m3jax.{command}")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    usage, described = text.split("\n\n", 2)[:2]
    assert usage.startswith("usage: python -m m3jax.")
    if command != "plot":  # plot's description is its two forms, each with what it draws
        assert not described.lstrip().startswith("python -m"), described
    assert len(described.split()) >= 8, described  # a sentence, not a name


def test_the_indexer_alignment_the_plan_leaves_out_is_said(capsys):
    """model.indexer_loss_coef > 0 adds a full-attention pass per sparse layer; the plan printed the same as without."""
    from m3jax.plan.__main__ import main
    main(["--config", "configs/recipes/m3-32node.yaml", "--model", "release", "model.indexer_loss_coef=0.1"])
    out = capsys.readouterr().out
    assert "not planned: model.indexer_loss_coef's alignment pass, 7.019e+16 fp32 FLOPs per step (9% of" in out
    main(["--config", "configs/recipes/m3-32node.yaml", "--model", "release"])
    assert "indexer_loss_coef" not in capsys.readouterr().out


def test_a_sweep_writes_its_chart_only_where_asked(tmp_path, monkeypatch, capsys):
    """The documented `--sweep 128 --top 5` wrote mesh_sweep.png into the working directory, over a file of that name
    (the repository's own, run from its root: a docs audit)."""
    from m3jax.plan.__main__ import main
    monkeypatch.chdir(tmp_path)
    main(["--config", os.path.join(ROOT, "configs/tiny.yaml"), "--sweep", "4", "--top", "2"])
    assert os.listdir(tmp_path) == [] and "plot:" not in capsys.readouterr().out
    main(["--config", os.path.join(ROOT, "configs/tiny.yaml"), "--sweep", "4", "--top", "2", "--png", "s.png"])
    assert os.listdir(tmp_path) == ["s.png"] and "plot: s.png" in capsys.readouterr().out
