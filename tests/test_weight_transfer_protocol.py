"""The collective weight path's protocol without vLLM (rl.generation.collective): plain Ray actors that keep
applied tensors in a dict join a gloo group with the test process; buckets arrive bit for bit (fp32 and
bf16, a tensor larger than a bucket travels alone), and a corrupted or partial push is refused with the
tensor named and nothing applied anywhere, after which the same group carries the next update.

One of the engines stands in for a vLLM engine on the Ray executor: the real `EngineActor` over two workers
that are ranks of the group themselves (`rl.generation.vllm_worker_weights.WorkerWeights`, the methods
vLLM's workers get), so the group has 1 + 1 + 2 ranks."""

import concurrent.futures
import contextlib
import json

import numpy as np
import pytest

pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")
import ml_dtypes  # noqa: E402
import ray  # noqa: E402

from rl.generation import bucket_sender, collective, collective_receiver, word_checksum  # noqa: E402
from rl.generation.torch_arrays import to_numpy  # noqa: E402
from rl.generation.transfer import StagedUpdate, TransferError  # noqa: E402
from rl.generation.weight_group import WeightGroup  # noqa: E402
from rl.generation.vllm_actor import EngineActor  # noqa: E402
from rl.generation.vllm_worker_weights import WorkerWeights  # noqa: E402


class DictEngine:
    """The engine surface the collective path uses: a manifest, `check`, and commit into a dict."""

    def __init__(self, named, staging="auto"):
        self.manifest = {n: (a.shape, a.dtype) for n, a in named}
        self.receiver, self.applied, self.version, self.staging = None, {}, 0, staging

    def check(self, name, shape, dtype):
        if name not in self.manifest or tuple(shape) != self.manifest[name][0]:
            raise KeyError(f"{name!r} {tuple(shape)} is not a tensor of this engine")

    def join_weight_group(self, senders_by_route, placement, routes, backend, timeout_s):
        self.receiver = self.receiver or collective_receiver.Receiver(self.staging)
        self.receiver.join_placed(senders_by_route, placement, routes, 0, backend, timeout_s)

    def leave_weight_group(self):
        self.receiver.leave()

    def receive_weights(self, version):
        return self.receiver.receive(version, self.check, self.manifest)

    def commit(self, version, num_buckets):
        self.applied = {n: to_numpy(a).copy() for n, a in self.receiver.tensors(version, num_buckets)}
        self.receiver.clear()
        self.version = version
        return version

    def abort(self, version):
        if self.receiver is not None and self.receiver.version == version:
            self.receiver.clear()

    def weight_receivers(self):
        return [None]

    def ring_buffers(self):
        return len(self.receiver._ring)

    def states(self):
        return [(self.version, self.applied)]


def _numpy(weights):
    import torch

    return {n: (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16
                else t.numpy()).copy() for n, t in weights}


class _SlicingApplier:
    """The in-place applier's surface for a worker whose loaders read only `boxes` of some tensors (what
    rl.generation.inplace.InplaceApplier.read_boxes probes from vLLM's loaders): apply keeps the boxes."""

    def __init__(self, worker, boxes):
        self.worker, self.boxes = worker, boxes

    def read_boxes(self, manifest, names):
        return {n: b for n, b in self.boxes.items() if n in names}

    def apply(self, weights):
        from rl.generation.weight_slices import cut

        self.worker.applied = {n: cut(a, self.boxes.get(n)).copy() for n, a in _numpy(weights).items()}


class _Worker(WorkerWeights):
    """A vLLM worker's weight methods over a dict: reload_weights keeps what it is given."""

    def __init__(self, rank, experts=None, boxes=None):
        self.rank, self.applied, self.experts = rank, {}, experts
        if boxes is not None:
            self._m3jax_applier = _SlicingApplier(self, boxes)

    def m3jax_local_experts(self):  # vLLM's expert map, which the real method reads, is not here
        return self.experts

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.applied = _numpy(weights_iterator)


class _RayExecutorEngine:
    """The VLLMEngine surface EngineActor uses for an engine on vLLM's Ray executor: two workers, each a rank
    of the weight group; collective_rpc runs a method on both at once, as vLLM's executor does."""

    executor, model_dir = "ray", "the served checkpoint"

    def __init__(self, named, experts=(None, None), boxes=(None, None)):
        self.manifest = {n: (a.shape, a.dtype) for n, a in named}
        self.workers = [_Worker(r, experts[r], boxes[r]) for r in range(2)]
        self.version, self.llm = 0, self

    def weight_receivers(self):
        return self.collective_rpc("m3jax_weight_route", args=(self.manifest,))

    def collective_rpc(self, method, args=(), kwargs=None):
        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
            futures = [pool.submit(getattr(w, method), *args, **(kwargs or {})) for w in self.workers]
            return [f.result() for f in futures]

    def commit_in_workers(self, version, num_buckets):
        self.collective_rpc("m3jax_commit_weights", kwargs={"version": version, "num_buckets": num_buckets})


class RayExecutorEngine(EngineActor):
    def __init__(self, named, experts=(None, None), boxes=(None, None)):  # EngineActor's own would start vLLM
        self.rank, self.staged, self.busy_since = 1, StagedUpdate(), None
        self.engine = _RayExecutorEngine(named, experts, boxes)

    def states(self):
        return [(self.engine.version, w.applied) for w in self.engine.workers]


def _named(seed):
    rng = np.random.default_rng(seed)
    return [("a", rng.standard_normal((3, 5)).astype(np.float32)),
            ("b", rng.standard_normal((7,)).astype(ml_dtypes.bfloat16)),
            ("big", rng.standard_normal((64, 40)).astype(np.float32)),  # 10 kB: alone in its bucket
            ("c", rng.standard_normal((2, 2, 3)).astype(np.float32))]


# xxh3: what the gloo path checks with; wordsum64: the NCCL path's check on the device where the buckets land
# (rl.generation.word_checksum), here on host buffers: the engines are then handed torch views of the buckets;
# "+host staging": the dict engine receives into a ring of buffers and stages each verified bucket in memory of
# its own (what an engine on a GPU whose weights fill it does, collective_receiver.Receiver)
@pytest.fixture(scope="module", params=["xxh3", word_checksum.KIND, word_checksum.KIND + "+host staging"])
def engines(ray_local, request):
    kind, _, staging = request.param.partition("+")
    handles = [ray.remote(DictEngine).remote(_named(0), "host" if staging else "auto"),
               ray.remote(RayExecutorEngine).remote(_named(0))]
    t = collective.CollectiveTransport(handles, bucket_bytes=256, timeout_s=60, checksum_kind=kind)
    yield t, handles, bool(staging)
    t.close()
    for h in handles:
        ray.kill(h)


def _check_applied(handles, version, named):
    states = [state for h in handles for state in ray.get(h.states.remote())]
    assert len(states) == 3  # the dict engine and both workers of the Ray-executor one
    for version_got, applied in states:
        assert version_got == version and list(applied) == [n for n, _ in named]
        for n, a in named:
            assert applied[n].dtype == a.dtype and np.array_equal(applied[n].view(np.uint8), a.view(np.uint8)), n


def test_collective_push_arrives_bit_for_bit_on_every_engine(engines):
    t, handles, host_staging = engines
    stats = t.push(iter(_named(1)), 1)
    assert [s.group.world for s in t.sender.senders] == [4]  # the trainer, the dict engine, the two workers
    assert stats.setup_s > 0 and stats.buckets == 3 and stats.tensors == 4  # [a b] [big] [c]
    assert stats.bytes == sum(a.nbytes for _, a in _named(1))
    _check_applied(handles, 1, _named(1))
    assert ray.get(handles[0].ring_buffers.remote()) == (collective_receiver.RING if host_staging else 0)
    assert t.push(iter(_named(2)), 2).setup_s == 0  # the group is kept between updates
    _check_applied(handles, 2, _named(2))


def test_corrupted_or_partial_push_is_refused_everywhere_and_the_group_stays_usable(engines, monkeypatch):
    t, handles, host_staging = engines
    t.push(iter(_named(3)), 3)
    real = WeightGroup.broadcast

    def corrupt_big(self, tensor, root=0):
        if tensor.numel() == 64 * 40 * 4:  # the payload of the bucket holding 'big'
            tensor = tensor.clone()
            tensor[17] ^= 4
        return real(self, tensor, root)

    monkeypatch.setattr(WeightGroup, "broadcast", corrupt_big)
    with pytest.raises(TransferError, match=r"tensor 'big' \(bucket 1, version 4\): checksum mismatch"):
        t.push(iter(_named(4)), 4)
    monkeypatch.setattr(WeightGroup, "broadcast", real)

    class UnknownKind:  # a sender of another version, say: a checksum no receiver computes
        @staticmethod
        def dumps(records):
            return json.dumps([{**r, "hash": "crc32"} if r["name"] == "big" else r for r in records])

    monkeypatch.setattr(bucket_sender, "json", UnknownKind)
    with pytest.raises(TransferError, match=r"bucket 1 of version 4: checksum kind 'crc32', expected xxh3 or"):
        t.push(iter(_named(4)), 4)
    monkeypatch.undo()
    with pytest.raises(TransferError, match=r"tensor 'c' missing from version 5 \(partial update: 1 of 4"):
        t.push(iter(_named(5)[:3]), 5)
    with pytest.raises(TransferError, match=r"tensor 'a' sent twice in version 6"):
        t.push(iter(_named(6) + _named(6)[:1]), 6)
    _check_applied(handles, 3, _named(3))  # nothing of 4, 5 or 6 was applied anywhere
    t.push(iter(_named(7)), 7)
    _check_applied(handles, 7, _named(7))


def test_device_arrays_are_packed_device_to_device(engines):
    """JAX arrays (what hf_tensors(on_host=False) yields for buckets on an accelerator), one of them spread over
    the 8 simulated devices, arrive bit for bit: copied into the buckets through DLPack, not via numpy."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    t, handles, host_staging = engines
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    named = [(n, jax.device_put(jnp.asarray(a), NamedSharding(mesh, PartitionSpec("d"))) if n == "big"
              else jnp.asarray(a)) for n, a in _named(8)]
    assert len(named[2][1].devices()) == 8
    t.push(iter(named), 8)
    _check_applied(handles, 8, _named(8))


def test_the_config_selects_the_collective_transport_and_refuses_unknown_ones():
    from pathlib import Path

    from rl.config import ConfigError, load_config
    from rl.generation.transfer import TRANSPORTS

    tiny_vllm = Path(__file__).resolve().parents[1] / "configs" / "tiny-vllm.yaml"
    cfg = load_config(tiny_vllm, ["generation.weight_transport=collective"])
    assert cfg.generation.weight_transport == "collective" and TRANSPORTS["collective"] is collective.CollectiveTransport
    with pytest.raises(ConfigError, match=r'generation.weight_transport = "nccl".*ray.*collective'):
        load_config(tiny_vllm, ["generation.weight_transport=nccl"])


def _named_moe(seed):
    """_named plus two routed experts of one layer, in the released layout's names."""
    rng = np.random.default_rng(seed)
    experts = [(f"language_model.model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight",
                rng.standard_normal((4, 6)).astype(np.float32)) for e in range(2) for w in (1, 2, 3)]
    return _named(seed) + experts


@contextlib.contextmanager
def _dict_and_ray_executor_engines(named, **reads):
    """The dict engine and a Ray-executor engine (its workers' `reads`: experts, boxes) behind one transport."""
    handles = [ray.remote(DictEngine).remote(named), ray.remote(RayExecutorEngine).remote(named, **reads)]
    t = collective.CollectiveTransport(handles, bucket_bytes=256, timeout_s=60)
    try:
        yield t, handles
    finally:
        t.close()
        for h in handles:
            ray.kill(h)


def _versions(handles) -> list[int]:
    """The version each receiver is on: the dict engine, then each worker of the Ray-executor engine."""
    return [v for h in handles for v, _ in ray.get(h.states.remote())]


def test_expert_parallel_workers_receive_only_their_experts(ray_local):
    """Worker r of an expert-parallel engine holds expert r: it gets every other tensor and its own experts,
    through its route's group (rl.generation.weight_routes); the in-process engine still gets everything."""
    named = _named_moe(0)
    with _dict_and_ray_executor_engines(named, experts=([0], [1])) as (t, handles):
        stats = t.push(iter(_named_moe(1)), 1)
        assert t.sender.routes == [None, frozenset({0}), frozenset({1})]
        assert [s.group.world for s in t.sender.senders] == [2, 2, 2]  # the trainer and one receiver each
        assert stats.tensors == len(named) and stats.bytes == sum(a.nbytes for _, a in named)
        (_, whole), = ray.get(handles[0].states.remote())
        workers = ray.get(handles[1].states.remote())
        want = dict(_named_moe(1))
        # buckets group the tensors by the routes that want them, so they arrive in another order
        assert sorted(whole) == sorted(want)
        for r, (version, got) in enumerate(workers):
            mine = [n for n in want if ".experts." not in n or f".experts.{r}." in n]
            assert version == 1 and sorted(got) == sorted(mine), r
            assert all(np.array_equal(got[n].view(np.uint8), want[n].view(np.uint8)) for n in mine)
        # worker 1 misses its expert: refused with the name, nothing applied anywhere
        missing = "language_model.model.layers.0.block_sparse_moe.experts.1.w2.weight"
        with pytest.raises(TransferError, match=rf"tensor '{missing}' missing from version 2"):
            t.push(iter([(n, a) for n, a in _named_moe(2) if n != missing]), 2)
        assert _versions(handles) == [1, 1, 1]


def row_halves(shapes: dict, suffixes=("embed_tokens.weight", "lm_head.weight", "self_attn.q_proj.weight",
                                       "self_attn.o_proj.weight")) -> tuple[dict, dict]:
    """Boxes of a TP 2 engine's two workers for the tensors named ...suffix (name -> shape): rank r the r-th half
    of the rows (the columns for o_proj, as vLLM's row-parallel layers read). tests/workers/multihost_weights.py."""
    out = ({}, {})
    for name, shape in shapes.items():
        if not name.endswith(suffixes):
            continue
        dim = 1 if name.endswith("o_proj.weight") else 0
        half = shape[dim] // 2
        for r in range(2):
            box = [(0, n) for n in shape]
            box[dim] = (r * half, (r + 1) * half if r == 0 else shape[dim])
            out[r][name] = tuple(box)
    return out


# Rank r of a TP 2 engine: q's rows, big's columns (a strided box), c whole; 'a' overlaps between the ranks.
_BOXES = ({"a": ((0, 2), (0, 5)), "big": ((0, 64), (0, 20))},
          {"a": ((1, 3), (0, 5)), "big": ((0, 64), (20, 40)), "c": ((1, 2), (0, 2), (0, 3))})


def test_tensor_parallel_workers_receive_only_their_slices(ray_local, monkeypatch):
    """Each worker of a TP engine is sent only the box of each tensor its loaders read (rl.generation.
    weight_slices), through a group of its own; the in-process engine still gets every tensor whole. A slice
    that is not the one a receiver reads is refused with the tensor's name, and nothing is applied."""
    from rl.generation import bucket_sender
    from rl.generation.weight_slices import cut

    named = _named(0)
    with _dict_and_ray_executor_engines(named, boxes=_BOXES) as (t, handles):
        stats = t.push(iter(_named(1)), 1)
        assert t.sender.routes == [None, None, None]  # no experts: the three differ in their slices only
        assert [s.group.world for s in t.sender.senders] == [2, 2, 2]
        # every tensor once whole (the dict engine's group, and each worker reading it whole shares that
        # piece), plus each worker's boxes: 'big' is half the bytes it was for each
        whole_bytes = sum(a.nbytes for _, a in named)
        pieces = sum(cut(a, b[n]).nbytes for b in _BOXES for n, a in named if n in b)
        sliced_whole = sum(a.nbytes for b in _BOXES for n, a in named if n in b)
        assert stats.tensors == len(named) and stats.bytes == whole_bytes + pieces
        assert pieces < 0.6 * sliced_whole, (pieces, sliced_whole)
        # into each worker's group: its boxes and the tensors it reads whole (each padded to 64 bytes)
        for g, b in ((1, _BOXES[0]), (2, _BOXES[1])):
            assert 0 <= stats.route_bytes[g] - sum(cut(a, b.get(n)).nbytes for n, a in named) < 64 * len(named)
        assert stats.route_bytes[0] >= whole_bytes
        (_, whole), = ray.get(handles[0].states.remote())
        want = dict(_named(1))
        assert all(np.array_equal(whole[n].view(np.uint8), a.view(np.uint8)) for n, a in want.items())
        for r, (version, got) in enumerate(ray.get(handles[1].states.remote())):
            assert version == 1 and sorted(got) == sorted(want), r
            for n, a in want.items():  # the boxes a rank reads hold exactly the sent values
                assert np.array_equal(got[n].view(np.uint8), cut(a, _BOXES[r].get(n)).view(np.uint8)), (r, n)

        # a sender that cuts rank 1's 'big' at another box: refused, version 1 stays everywhere
        real = bucket_sender.RoutedSender.send

        def shifted(self, named_arrays, version):
            key = collective.weight_slices.name_key("big")
            self.slices = [{k: (((0, 64), (19, 39)) if k == key and b == ((0, 64), (20, 40)) else b)
                            for k, b in s.items()} for s in self.slices]
            return real(self, named_arrays, version)

        monkeypatch.setattr(bucket_sender.RoutedSender, "send", shifted)
        with pytest.raises(TransferError, match=r"tensor 'big' \(bucket \d+, version 2\): rejected by the engine: "
                                                r"got the slice \[\[0, 64\], \[19, 39\]\], this receiver reads "
                                                r"\[\[0, 64\], \[20, 40\]\]"):
            t.push(iter(_named(2)), 2)
        assert _versions(handles) == [1, 1, 1]
