"""The run's progress on the terminal (`rl.progress`): a bar on a terminal, dated lines in a file."""

import io
import logging

import pytest

from rl.progress import Bar, Lines, open_progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def shown_steps(caplog):
    return [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records if r.name == "rl.progress"]


def test_lines_show_the_first_step_each_evaluation_the_last_and_one_per_interval(caplog):
    clock = Clock()
    lines = Lines(100, 0, every_s=30.0, clock=clock)
    clock.now += 12.0  # the first step compiles
    with caplog.at_level(logging.INFO, logger="rl.progress"):
        for step in range(1, 101):
            if step > 1:
                clock.now += 2.0
            lines.step(step, 0.5, 1000.0, 0.25 if step >= 40 else None, evaluated=step in (40, 80))
    # step 1; then 30 s after each line (15 steps of 2 s); the evaluations at 40 and 80 restart the interval;
    # the last step
    assert shown_steps(caplog) == [1, 16, 31, 40, 55, 70, 80, 95, 100]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "step 1/100 (1%): reward 0.500, 1000 tokens/s; elapsed 00:12"  # no pace from one step
    assert messages[3] == ("step 40/100 (40%): reward 0.500, 1000 tokens/s, held-out pass@1 0.250; elapsed 01:30, "
                           "2.00 s/step, 02:00 left")
    assert messages[-1].endswith("2.00 s/step, 00:00 left")


def test_a_run_that_stops_early_ends_on_the_step_it_reached(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="rl.progress"):
        lines = Lines(1000, 200, every_s=30.0, clock=clock)  # resumed at step 200
        for step in range(201, 211):
            clock.now += 1.0
            lines.step(step, 0.5, 1000.0, None)
        lines.close()  # a signal or run.max_wall_minutes
        lines.close()  # twice: nothing more
    assert shown_steps(caplog) == [201, 210]
    assert caplog.records[-1].getMessage().startswith("step 210/1000 (21%): ")


class Stream(io.StringIO):
    def __init__(self, terminal):
        super().__init__()
        self.terminal = terminal

    def isatty(self):
        if self.terminal is None:
            raise ValueError("I/O operation on closed file")
        return self.terminal


def test_a_terminal_gets_the_bar_and_a_file_or_a_closed_stream_gets_lines():
    terminal = Stream(True)
    bar = open_progress(10, 0, stream=terminal)
    assert isinstance(bar, Bar)
    bar.step(1, 0.5, 1234.0, 0.75)
    bar.close()
    assert "\r" in terminal.getvalue() and "reward=0.500, tok_s=1234, val_pass1=0.750" in terminal.getvalue()
    for stream in (Stream(False), Stream(None), object()):
        assert isinstance(open_progress(10, 0, stream=stream), Lines)


@pytest.mark.parametrize("evaluate_at_start", [True, False])
def test_the_run_logger_shows_its_rows_as_lines_where_stderr_is_a_file(tmp_path, caplog, evaluate_at_start):
    from rl.observe import RunLogger
    with caplog.at_level(logging.INFO, logger="rl.progress"):  # pytest's stderr is no terminal
        log = RunLogger(str(tmp_path), tensorboard=False, progress_bar=True, total_steps=3)
        if evaluate_at_start:
            log.log(0, {"val/pass@1": 0.125}, advance=False)
        log.log(1, {"reward/mean": 0.5, "throughput/tokens_per_s": 10.0})
        log.log(2, {"reward/mean": 0.6, "throughput/tokens_per_s": 10.0, "val/pass@1": 0.375})
        log.log(3, {"reward/mean": 0.7, "throughput/tokens_per_s": 10.0})
        log.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "rl.progress"]
    assert [m.split(":")[0] for m in messages] == ["step 1/3 (33%)", "step 2/3 (66%)", "step 3/3 (100%)"]
    assert ("held-out pass@1 0.125" in messages[0]) == evaluate_at_start
    assert "held-out pass@1 0.375" in messages[1] and "held-out pass@1 0.375" in messages[2]


def test_lines_reach_stderr_where_no_logging_is_set_up(capsys):
    """A trainer run from a script that configured no logging: Python drops INFO records, so the lines are printed."""
    logger = logging.getLogger("rl.progress")
    saved = logger.level, logger.propagate
    logger.setLevel(logging.NOTSET)
    logger.propagate = False  # as if neither root nor rl.progress had a handler
    try:
        lines = Lines(2, 0, clock=Clock())
        lines.step(1, 0.5, 10.0, None)
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    assert capsys.readouterr().err == "step 1/2 (50%): reward 0.500, 10 tokens/s; elapsed 00:00\n"


def test_a_notebooks_output_gets_the_bar():
    ipykernel_stream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()
    assert isinstance(open_progress(10, 0, stream=ipykernel_stream), Bar)


def test_a_resumed_run_shows_the_last_held_out_value_from_its_first_step(tmp_path, caplog):
    """The rows it keeps in metrics.jsonl hold the last evaluation (step 20 here); rows past the resumed step 25,
    which it logs again, do not count."""
    import json

    from rl.observe import RunLogger
    rows = [{"step": s, "reward/mean": 0.1, **({"val/pass@1": s / 100} if s % 20 == 0 else {})} for s in range(31)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="rl.progress"):
        log = RunLogger(str(tmp_path), tensorboard=False, progress_bar=True, total_steps=40, first_step=25)
        log.log(26, {"reward/mean": 0.5, "throughput/tokens_per_s": 10.0})
        log.close()
    assert "held-out pass@1 0.200" in caplog.records[0].getMessage()
