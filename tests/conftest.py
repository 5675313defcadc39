import atexit
import os
import shutil
import tempfile

import pytest

from sharding.cpu_threads import reserve_collective_threads

# Tests run on the CPU; 8 simulated devices let sharding tests build real meshes. Must be set before jax loads.
# Compiling dominates the suite (tiny programs, run once or twice): LLVM's -O0 backend compiles ~30% faster;
# XLA's own graph optimisations (fusion, layout, simplification) still run.
_XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", _XLA_FLAGS)
# XLA:CPU's fusion emitters (its MLIR codegen of fused loops) off halves the compile time that is left: six
# compile-heavy modules took 2 min 53 s with them and 1 min 27 s without (102 tests, two workers, 2026-12-03).
# Their code sums in other orders, so a test that compares two different programs bit for bit (a chunked loss
# against the full one, a restored precision mode against a fresh one) holds under XLA's defaults and not
# there; those are marked `xla_defaults`, and a process that runs one keeps the emitters
# (pytest_collection_modifyitems below). Programs a user runs (`python -m m3jax.train`, the benchmarks) keep
# XLA's defaults.
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# NPROC=24 for the 8 devices (inherited by the trainer and multi-host subprocesses): XLA:CPU's pool of exactly 8
# threads let a collective wait forever for its 8th share; XLA aborted a worker of CI's run (sharding/cpu_threads.py).
reserve_collective_threads(os.environ)
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
# Every program, not only those that took over a second to compile (JAX's default): a tiny trainer process
# compiles ~100 small programs (eager ops, metrics, the engine's pieces) at ~35 ms each, 3.3 of its 15 s
# when everything else was cached (cProfile, 2026-12-01); cached, a repeated run takes 11.5 s.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config):
    """The pytest process itself neither reads nor writes that cache (its programs stay in memory anyway):
    in the full suite, serialising the bf16 train step of test_train_step's many-steps test segfaulted
    inside XLA (`executable.serialize()`, twice, at the same test, 2026-12-01; alone the test passes). The
    subprocesses it starts keep sharing the cache among themselves. With pytest-xdist, its loadfile scheduling
    is tests/xdist_crash.py's, which goes on after a worker dies where xdist's own hangs."""
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    if config.pluginmanager.hasplugin("xdist"):  # a dead worker ends in one failure, not a hung run
        from tests import xdist_crash
        config.pluginmanager.register(xdist_crash, "m3jax-xdist-crash")


# The modules that take longest (end-to-end trainer runs, many compiles; `--durations`, 2026-12-01 and -03) run
# first, so that in scripts/test.sh's two-worker phase neither worker is left with one of them at the end.
# Only the order changes: no test depends on it.
FIRST = ("test_trainer.py", "test_recipe_miniature.py", "test_gpu_check.py", "test_resume.py", "test_ahead.py",
         "test_train_step.py", "test_plan.py", "test_jax_engine.py", "test_indexer_align.py", "test_routing_replay.py",
         "test_context_parallel_run.py", "test_remat_policy.py", "test_weight_senders.py", "test_step_copy.py",
         "test_multihost_failures.py", "test_multihost.py", "test_shared_draw.py")


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: `items` is what this process runs
def pytest_collection_modifyitems(config, items):
    """FIRST first; then compile with FAST_COMPILE_FLAG unless a selected test is `xla_defaults` or the caller
    set XLA_FLAGS. XLA reads its flags when jax starts its CPU backend, which no test module does at import
    (checked here)."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    # pytest-xdist's workers inherit the XLA_FLAGS the controller set above (the controller collects nothing):
    # ours are the ones that still equal _XLA_FLAGS here
    if os.environ["XLA_FLAGS"] != _XLA_FLAGS or any(item.get_closest_marker("xla_defaults") for item in items):
        return
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise pytest.UsageError("jax's backend started while the tests were collected (a module-level array?), "
                                f"before tests/conftest.py could add {FAST_COMPILE_FLAG} to XLA_FLAGS")
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAG


@pytest.fixture(scope="session")
def _ray_session():
    ray = pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")
    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A local Ray shared by the modules whose actors are plain Python (its start is a few seconds of the
    fast loop); started again if a module that ran its own (tests/test_vllm_pool.py) shut it down."""
    if not _ray_session.is_initialized():
        _ray_session.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return _ray_session


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A word-level tokenizer of a few words with a chat template (tests/test_data.py, tests/test_prompt_lengths.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>"]
    words = specials + ["what", "is", "1", "+", "2", "?", "be", "terse", "half", "of"]
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(specials)
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", chat_template=template)
    return tok
