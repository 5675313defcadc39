"""Full layers on cuDNN's fused attention (`m3jax.model.fused_attention`): the mask's mapping and the fallback.

No GPU here: the tests swap `fused_attention.implementation` for jax's "xla" implementation of the same
`jax.nn.dot_product_attention` call (same arguments, same mask semantics), so what is checked is that the
model's mask reaches cuDNN's PADDING_CAUSAL form exactly where it is that mask, and that every other input
takes the model's own attention. cuDNN's numbers are scripts/gpu_check.py's ("attention_kernels", "model_cudnn").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax.model import attention, fused_attention
from m3jax.model.attention import causal_keep, gqa_attention
from tests import reference as ref


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def xla_fused(monkeypatch):
    """The fused path on CPU through jax's XLA implementation, fp32 allowed; counts the fused calls traced."""
    calls = []
    real = jax.nn.dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("key_value_seq_lengths") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "implementation", lambda backend=None: "xla")
    monkeypatch.setattr(fused_attention, "FUSED_DTYPES", (jnp.bfloat16, jnp.float16, jnp.float32))
    monkeypatch.setattr(fused_attention.jax.nn, "dot_product_attention", counted)
    return calls


def _qkv(b=2, s=48, h=4, kv=2, d=16, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (b, s, h, d)), jax.random.normal(k[1], (b, s, kv, d)),
            jax.random.normal(k[2], (b, s, kv, d)))


def _dense(q, k, v, positions, key_valid):
    return gqa_attention(q, k, v, causal_keep(positions, key_valid, k.shape[1]), q.shape[-1] ** -0.5)


def _case(name, b=2, s=48):
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    valid = np.ones((b, s), bool)
    if name == "right_padding":
        valid[1, 30:] = False
    elif name == "left_padding":
        valid[1, :5] = False
    elif name == "padding_only_row":
        valid[1, :] = False
    elif name == "offset_positions":
        pos = pos + 3
    return pos, (None if name == "no_mask" else jnp.asarray(valid))


@pytest.mark.parametrize("name, fused", [("no_mask", True), ("all_valid", True), ("right_padding", True),
                                         ("left_padding", False), ("padding_only_row", False),
                                         ("offset_positions", False)])
def test_fused_where_the_mask_is_cudnns_form_else_the_fallback(xla_fused, name, fused):
    q, k, v = _qkv()
    pos, valid = _case(name)
    ok, lengths = fused_attention.fused_form(pos, valid)
    assert bool(ok) is fused
    if valid is not None and fused:
        assert lengths.tolist() == np.asarray(valid).sum(-1).tolist()
    def fallback(q, k, v):  # negated (exactly), so the result says which branch ran
        return -_dense(q, k, v, pos, valid)

    got = jax.jit(lambda q, k, v: fused_attention.fused_attention(q, k, v, pos, valid, q.shape[-1] ** -0.5,
                                                                  fallback))(q, k, v)
    want = _dense(q, k, v, pos, valid)
    assert xla_fused  # the fused call was traced (lax.cond traces both branches and runs the one `ok` names)
    # fused: every row, padding rows included, since cuDNN's PADDING_CAUSAL is the model's mask there
    assert rel_err(got if fused else -got, want) < 1e-6


def test_fused_gradients_equal_dense(xla_fused):
    q, k, v = _qkv(seed=1)
    pos, valid = _case("right_padding")
    dout = jax.random.normal(jax.random.key(9), q.shape)
    fused = lambda q, k, v: fused_attention.fused_attention(  # noqa: E731
        q, k, v, pos, valid, q.shape[-1] ** -0.5, lambda q, k, v: _dense(q, k, v, pos, valid))

    def grads(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * dout), argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads(fused), grads(lambda q, k, v: _dense(q, k, v, pos, valid))):
        assert rel_err(got, want) < 1e-5


def test_auto_is_cudnn_on_a_gpu_and_cudnn_runs_only_where_it_applies():
    assert attention.resolve_impl("auto", 8, backend="gpu") == "cudnn"
    assert attention.resolve_impl("auto", 8, backend="cpu") == "dense"
    assert attention.resolve_impl("cudnn", 8, backend="cpu") == "cudnn"
    q16 = jnp.zeros((1, 8, 4, 16), jnp.bfloat16)
    assert not fused_attention.applies(q16, 8, cached=False, n_ctx=1)  # off a GPU: never
    assert fused_attention.implementation("gpu") == "cudnn" and fused_attention.implementation("cpu") is None


def test_static_constraints(monkeypatch):
    monkeypatch.setattr(fused_attention, "implementation", lambda backend=None: "cudnn")
    q = jnp.zeros((1, 8, 4, 16), jnp.bfloat16)
    assert fused_attention.applies(q, 8, cached=False, n_ctx=1)
    assert not fused_attention.applies(q.astype(jnp.float32), 8, cached=False, n_ctx=1)  # cuDNN: 16-bit only
    assert not fused_attention.applies(jnp.zeros((1, 8, 4, 12), jnp.bfloat16), 8, False, 1)  # head dim % 8
    assert not fused_attention.applies(jnp.zeros((1, 8, 4, 256), jnp.bfloat16), 8, False, 1)  # head dim > 128
    assert not fused_attention.applies(q, 8, cached=True, n_ctx=1)  # a decode step over cache slots
    assert not fused_attention.applies(q, 8, cached=False, n_ctx=2)  # context-sharded keys
    assert not fused_attention.applies(q, 16, cached=False, n_ctx=1)  # keys other than the layer's own tokens


# ------------------------------------------------------------------------------------------ the tiny model
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = ref.tiny_config("release_like")
    hf = ref.build_model(cfg, seed=3)
    path = ref.save(hf, str(tmp_path_factory.mktemp("fused") / "native"))
    return cfg, hf, path


@jax.jit
def forward(model, ids, attention_mask=None):
    return model(ids, attention_mask=attention_mask)


def test_cudnn_model_matches_hf_with_right_padding(models, xla_fused, monkeypatch):
    """The full layer through the fused call: HF's logits on real tokens, right padding included. The
    fallback is poisoned (NaN), so these logits prove the fused branch ran."""
    monkeypatch.setattr(attention, "_unfused", lambda q, *args: jnp.full_like(q, jnp.nan))
    cfg, hf, path = models
    model = m3jax.from_pretrained(path, attention_impl="cudnn")
    ids = ref.random_ids(cfg, 2, 64, seed=1)
    mask = np.ones_like(ids)
    mask[1, 40:] = 0
    got = forward(model, jnp.asarray(ids), jnp.asarray(mask))
    want = ref.hf_logits(hf, ids, mask)
    assert xla_fused and any(xla_fused)  # the full layer traced the fused call, with the key lengths
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1, :40], want[1, :40]) < 1e-5


@pytest.mark.slow  # two gradient compiles of the tiny model
def test_cudnn_model_gradients_equal_dense(models, xla_fused):
    cfg, _, path = models
    ids = ref.random_ids(cfg, 2, 64, seed=2)
    grads = {impl: ref.next_token_grads(m3jax.from_pretrained(path, attention_impl=impl), ids)
             for impl in ("dense", "cudnn")}
    assert xla_fused
    ref.assert_grads_close(grads["cudnn"], grads["dense"], 1e-5)


def test_the_planner_plans_cudnn_as_flash():
    """cuDNN's fused attention holds per-query statistics and skips masked tiles, as flash does."""
    from m3jax.plan.flops import step_flops
    from m3jax.tiny import m3_config
    cfg = m3_config()
    assert step_flops(cfg, 2, 1024, attention="cudnn") == step_flops(cfg, 2, 1024, attention="flash") \
        != step_flops(cfg, 2, 1024, attention="dense")


def test_a_call_cudnn_refuses_at_trace_time_runs_the_fallback(xla_fused, monkeypatch, caplog):
    """jax checks cuDNN's own constraints (version, compute capability, shapes) when the call is traced: a
    refusal there runs the model's own attention, with a warning, instead of failing the step."""
    def refusing(*args, **kwargs):
        raise NotImplementedError("The head dim must be <= 128 and a multiple of 8")

    monkeypatch.setattr(fused_attention.jax.nn, "dot_product_attention", refusing)
    q, k, v = _qkv()
    pos, valid = _case("right_padding")
    got = fused_attention.fused_attention(q, k, v, pos, valid, q.shape[-1] ** -0.5,
                                          lambda q, k, v: -_dense(q, k, v, pos, valid))
    assert rel_err(-got, _dense(q, k, v, pos, valid)) < 1e-6 and "does not apply" in caplog.text
