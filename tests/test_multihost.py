"""Multi-host: two CPU processes joined with jax.distributed run the sharded model like one (from
MeshConfig), and a GRPO step launched from the YAML config with the launcher's environment only (both
slow: subprocesses). Fast: where the job's size comes from, and the process-0 pool wrapper's broadcasts
simulated in one process."""

import os
import re
import socket
import subprocess
import sys

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config
from rl.generation.base import Rollout, SamplingParams
from rl.generation.transfer import TransferStats
from sharding.mesh import MeshConfig, distributed_args
from tests import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint(tmp_path) -> str:
    return ref.save(ref.build_model(ref.tiny_config("release_like"), seed=3), str(tmp_path / "ckpt"))


def two_processes(ckpt: str, out: str, *flags: str):
    """tests/workers/multihost_forward.py as processes 0 and 1 of a CPU "cluster" -> (processes, their output)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/multihost_forward.py"), ckpt,
                               str(port), str(i), out, *flags], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    return procs, [p.communicate(timeout=600)[0] for p in procs]


@pytest.mark.slow
def test_two_process_mesh_equals_single_device(tmp_path):
    ckpt = tiny_checkpoint(tmp_path)
    out = tmp_path / "logits.npy"
    procs, logs = two_processes(ckpt, str(out))
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    model = m3jax.from_pretrained(ckpt)
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    want = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    got = np.load(out)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5
    # Each process read the blocks its own devices hold (half the experts, half the FSDP rows), not the whole
    # checkpoint; together they read all of it.
    reads = [re.search(r"read (\d+) of the checkpoint's (\d+) bytes", log) for log in logs]
    assert all(reads), "\n".join(logs)[-4000:]
    read, total = [int(m.group(1)) for m in reads], int(reads[0].group(2))
    assert all(r < 0.6 * total for r in read) and sum(read) >= total, (read, total)


@pytest.mark.parametrize("mesh, env, want", [
    (MeshConfig(), {}, None),
    (MeshConfig(coordinator_address="h0:1234", num_processes=16, process_id=3), {"JAX_PROCESS_ID": "9"},
     {"coordinator_address": "h0:1234", "num_processes": 16, "process_id": 3}),  # the config wins
    (MeshConfig(), {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "16", "JAX_PROCESS_ID": "5"},
     {"coordinator_address": "h0:1234", "num_processes": 16, "process_id": 5}),
    (MeshConfig(), {"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16"}, {}),  # srun step: jax detects the rest
    (MeshConfig(), {"SLURM_NTASKS": "16"}, None),  # a batch script run once: no peers to wait for
    (MeshConfig(), {"OMPI_COMM_WORLD_SIZE": "2"}, {}),
])
def test_distributed_args_from_config_then_environment(mesh, env, want):
    assert distributed_args(mesh, env) == want


@pytest.mark.parametrize("name", ["JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NUM_TASKS",
                                  "OMPI_COMM_WORLD_SIZE"])
def test_a_launch_variable_that_is_not_a_number_is_named(name):
    """int() of it raised a ValueError traceback naming no variable (a helper's fuzz). A launcher's count is read
    also where the config names the job; the JAX_* ones only where it does not."""
    from sharding.launch import launch_problem
    job = MeshConfig(coordinator_address="h0:1234", num_processes=2, process_id=0)
    for m in (MeshConfig(),) + (() if name.startswith("JAX_") else (job,)):
        assert launch_problem(m, {name: "abc"}) == (f"${name} = 'abc' in the environment is not an integer; allowed: "
                                                    "a whole number (a process count or index), or unset")


TWO_HOSTS = ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "grpo.prompts_per_step=4", "grpo.group_size=2",
             "grpo.micro_batch_size=2", "logging.progress_bar=false"]


def two_hosts(out: str, overrides: list[str], own: tuple[list[str], list[str]] = ([], [])) -> list[subprocess.Popen]:
    """Two processes of one job, each running `python -m m3jax.train` on configs/tiny.yaml with `overrides`, then
    process i's `own[i]` (tests/workers/multihost_train.py writes `out`.<process>.json as it ends)."""
    port = free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/multihost_train.py"), out,
                                       "--config", os.path.join(ROOT, "configs/tiny.yaml"), *overrides, *own[i]],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.slow  # ~40 s, as the test below
def test_a_sigterm_to_one_host_stops_both_at_the_same_saved_step(tmp_path):
    """A preemption notice may reach one process of a job only: both save the same step and stop (a process
    that saved or stopped alone would leave the other waiting in a collective)."""
    import signal
    import time

    run, out = tmp_path / "run", str(tmp_path / "out")
    procs = two_hosts(out, [*TWO_HOSTS, "run.total_steps=6", "checkpoint.every_steps=0", f"run.out_dir={run}",
                            "eval.at_start=false"])  # no evaluation to compile and run on both hosts before step 1
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 600
    while procs[1].poll() is None and time.time() < deadline and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 1):  # step 1 done
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert [json.load(open(f"{out}.{i}.json"))["rc"] for i in range(2)] == [143, 143], "\n".join(logs)[-4000:]
    assert 1 <= steps[-1] < 6 and sorted(os.listdir(run / "checkpoints")) == [str(steps[-1])], (steps, logs)
    assert f"stopped by SIGTERM after step {steps[-1]} of 6" in logs[1]
    assert f"stopped by a stop on another process after step {steps[-1]} of 6" in logs[0]


@pytest.mark.slow  # ~30 s: two processes compiling the tiny trainer on a 2x2x2 mesh
def test_two_hosts_train_from_the_yaml_config(tmp_path):
    """Every host runs `python -m m3jax.train` with the same config; only the launcher's environment
    differs. One GRPO step, then the run's checkpoint, metrics, HF export and curves, written once. (In the
    default run since a change made every host of a job die at start, unseen while this test was `extended`.)"""
    run, out = tmp_path / "run", str(tmp_path / "out")
    procs = two_hosts(out, [*TWO_HOSTS, "run.total_steps=1", f"run.out_dir={run}"])
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    done = [[line for line in log.splitlines() if line.startswith("done:")] for log in logs]
    assert done[0] and done[0] == done[1]  # one global step: the same last reward on both hosts
    for i in range(2):
        host = json.load(open(f"{out}.{i}.json"))
        # a data row per host; no array gathered from every host to check that the hosts agree on it (the Adam
        # moments made whole, each batch placed with jax.device_put: ~70 arrays a step)
        assert host == {"rc": 0, "processes": 2, "devices": 8, "data_row_owners": [[0], [1]],
                        "compared_across_hosts": []}
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # written by process 0 only (step 0: the evaluation of the initial policy)
    assert (run / "checkpoints" / "1").is_dir() and (run / "curves.png").exists()
    exported = m3jax.from_pretrained(str(run / "export"))
    assert all(np.isfinite(np.asarray(v)).all() for _, v in nnx.to_flat_state(nnx.state(exported)))


class FakePool:
    """The VLLMPool surface ProcessZeroPool uses."""

    def __init__(self, routes=False):
        self.resent_rows, self.restarts, self.pushed, self.routes = 3, 1, [], routes

    def generate(self, prompts, params, key, prompt_width=None):
        n, t = len(prompts), params.max_new_tokens
        lengths = np.arange(n, dtype=np.int32) % t + 1
        tokens = np.where(np.arange(t) < lengths[:, None], np.arange(n * t).reshape(n, t) + 5, 0).astype(np.int32)
        logprobs = np.where(tokens > 0, -0.25, 0.0).astype(np.float32)
        routes = (np.arange(n * (3 + t) * 2 * 1, dtype=np.int16).reshape(n, 3 + t, 2, 1) % 5) if self.routes else None
        return Rollout([list(p) for p in prompts], tokens, logprobs, lengths, lengths == t, 7, routes=routes)

    def push(self, tensors, version):
        self.pushed.append((version, [name for name, _ in tensors]))
        return TransferStats(version, 1234, 2, len(self.pushed[-1][1]), 0.5, 0.25, 0.125, 1.0)

    def score(self, prompts, responses, params):
        return [[np.full(len(r), -e - 0.5, np.float32) for r in responses] for e in range(2)]


class Broadcast:
    """Stands in for broadcast_one_to_all between two processes: process 0's call records what it sends;
    the other process must offer the same tree of shapes and dtypes (or the collective would hang or fail)
    and receives process 0's values."""

    def __init__(self):
        self.sent = []

    def zero(self, value):
        self.sent.append(jax.tree.map(np.asarray, value))
        return self.sent[-1]

    def other(self, value):
        want = self.sent.pop(0)
        assert jax.tree.structure(value) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want)):
            assert np.shape(a) == b.shape and np.asarray(a).dtype == b.dtype, (np.shape(a), b.shape)
        return want


def _zero_model():
    """graphdef, params, rest of a one-layer MoE model filled with zeros (what the pool wrappers convert)."""
    cfg = M3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=8, intermediate_size=8, dense_intermediate_size=16, shared_intermediate_size=8,
                   num_local_experts=2, num_experts_per_tok=1, layer_types=("full_attention",),
                   mlp_layer_types=("sparse",), index_n_heads=1, index_head_dim=8, index_block_size=4,
                   index_topk_blocks=1)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    params, rest = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t) for t in (params, rest))
    return graphdef, params, rest


def test_process_zero_pool_broadcasts_what_process_zero_got(monkeypatch):
    from rl.generation import multihost
    from rl.generation.multihost import ProcessZeroPool

    graphdef, params, rest = _zero_model()
    fake, bc = FakePool(), Broadcast()
    zero = ProcessZeroPool(fake, graphdef, is_zero=True)
    other = ProcessZeroPool(None, graphdef, is_zero=False)
    prompts, sp = [[1, 2], [3], [4, 5, 6]], SamplingParams(max_new_tokens=4)

    def on(rank, method, *args):
        monkeypatch.setattr(multihost, "_from_zero", bc.zero if rank == 0 else bc.other)
        return getattr(zero if rank == 0 else other, method)(*args)

    want = fake.generate(prompts, sp, None)
    for rank in (0, 1):
        r = on(rank, "generate", prompts, sp, jax.random.key(0))
        for name in ("tokens", "logprobs", "lengths", "truncated"):
            got, ref_ = getattr(r, name), getattr(want, name)
            assert got.dtype == ref_.dtype and np.array_equal(got, ref_), (rank, name)
        assert r.weight_version == 7 and r.prompt_ids == prompts and r.routes is None
        assert ((zero, other)[rank].resent_rows, (zero, other)[rank].restarts) == (3, 1)
    fake.routes = True  # engines that return MoE routes (GPU vLLM): every process gets process 0's
    want = fake.generate(prompts, sp, None)
    for rank in (0, 1):
        r = on(rank, "generate", prompts, sp, jax.random.key(0))
        assert r.routes.dtype == np.int16 and np.array_equal(r.routes, want.routes), rank
    fake.routes = False

    stats = [on(rank, "set_weights", params, 5, rest) for rank in (0, 1)]  # both drain the tensors
    names = fake.pushed[0][1]
    assert fake.pushed == [(5, names)] and any("experts" in n for n in names)
    for s in stats:
        assert (s.version, s.bytes, s.buckets, s.tensors) == (5, 1234, 2, len(names))
        assert (s.convert_s, s.send_s, s.apply_s, s.total_s) == (0.5, 0.25, 0.125, 1.0)

    responses = [[1, 2, 3], [4], [5, 6]]
    for rank in (0, 1):
        per_engine = on(rank, "score", prompts, responses, sp)
        assert len(per_engine) == 2
        for e, lps in enumerate(per_engine):
            assert [lp.tolist() for lp in lps] == [[-e - 0.5] * len(r) for r in responses]
    assert not bc.sent


def test_a_collective_push_that_fails_before_the_transport_releases_the_other_processes(monkeypatch):
    """On the collective transport every process sends, in lockstep with process 0's transport. When process 0
    fails before the transport's first step (no live engine), it still takes that step with 'no update', so
    the others neither wait nor iterate their tensors, and every process raises."""
    from rl.generation import multihost
    from rl.generation.bucket_sender import RoutedSender
    from rl.generation.multihost import JaxPeers, ProcessZeroPool
    from rl.generation.transfer import TransferError
    from rl.generation.vllm_pool import PoolError

    class NoEngines(FakePool):
        def push(self, tensors, version):
            raise PoolError(f"no live vLLM engine to receive weight version {version}")

    graphdef, params, rest = _zero_model()
    bc = Broadcast()
    zero = ProcessZeroPool(NoEngines(), graphdef, is_zero=True, peers=JaxPeers())
    other = ProcessZeroPool(None, graphdef, is_zero=False, peers=JaxPeers(), sender=RoutedSender(1 << 16))
    sent = []

    def owned(*_, on_device=False):
        sent.append("iterated")
        yield "model.norm.weight", np.zeros(16, np.float32)

    monkeypatch.setattr(multihost, "owned_model_tensors", owned)
    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    with pytest.raises(PoolError, match="no live vLLM engine"):
        zero.set_weights(params, 5, rest)
    monkeypatch.setattr(multihost, "_from_zero", bc.other)
    with pytest.raises(TransferError, match="weight version 5 was refused"):
        other.set_weights(params, 5, rest)
    assert not bc.sent and not sent  # the same steps on both sides; nobody iterated a tensor


def test_a_pool_failure_on_process_zero_is_raised_on_every_process(monkeypatch):
    """On the `ray` transport a push refused after one tensor stopped process 0 before the broadcast the others
    waited in (and before it iterated the rest of the tensors, a gather on a multi-host mesh): they hung until jax's
    distributed timeout, the cause lost. So for a failed rollout or probe scoring. Now both take the same steps."""
    from rl.generation import multihost
    from rl.generation.multihost import ProcessZeroPool
    from rl.generation.transfer import TransferError
    from rl.generation.vllm_pool import PoolError

    class Failing(FakePool):
        def push(self, tensors, version):
            next(iter(tensors))  # the transport read one tensor, then an engine refused its bucket
            raise TransferError("tensor 'x' (bucket 0, version 5): rejected by the engine")

        def generate(self, prompts, params, key, prompt_width=None):
            raise PoolError("every vLLM engine died")

        def score(self, prompts, responses, params):
            raise PoolError("no live vLLM engine to score on")

    graphdef, params, rest = _zero_model()
    read = {0: 0, 1: 0}
    real = multihost.model_tensors

    def counted(*args, **kw):  # how many tensors each process iterates
        for item in real(*args, **kw):
            read[rank] += 1
            yield item

    monkeypatch.setattr(multihost, "model_tensors", counted)
    bc = Broadcast()
    pools = {0: ProcessZeroPool(Failing(), graphdef, is_zero=True), 1: ProcessZeroPool(None, graphdef, is_zero=False)}
    prompts, sp = [[1, 2], [3]], SamplingParams(max_new_tokens=4)
    calls = {"set_weights": (params, 5, rest), "generate": (prompts, sp, jax.random.key(0)),
             "score": (prompts, [[1], [2]], sp)}
    errors = {"set_weights": (TransferError, "rejected by the engine", "weight version 5 was refused"),
              "generate": (PoolError, "every vLLM engine died", "failed generating the rollout"),
              "score": (PoolError, "no live vLLM engine", "failed scoring the probe sequences")}
    for method, args in calls.items():
        kind, on_zero, on_other = errors[method]
        for rank in (0, 1):
            monkeypatch.setattr(multihost, "_from_zero", bc.zero if rank == 0 else bc.other)
            with pytest.raises(kind, match=on_zero if rank == 0 else on_other):
                getattr(pools[rank], method)(*args)
        assert not bc.sent, method  # process 1 took every broadcast process 0 took
    assert read[0] == read[1] > 1  # both iterated every tensor


def test_a_pool_that_fails_to_start_on_process_zero_is_raised_on_every_process(monkeypatch):
    """Ray unreachable on process 0: the others went on to their next collective, and both aborted at jax's shutdown
    barrier minutes later, the cause in process 0's log alone."""
    from rl.generation import multihost
    from rl.generation.multihost import started_on_zero
    from rl.generation.vllm_pool import PoolError

    def unreachable():
        raise ConnectionError("could not connect to the Ray cluster at auto")

    bc = Broadcast()
    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    with pytest.raises(ConnectionError, match="could not connect"):
        started_on_zero(unreachable, True)
    monkeypatch.setattr(multihost, "_from_zero", bc.other)
    with pytest.raises(PoolError, match="process 0 could not start the vLLM pool"):
        started_on_zero(lambda: pytest.fail("only process 0 starts the pool"), False)
    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    assert started_on_zero(lambda: "pool", True) == "pool"
    monkeypatch.setattr(multihost, "_from_zero", bc.other)
    assert started_on_zero(lambda: "pool", False) is None and not bc.sent


def test_make_generator_starts_the_pool_through_the_agreement(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from m3jax.tiny import m3_model
    from rl.config import load_config
    from rl.generation import backends, multihost, vllm_pool

    class Unreachable:
        def __init__(self, *a, **k):
            raise ConnectionError("could not connect to the Ray cluster at auto")

    cfg = load_config("configs/tiny.yaml", ["generation.backend=vllm"], check_paths=False)
    graphdef, params, rest = nnx.split(m3_model(cfg.model.m3_config()), nnx.Param, ...)
    bc = Broadcast()
    monkeypatch.setattr(vllm_pool, "VLLMPool", Unreachable)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(multihost, "_from_zero", bc.zero)
    with pytest.raises(ConnectionError, match="could not connect"):
        backends.make_generator(cfg, graphdef, SimpleNamespace(params=params, rest=rest), pad_id=0,
                                run_dir=str(tmp_path))
    assert [int(v) for v in bc.sent] == [1]  # process 0 told the others before raising


@pytest.fixture(scope="module")
def host_values_outputs(tmp_path_factory) -> list:
    """What each of two jax processes got from tests/workers/host_values_check.py (~10 s)."""
    port, out = free_port(), str(tmp_path_factory.mktemp("host_values") / "out")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/host_values_check.py"), str(port),
                               str(i), out], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    return [np.load(f"{out}.{i}.npz") for i in range(2)]


@pytest.mark.slow  # two jax processes
def test_the_broadcast_from_process_zero_is_jaxs_bit_for_bit(host_values_outputs):
    """`broadcast_from_first_process` (the rollouts, rewards and figures process 0 shares) sums over one device per
    process, where jax's broadcast_one_to_all sums a copy on every device: the same bits on every process, NaN, -0.0
    (summed with zeros: +0.0, as jax's), booleans, int16 routes, scalars and empty arrays included."""
    for i, got in enumerate(host_values_outputs):
        for key in ("floats", "routes", "done", "count", "empty"):
            ours, theirs, sent = got[f"ours_{key}"], got[f"jax_{key}"], got[f"sent_{key}"]
            assert ours.dtype == theirs.dtype == sent.dtype and ours.shape == sent.shape, (i, key)
            assert ours.tobytes() == theirs.tobytes(), (i, key)
            np.testing.assert_array_equal(ours, sent, err_msg=f"process {i} {key}")  # NaN == NaN; -0.0 == 0.0


@pytest.mark.slow  # two jax processes
def test_an_array_held_across_processes_is_gathered_whole_on_each(host_values_outputs):
    """`gather_to_every_process` (the JAX engine's rollouts, routes and key-block ids on a mesh over several hosts)
    gives each process the whole value, bit for bit, in chunks of rows smaller than the array: rows split over the
    processes, over processes and local devices, and rows every process holds (each entry counted once)."""
    for i, got in enumerate(host_values_outputs):
        for key in ("rows", "rows_and_cols", "cols_only", "logps", "done"):
            gathered, value = got[f"gathered_{key}"], got[f"value_{key}"]
            assert gathered.dtype == value.dtype and gathered.shape == value.shape, (i, key)
            assert gathered.tobytes() == value.tobytes(), (i, key)
