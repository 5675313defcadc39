"""model.scan_layers: a stack of same-kind layers as one loop over its stacked weights, or unrolled (a copy of
the layer per layer). The program changes, never the numbers: logits, gradients (with and without remat), the
returned routes and block ids, and a decode step with its cache agree between the two. Either way a decode step
writes its new cache slots in place (`m3jax.model.kv_cache`).

The model is the tiny two-kind one of tests/test_remat_policy.py (a full-attention dense layer, then two sparse
MoE layers in one stack), at 64 tokens: 8 key blocks of 8 against top-2, so the sparse layers really select.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.model.decoder import M3ForCausalLM
from rl.config.model_section import ModelSection
from tests.test_remat_policy import CFG, _close

SEQ = 64


def _run(scan_layers: bool, remat: bool):
    model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0), remat=remat, scan_layers=scan_layers)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, CFG.vocab_size)

    def loss(p):
        logits, routes, blocks = nnx.merge(graphdef, p, rest)(ids, return_routes=True, return_block_ids=True)
        logits = logits.astype(jnp.float32)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), (logits, routes, blocks)

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return float(value), jax.tree.map(np.asarray, aux), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_give_the_scanned_values_and_gradients(remat):
    value, (logits, routes, blocks), grads = _run(True, remat)
    value_u, (logits_u, routes_u, blocks_u), grads_u = _run(False, remat)
    assert abs(value - value_u) <= 1e-6 * abs(value)
    _close(logits_u, logits)
    np.testing.assert_array_equal(routes_u, routes)
    np.testing.assert_array_equal(blocks_u, blocks)
    assert (blocks >= 0).any() and (blocks == -1).any()  # the sparse layers select (and see past the start)
    flat, flat_u = jax.tree.leaves(grads), jax.tree.leaves(grads_u)
    assert len(flat) == len(flat_u)
    for g, g_u in zip(flat, flat_u):
        _close(g_u, g)


def test_unrolled_decode_step_matches_the_scanned_one():
    ids = jax.random.randint(jax.random.key(2), (2, 24), 0, CFG.vocab_size)
    out = {}
    for scan_layers in (True, False):
        model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0), scan_layers=scan_layers)
        cache = model.init_cache(2, 32)
        mask = jnp.zeros((2, 32), jnp.int32).at[:, :24].set(1)
        pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
        _, cache = model(ids, positions=pos, attention_mask=mask, cache=cache)
        step_mask = mask.at[:, 24].set(1)
        logits, cache = model(ids[:, -1:], positions=jnp.full((2, 1), 24), attention_mask=step_mask, cache=cache)
        out[scan_layers] = (np.asarray(logits), jax.tree.map(np.asarray, cache))
    _close(out[False][0], out[True][0])
    for c_u, c in zip(jax.tree.leaves(out[False][1]), jax.tree.leaves(out[True][1])):
        _close(c_u, c)


def test_scan_layers_option():
    assert ModelSection().model_options()["scan_layers"] is True
    assert ModelSection(scan_layers=False).model_options()["scan_layers"] is False
    with pytest.raises(ValueError, match="scan_layers='no'"):
        M3ForCausalLM(CFG, rngs=nnx.Rngs(0), scan_layers="no")


def test_unrolled_stacks_have_no_layer_loop():
    """The option reaches the stacks: three full-attention dense layers (one stack, no loops of their own at 64
    keys) run as one while loop, or unrolled as none."""
    cfg = dataclasses.replace(CFG, layer_types=("full_attention",) * 3, mlp_layer_types=("dense",) * 3)
    ids = jnp.zeros((1, SEQ), jnp.int32)
    whiles = {}
    for scan_layers in (True, False):
        graphdef, state = nnx.split(M3ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=False, scan_layers=scan_layers))
        text = jax.jit(lambda s: nnx.merge(graphdef, s)(ids)).lower(state).as_text()
        whiles[scan_layers] = text.count("stablehlo.while")
    assert whiles == {True: 1, False: 0}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_decode_step_writes_its_cache_slots_in_place(scan_layers):
    """The stacks carry their stacked decode cache and scatter each layer's new slots into it
    (`m3jax.model.kv_cache`). When the cache was the layer loop's scanned input and output, the compiled step
    zero-filled a fresh stacked buffer for it (a broadcast of the stacked shape) and wrote every layer back
    whole: checked to fail on that code (session 28)."""
    model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 48)
    stacked = {f"f32[{','.join(map(str, a.shape))}]" for c in cache for a in c.values() if a.shape[0] > 1}

    def step(state, cache):
        return nnx.merge(graphdef, state)(jnp.ones((2, 1), jnp.int32), positions=jnp.full((2, 1), 5),
                                          attention_mask=jnp.ones((2, 48), jnp.int32), cache=cache)

    text = jax.jit(step, donate_argnums=1).lower(state, cache).compile().as_text()
    producers = [(m.group(1), m.group(3)) for m in
                 re.finditer(r"%([\w.-]+) = (f32\[[\d,]+\])\{[^}]*\} ([\w-]+)\(", text) if m.group(2) in stacked]
    assert producers  # the cache's buffers are found in the program
    assert not [name for name, op in producers if op == "broadcast" or "broadcast" in name]
