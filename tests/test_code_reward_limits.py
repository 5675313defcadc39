"""What a completion's program may do to the trainer that runs it (rl/rewards/code.py): read its environment, leave
processes behind, signal its process group, flood its memory with output, read the tests from its own file, keep
state between tests, outlive the reward's process."""

import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest

from rl.rewards import code, get_reward
from rl.rewards.code import run_tests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed, waiting for an init that may not reap it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()
    except FileNotFoundError:
        return True


def _assert_gone(pid: int, settle_s: float) -> None:
    """`pid` is gone `settle_s` after it should have died; killed here if not, so that no test leaves it running."""
    time.sleep(settle_s)
    try:
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_for(path, limit_s: float = 10.0) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if os.path.exists(path) and open(path).read().strip():
            return int(open(path).read())
        time.sleep(0.05)
    raise AssertionError(f"{path} not written")


def test_the_trainers_environment_is_not_passed_on(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-secret")  # the judge reward's key, in the trainer's environment
    prog = "import os\nprint(os.environ.get('JUDGE_API_KEY'))\n"
    assert run_tests(prog, [("io", "", "None")], timeout_s=4) == (1, 1)


def test_what_the_program_forked_dies_with_the_test(tmp_path):
    """A child it left sleeping outlived the test (and held its stdout pipe, so that the test waited to its limit)."""
    pid_file = tmp_path / "pid"
    prog = (f"import os, time\nif os.fork() == 0:\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "    time.sleep(60)\n    os._exit(0)\nprint('x')\n")
    t0 = time.monotonic()
    assert run_tests(prog, [("io", "", "x")], timeout_s=3) == (1, 1)
    assert time.monotonic() - t0 < 2.0
    _assert_gone(_wait_for(pid_file), 0.2)


def test_signalling_its_process_group_does_not_reach_the_trainer():
    """os.kill(0, SIGTERM) reached the whole group of the trainer. Run in a session of its own, so that the old
    behaviour kills only that."""
    probe = ("from rl.rewards.code import run_tests\n"
             "print(run_tests('import os, signal\\nos.kill(0, signal.SIGTERM)\\n', [('io', '', 'x')], timeout_s=4))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}, start_new_session=True)
    assert done.returncode == 0 and done.stdout.strip() == "(0, 1)", (done.returncode, done.stderr[-500:])


def test_output_over_the_file_limit_fails_and_is_not_read(monkeypatch):
    """The whole of stdout was read into the reward's memory (gigabytes within a test's seconds)."""
    monkeypatch.setattr(code, "FILE_BYTES", 1 << 20)
    prog = ("def f():\n    return 1\nimport sys\nfor _ in range(4):\n    sys.stdout.write('y\\n' * (1 << 19))\n")
    spec = {"fn_name": "f", "inputs": [[]], "outputs": [1]}
    assert get_reward("code_tests")("```python\n" + prog + "```", spec) == 0.0
    assert get_reward("code_tests")("```python\n" + prog.split("import sys")[0] + "```", spec) == 1.0


def test_the_program_cannot_read_the_asserts_from_its_own_file():
    """The asserts and the end-of-tests marker were appended to the program's file: a program that read and printed
    the marker, then exited, passed every assert."""
    prog = ("def add(a, b):\n    return 0\nimport sys, os\nprint(open(sys.argv[0]).read().rstrip().splitlines()[-1]"
            ".split(\"'\")[1])\nsys.stdout.flush()\nos._exit(0)\n")
    assert get_reward("code_tests_frac")("```python\n" + prog + "```", ["assert add(1, 2) == 3"]) == 0.0


def test_each_test_starts_in_an_empty_directory_with_limits():
    """One directory served a sample's tests: a file (or a symlink in place of main.py, which the next test's code
    was then written through) carried over from one test to the next."""
    prog = "import os\nprint(sorted(os.listdir('.')))\nopen('left', 'w').write('x')\n"
    assert run_tests(prog, [("io", "", "['main.py']")] * 2, timeout_s=8) == (2, 2)
    prog = "from resource import *\nprint(getrlimit(RLIMIT_NOFILE)[0], getrlimit(RLIMIT_CORE)[0])\n"
    assert run_tests(prog, [("io", "", f"{code.OPEN_FILES} 0")], timeout_s=4) == (1, 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_program_dies_with_the_rewards_process(tmp_path):
    """The pool kills a worker past its time limit (or the batch's): its test process lived on, sleeping."""
    pid_file = tmp_path / "pid"
    prog = (f"import os, time\nopen({str(pid_file) + '.dir'!r}, 'w').write(os.getcwd())\n"
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    probe = f"from rl.rewards.code import run_tests\nrun_tests({prog!r}, [('io', '', 'x')], timeout_s=30)\n"
    worker = subprocess.Popen([sys.executable, "-c", probe], cwd=REPO, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    try:
        pid = _wait_for(pid_file, 60.0)
    finally:
        worker.kill()
        worker.wait()
    try:
        _assert_gone(pid, 0.3)
    finally:
        shutil.rmtree(open(str(pid_file) + ".dir").read(), ignore_errors=True)  # a killed reward leaves it


def test_each_test_gets_its_own_limit_and_the_tests_a_share_of_the_samples(monkeypatch):
    """Each test runs under min(PER_TEST_S, the time left) and none starts with 0.05 s or less left; a sample's tests
    take TESTS_SHARE of its timeout_s in all (the pool kills the worker at the whole of it, losing the passed tests'
    credit). A clock advanced by the tests' own durations stands in for slow programs. (A mutation audit: either
    limit changed, no test failed; the real ones take seconds each.)"""
    now, limits = [100.0], []

    def one(program, kind, given, expected, limit_s):
        limits.append(round(limit_s, 6))
        now[0] += min(limit_s, given)  # `given` here: how long this test's program would run
        return given < limit_s  # a program killed at its limit fails

    monkeypatch.setattr(code, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # this module's clock only
    monkeypatch.setattr(code, "_one", one)
    assert run_tests("p", [("io", 9.0, ""), ("io", 1.0, ""), ("io", 1.0, "")], timeout_s=6.0) == (1, 3)
    assert limits == [code.PER_TEST_S, 2.0, 1.0]  # the first cut at PER_TEST_S, the rest at what is left
    limits.clear()
    assert run_tests("p", [("io", 3.99, ""), ("io", 1.97, ""), ("io", 0.01, "")], timeout_s=6.0) == (2, 3)
    assert limits == [code.PER_TEST_S, 2.01]  # 0.04 s left after the second: no third run
    limits.clear()
    assert run_tests("p", [("io", 0.5, "")] * 3) == (3, 3) and limits == [code.PER_TEST_S] * 3  # no timeout_s
    seen = []
    monkeypatch.setattr(code, "run_tests", lambda program, tests, timeout_s=None: seen.append(timeout_s) or (1, 1))
    get_reward("code_tests")("```python\nprint(1)\n```", [{"input": "", "output": "1"}], timeout_s=20.0)
    assert seen == [pytest.approx(code.TESTS_SHARE * 20.0)]
