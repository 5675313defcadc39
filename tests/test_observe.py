"""The run's own outputs (rl/observe.py) that the trainer tests do not look at directly."""

import glob
import os
import subprocess
import sys

import pytest


def test_tensorboard_scalars_are_written_without_loading_torch(tmp_path):
    """tensorboardX imports torch when it is installed (1.6 s of a trainer's start); the run logger keeps it
    out, and the event file still holds the scalars. In a fresh process: this one may have torch loaded."""
    code = ("import sys; from rl.observe import RunLogger; "
            f"log = RunLogger({str(tmp_path)!r}, progress_bar=False); log.log(1, {{'reward/mean': 0.25}}); "
            "log.close(); assert 'torch' not in sys.modules, 'torch was imported'; import torch")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert len(events) == 1 and b"reward/mean" in open(events[0], "rb").read()


def test_a_row_cut_short_by_a_crash_is_removed_on_resume_and_skipped_by_readers(tmp_path, caplog):
    """A crash while metrics.jsonl was being written leaves a last line without its newline: the resumed run's
    logger cuts it off (its first row used to be appended onto it, two unreadable rows), and `read_metrics` (the
    plot) skips a line that is not a row, naming it, rather than failing the end of the run."""
    import json
    import logging

    from rl.observe import RunLogger, cut_partial_row, read_metrics
    path = tmp_path / "metrics.jsonl"
    whole = '{"step": 1, "reward/mean": 0.5}\n'
    path.write_text(whole + '{"step": 2, "reward/me')
    with caplog.at_level(logging.WARNING, logger="rl.observe"):
        log = RunLogger(str(tmp_path), tensorboard=False, progress_bar=False, first_step=1)  # resumed at step 1
    assert "cut short (22 bytes" in caplog.text
    log.log(2, {"reward/mean": 0.75})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert cut_partial_row(str(path)) == 0  # a whole file is left alone
    path.write_text(whole + "{not a row\n" + '{"step": 3}\n')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl.observe"):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 3]
    assert "skipped line 2 (not a metrics row)" in caplog.text
    path.write_text('{"step": 1, "reward')  # no newline anywhere: the one partial row goes
    assert cut_partial_row(str(path)) == 19 and path.read_text() == ""


def test_the_plot_command_names_a_directory_without_metrics_and_a_label_count_that_does_not_fit(tmp_path, capsys):
    import pytest

    from m3jax.plot import main
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert f"no metrics.jsonl in {tmp_path / 'nowhere'}: expected the run.out_dir of a run" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path), "--metrics", "reward/mean", "--labels", "a",
              "--out", str(tmp_path / "c.png")])
    assert "--labels: 1 label(s) for 2 run(s); expected one per run" in capsys.readouterr().err


def test_the_plot_command_checks_its_output_and_metrics_before_drawing(tmp_path, capsys):
    """An --out in a missing directory was a traceback after the drawing, a directory was written as DIR.png (and
    printed as DIR), and an unknown metric gave an empty plot and status 0."""
    import pytest

    from m3jax.plot import main
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "loss": 1.0}\n')
    for argv, want in (([str(tmp_path), "--out", str(tmp_path / "nodir" / "x.png")], "does not exist"),
                       ([str(tmp_path), "--out", str(tmp_path)], "is a directory"),
                       ([str(tmp_path), "--metrics", "reward/man", "--out", str(tmp_path / "c.png")],
                        "reward/man not logged in these runs' metrics.jsonl; close: reward/mean")):
        with pytest.raises(SystemExit):
            main(argv)
        assert want in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))
    main([str(tmp_path), "--out", str(tmp_path / "curves")])  # no suffix: the file written is the one printed
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png") and (tmp_path / "curves.png").exists()


def test_curves_that_cannot_be_drawn_at_a_runs_end_are_a_warning_naming_the_redraw(tmp_path, caplog):
    """The run's end draws curves.png from metrics.jsonl (rl.observe.draw_curves). A drawing that fails (here its
    path taken by a directory) used to raise after the last checkpoint: status 1 for a finished run, and in a
    multi-host job on process 0 alone. It is a warning now, naming the command that draws them again."""
    import logging

    from rl.observe import draw_curves
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "loss": 1.0}\n')
    (tmp_path / "curves.png").mkdir()
    with caplog.at_level(logging.WARNING, logger="rl.observe"):
        assert draw_curves(str(tmp_path)) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "the curves were not drawn (IsADirectoryError" in warned[0], warned
    assert f"python -m m3jax.plot {tmp_path} draws them" in warned[0], warned
    (tmp_path / "curves.png").rmdir()
    assert draw_curves(str(tmp_path)) == str(tmp_path / "curves.png") and (tmp_path / "curves.png").is_file()


def test_a_drawing_that_fails_part_way_keeps_the_last_good_curves(tmp_path, monkeypatch):
    """savefig wrote straight over curves.png: a full disk mid-write left a cut image in place of the last good one."""
    import matplotlib.figure

    from rl.observe import draw_curves
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "loss": 1.0}\n')
    assert draw_curves(str(tmp_path))
    good = (tmp_path / "curves.png").read_bytes()

    def disk_full(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(good[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)
    assert draw_curves(str(tmp_path)) is None  # a warning, as any failed drawing
    assert (tmp_path / "curves.png").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_the_plan_and_demo_commands_check_their_arguments_before_any_output(tmp_path, capsys):
    import pytest

    from m3jax.demo import main as demo
    from m3jax.plan.__main__ import main as plan
    for argv, want in ((["--config", "configs/tiny.yaml", "--sweep", "4", "--png", str(tmp_path / "no" / "s.png")],
                        "does not exist"),
                       (["--config", "configs/tiny.yaml", "--sweep", "0"], "expected a positive device count"),
                       (["--config", "configs/tiny.yaml", "--compile-layers", "2:x"], "expected dense:moe pairs")):
        with pytest.raises(SystemExit):
            plan(argv)
        out = capsys.readouterr()
        assert want in out.err and out.out == ""
    (tmp_path / "afile").write_text("")
    for argv, want in ((["--out", str(tmp_path / "afile" / "demo")], "is a file"), (["--seed", "-1"], "--seed -1")):
        with pytest.raises(SystemExit):
            demo(argv)
        assert want in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_the_run_directory_keeps_its_config_and_a_resume_names_what_changed(tmp_path):
    """`<run.out_dir>/config.yaml` is the resolved config (`--print-config`'s text: it loads back to the same
    config); writing it again returns the settings that differ from the file there, which a resumed run warns of
    (nothing in a checkpoint records a learning rate)."""
    from rl.config import load_config
    from rl.config_record import CONFIG_FILE, differences, record_config
    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path}"])
    assert record_config(str(tmp_path), cfg) == []
    assert load_config(str(tmp_path / CONFIG_FILE)) == cfg
    again = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path}", "optim.lr=3e-4", "grpo.loss=gspo"])
    changed = record_config(str(tmp_path), again)
    assert ("optim.lr", 1e-3, 3e-4) in changed and [k for k, *_ in changed] == ["optim.lr", "grpo.loss"]
    assert load_config(str(tmp_path / CONFIG_FILE)) == again
    assert differences({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3}) == [("a.c", None, 2), ("d", None, 3)]


def test_a_resumed_run_keeps_one_row_per_step(tmp_path, caplog):
    """Resumed at step 4, the run logs steps 5.. again: the rows past 4 (written after the last checkpoint) go, so
    each step has one row. A row of step 4 lost to a kill between the save and its write comes back from the
    checkpoint's copy; one that is there stays. A run that starts over (step 0) keeps none."""
    import json
    import logging

    from rl.observe import RunLogger
    path = tmp_path / "metrics.jsonl"

    def rows(steps):
        return "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in steps)

    def steps_after(first, written, resumed_row=None):
        path.write_text(written)
        log = RunLogger(str(tmp_path), tensorboard=False, progress_bar=False, first_step=first,
                        resumed_row=resumed_row)
        log.log(first + 1, {"reward/mean": 0.0})
        log.close()
        return [(r["step"], r["reward/mean"]) for r in map(json.loads, path.read_text().splitlines())]

    with caplog.at_level(logging.INFO, logger="rl.observe"):
        assert steps_after(4, rows(range(8))) == [(s, s / 10) for s in range(5)] + [(5, 0.0)]
    assert "removed 3 row(s) past step 4" in caplog.text
    assert steps_after(4, rows(range(4)), {"reward/mean": 0.4}) == [(s, s / 10) for s in range(5)] + [(5, 0.0)]
    assert steps_after(4, rows(range(5)), {"reward/mean": 9.0}) == [(s, s / 10) for s in range(5)] + [(5, 0.0)]
    assert steps_after(0, rows(range(3))) == [(1, 0.0)]


def test_a_row_restored_from_the_checkpoint_reaches_tensorboard_too(tmp_path):
    """The checkpoint's copy of a lost row went to metrics.jsonl alone: TensorBoard, whose purge from the next step
    on is set at the resume, never got that step (a helper's audit)."""
    from rl.observe import RunLogger
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "reward/mean": {s / 10}}}\n' for s in range(4)))
    log = RunLogger(str(tmp_path), progress_bar=False, first_step=4, resumed_row={"reward/mean": 0.4})
    log.log(5, {"reward/mean": 0.5})
    log.close()
    assert _event_scalars(tmp_path)["reward/mean"] == {4: pytest.approx(0.4), 5: pytest.approx(0.5)}


def _events(run_dir):
    """The Events of the run's TensorBoard files in order, read with the record format's own framing (tensorboard's
    reader is not installed): 8-byte length, 4-byte CRC, the Event, 4-byte CRC."""
    import struct

    from tensorboardX.proto import event_pb2
    for path in sorted(glob.glob(os.path.join(str(run_dir), "tensorboard", "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            yield event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4


def _event_scalars(run_dir) -> dict:
    """{tag: {step: value}} of the run's TensorBoard event files."""
    out = {}
    for event in _events(run_dir):
        for v in event.summary.value:
            out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_tensorboard_tags_are_the_metrics_jsonl_keys(tmp_path):
    """Every number of a row is a TensorBoard scalar under its metrics.jsonl key: tensorboardX's add_scalar
    renamed the held-out metrics (val/pass@1 -> val/pass_1, val/maj@k -> val/maj_k), so the keys the docs, the
    config (eval.best_metric) and metrics.jsonl name were not found in TensorBoard. NaN and inf too (an audit: they
    were left out, where metrics.jsonl and W&B keep them)."""
    import math

    from rl.observe import RunLogger
    row = {"reward/mean": 0.25, "val/pass@1": 0.5, "val/pass@k": 0.75, "val/pass@8": 1.0, "val/maj@k": 0.125,
           "loss": float("nan"), "grad_norm": float("inf"), "note": "text"}
    log = RunLogger(str(tmp_path), progress_bar=False)
    log.log(3, row)
    log.close()
    scalars = _event_scalars(tmp_path)
    assert math.isnan(scalars.pop("loss")[3])
    assert scalars == {k: {3: v} for k, v in row.items() if k not in ("loss", "note")}


def _tensorboard_view(run_dir) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard shows the run: its event files in order, each SessionLog START at
    step P (what tensorboardX writes for `purge_step=P`) hiding every earlier value at a step >= P
    (tensorboard's event_accumulator, `_Purge`)."""
    shown = {}
    for event in _events(run_dir):
        if event.HasField("session_log") and event.session_log.status == event.session_log.START:
            shown = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in shown.items()}
        for v in event.summary.value:
            shown.setdefault(v.tag, []).append((event.step, pytest.approx(v.simple_value)))
    return shown


def test_a_resume_shows_each_step_once_in_tensorboard(tmp_path):
    """A run killed after step 5 with its last checkpoint at step 3 logs steps 4 and 5 again: TensorBoard hides the
    first run's 4 and 5 (its purge from step 4 on) and keeps 1 to 3; a run started afresh in the directory hides
    everything before it. (A mutation audit: a purge from the resumed step itself, 3, passed every test and lost
    step 3's point from the curves.) Each run's file sorts after the last's (named by the nanosecond; tensorboardX's
    were by the second)."""
    from rl.observe import RunLogger

    def run(first_step, steps, scale):
        log = RunLogger(str(tmp_path), progress_bar=False, first_step=first_step)
        for s in steps:
            log.log(s, {"reward/mean": s * scale})
        log.close()

    run(0, range(1, 6), 0.1)
    run(3, (4, 5), 1.0)
    assert _tensorboard_view(tmp_path) == {"reward/mean": [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0), (5, 5.0)]}
    run(0, (1,), 10.0)
    assert _tensorboard_view(tmp_path) == {"reward/mean": [(1, 10.0)]}


def test_a_run_killed_hard_keeps_every_logged_step_in_tensorboard(tmp_path):
    """A run SIGKILLed after step 5 (the OOM killer, a lost node) and resumed from its checkpoint at step 3:
    tensorboardX's writer held the rows in memory for up to 120 s, so TensorBoard lost steps 1-3 for good (the
    resumed run logs only 4 and 5 again) while metrics.jsonl kept them (a helper's audit, steps 1-4 of a 6-step run).
    Each row is on disk once logged, as metrics.jsonl's."""
    import signal
    killed = ("import os, signal\nfrom rl.observe import RunLogger\n"
              f"log = RunLogger({str(tmp_path)!r}, progress_bar=False)\n"
              "for s in range(1, 6):\n    log.log(s, {'reward/mean': s * 0.1})\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", killed], env={**os.environ, "PYTHONPATH": root}, timeout=300)
    assert done.returncode == -signal.SIGKILL
    from rl.observe import RunLogger
    log = RunLogger(str(tmp_path), progress_bar=False, first_step=3)
    for s in (4, 5):
        log.log(s, {"reward/mean": s * 1.0})
    log.close()
    assert _tensorboard_view(tmp_path) == {"reward/mean": [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0), (5, 5.0)]}
