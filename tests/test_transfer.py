"""Weight-transfer protocol: buckets, checksums, staging, two-phase commit (rl.generation.transfer).

The transport tests use small Ray actors that keep applied tensors in a dict (the vLLM-backed actor is
tested in tests/test_vllm_pool.py); what is under test here is the protocol: nothing is applied until
every engine verified every bucket, and a rejected update leaves every engine on its old version.
"""

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.config import M3Config
from m3jax.hf.save import hf_tensors
from rl.generation import transfer as tr

CFG = M3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, intermediate_size=16, dense_intermediate_size=48, shared_intermediate_size=16,
               num_local_experts=4, num_experts_per_tok=2, partial_rotary_factor=0.5,
               layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"),
               index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2)


def _arrays(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"w{i}", rng.standard_normal((i + 1, 3)).astype(np.float32)) for i in range(n)]


def test_buckets_keep_order_and_size_and_big_tensors_travel_alone():
    named = _arrays(6) + [("big", np.zeros((100,), np.float32))]
    buckets = list(tr.make_buckets(named, bucket_bytes=60, version=3))
    assert [r.name for b in buckets for r in b.records] == [n for n, _ in named]
    assert all(b.version == 3 for b in buckets) and [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.nbytes <= 60 or len(b.arrays) == 1
    assert buckets[-1].records[0].name == "big" and len(buckets[-1].arrays) == 1


def test_checksum_catches_a_flipped_bit_and_names_the_tensor():
    (bucket,) = tr.make_buckets(_arrays(3), bucket_bytes=1 << 20, version=1)
    tr.verify_bucket(bucket)
    bucket.arrays[1] = bucket.arrays[1].copy()
    bucket.arrays[1].view(np.uint32)[0, 0] ^= 1
    with pytest.raises(tr.TransferError, match=r"tensor 'w1' .*checksum mismatch"):
        tr.verify_bucket(bucket)


def test_checksum_of_bfloat16_hashes_raw_words():
    import ml_dtypes

    a = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert tr.checksum(a) == tr.checksum(a.view(np.uint16))
    b = a.copy()
    b.view(np.uint16)[3] ^= 1
    assert tr.checksum(a) != tr.checksum(b)


def test_verify_rejects_shape_dtype_and_names_the_engine_refuses():
    (bucket,) = tr.make_buckets(_arrays(2), bucket_bytes=1 << 20, version=1)
    bad = tr.Bucket(1, 0, bucket.records, [bucket.arrays[0].astype(np.float64), bucket.arrays[1]])
    with pytest.raises(tr.TransferError, match=r"'w0'.*arrived as float64"):
        tr.verify_bucket(bad)

    def check(name, shape, dtype):
        if name == "w1":
            raise KeyError(f"{name} is not a parameter of the engine's model")

    with pytest.raises(tr.TransferError, match=r"'w1'.*rejected by the engine"):
        tr.verify_bucket(bucket, check)


def test_staged_update_refuses_incomplete_or_repeated_and_restarts_on_new_version():
    b0, b1 = tr.make_buckets(_arrays(4), bucket_bytes=72, version=7)
    st = tr.StagedUpdate()
    st.stage(b0)
    with pytest.raises(tr.TransferError, match="holds buckets \\[0\\]"):
        list(st.tensors(7, 2))
    st.stage(b1)
    assert [n for n, _ in st.tensors(7, 2)] == ["w0", "w1", "w2", "w3"]
    dup = tr.Bucket(7, 1, b0.records, b0.arrays)
    st.stage(dup)
    with pytest.raises(tr.TransferError, match="'w0' sent twice"):
        list(st.tensors(7, 2))
    (other,) = tr.make_buckets(_arrays(1), bucket_bytes=1 << 20, version=8)
    st.stage(other)  # an abandoned update is replaced by the next version's
    assert st.version == 8 and list(st.buckets) == [0]


def test_transport_is_built_by_its_config_name():
    t = tr.make_transport("ray", ["e0", "e1"], bucket_bytes=64, timeout_s=5.0)
    assert isinstance(t, tr.RayObjectStoreTransport)
    assert (t.engines, t.bucket_bytes, t.timeout_s) == (["e0", "e1"], 64, 5.0)
    with pytest.raises(ValueError, match=r"weight transport 'nccl' is not built; allowed: ray"):
        tr.make_transport("nccl", [], bucket_bytes=64)


def test_transferred_tensors_are_what_save_pretrained_writes(tmp_path):
    """The transfer path and the export path are the same generator: every byte agrees with the files."""
    from safetensors.numpy import load_file

    model = m3jax.M3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    m3jax.save_pretrained(model, tmp_path / "export", layout="released")
    on_disk = {}
    for f in os.listdir(tmp_path / "export"):
        if f.endswith(".safetensors"):
            on_disk.update(load_file(str(tmp_path / "export" / f)))
    st = tr.StagedUpdate()
    buckets = list(tr.make_buckets(hf_tensors(model, "released"), bucket_bytes=4096, version=1))
    for b in buckets:
        st.stage(b)
    sent = dict(st.tensors(1, len(buckets)))
    assert len(buckets) > 1 and sent.keys() == on_disk.keys()
    for name, a in sent.items():
        assert a.dtype == on_disk[name].dtype and np.array_equal(a.view(np.uint8), on_disk[name].view(np.uint8)), name


# ------------------------------------------------------------------------------------ transport
class DictEngine:
    """Applies committed tensors to a dict; `fail_stage_after` simulates an engine that dies."""

    def __init__(self, manifest, die_on_bucket=None):
        self.weights = {n: np.zeros(s, d) for n, (s, d) in manifest.items()}
        self.manifest = manifest
        self.version, self.staged, self.die_on_bucket = 0, tr.StagedUpdate(), die_on_bucket

    def check(self, name, shape, dtype):
        if name not in self.manifest:
            raise KeyError(f"{name!r} is not a tensor of this checkpoint")
        if (tuple(shape), np.dtype(dtype)) != (tuple(self.manifest[name][0]), np.dtype(self.manifest[name][1])):
            raise ValueError(f"{name!r}: expected {self.manifest[name]}, got {shape} {dtype}")

    def stage(self, bucket):
        if bucket.index == self.die_on_bucket:
            os._exit(1)
        self.staged.stage(bucket, self.check)
        return bucket.index

    def commit(self, version, n):
        self.weights.update({k: v.copy() for k, v in self.staged.tensors(version, n)})
        self.staged.clear()
        self.version = version
        return version

    def abort(self, version):
        self.staged.clear()

    def get(self):
        return self.version, self.weights


def test_transport_commits_everywhere_or_nowhere(ray_local, monkeypatch):
    ray = ray_local
    named = _arrays(6)
    manifest = {n: (a.shape, a.dtype) for n, a in named}
    actor = ray.remote(DictEngine)
    engines = [actor.remote(manifest) for _ in range(2)]
    t = tr.RayObjectStoreTransport(engines, bucket_bytes=64, depth=2, timeout_s=60)
    stats = t.push(iter(named), version=1)
    assert stats.buckets > 2 and stats.tensors == 6 and stats.lost == []
    for version, weights in ray.get([e.get.remote() for e in engines]):
        assert version == 1 and all(np.array_equal(weights[n], a) for n, a in named)

    # corrupt one tensor after its checksum was taken: rejected, named, nobody moves to version 2
    real = tr.make_buckets

    def corrupting(named_arrays, bucket_bytes, version):
        for b in real(named_arrays, bucket_bytes, version):
            if any(r.name == "w4" for r in b.records):
                i = [r.name for r in b.records].index("w4")
                b.arrays[i] = b.arrays[i] + 1
            yield b

    monkeypatch.setattr(tr, "make_buckets", corrupting)
    new = [(n, a * 2) for n, a in named]
    with pytest.raises(tr.TransferError, match=r"tensor 'w4'.*checksum mismatch"):
        t.push(iter(new), version=2)
    for version, weights in ray.get([e.get.remote() for e in engines]):
        assert version == 1 and all(np.array_equal(weights[n], a) for n, a in named)

    # a name the engine does not have: rejected before anything is applied
    monkeypatch.setattr(tr, "make_buckets", real)
    with pytest.raises(tr.TransferError, match=r"'nope'.*rejected by the engine"):
        t.push(iter(new[:3] + [("nope", np.zeros(2, np.float32))]), version=2)
    assert {v for v, _ in ray.get([e.get.remote() for e in engines])} == {1}


@pytest.mark.slow  # kills a Ray actor and waits for it
def test_transport_drops_an_engine_that_dies_mid_update(ray_local):
    ray = ray_local
    named = _arrays(6)
    manifest = {n: (a.shape, a.dtype) for n, a in named}
    actor = ray.remote(DictEngine).options(max_restarts=0)
    engines = [actor.remote(manifest), actor.remote(manifest, die_on_bucket=1)]
    stats = tr.RayObjectStoreTransport(engines, bucket_bytes=64, timeout_s=60).push(iter(named), version=5)
    assert stats.lost == [1]
    version, weights = ray.get(engines[0].get.remote())
    assert version == 5 and all(np.array_equal(weights[n], a) for n, a in named)


# ------------------------------------------------------------------------------------ shm transport
def test_shm_transport_commits_everywhere_or_nowhere_and_names_a_corrupted_tensor(ray_local):
    """Buckets written once into /dev/shm files (rl.generation.shared_segments): the same two-phase commit and
    checks as the object store; a byte changed in the file after the sender's checksum is caught by every engine."""
    ray = ray_local
    named = _arrays(6)
    manifest = {n: (a.shape, a.dtype) for n, a in named}
    engines = [ray.remote(DictEngine).remote(manifest) for _ in range(2)]
    t = tr.make_transport("shm", engines, bucket_bytes=64, timeout_s=60)
    assert isinstance(t, tr.SharedMemoryTransport)
    try:
        stats = t.push(iter(named), version=1)
        assert stats.buckets > 2 and stats.tensors == 6 and stats.bytes == sum(a.nbytes for _, a in named)
        for version, weights in ray.get([e.get.remote() for e in engines]):
            assert version == 1 and all(np.array_equal(weights[n], a) for n, a in named)

        real = t.segments.buckets

        def corrupting(named_arrays, version):
            for b in real(named_arrays, version):
                if "w4" in [r.name for r in b.records]:
                    off = b.offsets[[r.name for r in b.records].index("w4")]
                    dict(t.segments.files)[b.path][off] ^= 1  # in the shared file, after the checksum
                yield b

        t.segments.buckets = corrupting
        new = [(n, a * 2) for n, a in named]
        with pytest.raises(tr.TransferError, match=r"tensor 'w4'.*checksum mismatch"):
            t.push(iter(new), version=2)
        for version, weights in ray.get([e.get.remote() for e in engines]):
            assert version == 1 and all(np.array_equal(weights[n], a) for n, a in named)
        t.segments.buckets = real
        t.push(iter(new), version=3)  # the same files serve the next update
        for version, weights in ray.get([e.get.remote() for e in engines]):
            assert version == 3 and all(np.array_equal(weights[n], a) for n, a in new)
    finally:
        t.close()
    assert not os.path.exists(t.segments.dir)


def test_segment_files_are_reserved_reused_and_taken_by_size(tmp_path):
    from rl.generation import shared_segments as ss

    arrays = _arrays(4)  # 12, 24, 36, 48 bytes, each starting on a 64-byte line: 128-byte buckets [w0 w1] [w2 w3]
    big = np.arange(100, dtype=np.float32)  # 400 bytes: travels alone
    order = [("big", big)] + arrays
    sizes = ss.bucket_sizes([a.nbytes for _, a in order], bucket_bytes=128)
    assert sizes == [448, 128, 128]
    w = ss.SegmentWriter(bucket_bytes=128, root=str(tmp_path))
    try:
        w.reserve(sizes)
        made = [p for p, _ in w.files]
        st = tr.StagedUpdate()
        for version in (1, 2):
            got = list(w.buckets(iter(order), version=version))
            assert [p for p, _ in w.files] == made  # every bucket found a reserved file: nothing new was made
            assert len({b.path for b in got}) == len(got)  # one bucket per file in an update
            for b in got:
                st.stage(b)
            out = dict(st.tensors(version, len(got)))
            assert np.array_equal(out["big"], big) and all(np.array_equal(out[n], a) for n, a in arrays)
        assert not out["big"].flags.writeable  # a loader writing into it would fault, not change the next update
        assert len(st.mappings) == len(made)  # the receiver mapped each file once
    finally:
        w.close()


def test_shm_bucket_on_another_machine_is_refused_and_dead_trainers_segments_are_swept(tmp_path):
    import subprocess

    from rl.generation import shared_segments as ss

    w = ss.SegmentWriter(bucket_bytes=1 << 10, root=str(tmp_path))
    try:
        (b,) = w.buckets(iter(_arrays(2)), version=4)
        gone = dataclasses.replace(b, path=str(tmp_path / "elsewhere" / "bucket-0"))
        with pytest.raises(tr.TransferError, match=r"bucket 0 of version 4: cannot map .*every engine on the "
                                                   r"trainer's machine"):
            tr.StagedUpdate().stage(gone)
        outside = dataclasses.replace(b, offsets=[0, b.capacity])
        with pytest.raises(tr.TransferError, match=r"tensor 'w1' .* lie outside segment"):
            tr.StagedUpdate().stage(outside)
    finally:
        w.close()

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{ss._owner_prefix(dead.pid)}x").mkdir()
    (tmp_path / f"{ss.PREFIX}another-host-{dead.pid}-x").mkdir()  # another container's: not ours to judge
    alive = ss.SegmentWriter(bucket_bytes=64, root=str(tmp_path))  # sweeps on start
    try:
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(ss.PREFIX))
        assert left == sorted([f"{ss.PREFIX}another-host-{dead.pid}-x", os.path.basename(alive.dir)])
    finally:
        alive.close()
