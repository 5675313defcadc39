"""Flash attention (m3jax.model.flash) computes the dense masked softmax attention, values and gradients.

Unit level: against the model's dense path (`gqa_attention` with `causal_keep` and the indexer's
token mask) for causal / non-causal, padding, GQA ratios 1 and 4, tiles dividing S or not, block masks
(with queries that see no key at all) and queries fewer than keys (a decode step). Model level: the tiny
release-like M3 with attention_impl="flash" matches HF's logits and the dense path's gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.model.attention import causal_keep, gqa_attention
from m3jax.model.flash import flash_attention, visited_key_tiles
from m3jax.model.indexer import block_mask_to_tokens
from m3jax.tiny import m3_config
from tests import reference as ref

D = 16


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def dense(q, k, v, positions, key_valid, block_mask, block_size, causal):
    keep = causal_keep(positions, key_valid, k.shape[1]) if causal else \
        jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool) & (
            True if key_valid is None else key_valid[:, None, None, :])
    if block_mask is not None:
        keep = keep & block_mask_to_tokens(block_mask, block_size, k.shape[1], q.shape[2])
    return gqa_attention(q, k, v, keep, D ** -0.5)


# name: (S_q, S_k, H, KV, q_tile, k_tile, causal, padding, block mask heads (0 = none), block size)
CASES = {
    "causal_g1_tiles_divide": (32, 32, 2, 2, 8, 8, True, False, 0, 8),
    "causal_g4_pad_tiles_ragged": (37, 37, 8, 2, 8, 16, True, True, 0, 8),
    "noncausal_g4_pad": (37, 37, 8, 2, 16, 8, False, True, 0, 8),
    "noncausal_g1": (20, 20, 2, 2, 8, 8, False, False, 0, 8),
    "blocks_per_kv_head_g4": (37, 37, 8, 2, 8, 8, True, False, 2, 8),
    "blocks_per_query_head_pad_ragged": (45, 45, 4, 2, 16, 8, True, True, 4, 8),
    "blocks_coarser_than_tiles": (40, 40, 4, 1, 8, 4, True, True, 2, 8),
    "blocks_finer_than_tiles": (37, 37, 4, 2, 8, 16, True, True, 2, 8),
    "blocks_misaligned_with_tiles": (40, 40, 4, 2, 8, 12, True, False, 2, 8),
    "decode_step": (3, 40, 8, 2, 8, 8, True, True, 2, 8),
}


def make(name):
    sq, sk, h, kvh, tq, tk, causal, padding, hb, bs = CASES[name]
    r = np.random.default_rng(len(name))
    b = 2
    q = jnp.asarray(r.normal(size=(b, sq, h, D)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, sk, kvh, D)), jnp.float32)
    v = jnp.asarray(r.normal(size=(b, sk, kvh, D)), jnp.float32)
    positions = jnp.asarray(np.arange(sk - sq, sk)[None].repeat(b, 0), jnp.int32)
    key_valid = jnp.asarray(np.arange(sk)[None] < np.array([[sk], [sk - 9]])) if padding else None
    block_mask = None
    if hb:
        block_mask = r.random((b, hb, sq, -(-sk // bs))) < 0.4
        block_mask[0, 0, :3] = False  # queries that see no key at all
        block_mask = jnp.asarray(block_mask)
    return (q, k, v), dict(positions=positions, key_valid=key_valid, block_mask=block_mask, block_size=bs,
                           causal=causal), (tq, tk)


# The fast loop: GQA with padding and ragged tiles, per-query-head blocks, blocks misaligned with tiles, a
# decode step; the other cases are slow.
FAST_CASES = ("causal_g4_pad_tiles_ragged", "blocks_per_query_head_pad_ragged", "blocks_misaligned_with_tiles",
              "decode_step")


@pytest.fixture(scope="module", params=[c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow)
                                        for c in CASES])
def results(request):
    """(flash, dense) outputs and (q, k, v) cotangents of a random output cotangent, one jit each."""
    (q, k, v), kw, (tq, tk) = make(request.param)
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def flash(q, k, v):
        return flash_attention(q, k, v, scale=D ** -0.5, q_tile=tq, k_tile=tk,
                               **kw)

    def ref_(q, k, v):
        return dense(q, k, v, kw["positions"], kw["key_valid"], kw["block_mask"], kw["block_size"], kw["causal"])

    def value_and_grads(f, q, k, v):
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(w.astype(o.dtype))

    out = {name: jax.jit(value_and_grads, static_argnums=0)(f, q, k, v) for name, f in (("flash", flash),
                                                                                      ("dense", ref_))}
    return request.param, out


def test_values_equal_dense(results):
    name, out = results
    assert rel_err(out["flash"][0], out["dense"][0]) < 1e-5, name


def test_gradients_equal_dense(results):
    name, out = results
    for what, got, want in zip("qkv", out["flash"][1], out["dense"][1]):
        assert rel_err(got, want) < 1e-5, (name, what)


def test_query_without_visible_key_gets_mean_value():
    """Like the dense path (softmax over an all-masked row is uniform): mean of v over every slot."""
    (q, k, v), kw, (tq, tk) = make("blocks_per_kv_head_g4")
    o = jax.jit(lambda q, k, v: flash_attention(q, k, v, scale=D ** -0.5, q_tile=tq, k_tile=tk, **kw))(q, k, v)
    # block-mask head 0 serves query heads 0..3, which read kv head 0
    np.testing.assert_allclose(o[0, :3, :4], np.broadcast_to(v[0, :, 0].mean(0), (3, 4, D)), rtol=1e-6, atol=1e-6)


def test_visited_tiles_follow_causality_and_the_block_mask():
    """The key loop visits only tiles some query of the tile can see: causal tile i visits i + 1 tiles,
    a block mask selecting 2 blocks per query (tiles = blocks) visits 2."""
    b, s, t = 1, 64, 8
    n = s // t
    pos = jnp.arange(s)[None]
    kval = jnp.ones((b, s), bool)
    _, count = visited_key_tiles(pos, kval, jnp.ones((b, 1, s, n), bool), t, t, t, n, n, 4, 2)
    assert count.tolist() == [[list(range(1, n + 1))] * 2]
    own = np.arange(s) // t
    bm = np.zeros((b, 1, s, n), bool)
    bm[0, 0, np.arange(s), own] = True
    bm[0, 0, np.arange(s), own // 2] = True  # the own block and an earlier one, the same for the whole tile
    _, count = visited_key_tiles(pos, kval, jnp.asarray(bm), t, t, t, n, n, 4, 2)
    assert count.tolist() == [[[1 if i // 2 == i else 2 for i in range(n)]] * 2]


# ------------------------------------------------------------------------------------------ the tiny model
SEQ = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = ref.tiny_config("release_like")
    hf = ref.build_model(cfg, seed=3)
    path = ref.save(hf, str(tmp_path_factory.mktemp("flash") / "native"))
    return cfg, hf, {impl: m3jax.from_pretrained(path, attention_impl=impl) for impl in ("dense", "flash")}, path


@jax.jit
def forward(model, ids, attention_mask=None):
    return model(ids, attention_mask=attention_mask)


def test_flash_model_logits_match_hf(models):
    cfg, hf, by_impl, _ = models
    ids = ref.random_ids(cfg, 2, SEQ, seed=1)
    assert rel_err(forward(by_impl["flash"], jnp.asarray(ids)), ref.hf_logits(hf, ids)) < 1e-5


@pytest.mark.slow  # another forward compile (~6 s on the shared 2-core CPU)
def test_flash_model_right_padding_matches_hf(models):
    cfg, hf, by_impl, _ = models
    ids = ref.random_ids(cfg, 2, SEQ, seed=1)
    mask = np.ones_like(ids)
    mask[1, 40:] = 0  # right padding
    got = forward(by_impl["flash"], jnp.asarray(ids), jnp.asarray(mask))
    want = ref.hf_logits(hf, ids, mask)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1, :40], want[1, :40]) < 1e-5


@pytest.mark.slow  # two gradient compiles of the tiny model (~17 s on the shared 2-core CPU)
def test_flash_model_gradients_equal_dense(models):
    cfg, _, by_impl, _ = models
    ids = ref.random_ids(cfg, 2, SEQ, seed=2)
    grads = {impl: ref.next_token_grads(model, ids) for impl, model in by_impl.items()}
    ref.assert_grads_close(grads["flash"], grads["dense"], 1e-5, at_least=11)


@pytest.mark.slow  # prefill + decode-step compiles (~13 s on the shared 2-core CPU)
def test_flash_model_cached_decoding_matches_full_forward(models):
    """Prefill 40 tokens into the cache, then decode 4 one at a time: the logits of the full forward."""
    cfg, _, by_impl, _ = models
    model = by_impl["flash"]
    ids = jnp.asarray(ref.random_ids(cfg, 2, 44, seed=4))
    want = np.asarray(forward(model, ids))

    @jax.jit
    def step(model, ids, positions, cache):
        return model(ids, positions=positions, cache=cache)

    logits, cache = step(model, ids[:, :40], jnp.broadcast_to(jnp.arange(40), (2, 40)), model.init_cache(2, 48))
    got = [logits]
    for t in range(40, 44):
        logits, cache = step(model, ids[:, t:t + 1], jnp.full((2, 1), t), cache)
        got.append(logits)
    assert rel_err(np.concatenate([np.asarray(g) for g in got], axis=1), want) < 1e-5


def test_config_choices_are_the_impls():
    import dataclasses

    from m3jax.model.attention import IMPLS
    from rl.config.model_section import ModelSection
    field = next(f for f in dataclasses.fields(ModelSection) if f.name == "attention_impl")
    assert tuple(field.metadata["choices"]) == IMPLS and ModelSection().model_options()["attention_impl"] == "auto"
    with pytest.raises(ValueError, match="attention_impl"):
        m3jax.M3ForCausalLM(m3_config(), attention_impl="sdpa")


def test_auto_is_dense_below_flash_min_keys_and_flash_from_it(models, monkeypatch):
    from m3jax.model import attention
    assert [attention.resolve_impl("auto", n) for n in (attention.FLASH_MIN_KEYS - 1, attention.FLASH_MIN_KEYS)] \
        == ["dense", "flash"]
    assert attention.resolve_impl("dense", 10 ** 6) == "dense" and attention.resolve_impl("flash", 1) == "flash"
    # A decode step's one query a row holds no scores block worth tiling: dense over any cache it can hold.
    assert attention.resolve_impl("auto", 4096, "cpu", 1) == "dense"
    assert attention.resolve_impl("auto", 4096, "cpu", 64) == "flash"  # a 64-token prefill chunk: 64 x 4096
    with pytest.raises(ValueError, match="sdpa"):
        attention.resolve_impl("sdpa", 8)
    # The model under "auto" runs exactly the resolved impl: bitwise its logits (a lower threshold keeps it small).
    cfg, _, by_impl, path = models
    monkeypatch.setattr(attention, "FLASH_MIN_KEYS", 24)
    auto = m3jax.from_pretrained(path, attention_impl="auto")
    for seq, impl in ((16, "dense"), (SEQ, "flash")):  # SEQ = 64 keys >= 24
        ids = jnp.asarray(ref.random_ids(cfg, 2, seq, seed=5))
        np.testing.assert_array_equal(forward(auto, ids), forward(by_impl[impl], ids))


@pytest.mark.slow  # 8-device compiles of the model's gradient (~20 s each on the shared 2-core CPU)
@pytest.mark.extended  # flash is not the default; its sharded equality runs with -m extended
@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 8, 1, 1)])
def test_flash_sharded_equals_single_device(models, shape):
    """Data x context x expert mesh (and all-context): the partitioner runs flash on sequence-sharded
    activations; logits and every gradient equal the single device's dense path."""
    from sharding.mesh import MeshConfig, build_mesh
    cfg, _, by_impl, path = models
    ids = jnp.asarray(ref.random_ids(cfg, 8, SEQ + 1, seed=5))

    def logits_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(ids[:, :-1])
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return np.asarray(logits), dict(nnx.to_flat_state(grads))

    want_logits, want = logits_and_grads(by_impl["dense"])
    layout = build_mesh(MeshConfig(*shape), by_impl["dense"].cfg, seq_len=SEQ, batch=8)
    model = m3jax.from_pretrained(path, mesh=layout, attention_impl="flash")
    with jax.set_mesh(layout.mesh):
        logits, got = logits_and_grads(model)
    assert rel_err(logits, want_logits) < 1e-5
    for key, g in want.items():
        g, h = np.asarray(g.get_value()), np.asarray(got[key].get_value())
        assert (not np.any(h)) if not np.any(g) else rel_err(h, g) < 1e-5, key
