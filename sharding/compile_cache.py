"""JAX's persistent compilation cache, pointed at a run's directory: a restart or a resume loads each compiled
program instead of compiling it again (at M3's size minutes per program, one more per micro-batch width)."""

from __future__ import annotations

import os

import jax

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def use_compilation_cache(path: str | None, out_dir: str, environ=None) -> str | None:
    """Have JAX keep every compiled program under `path` (relative: under `out_dir`); JAX's own default skips
    the programs that compile in under a second, which are most of a small run's. None leaves JAX's default.
    A directory already in the environment ($JAX_COMPILATION_CACHE_DIR, which JAX reads itself) wins; the
    returned text says so when it differs. Call it before the first compile."""
    env = os.environ if environ is None else environ
    if path is None:
        return None
    target = os.path.abspath(path if os.path.isabs(path) else os.path.join(out_dir, path))
    current = env.get(CACHE_ENV)
    if current not in (None, ""):
        if os.path.abspath(current) != target:
            return f"{CACHE_ENV}={current} from the environment is used, not run.compilation_cache {target}"
        return None
    # JAX warns at every compile of a directory it cannot write, and runs on: raised here, named by the caller
    os.makedirs(target, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", target)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return None
