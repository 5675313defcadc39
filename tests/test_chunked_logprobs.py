"""Logprobs without full logits (`rl.logprobs.chunked_token_logprobs`): the same values and gradients as
`token_logprobs` on the model's full [.., T, vocab] logits, in the logprob pass and the GRPO loss, and a
compiled program whose temporaries do not grow with tokens x vocab."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax import tiny
from m3jax.model.decoder import lm_head_logits
from rl.config import load_config
from rl.config.errors import ConfigError
from rl.generation.base import SamplingParams, token_logprobs
from rl.grpo.loss import LossConfig
from rl.logprobs import chunked_token_logprobs, make_logprob_pass
from rl.policy import grpo_loss_fn
from sharding.layout import Layout
from sharding.mesh import MeshConfig, build_mesh

T, D, V = 24, 16, 40
# (temperature, top_p, top_k): plain, temperature, nucleus, top-k, all three
SAMPLINGS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 0), (0.7, 1.0, 5), (0.7, 0.8, 5)]


def _inputs(lead=(2,), t=T, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (*lead, t, D)).astype(dtype)
    w = (0.5 * jax.random.normal(k[1], (V, D))).astype(dtype)
    y = jax.random.randint(k[2], (*lead, t), 0, V)
    ct = jax.random.normal(k[3], (*lead, t))  # a cotangent with a different weight per position
    return h, w, y, ct


def _full(h, w, y, s):
    # today's path: the model's logits, then token_logprobs (rank-3 like the model's [B, S, d])
    lead = h.shape[:-2]
    h3, y3 = h.reshape(-1, *h.shape[-2:]), y.reshape(-1, y.shape[-1])
    return token_logprobs(lm_head_logits(h3, w), y3, *s).reshape(*lead, y.shape[-1])


def _value_and_grads(fn, h, w, y, ct):
    def loss(h, w):
        lp = fn(h, w, y)
        return jnp.sum(jnp.where(jnp.isfinite(lp), lp * ct, 0.0)), lp  # targets cut by top-k/p are -inf
    (_, lp), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
    return np.asarray(lp), [np.asarray(g, np.float32) for g in grads]


def _assert_same(got, want, rtol):
    lp, grads = got
    np.testing.assert_array_equal(np.isfinite(lp), np.isfinite(want[0]))
    fin = np.isfinite(lp)
    np.testing.assert_allclose(lp[fin], want[0][fin], rtol=rtol, atol=rtol * np.max(np.abs(want[0][fin])))
    for g, ref in zip(grads, want[1], strict=True):
        np.testing.assert_allclose(g, ref, rtol=rtol, atol=rtol * np.max(np.abs(ref)))


# The fast loop keeps every transform at once (T 0.7, top-p 0.8, top-k 5) with both chunk kinds, and the
# plain softmax with a padded last block; the single transforms are slow.
FAST_CASES = {((0.7, 0.8, 5), 8), ((0.7, 0.8, 5), 5), ((1.0, 1.0, 0), 5)}


@pytest.mark.parametrize("sampling, chunk", [
    pytest.param(s, c, marks=() if (s, c) in FAST_CASES else pytest.mark.slow,
                 id=f"T{s[0]}-p{s[1]}-k{s[2]}-{'divides' if c == 8 else 'pads'}")
    for s in SAMPLINGS for c in (8, 5)])  # 24 = 3 x 8; 5 x 5 = 25: one pad
def test_values_and_gradients_equal_the_full_logits(sampling, chunk):
    h, w, y, ct = _inputs()
    want = _value_and_grads(lambda h, w, y: _full(h, w, y, sampling), h, w, y, ct)
    got = _value_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, *sampling, chunk_tokens=chunk),
                           h, w, y, ct)
    # Values: the same logits row by row. lm_head's gradient sums positions block by block: fp32 rounding.
    _assert_same(got, want, rtol=1e-6)


@pytest.mark.slow  # one block is the path every model test runs (rows shorter than the default chunk)
@pytest.mark.parametrize("lead", [(), (3, 2)], ids=["rank2", "rank4"])
def test_any_leading_shape_and_one_block(lead):
    h, w, y, ct = _inputs(lead, t=13)
    s = (0.7, 0.9, 0)
    want = _value_and_grads(lambda h, w, y: _full(h, w, y, s), h, w, y, ct)
    for chunk in (4, 13, 100):  # 4 blocks of 4 (3 pads); exactly one block; one block larger than T
        got = _value_and_grads(lambda h, w, y, c=chunk: chunked_token_logprobs(h, w, y, *s, chunk_tokens=c),
                               h, w, y, ct)
        _assert_same(got, want, rtol=1e-6)


@pytest.mark.xla_defaults  # chunked and full logits, bit for bit
def test_a_bf16_head_gives_the_same_logits_and_its_gradient_within_one_rounding():
    h, w, y, ct = _inputs(dtype=jnp.bfloat16)
    s = (0.7, 1.0, 0)
    want = _value_and_grads(lambda h, w, y: _full(h, w, y, s), h, w, y, ct)
    got = _value_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, *s, chunk_tokens=4), h, w, y, ct)
    np.testing.assert_array_equal(got[0], want[0])  # the same bf16 logits, then the same fp32 math
    np.testing.assert_array_equal(got[1][0], want[1][0])  # each position's hidden gradient: one block's
    # lm_head: blocks summed in fp32 and rounded once to bf16, as the full matmul is: within 2^-8 of the max
    np.testing.assert_allclose(got[1][1], want[1][1], rtol=0, atol=2.0 ** -8 * np.max(np.abs(want[1][1])))


@pytest.mark.xla_defaults  # XLA's default excess precision is what elided the rounding
def test_a_bf16_models_logprobs_read_its_bf16_logits_on_every_path():
    """The jitted full-logits pass, the chunked one and eager code (as vLLM and HF compute: bf16 logits, then fp32)
    give the same logprobs of a bf16 model. XLA fused the bf16 round trip away, each program differently: up to
    1.6e-3 apart on this model (an audit); `sampling_logits` now reads them at bf16 precision explicitly."""
    from rl.logprobs import policy_logprobs
    cfg = tiny.m3_config()
    model = tiny.m3_model(cfg, seed=0, dtype=jnp.bfloat16)
    ids = tiny.random_ids(cfg, 2, 65, seed=1)
    mb = {"input_ids": jnp.asarray(ids[:, :-1]), "attention_mask": jnp.ones((2, 64), bool),
          "targets": jnp.asarray(ids[:, 1:])}
    for sp in (SamplingParams(temperature=1.0, max_new_tokens=1), SamplingParams(1, 0.7, 0.9, 20)):
        logits = model(mb["input_ids"], attention_mask=mb["attention_mask"])
        assert logits.dtype == jnp.bfloat16
        want = np.asarray(token_logprobs(logits, mb["targets"], sp.temperature, sp.top_p, sp.top_k))  # eager
        full, chunked = (np.asarray(jax.jit(lambda m, b: policy_logprobs(m, b, sp, c))(model, mb)) for c in (0, 16))
        np.testing.assert_array_equal(chunked, full, err_msg=str(sp))  # were 9.4e-4 apart
        np.testing.assert_allclose(full, want, rtol=0, atol=1e-4, err_msg=str(sp))  # fp32 sums' order only


def test_bad_chunk_and_shapes_are_errors():
    h, w, y, _ = _inputs()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="chunk_tokens"):
            chunked_token_logprobs(h, w, y, 1.0, chunk_tokens=bad)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, y[:, 1:], 1.0, chunk_tokens=4)


def test_sharded_blocks_equal_one_device():
    """Batch, sequence and vocabulary cut over the mesh (data 2 x context 2 x tensor 2): strided blocks
    keep every block spread over the sequence's devices; the values are one device's."""
    layout = build_mesh(MeshConfig(2, 2, 1, 2))
    h, w, y, ct = _inputs(lead=(4,), t=32)
    s = (0.7, 0.9, 5)
    want = _value_and_grads(lambda h, w, y: _full(h, w, y, s), h, w, y, ct)
    h_s = jax.device_put(h, layout.sharding(("act_batch", "act_seq", "act_embed")))
    y_s = jax.device_put(y, layout.sharding(("act_batch", "act_seq")))
    w_s = jax.device_put(w, layout.sharding(("vocab", "embed")))
    with jax.set_mesh(layout.mesh):
        got = _value_and_grads(lambda h, w, y: chunked_token_logprobs(h, w, y, *s, chunk_tokens=8, layout=layout,
                                                                      head_axes=("vocab", "embed")),
                               h_s, w_s, y_s, ct)
    _assert_same(got, want, rtol=1e-6)


def test_the_head_gradient_crosses_the_batch_axes_once_not_per_block():
    """The head gradient's partial sums are kept per batch shard over the blocks (cut over the sequence's devices);
    the reduction over data comes once, after the backward's scan. Constraining the running sum to the head's layout
    made the partitioner reduce the whole fp32 head over data at every block: 8 x 4.6 GB over the inter-node axis
    per micro-batch at the 32-node recipe's shapes."""
    from sharding.hlo_collectives import collectives
    layout = build_mesh(MeshConfig(2, 2, 1, 2))
    h, w, y, ct = _inputs(lead=(4,), t=32)
    h_s = jax.device_put(h, layout.sharding(("act_batch", "act_seq", "act_embed")))
    y_s = jax.device_put(y, layout.sharding(("act_batch", "act_seq")))
    w_s = jax.device_put(w, layout.sharding(("vocab", "embed")))

    def loss(h, w):
        return jnp.sum(ct * chunked_token_logprobs(h, w, y_s, 0.7, 0.9, 5, chunk_tokens=8, layout=layout,
                                                   head_axes=("vocab", "embed")))

    with jax.set_mesh(layout.mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h_s, w_s).compile().as_text()
    reductions = [c for c in collectives(hlo, layout.mesh) if c.op in ("all-reduce", "reduce-scatter")]
    assert not [c for c in reductions if c.in_loop and "data" in c.axes]
    assert [c for c in reductions if not c.in_loop and "data" in c.axes]  # the one reduction, after the scan


# ------------------------------------------------------------------ the logprob pass and the loss on a model
@pytest.fixture(scope="module")
def tiny_model():
    # One full-attention dense layer: the chunking is all after the final norm, so the layer kinds (each
    # compared with itself) only add compile time.
    cfg = tiny.m3_config(layers=1, vocab_size=64, hidden_size=32, num_attention_heads=2, head_dim=16)
    model = tiny.m3_model(cfg, seed=3)
    ids = tiny.random_ids(cfg, 3, 20, seed=1)  # 2 micro-batches: [2, 3 rows, 19] after the shift
    batch = {"input_ids": np.stack([ids[:, :-1]] * 2), "targets": np.stack([ids[:, 1:], ids[::-1, 1:]]),
             "attention_mask": np.ones((2, 3, 19), np.int32)}
    batch["attention_mask"][:, 0, 15:] = 0  # a right-padded row
    return model, batch


SAMPLING = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20)


@pytest.mark.slow  # compiles the pass twice; the loss test below runs the same policy_logprobs in the fast loop
def test_logprob_pass_chunked_equals_full_logits(tiny_model):
    model, batch = tiny_model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    want = np.asarray(make_logprob_pass(graphdef, SAMPLING)(params, rest, batch))
    got = np.asarray(make_logprob_pass(graphdef, SAMPLING, Layout(), chunk_tokens=8)(params, rest, batch))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)


def test_grpo_loss_and_gradients_chunked_equal_full_logits(tiny_model):
    model, batch = tiny_model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    logp = make_logprob_pass(graphdef, SAMPLING)(params, rest, batch)[0]  # jitted: eagerly, op by op, is slow
    noise = jax.random.normal(jax.random.key(0), logp.shape)
    mb.update(logp_old=jnp.where(jnp.isfinite(logp), logp + 0.1 * noise, 0.0), advantages=jnp.array([1.0, -0.5, 2.0]))
    mb["logp_gen"] = mb["logp_old"]
    mb["loss_mask"] = (mb["attention_mask"] * jnp.isfinite(logp)).astype(jnp.float32)

    def value_and_grad(chunk):
        loss_fn = grpo_loss_fn(SAMPLING, LossConfig(), chunk)
        f = jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), mb)[0]))
        loss, grads = f(params)
        return float(loss), jax.tree.leaves(grads)

    want_loss, want = value_and_grad(0)
    got_loss, got = value_and_grad(8)  # 19 positions: 3 blocks of 7 (2 pads)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for g, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-6, atol=1e-6 * np.max(np.abs(ref)))


def test_run_config_field():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.model.logprob_chunk_tokens == 1024 and "logprob_chunk_tokens" not in cfg.model.model_options()
    assert load_config("configs/tiny.yaml", ["model.logprob_chunk_tokens=0"]).model.logprob_chunk_tokens == 0
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        load_config("configs/tiny.yaml", ["model.logprob_chunk_tokens=-1"])


# ------------------------------------------------------------------ memory: compiled temporaries
def _temp_bytes(chunk: int, t: int, v: int = 32768, d: int = 64) -> int:
    h = jax.ShapeDtypeStruct((1, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    y = jax.ShapeDtypeStruct((1, t), jnp.int32)
    s = (0.7, 1.0, 0)
    lp = (lambda h, w, y: _full(h, w, y, s)) if not chunk else \
        (lambda h, w, y: chunked_token_logprobs(h, w, y, *s, chunk_tokens=chunk))
    grad = jax.grad(lambda h, w, y: jnp.sum(lp(h, w, y)), argnums=(0, 1))
    return jax.jit(grad).lower(h, w, y).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temporaries_do_not_grow_with_tokens_times_vocab():
    """Forward + backward at vocab 32k, T 2048: the full path holds several [T, V] fp32 buffers; blocks
    of 256 positions hold [256, V] ones (plus the [V, d] fp32 gradient sum), and doubling T leaves them
    as they are (scripts/bench_logprob_memory.py has the M3-sized figures)."""
    full, chunked, chunked_2t = _temp_bytes(0, 2048), _temp_bytes(256, 2048), _temp_bytes(256, 4096)
    tv = 2048 * 32768 * 4
    assert full >= tv  # at least one [T, V] fp32 array
    assert chunked < full / 6 and chunked < 5 * 256 * 32768 * 4  # a few [chunk, V] fp32 buffers
    assert chunked_2t < 1.1 * chunked
