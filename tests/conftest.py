import atexit
import os
import shutil
import tempfile

# Tests run on the CPU; 8 simulated devices let sharding tests build real meshes. Must be set before jax loads.
# Compiling dominates the suite (tiny programs, run once or twice): LLVM's -O0 backend compiles ~30% faster;
# XLA's own graph optimisations (fusion, layout, simplification) still run.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent XLA compilation cache per test session, inherited by the subprocesses tests start
# (trainer runs, resume, multi-host workers): a program every `python -m m3jax.train` of the tiny config
# compiles is compiled once per session, not once per process. The directory is new each session and
# removed at its end, so no result or timing depends on an earlier run. (Set JAX_COMPILATION_CACHE_DIR to
# keep a cache of your own across sessions.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="m3jax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
