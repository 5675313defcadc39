"""What a decode step reads of its cache (issue 11, item 3: "a cached step reads only its selected blocks").

A sparse layer's decode step gathers its selected key blocks straight from the stacked cache: no copy,
transpose or cast of a whole layer's keys or values is formed (the indexer still scores every slot's index
key). A decode step runs the slot path even where a whole sequence runs the grouped one, and its logits equal
the full forward's. The indexer's loop over key chunks, which small score blocks skip, equals the scores
formed at once, and the gate/up product merged for a few rows equals the einsum.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax import tiny
from m3jax.model import indexer
from m3jax.model.decoder import M3ForCausalLM
from m3jax.model.mlp import MERGED_GATE_UP_ROWS, dense_mlp
from m3jax.model.sparse import one_device_path

# Three sparse MoE layers in one stack (a stack of one layer would make a layer's cache the whole stack).
CFG = tiny.m3_config(layers=3, full_attention_layers=0, dense_layers=0, vocab_size=64, hidden_size=64,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                     index_n_heads=2, index_head_dim=8, index_block_size=8, index_topk_blocks=2)


def _layer_cache_copies(text: str, count: int) -> list[str]:
    """Instructions of the compiled HLO, outside fusion bodies (what a fusion computes inside is never stored),
    that produce an array of `count` elements, any dtype (parameters, their tuple elements and bitcasts are views,
    not copies)."""
    fused = set(re.findall(r"fusion\(.*?calls=%([\w.-]+)", text))
    out, body = [], None
    for line in text.splitlines():
        if head := re.match(r"(?:ENTRY )?%([\w.-]+) .*\{$", line):
            body = head.group(1)
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", line)
        if not m or body in fused or m.group(3) in ("parameter", "get-tuple-element", "bitcast"):
            continue
        if int(np.prod([int(d) for d in m.group(2).split(",") if d])) == count:
            out.append(f"{m.group(1)} {m.group(3)} [{m.group(2)}]")
    return out


def test_a_sparse_decode_step_copies_no_whole_layer_of_its_cache():
    """Before session 29 the step sliced each layer's keys and values out of the stack, transposed them into
    blocks in fp32 and took the mean of every value slot (for queries that see nothing, which a decode step
    without a padding mask never has): checked to fail on that code."""
    b, s_max = 2, 96
    model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = model.init_cache(b, s_max)
    assert cache[0]["k"].shape[0] == 3  # one stack of the three layers

    def step(state, cache):  # as the engine's decode loop calls it: no attention mask
        return nnx.merge(graphdef, state)(jnp.ones((b, 1), jnp.int32), positions=jnp.full((b, 1), 70), cache=cache)

    text = jax.jit(step, donate_argnums=1).lower(state, cache).compile().as_text()
    one_layer = b * s_max * CFG.num_key_value_heads * CFG.head_dim
    assert not _layer_cache_copies(text, one_layer)
    assert _layer_cache_copies(text, 3 * one_layer)  # the stacked cache itself is found (written in place)


def test_a_decode_step_runs_the_slots_where_a_sequence_runs_grouped_and_matches_the_full_forward():
    cfg = tiny.m3_config(layers=2, full_attention_layers=0, dense_layers=0, vocab_size=64, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                         index_n_heads=2, index_head_dim=8, index_block_size=32, index_topk_blocks=2)
    heads_per_unit = 2  # lcm(2 kv heads, 2 index heads) = 2 units of 4 / 2 heads
    assert one_device_path(2, 32, heads_per_unit, "cpu") == "grouped"  # K bs H/U = 128 rows a block
    assert one_device_path(2, 32, heads_per_unit, "cpu", 1 / 160) == "slots"  # one query a row, 160 slots
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    s = 150  # 5 key blocks of 32 against top-2: the layers select
    ids = jax.random.randint(jax.random.key(3), (2, s + 1), 0, cfg.vocab_size)
    full = model(ids)[:, s]
    cache = model.init_cache(2, 160)
    positions = jnp.broadcast_to(jnp.arange(s), (2, s))
    _, cache = model(ids[:, :s], positions=positions, cache=cache)
    step, _ = model(ids[:, s:], positions=jnp.full((2, 1), s), cache=cache)
    np.testing.assert_allclose(step[:, 0], full, rtol=2e-5, atol=2e-5)


def test_a_decode_position_past_the_cache_is_refused_or_nan():
    """jax drops a scatter past the array: the token's key was never stored and its logits (0.33 from the full
    forward's) came back without a word. Known positions are refused; traced ones give NaN."""
    cfg = tiny.m3_config(index_block_size=4, index_topk_blocks=2, max_position_embeddings=64)
    model = M3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (1, 9), 3, cfg.vocab_size)
    _, cache = model(ids[:, :8], positions=jnp.arange(8)[None], cache=model.init_cache(1, 8))
    with pytest.raises(ValueError, match=r"decode positions up to 8 with a cache of 8 slots .*expected positions "
                                         r"below 8"):
        model(ids[:, 8:], positions=jnp.asarray([[8]]), cache=cache)
    with pytest.raises(ValueError, match="decode positions up to 8 with a cache of 8 slots"):
        model(ids, cache=model.init_cache(1, 8))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, positions, cache):
        return nnx.merge(graphdef, state)(ids, positions=positions, cache=cache)[0]

    assert np.isnan(np.asarray(step(state, ids[:, 8:], jnp.asarray([[8]]), cache))).all()
    assert np.isfinite(np.asarray(step(state, ids[:, 7:8], jnp.asarray([[7]]), cache))).all()


def test_indexer_scores_in_key_chunks_equal_the_scores_formed_at_once(monkeypatch):
    """Small score blocks skip the loop over key chunks (`indexer.scores_fit_whole`); forced through it, in
    chunks of 2 blocks that stop after the last one any query sees, the scores and the top-k are the same."""
    b, s, hi, di = 2, 45, 2, 8  # 45 keys: a partial last block of 8
    k1, k2 = jax.random.split(jax.random.key(4))
    iq, ik = jax.random.normal(k1, (b, s, hi, di)), jax.random.normal(k2, (b, s, di))
    pos = jnp.stack([jnp.arange(s), jnp.minimum(jnp.arange(s), 20)])  # row 1 sees no key past 20
    kw = dict(block_size=8, local_blocks=2)
    assert indexer.scores_fit_whole(b, hi, s, s)
    whole = indexer.key_block_scores(iq, ik, pos, **kw)
    ids = indexer.topk_key_blocks(iq, ik, pos, topk_blocks=3, **kw)
    monkeypatch.setattr(indexer, "WHOLE_SCORES_ELEMENTS", 0)
    monkeypatch.setattr(indexer, "KEY_CHUNK_BLOCKS", 2)
    chunked = indexer.key_block_scores(iq, ik, pos, **kw)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    np.testing.assert_array_equal(indexer.topk_key_blocks(iq, ik, pos, topk_blocks=3, **kw), ids)


@pytest.mark.parametrize("rows", [4, MERGED_GATE_UP_ROWS + 1])
def test_the_gate_up_product_merged_for_few_rows_equals_the_einsum(rows):
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k1, (1, rows, 32))
    gate_up, down = jax.random.normal(k2, (2, 48, 32)) * 0.2, jax.random.normal(k3, (32, 48)) * 0.2

    def loss(x, gate_up, down, one_device):
        return jnp.sum(jnp.sin(dense_mlp(x, gate_up, down, 1.702, 7.0, one_device)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (v1, g1), (v0, g0) = grad(x, gate_up, down, True), grad(x, gate_up, down, False)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6)  # fp32 sums of 48-96 O(1) terms, reordered
    text = jax.jit(dense_mlp, static_argnums=(3, 4, 5)).lower(x, gate_up, down, 1.702, 7.0, True).compile().as_text()
    assert ("transpose(" in text) == (rows > MERGED_GATE_UP_ROWS)  # merged: no transposed copy of the weight
