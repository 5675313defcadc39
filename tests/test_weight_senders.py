"""Several trainer processes send the weights on the collective path, each the tensors its own devices hold
(m3jax.hf.owned, rl.generation.bucket_sender, rl.generation.multihost.follow_push). Fast: the ownership
plan, the routes and the pieces the senders exchange. Slow: two JAX processes push, each through its own
weight groups, into an engine that receives every tensor exactly once and bit for bit, and into an
expert-parallel engine whose workers receive only their own experts (and everything else)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import m3jax
from m3jax import tiny
from m3jax.hf.owned import assign_owners, covers, owned_hf_tensors
from m3jax.hf.save import hf_tensors
from rl.generation.bucket_sender import SendResult
from rl.generation.collective import decode_address, encode_address
from rl.generation.transfer import make_transport
from rl.generation.weight_routes import expert_of
from tests import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_covers_needs_every_element_and_counts_replicas_once():
    region = ((2, 3), (0, 8))  # row 2 of an [8, 8] array
    assert covers([((0, 4), (0, 8))], region)
    assert covers([((0, 4), (0, 4)), ((0, 4), (4, 8))], region)  # two column halves, both here
    assert not covers([((0, 4), (0, 4)), ((0, 4), (0, 4))], region)  # a replica is not the other half
    assert not covers([((4, 8), (0, 8))], region)
    assert covers([((0, 8), (0, 8))] * 3, ((0, 8), (0, 8)))


def test_owners_balance_bytes_among_holders_and_agree_everywhere():
    holders = [[0, 1], [0, 1], [1], [], [0]]
    sizes = [10, 10, 30, 5, 1]
    owners = assign_owners(holders, sizes, 2)
    assert owners == [0, 1, 1, 0, 0]  # tie -> lower index; the gathered tensor goes to the lighter one
    assert all(o in h for o, h in zip(owners, holders) if h)
    assert assign_owners(holders, sizes, 2) == owners  # a pure function of shapes and shardings


def test_one_process_owns_everything_in_hf_order():
    model = tiny.m3_model(tiny.m3_config(), seed=1)
    got, want = list(owned_hf_tensors(model, "released")), list(hf_tensors(model, "released"))
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))


def _sharded_over_8(model):
    """The model's parameters spread over the 8 (simulated) devices: each along its first axis that 8 divides
    (so an expert stack puts its experts on different devices and a dense weight is cut in rows), else kept
    whole on every device."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))

    def place(x):
        axis = next((i for i, n in enumerate(x.shape) if n % 8 == 0), None)
        spec = PartitionSpec() if axis is None else PartitionSpec(*([None] * axis + ["d"]))
        return jax.device_put(x, NamedSharding(mesh, spec))

    nnx.update(model, jax.tree.map(place, nnx.state(model)))
    return model


def test_device_sources_equal_the_host_arrays_and_stay_on_the_devices():
    """hf_tensors(on_host=False) and the owned path's device regions (`_local_region_on_device`: one shard's
    slice, or pieces of several shards written into one array) hold exactly the host path's values."""
    import jax

    model = _sharded_over_8(tiny.m3_model(tiny.m3_config(num_local_experts=8), seed=2))
    want = dict(hf_tensors(model, "released"))
    for got in (list(hf_tensors(model, "released", on_host=False)),
                list(owned_hf_tensors(model, "released", process=0, processes=2, on_host=False))):
        assert [n for n, _ in got] == list(want)
        assert all(isinstance(a, jax.Array) for _, a in got)
        assert all(a.dtype == want[n].dtype and np.array_equal(np.asarray(a), want[n]) for n, a in got)
    assert any(len(a.devices()) > 1 for _, a in hf_tensors(model, "released", on_host=False))  # sharded ones too


def test_the_pieces_the_senders_exchange_round_trip():
    assert decode_address(encode_address("10.1.2.3", 29500)) == ("10.1.2.3", 29500)
    with pytest.raises(ValueError, match="IPv4"):
        encode_address("::1", 1)
    r = SendResult(3, 1 << 40, 7, 0.5, 0.25, "tensor 'x' failed: é", True)
    assert SendResult.from_array(r.to_array()) == r
    assert SendResult.from_array(SendResult(1, 2, 3).to_array()) == SendResult(1, 2, 3)
    with pytest.raises(ValueError, match="several senders need 'collective'"):
        make_transport("ray", [], 1 << 20, peers=object())


@pytest.mark.slow  # two JAX processes and a Ray engine: ~40 s
def test_two_processes_send_their_own_tensors_into_one_engine(tmp_path):
    from tests.test_multihost import free_port

    pytest.importorskip("ray", reason="ray is not installed (scripts/setup.sh installs it)")
    from rl.generation.weight_slices import cut
    from tests.test_weight_transfer_protocol import row_halves

    ckpt = ref.save(ref.build_model(ref.tiny_config("release_like"), seed=3), str(tmp_path / "ckpt"))
    model = m3jax.from_pretrained(ckpt)
    port, out = free_port(), str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/workers/multihost_weights.py"), ckpt,
                               str(port), str(i), out], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    want = dict(hf_tensors(model, "released"))
    sent = [json.load(open(f"{out}.{i}.json")) for i in range(2)]
    assert not set(sent[0]) & set(sent[1]) and set(sent[0]) | set(sent[1]) == set(want)  # each once
    experts = [n for n in want if ".experts." in n]
    assert experts and all(any(n in s for n in experts) for s in sent)  # the experts go from where they live
    share = sum(sent[1].values()) / sum(a.nbytes for a in want.values())
    assert 0.3 < share < 0.7, share  # balanced, not one process sending everything
    half = model.cfg.num_local_experts // 2
    routes = [None, range(half), range(half, model.cfg.num_local_experts)]  # the dict engine, then 2 workers
    boxes = ({},) + row_halves({n: a.shape for n, a in want.items()})
    assert boxes[1] and boxes[2]
    for i, route in enumerate(routes):
        got = np.load(f"{out}.engine{i}.npz")
        mine = {n for n in want if route is None or expert_of(n) is None or expert_of(n) in route}
        assert set(got.files) == mine, i  # an expert-parallel worker: its own experts and everything else
        for name in mine:  # a worker's boxes hold exactly the trainer's values there (the stand-in keeps them)
            expect = cut(want[name], boxes[i].get(name))
            assert got[name].dtype == expect.dtype and np.array_equal(got[name], expect), name


def test_routes_group_receivers_by_the_experts_they_hold():
    from rl.generation import weight_routes as wr

    # an in-process engine (everything), then a 2-rank expert-parallel engine, then another like it
    receivers = [[None], [[0, 1], [2, 3]], [[2, 3], [1, 0]]]
    routes, placement, slices = wr.plan(receivers)
    assert routes == [None, frozenset({0, 1}), frozenset({2, 3})] and slices == [{}, {}, {}]
    # (route, rank in its group, group size): rank 0 of every group is its sender
    assert placement == [[(0, 1, 2)], [(1, 1, 3), (2, 1, 3)], [(2, 2, 3), (1, 2, 3)]]
    assert wr.plan([[None, None]]) == ([None], [[(0, 1, 3), (0, 2, 3)]], [{}])  # no expert parallelism: one group
    # tensor-parallel ranks that read different slices (rl.generation.weight_slices) are in different groups,
    # ranks of two engines that read the same share one; boxes arrive from Ray as lists
    tp = [[{"experts": None, "slices": {"q": [[0, 4], [0, 6]]}}, {"experts": None, "slices": {"q": [[4, 8], [0, 6]]}}]]
    tp_routes, tp_placement, tp_slices = wr.plan(tp + tp)
    assert tp_routes == [None, None] and tp_slices == [{"q": ((0, 4), (0, 6))}, {"q": ((4, 8), (0, 6))}]
    assert tp_placement == [[(0, 1, 3), (1, 1, 3)], [(0, 2, 3), (1, 2, 3)]]
    name = "language_model.model.layers.3.block_sparse_moe.experts.{}.w2.weight"
    assert wr.expert_of(name.format(12)) == 12
    assert wr.expert_of("language_model.model.layers.3.block_sparse_moe.shared_experts.down_proj.weight") is None
    assert wr.wants(frozenset({0}), name.format(0)) and not wr.wants(frozenset({0}), name.format(1))
    assert wr.wants(frozenset({0}), "language_model.model.norm.weight") and wr.wants(None, name.format(1))
    table = wr.encode(routes, [2, 3, 3], 4)
    assert wr.decode(table) == (routes, [2, 3, 3])
    with pytest.raises(ValueError, match="expert 7, but the model has 4"):
        wr.encode([frozenset({7})], [2], 4)


def test_a_sender_that_fails_to_pack_still_drains_its_tensors(monkeypatch):
    """On a multi-host trainer the tensors a process sends hold gathers every process must join, so a sender
    whose packing fails keeps iterating (unsent) and reports the failure instead of stopping short."""
    from rl.generation import bucket_sender

    taken = []

    def tensors():
        for i in range(5):
            taken.append(i)
            yield f"t{i}", np.full((4,), i, np.float32)

    real = bucket_sender.checksum
    monkeypatch.setattr(bucket_sender, "checksum", lambda a: real(a) if a[0] != 1 else 1 // 0)
    out = bucket_sender.BucketSender(64).send(tensors(), 3)  # no group: nothing goes on a wire
    assert taken == [0, 1, 2, 3, 4] and out.error is not None and out.buckets == 0


def test_a_sender_never_opened_drains_and_reports_it():
    from rl.generation.bucket_sender import RoutedSender

    taken = []
    out = RoutedSender(64).send(((taken.append(i) or f"t{i}", np.zeros(2, np.float32)) for i in range(3)), 1)
    assert taken == [0, 1, 2] and out.broken and "not in a weight group" in out.error


class _RecordingGroup:
    """A weight group that keeps what is broadcast into it: (header, metadata JSON, payload bytes) per bucket."""

    def __init__(self):
        self.sent, self.closed = [], False

    def broadcast(self, t):
        self.sent.append(t.clone())
        return self

    def wait(self):
        pass

    def close(self):
        self.closed = True

    def buckets(self):
        import json

        out, i = [], 0
        while i < len(self.sent):
            head = self.sent[i].tolist()
            if head[0] != 0:  # END / ABORT
                out.append(("end", head))
                i += 1
                continue
            meta = json.loads(bytes(self.sent[i + 1].tolist()))
            out.append((head, meta, self.sent[i + 2].numpy().tobytes()))
            i += 3
        return out


def test_routed_buckets_are_packed_once_and_each_group_gets_exactly_its_tensors(monkeypatch):
    """Three routes (everything, expert 0, expert 1): a tensor every route wants is packed and hashed once and
    broadcast into all three groups from the same buffer; each group numbers its own buckets from 0 and ends
    with END and its count; the buffers stay at depth + open_buckets - 1, not depth per route."""
    from rl.generation import bucket_sender

    hashed = []
    real = bucket_sender.checksum
    monkeypatch.setattr(bucket_sender, "checksum", lambda a: hashed.append(1) or real(a))
    expert = "language_model.model.layers.0.block_sparse_moe.experts.{}.w1.weight"
    named = [("language_model.model.embed_tokens.weight", np.arange(40, dtype=np.float32)),
             (expert.format(0), np.full(30, 1, np.float32)), (expert.format(1), np.full(30, 2, np.float32)),
             ("language_model.model.norm.weight", np.ones(8, np.float32)),
             (expert.format(0).replace("w1", "w2"), np.full(30, 3, np.float32))]
    sender = bucket_sender.RoutedSender(256)
    sender.routes = [None, frozenset({0}), frozenset({1})]
    sender.senders = [bucket_sender.BucketSender(256) for _ in sender.routes]
    for s in sender.senders:
        s.group = _RecordingGroup()
    out = sender.send(iter(named), 7)
    assert out.error is None and out.tensors == len(named) == len(hashed)
    assert out.bytes == sum(a.nbytes for _, a in named)
    assert len(sender._buffers.slots) <= 2 + 2 - 1
    for g, route in enumerate(sender.routes):
        buckets = sender.senders[g].group.buckets()
        *data, end = buckets
        assert end == ("end", [bucket_sender.END, 0, 0, len(data)]) and out.route_buckets[g] == len(data)
        assert [head[3] for head, _, _ in data] == list(range(len(data)))  # this group's own numbering
        got = {r["name"]: np.frombuffer(payload[r["offset"]:r["offset"] + r["nbytes"]], np.float32)
               for _, meta, payload in data for r in meta}
        wanted = {n: a for n, a in named if route is None or ".experts." not in n or f".experts.{min(route)}." in n}
        assert sorted(got) == sorted(wanted), g
        assert all(np.array_equal(got[n], wanted[n]) for n in wanted)
