"""run.compilation_cache (sharding.compile_cache): the trainer's programs go to JAX's persistent cache under the run
directory, every one of them; a cache directory already in the environment wins, with a note."""

import os
import subprocess
import sys

from sharding.compile_cache import CACHE_ENV, use_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_null_leaves_jax_alone_and_the_environment_wins():
    assert use_compilation_cache(None, "/runs/a", environ={}) is None
    env = {CACHE_ENV: "/shared/cache"}
    note = use_compilation_cache("xla_cache", "/runs/a", environ=env)
    assert note == f"{CACHE_ENV}=/shared/cache from the environment is used, not run.compilation_cache " \
                   "/runs/a/xla_cache"
    assert use_compilation_cache("/shared/cache", "/runs/a", environ=env) is None  # the same place: no note
    assert env == {CACHE_ENV: "/shared/cache"}


def test_a_run_directory_cache_keeps_every_program(tmp_path):
    """In a fresh process (this one keeps its cache off, tests/conftest.py): a relative directory lands under
    out_dir, and a program that compiles in far under JAX's 1 s default threshold is written there."""
    code = ("import jax, sys\n"
            "from sharding.compile_cache import use_compilation_cache\n"
            "assert use_compilation_cache('xla_cache', sys.argv[1]) is None\n"
            "print(float(jax.jit(lambda x: x * 2 + 1)(1.0)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "3.0"
    written = os.listdir(tmp_path / "xla_cache")
    assert written, "no program was written to the cache"
