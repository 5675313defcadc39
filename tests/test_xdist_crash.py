"""scripts/test.sh's two-worker phase survives a worker that dies mid-module (tests/xdist_crash.py): the test it died
in fails once, every other test runs, and the run ends. With pytest-xdist's own loadfile scheduler it hangs. A test
that hangs is ended by pytest's faulthandler (pyproject.toml) the same way, with its stack printed."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULES = {
    # the module a worker dies in: two tests before the crash, two after it (they must still run, once each)
    "test_dies.py": """
        import os
        def test_one(): pass
        def test_two(): pass
        def test_abort(): os.abort()
        def test_four(): pass
        def test_five(): pass
    """,
    # the first module, long enough that the other worker takes the next three (and dies in the third)
    "test_slow.py": "".join(f"def test_{i}():\n    __import__('time').sleep(0.5)\n" for i in range(6)),
    # finished by the worker that dies before it dies: not run again (a worker sent one of them got no test and
    # waited forever)
    "test_done_first.py": "def test_a(): pass\ndef test_b(): pass\n",
    "test_done_second.py": "def test_c(): pass\n",
    # stuck: pytest's faulthandler (pyproject.toml: faulthandler_timeout) prints the stacks and ends its worker
    "test_stuck.py": "def test_stuck():\n    __import__('time').sleep(600)\ndef test_g(): pass\n",
}


@pytest.mark.slow  # a pytest run with two xdist workers and a third that replaces the dead one: ~5 s
def test_a_dead_worker_fails_its_test_once_and_the_rest_still_run(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (scripts/setup.sh installs it)")
    for name, text in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    order = ["test_slow.py", "test_done_first.py", "test_done_second.py", "test_dies.py", "test_stuck.py"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.xdist_crash", "-p", "no:cacheprovider", "-n", "2",
           "--dist", "loadfile", "--no-loadscope-reorder", "-rA", "--rootdir", str(tmp_path), "-o", "addopts=",
           "-o", "faulthandler_timeout=3", "-o", "faulthandler_exit_on_timeout=true", *order]
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run hung after the worker died:\n{(e.stdout or b'').decode()}")  # bytes, even with text=True
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 failed, 14 passed" in out, out
    assert "FAILED test_dies.py::test_abort" in out and "FAILED test_stuck.py::test_stuck" in out, out
    assert "Timeout (0:00:03)!" in out and "in test_stuck" in out, out  # the stuck test's stack
    for test in ("test_dies.py::test_four", "test_dies.py::test_five", "test_done_first.py::test_a",
                 "test_stuck.py::test_g"):
        assert out.count(f"PASSED {test}") == 1, out
