"""Sparse layers' forward on jax's Pallas paged-attention kernel (`model.sparse_attention: paged`).

No GPU here: the kernel runs in Pallas's interpreter (`paged_sparse.interpret` patched), fp32 allowed. Checked:
the page tables reproduce the model's kept slots exactly where the mask has the paged form, the forward equals
the gather path (every row, padding rows included), any other input takes gather, gradients are gather's, and
the kernel lowers to Triton for CUDA. Its speed is scripts/gpu_check.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax.model import attention, paged_sparse
from m3jax.model.sparse import _kept_slots, _Static, head_units
from tests import reference as ref

BS, K = 8, 3


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(paged_sparse, "interpret", lambda backend=None: True)
    monkeypatch.setattr(paged_sparse, "FUSED_DTYPES", (jnp.bfloat16, jnp.float16, jnp.float32))


def _problem(seed=0, b=2, s=48, h=4, kv=2, hi=2, d=16, lengths=(48, 30)):
    """q/k/v, positions 0..S-1, right padding, and per (row, query, index head) K causal block ids, the own
    block among them, -1 where fewer blocks exist."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, s, h, d), (b, s, kv, d), (b, s, kv, d)))
    pos = np.broadcast_to(np.arange(s), (b, s))
    valid = np.arange(s)[None, :] < np.asarray(lengths)[:, None]
    ids = np.full((b, s, hi, K), -1, np.int32)
    for bi, t, j in np.ndindex(b, s, hi):
        own = t // BS
        others = rng.permutation(own)[:K - 1]
        chosen = np.concatenate([[own], others])
        ids[bi, t, j, :len(chosen)] = rng.permutation(chosen)
    return q, k, v, jnp.asarray(pos), jnp.asarray(valid), jnp.asarray(ids)


def test_page_tables_hold_exactly_the_kept_slots():
    q, k, v, pos, valid, ids = _problem()
    b, s, h, _ = q.shape
    kv_of, idx_of = head_units(h, k.shape[2], ids.shape[2])
    st = _Static(s, BS, 1.0, "float32", tuple(kv_of.tolist()), tuple(idx_of.tolist()))
    nb = s // BS
    keep, _ = _kept_slots(st, valid.reshape(b, nb, BS), pos, ids)  # [B, U, S, K, bs]
    pages, seen = paged_sparse.page_tables(ids, pos, valid.sum(-1).astype(jnp.int32), BS, nb, kv_of, idx_of)
    pages, seen, keep = np.asarray(pages), np.asarray(seen), np.asarray(keep)
    for bi, t, u in np.ndindex(b, s, len(kv_of)):
        want = {int(blk) * BS + j for blk, row in zip(np.asarray(ids)[bi, t, idx_of[u]], keep[bi, u, t]) for j in
                np.flatnonzero(row)}
        slots = [(p - (bi * 2 + kv_of[u]) * nb) * BS + j for p in pages[bi, t, u] for j in range(BS)][:seen[bi, t, u]]
        assert sorted(slots) == sorted(want), (bi, t, u)  # the first `seen` slots of the pages are the kept ones


@pytest.mark.parametrize("name, paged", [("right_padding", True), ("offset_positions", True),
                                         ("left_padding", False)])
def test_forward_equals_gather_where_the_form_holds_else_gather_runs(interpreted, name, paged):
    q, k, v, pos, valid, ids = _problem()
    if name == "left_padding":
        valid = valid.at[0, :4].set(False)
    elif name == "offset_positions":  # queries later than their slots (a decode step's cache): the threshold holds
        pos = pos + 5
    cfg = type("Cfg", (), {"index_block_size": BS, "head_dim": q.shape[-1]})
    kv_of, idx_of = head_units(q.shape[2], k.shape[2], ids.shape[2])
    scale = q.shape[-1] ** -0.5
    st = _Static(q.shape[1], BS, scale, "float32", tuple(kv_of.tolist()), tuple(idx_of.tolist()))
    keep, _ = _kept_slots(st, valid.reshape(2, -1, BS), pos, ids)

    def reference(q, k, v):  # the kept slots as a dense mask, as the masked path computes it
        g = q.shape[2] // len(kv_of)
        logits = jnp.einsum("bsugd,btud->bugst", q.reshape(*q.shape[:2], len(kv_of), g, -1),
                            k[:, :, jnp.asarray(kv_of)]) * scale
        mask = np.zeros((2, len(kv_of), q.shape[1], q.shape[1]), bool)
        kp, ip = np.asarray(keep), np.asarray(ids)
        for bi, u, t, kk, j in zip(*np.nonzero(kp)):
            mask[bi, u, t, ip[bi, t, idx_of[u], kk] * BS + j] = True
        logits = jnp.where(jnp.asarray(mask)[:, :, None], logits, jnp.finfo(jnp.float32).min)
        o = jnp.einsum("bugst,btud->bsugd", jax.nn.softmax(logits, -1), v[:, :, jnp.asarray(kv_of)])
        return o.reshape(q.shape)

    got = jax.jit(lambda q, k, v: paged_sparse.paged_sparse_attention(
        q, k, v, pos, valid, ids, cfg, kv_of, idx_of, gather=lambda q, k, v, *_: -reference(q, k, v)))(q, k, v)
    assert _rel(got if paged else -got, reference(q, k, v)) < 1e-5  # the fallback is negated: it shows


def test_it_lowers_to_triton_for_cuda():
    from jax import export
    q, k, v, pos, valid, ids = _problem()
    kv_of, idx_of = head_units(4, 2, 2)
    f = lambda q, k, v: paged_sparse.paged_attention_forward(  # noqa: E731
        q, k, v, pos, valid, ids, BS * 2, 0.25, kv_of, idx_of, interpret_kernel=False)
    args = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    text = export.export(jax.jit(f), platforms=("cuda",),
                         disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in text.mlir_module()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = ref.tiny_config("release_like")
    hf = ref.build_model(cfg, seed=3)
    return cfg, hf, ref.save(hf, str(tmp_path_factory.mktemp("paged") / "native"))


def _poison_gather(monkeypatch):
    real = paged_sparse.paged_sparse_attention
    monkeypatch.setattr(attention, "paged_sparse_attention", lambda *a, gather, **kw: real(
        *a, gather=lambda q, *_: jnp.full_like(q, jnp.nan), **kw))


def test_model_forward_matches_hf_on_the_kernel(models, interpreted, monkeypatch):
    """The sparse layers' forward on the (interpreted) kernel, gather poisoned (NaN) so that finite logits
    prove the kernel ran: HF's logits with right padding."""
    _poison_gather(monkeypatch)
    cfg, hf, path = models
    model = m3jax.from_pretrained(path, sparse_attention="paged")
    ids = ref.random_ids(cfg, 2, 64, seed=1)
    mask = np.ones_like(ids)
    mask[1, 40:] = 0
    got = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, jnp.asarray(ids), jnp.asarray(mask)))
    want = ref.hf_logits(hf, ids, mask)
    assert _rel(got[0], want[0]) < 1e-5 and _rel(got[1, :40], want[1, :40]) < 1e-5


@pytest.mark.slow  # prefill + decode-step compiles, twice
def test_cached_decoding_on_the_kernel_equals_gather(models, interpreted, monkeypatch):
    """Prefill 40 tokens into the cache, then decode 4 one at a time: every step's sparse layers read their
    selected cache blocks through the kernel (gather poisoned), with the logits of the gather model."""
    cfg, _, path = models
    ids = jnp.asarray(ref.random_ids(cfg, 2, 44, seed=4))

    def decode(model):
        step = jax.jit(lambda model, ids, positions, cache: model(ids, positions=positions, cache=cache))
        logits, cache = step(model, ids[:, :40], jnp.broadcast_to(jnp.arange(40), (2, 40)), model.init_cache(2, 48))
        out = [logits]
        for t in range(40, 44):
            logits, cache = step(model, ids[:, t:t + 1], jnp.full((2, 1), t), cache)
            out.append(logits)
        return np.concatenate([np.asarray(o) for o in out], axis=1)

    want = decode(m3jax.from_pretrained(path, sparse_attention="gather"))
    _poison_gather(monkeypatch)
    assert _rel(decode(m3jax.from_pretrained(path, sparse_attention="paged")), want) < 1e-5


@pytest.mark.slow  # two gradient compiles of the tiny model
def test_model_gradients_are_gathers(models, interpreted):
    cfg, _, path = models
    ids = ref.random_ids(cfg, 2, 64, seed=2)
    grads = {impl: ref.next_token_grads(m3jax.from_pretrained(path, sparse_attention=impl), ids)
             for impl in ("gather", "paged")}
    ref.assert_grads_close(grads["paged"], grads["gather"], 1e-6)


def test_the_planner_plans_paged_as_gather():
    """Its training step (everything differentiated) is gather's."""
    from m3jax.plan.flops import step_flops
    from m3jax.plan.remat import saved_bytes_per_token
    from m3jax.tiny import m3_config
    cfg = m3_config()
    assert step_flops(cfg, 2, 1024, sparse_attention="paged") == step_flops(cfg, 2, 1024, sparse_attention="gather")
    layer = ("minimax_m3_sparse", "sparse")
    assert saved_bytes_per_token(cfg, *layer, 1, 2, "save_dots", "paged") == \
        saved_bytes_per_token(cfg, *layer, 1, 2, "save_dots", "gather")


def test_lowers_at_m3_shapes():
    """One sparse layer of the release at 8k tokens (64 query heads, 4 kv and index heads of 128, blocks of 128,
    top-16): the kernel lowers to Triton for CUDA (abstract shapes: nothing is allocated)."""
    from jax import export
    b, s, d = 1, 8192, 128
    q = jax.ShapeDtypeStruct((b, s, 64, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, 4, d), jnp.bfloat16)
    pos, valid = jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.bool_)
    ids = jax.ShapeDtypeStruct((b, s, 4, 16), jnp.int32)
    kv_of, idx_of = head_units(64, 4, 4)
    f = lambda q, k, v, pos, valid, ids: paged_sparse.paged_attention_forward(  # noqa: E731
        q, k, v, pos, valid, ids, 128, d ** -0.5, kv_of, idx_of, interpret_kernel=False)
    text = export.export(jax.jit(f), platforms=("cuda",),
                         disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        q, kv, kv, pos, valid, ids).mlir_module()
    assert text.count("xla.gpu.triton") == 1
