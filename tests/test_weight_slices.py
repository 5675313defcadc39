"""The tensor-parallel slices of the collective weight path (rl.generation.weight_slices), without vLLM: a
rank's loader written the way vLLM's are (narrow + copy_ into its parameter; a padded vocabulary; a
replicated tensor; loaders that transpose, convert or read a value, which must travel whole), probed for
the box of each tensor it reads; an update holding only those boxes loads the same parameters as the whole
tensors. The real vLLM loaders: tests/test_vllm_engine_tp.py; on the wire: tests/test_weight_transfer_protocol.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ml_dtypes  # noqa: E402

from rl.generation import weight_slices  # noqa: E402
from rl.generation.weight_slices import Box, bounding, box_of, cut, expand, read_boxes  # noqa: E402

MANIFEST = {"q": ((8, 6), np.float32), "o": ((6, 8), np.float32), "emb": ((10, 4), ml_dtypes.bfloat16),
            "norm": ((6,), np.float32), "kv": ((4, 6), np.float32), "t": ((6, 8), np.float32),
            "x": ((8, 6), np.float32), "s": ((1,), np.float32), "v": ((8, 6), np.float32),
            "skipped": ((3, 3), np.float32)}


class Rank:
    """Rank `rank` of 2: q/x rows, o columns, the vocab range (padded to 6 rows), kv rows of its kv head
    (one kv head of 2 rows replicated... here 2 heads: its own), norm whole, t transposed, x converted,
    s read as a value, v copied through setitem, `skipped` never loaded."""

    def __init__(self, rank):
        self.rank = rank
        shapes = {"q": (4, 6), "o": (6, 4), "emb": (6, 4), "norm": (6,), "kv": (2, 6), "t": (8, 6), "x": (4, 6),
                  "s": (1,), "v": (4, 6)}
        self.p = {n: torch.full(shape, 7.0, dtype=torch.bfloat16 if n == "emb" else torch.float32)
                  for n, shape in shapes.items()}

    def load_weights(self, weights):
        r = self.rank
        for name, w in weights:
            p = self.p.get(name)
            if name in ("q", "kv"):
                p.data.copy_(w.narrow(0, r * p.shape[0], p.shape[0]))
            elif name == "o":
                p.copy_(w[:, r * 4:(r + 1) * 4])
            elif name == "emb":  # rows 0-4 / 5-9 of the vocabulary, into a 6-row padded shard
                part = w.narrow(0, 5 * r, 5)
                p[:part.shape[0]].data.copy_(part)
                p[part.shape[0]:].data.fill_(0)
            elif name == "norm":
                assert p.shape == w.shape
                p.copy_(w)
            elif name == "t":
                p.copy_(w.t())
            elif name == "x":
                p.copy_(w.to(torch.float64).narrow(0, r * 4, 4))
            elif name == "s":
                p.fill_(w.item())
            elif name == "v":
                p[:] = w[r * 4:(r + 1) * 4]


def _full(seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape).astype(dtype) for n, (shape, dtype) in MANIFEST.items()}


def _to_torch(a):
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


@pytest.mark.parametrize("rank", [0, 1])
def test_boxes_are_what_each_rank_reads_and_the_probe_changes_nothing(rank):
    model = Rank(rank)
    boxes = read_boxes(model.load_weights, MANIFEST, list(MANIFEST), model.p.values())
    r = rank
    assert boxes == {"q": ((4 * r, 4 * r + 4), (0, 6)), "o": ((0, 6), (4 * r, 4 * r + 4)),
                     "emb": ((5 * r, 5 * r + 5), (0, 4)), "kv": ((2 * r, 2 * r + 2), (0, 6)),
                     "v": ((4 * r, 4 * r + 4), (0, 6))}  # norm whole, t / x / s opaque, skipped unread
    assert all(bool((p == 7).all()) for p in model.p.values())  # nothing was written: not even the pad rows' fill

    # an update of only the boxes (the rest never written) loads what the whole tensors load
    full = _full(0)
    whole, sliced = Rank(rank), Rank(rank)
    whole.load_weights((n, _to_torch(a)) for n, a in full.items())
    sliced.load_weights((n, _to_torch(expand(np.ascontiguousarray(cut(a, boxes.get(n))), boxes[n], a.shape)
                                      if n in boxes else a)) for n, a in full.items())
    for n in model.p:
        assert torch.equal(whole.p[n], sliced.p[n]), n


def test_loaders_the_probe_cannot_follow_send_whole_and_write_nothing():
    class ReadsValue(Rank):
        def load_weights(self, weights):
            for name, w in weights:
                self.p[name].fill_(w.sum())  # a reduction of never-written memory

    model = ReadsValue(0)
    assert read_boxes(model.load_weights, MANIFEST, ["q", "norm"], model.p.values()) == {}
    assert all(bool((p == 7).all()) for p in model.p.values())

    class CopiesPartThenConverts(Rank):  # and swallows every Exception, as some loaders do
        def load_weights(self, weights):
            for name, w in weights:
                try:
                    self.p[name][:2].copy_(w.narrow(0, 0, 2))  # a box the probe records ...
                    self.p[name][2:].copy_(w.to(torch.float64)[2:4])  # ... then a copy it cannot follow
                except Exception:  # noqa: BLE001
                    pass

    model = CopiesPartThenConverts(0)
    assert read_boxes(model.load_weights, MANIFEST, ["q", "x"], model.p.values()) == {}  # whole, not a part
    assert all(bool((p == 7).all()) for p in model.p.values())

    class ZeroesThenCopiesThroughATemporary(Rank):
        def load_weights(self, weights):
            for name, w in weights:
                p = self.p[name]
                p.zero_()  # never reaches the parameter while probing
                if name == "q":  # through a temporary: the probe cannot follow it to the parameter
                    tmp = torch.empty_like(p)
                    tmp.copy_(w.narrow(0, 0, 4))
                    p.copy_(tmp)
                else:
                    p.copy_(w.narrow(0, 4, 4))

    model = ZeroesThenCopiesThroughATemporary(0)
    assert read_boxes(model.load_weights, MANIFEST, ["q", "x"], model.p.values()) == {"x": ((4, 8), (0, 6))}
    assert all(bool((p == 7).all()) for p in model.p.values())


def test_box_of_and_bounding():
    t = torch.empty(5, 7, 3)
    assert box_of(t.narrow(1, 2, 4).narrow(0, 1, 3), (5, 7, 3)) == ((1, 4), (2, 6), (0, 3))
    assert box_of(t[4:5, 6:7], (5, 7, 3)) == ((4, 5), (6, 7), (0, 3))
    with pytest.raises(weight_slices._Opaque):
        box_of(t.transpose(0, 1), (5, 7, 3))
    with pytest.raises(weight_slices._Opaque):
        box_of(t.view(35, 3)[:7], (5, 7, 3))  # another shape: no box of the tensor
    boxes: list[Box] = [((0, 2), (1, 3)), ((4, 5), (0, 2))]
    assert bounding(boxes) == ((0, 5), (0, 3))


def test_the_slices_table_round_trips_and_refuses_a_name_collision(monkeypatch):
    slices = [{}, {"q": ((0, 4), (0, 6)), "norm.w": ((1, 2),)}, {"q": ((4, 8), (0, 6))}]
    table = weight_slices.encode(slices)
    assert table.shape == (3, weight_slices.WIDTH) and table.dtype == np.int64
    # the trainer processes agree on it through JAX (int32 without x64): every entry must survive that
    assert np.array_equal(table.astype(np.int32).astype(np.int64), table)
    got = weight_slices.decode(table.astype(np.int32), 3)
    assert got == [{weight_slices.name_key(n): b for n, b in s.items()} for s in slices]
    monkeypatch.setattr(weight_slices, "name_key", lambda name: 7)
    with pytest.raises(ValueError, match="'norm.w' and 'q' have the same key"):
        weight_slices.encode(slices)
