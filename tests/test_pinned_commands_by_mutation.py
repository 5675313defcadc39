"""Behaviour of the user commands (m3jax.train / eval / convert / plot) and of what they read at a start or resume
that a mutation audit changed without any test failing (session 55). Each test names the slip it catches."""

import errno
import os
import types

import pytest
import yaml

from tests.tiny_runs import TINY


class _TrainerFailingWith:
    """GRPOTrainer's surface m3jax.train uses, whose run() fails with OSError(`code`) (the run directory's disk)."""

    code = errno.ENOSPC

    def __init__(self, cfg, **_):
        self.policy = types.SimpleNamespace(model_cfg=cfg.model.m3_config())
        self.checkpointer = types.SimpleNamespace(steps=lambda: [3])

    def run(self):
        raise OSError(self.code, os.strerror(self.code), "metrics.jsonl")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO])
def test_a_run_directory_that_stops_taking_bytes_ends_in_one_line(code, tmp_path, monkeypatch, capsys):
    """Full, over quota, remounted read-only, its mount lost: one error line naming the step a rerun resumes from, no
    traceback (over quota, EDQUOT, was a traceback under a mutant)."""
    import rl.trainer
    from m3jax import train
    monkeypatch.setattr(rl.trainer, "GRPOTrainer", type("Failing", (_TrainerFailingWith,), {"code": code}))
    assert train.main(["--config", str(TINY), f"run.out_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: writing into the run directory {tmp_path / 'run'} failed: ") and \
        "rerunning the command resumes from step 3 once that is fixed" in err[-1], err
    assert f"(errno {code})" in err[-1]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_an_export_reads_a_run_directory_it_may_not_write(code, tmp_path, monkeypatch, capsys):
    """`--export` of a finished run on a read-only mount (EROFS) or of another user's run (EACCES) takes no lock and
    exports; refusing EACCES passed every test."""
    import rl.policy
    import rl.run_lock
    from m3jax import train
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)

    def refused(*_, **__):
        raise OSError(code, os.strerror(code), str(run / ".lock"))

    exported = []
    monkeypatch.setattr(rl.run_lock, "lock_run_dir", refused)
    monkeypatch.setattr(rl.policy, "export_latest", lambda cfg, dst, step=None: exported.append(dst) or (1, dst))
    dst = str(tmp_path / "export")
    assert train.main(["--config", str(TINY), f"run.out_dir={run}", "--export", dst]) == 0, capsys.readouterr().err
    assert exported == [dst]


def test_a_zero_process_id_or_a_one_process_job_is_a_single_process_run():
    """mesh.process_id = 0 without a job is allowed (the refusal itself says "allowed: null or 0"); a one-process job
    spelled out in the environment may draw ahead with the JAX engine (no other process to disagree with)."""
    from m3jax import train
    from rl.config import load_config
    assert train._process_problem(load_config(TINY, ["mesh.process_id=0"], check_paths=False).mesh, {}) is None
    assert "mesh.process_id = 1 in a single-process run" in \
        train._process_problem(load_config(TINY, ["mesh.process_id=1"], check_paths=False).mesh, {})
    cfg = load_config(TINY, ["grpo.max_trajectory_age_steps=1"], check_paths=False)
    one = {"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
    assert train._process_problem(cfg.mesh, one) is None and train._ahead_problem(cfg, one) is None
    assert train._ahead_problem(cfg, {**one, "JAX_NUM_PROCESSES": "2"}) is not None


def test_convert_writes_the_dtype_asked_for_and_the_native_layout_by_default(tmp_path, monkeypatch, capsys):
    """`--dtype bfloat16` reached the conversion as None (an fp32 checkpoint of twice the size, nothing said) and
    a default of the released layout passed every test: test_hf_io's CLI run names both flags."""
    import jax.numpy as jnp

    from m3jax import convert
    seen = []
    monkeypatch.setattr(convert, "convert_checkpoint", lambda src, dst, **kw: seen.append(kw))
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    assert convert.main([src, dst, "--dtype", "bfloat16"]) == 0
    assert convert.main([src, dst]) == 0
    assert [(kw["dtype"], kw["layout"]) for kw in seen] == [(jnp.bfloat16, "native"), (None, "native")]


def test_plotting_several_runs_without_metrics_is_refused(tmp_path, capsys):
    """Two run directories and no --metrics drew the first run's curves alone, status 0."""
    from m3jax.plot import main
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
        runs.append(str(tmp_path / name))
    with pytest.raises(SystemExit) as e:
        main(runs)
    assert e.value.code == 2 and "several runs need --metrics" in capsys.readouterr().err
    assert not any(os.path.exists(os.path.join(r, "curves.png")) for r in runs)


def test_an_hf_models_stop_token_at_its_vocab_size_is_refused(tmp_path):
    """`m3jax.eval --hf DIR` with a stop token equal to DIR's vocab_size: no response could stop ("not below" was
    taken for "above")."""
    from rl.config import ConfigError, load_config
    from rl.eval_checkpoint import from_hf
    from tests import reference as ref
    hf = ref.save(ref.build_model(ref.tiny_config("release_like")), str(tmp_path / "hf"))  # vocab_size 256
    cfg = load_config(TINY, ["model.tiny.vocab_size=512", "generation.stop_token_ids=[256]"], check_paths=False)
    with pytest.raises(ConfigError, match="stop token 256 is not below the model's vocab_size = 256"):
        from_hf(cfg, hf)


def test_a_damaged_config_yaml_is_rewritten_and_a_section_set_to_null_is_a_change(tmp_path):
    """config.yaml of undecodable bytes (a crashed copy) stopped every start with a UnicodeDecodeError; a section
    that became null (model.tiny=null, model.path=...) crashed the comparison with a TypeError."""
    from rl.config import load_config
    from rl.config_record import differences, record_config
    (tmp_path / "config.yaml").write_bytes(b"\xff\xfe junk from a crashed copy\n")
    assert record_config(str(tmp_path), load_config(TINY, [f"run.out_dir={tmp_path}"])) == []
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["run"]["out_dir"] == str(tmp_path)
    assert differences({"a": {"b": 1}}, {"a": None}) == [("a", {"b": 1}, None)]
    assert differences({"a": None}, {"a": {"b": 1}}) == [("a", None, {"b": 1})]


def test_a_resume_lists_twelve_changes_and_counts_the_rest():
    from rl.resume_checks import changes_warning

    def ending(n):
        return changes_warning(5, [(f"k{i}", 0, 1) for i in range(n)], None)

    assert ending(12).endswith("k11 0 -> 1") and ending(13).endswith("k11 0 -> 1; and 1 more")
    assert ending(14).endswith("; and 2 more")


def test_a_refused_restore_names_the_setting_from_the_newest_checkpoint():
    """The newest checkpoint is the one restored: its meta names the change (the oldest's, saved before configs
    were recorded, named nothing)."""
    from rl.checkpoint import CheckpointMismatch
    from rl.config import load_config
    from rl.resume_checks import restore_naming_changes, trained_under
    then = trained_under(load_config(TINY, [], check_paths=False))
    now = trained_under(load_config(TINY, ["optim.weight_decay=0.01"], check_paths=False))
    metas = {2: {"step": 2}, 4: {"step": 4, **then}}
    ck = types.SimpleNamespace(steps=lambda: [2, 4], read_meta=lambda s: metas[s], directory="run/checkpoints")

    def restore():
        raise CheckpointMismatch("checkpoint step 4 holds another state")

    with pytest.raises(CheckpointMismatch) as e:
        restore_naming_changes(restore, ck, now)
    assert "checkpoint step 4 in run/checkpoints" in str(e.value) and "optim.weight_decay" in str(e.value)


def test_a_refused_start_removes_a_link_it_made_and_leaves_its_target(tmp_path):
    from rl.refused_start import RunDirBefore
    run, target = tmp_path / "run", tmp_path / "data"
    run.mkdir()
    target.mkdir()
    (target / "keep.txt").write_text("x")
    before = RunDirBefore(str(run), "run.log")
    os.symlink(target, run / "cache")
    before.undo(owner=True)
    assert os.listdir(run) == [] and os.listdir(target) == ["keep.txt"]


def test_an_export_of_a_mistyped_run_directory_says_which_and_creates_nothing(tmp_path, capsys):
    """Refused before the lock and the heavy imports, with the run.out_dir read (without the check: 2.1 s later,
    the directory named without the setting)."""
    from m3jax import train
    from rl.config import checkpoint_dir, load_config
    typo = tmp_path / "typo"
    assert train.main(["--config", str(TINY), f"run.out_dir={typo}", "--export", str(tmp_path / "x")]) == 1
    where = checkpoint_dir(load_config(TINY, [f"run.out_dir={typo}"], check_paths=False))
    assert capsys.readouterr().err.strip() == f"error: no checkpoint to export in {where} (run.out_dir = {typo})"
    assert os.listdir(tmp_path) == []
