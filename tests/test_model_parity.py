"""The Flax model computes what transformers' MiniMaxM3VLForCausalLM computes (fp32, tiny random models).

Per variant, each (layout, options) checkpoint load and each compiled forward / gradient is shared by the
tests that need it: the passes are jitted (one XLA compile per shape, not one per op), and torch's
gradients are computed once per variant. The fast loop (-m "not slow") runs every check on the
release-like variant and the logits on every variant; the other variants' checks are slow.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import m3jax
from m3jax.hf import layouts
from tests import reference as ref

SEQ = 64  # > index_topk_blocks * index_block_size in every variant, so sparse layers really select
# Query-chunked attention: 16 divides SEQ, 24 does not (the last block is padded); 0 = unchunked.
CHUNKS = [0, 16, 24]


def rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@jax.jit
def forward(model, ids, attention_mask=None, positions=None):
    return model(ids, attention_mask=attention_mask, positions=positions)


class Case:
    """One variant: its HF model, both saved layouts, and memoised loads / torch gradients."""

    def __init__(self, name, tmp_path_factory):
        self.name, self.cfg = name, ref.tiny_config(name)
        self.hf = ref.build_model(self.cfg, seed=len(name))
        root = tmp_path_factory.mktemp(name)
        self.dirs = {layout: ref.save(self.hf, str(root / layout), layout) for layout in ("native", "released")}
        self._models, self._torch_grads = {}, None

    def model(self, layout="native", dtype=None, chunk=0):
        key = (layout, dtype, chunk)
        if key not in self._models:
            self._models[key] = m3jax.from_pretrained(self.dirs[layout], dtype=dtype, attention_query_chunk=chunk)
        return self._models[key]

    def torch_loss_and_grads(self, ids):
        if self._torch_grads is None:
            self.hf.zero_grad()
            logits = self.hf(torch.tensor(ids[:, :-1], dtype=torch.long)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.cfg.vocab_size),
                                                     torch.tensor(ids[:, 1:], dtype=torch.long).reshape(-1))
            loss.backward()
            self._torch_grads = ids, loss.item(), {n: p.grad for n, p in self.hf.named_parameters()}
        assert np.array_equal(self._torch_grads[0], ids)
        return self._torch_grads[1:]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant name -> its Case, built on first use and kept for the module (whatever the test order)."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = Case(name, tmp_path_factory)
        return built[name]
    return get


@pytest.fixture
def case(cases, variant):
    return cases(variant)


def variants(fast=("release_like",), suite=None):
    """Parametrize `variant` over every variant; those not in `fast` run in the full suite only, and those not
    in `suite` (when given) only with -m extended."""
    def marks(v):
        return (pytest.mark.slow,) + ((pytest.mark.extended,) if suite is not None and v not in suite else ())
    return pytest.mark.parametrize(
        "variant", [v if v in fast else pytest.param(v, marks=marks(v)) for v in ref.VARIANTS])


@variants(suite=("release_like",))  # the other variants: -m extended
@pytest.mark.parametrize("chunk", [c if c == 24 else pytest.param(c, marks=pytest.mark.slow) for c in CHUNKS[1:]])
def test_chunked_attention_logits_match_hf(case, chunk):  # fast: 24, the chunk loop with a padded last block
    ids = ref.random_ids(case.cfg, 2, SEQ, seed=1)
    assert rel_err(forward(case.model(chunk=chunk), jnp.asarray(ids)), ref.hf_logits(case.hf, ids)) < 1e-5


# Fast: every variant's native logits, the released layout's on the release-like variant.
@pytest.mark.parametrize("variant, layout", [
    pytest.param(v, layout, marks=() if v == "release_like" or layout == "native" else pytest.mark.slow)
    for v in ref.VARIANTS for layout in ("native", "released")])
def test_logits_match_hf(case, layout):
    name, cfg, hf = case.name, case.cfg, case.hf
    ids = ref.random_ids(cfg, 2, SEQ, seed=1)
    want = ref.hf_logits(hf, ids)
    assert rel_err(forward(case.model(layout), jnp.asarray(ids)), want) < 1e-5

    if layout == "native":
        # The sparse path is really exercised: the same weights with full attention everywhere differ.
        full_cfg = ref.tiny_config(name, sparse_attention_config=dict(
            sparse_attention_freq=[0] * cfg.num_hidden_layers))
        full = ref.build_model(full_cfg)
        missing, unexpected = full.load_state_dict(hf.state_dict(), strict=False)
        assert not missing and all(".indexer." in k for k in unexpected)
        diff = np.abs(ref.hf_logits(full, ids) - want)
        block_span = cfg.index_topk_blocks * cfg.index_block_size
        assert diff[:, :block_span].max() < 1e-4  # every causal block fits in the top-k: exact
        assert diff[:, block_span:].max() > 1e-2


# Chunks 0 and 24 (a padded last block) on every variant; 16 (divides SEQ: the same chunk loop without the
# padding) on the release-like one only. The fast loop: chunk 0 on the release-like variant; the default run
# adds chunk 24 there; the other variants' gradients run with -m extended.
def _gradient_marks(v, chunk):
    if v == "release_like":
        return () if chunk == 0 else (pytest.mark.slow,) if chunk == 24 else (pytest.mark.slow, pytest.mark.extended)
    return (pytest.mark.slow, pytest.mark.extended)


@pytest.mark.parametrize("variant, chunk", [
    pytest.param(v, chunk, marks=_gradient_marks(v, chunk))
    for v in ref.VARIANTS for chunk in CHUNKS if chunk != 16 or v == "release_like"])
def test_gradients_match_torch_autograd(case, chunk):
    cfg = case.cfg
    ids = ref.random_ids(cfg, 2, SEQ, seed=2)
    model = case.model(chunk=chunk)
    torch_loss, torch_grads = case.torch_loss_and_grads(ids)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids):
        out = nnx.merge(graphdef, params, rest)(ids[:, :-1])
        logp = jax.nn.log_softmax(out, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    jloss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, jnp.asarray(ids))
    assert abs(float(jloss) - torch_loss) < 1e-5
    flat = dict(nnx.to_flat_state(grads))
    checked = 0
    for slot in layouts.slots(model.cfg, "native"):
        if slot.param[-1] == "router_bias":
            assert slot.param not in flat  # a buffer: not trainable, no gradient
            continue
        g = np.asarray(flat[slot.param].get_value())
        g = (g[slot.index] if slot.index else g).reshape(slot.shape)
        tg = torch_grads[slot.name]
        if ".indexer." in slot.name:
            assert tg is None and not np.any(g), slot.name  # selection is not differentiable
            continue
        assert rel_err(g, tg.numpy()) < 1e-4, slot.name
        checked += 1
    assert checked > 20


@pytest.mark.slow  # another forward compile per variant
@variants(suite=("release_like",))  # the other variants: -m extended
def test_bf16_forward_within_bf16_tolerance(case):
    """bf16 error vs fp32 is what bf16 costs the reference too: no larger than HF's own bf16 model's."""
    cfg, hf = case.cfg, case.hf
    ids = ref.random_ids(cfg, 8, SEQ, seed=3)
    ref32 = ref.hf_logits(hf, ids)
    hf16 = ref.hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    model16 = case.model(dtype=jnp.bfloat16)
    moe_stack = next(s for s in model16.stacks if s.mlp_kind == "sparse")
    assert model16.embed[...].dtype == jnp.bfloat16 and moe_stack.router[...].dtype == jnp.float32
    got = np.asarray(forward(model16, jnp.asarray(ids)).astype(jnp.float32))
    scale = np.abs(ref32).max()
    ours = np.abs(got - ref32).mean(-1) / scale  # per position
    theirs = np.abs(hf16 - ref32).mean(-1) / scale
    # Typical positions stay within a few bf16 epsilons (2^-8); the mean also holds the positions where a
    # near-tie in MoE routing or block selection flips, which happens to HF's bf16 model just as often.
    assert np.median(ours) < 3 * 2.0**-8
    assert ours.mean() < 1.25 * theirs.mean()


@pytest.mark.slow  # another forward compile per variant
@variants(suite=("release_like",))  # the other variants: -m extended
def test_right_padding_leaves_real_tokens_unchanged(case):
    cfg, hf, model = case.cfg, case.hf, case.model()
    ids = ref.random_ids(cfg, 2, SEQ, seed=4)
    lengths = [SEQ - 13, SEQ - 29]
    mask = np.zeros_like(ids)
    padded = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        padded[row, :n] = ids[row, :n]
    got = np.asarray(forward(model, jnp.asarray(padded), attention_mask=jnp.asarray(mask)))
    want_hf = ref.hf_logits(hf, padded, mask)
    for row, n in enumerate(lengths):
        alone = np.asarray(forward(model, jnp.asarray(ids[row:row + 1, :n])))[0]
        assert rel_err(got[row, :n], alone) < 1e-5
        assert rel_err(got[row, :n], want_hf[row, :n]) < 1e-5


@pytest.mark.slow  # another forward compile per variant
@variants(suite=("release_like",))  # the other variants: -m extended
def test_explicit_positions_equal_default(case):
    model = case.model()
    ids = jnp.asarray(ref.random_ids(case.cfg, 2, 24, seed=5))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    np.testing.assert_array_equal(np.asarray(forward(model, ids)), np.asarray(forward(model, ids, positions=pos)))


def left_padded(ids, pads):
    """HF's convention for left padding (generate's): each row's first pads[row] slots masked, its position_ids
    counted from its first real token (0 on the pads)."""
    mask, pos = np.ones_like(ids), np.zeros_like(ids)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
        pos[row] = np.maximum(np.arange(ids.shape[1]) - p, 0)
    return mask, pos


def test_left_padding_with_positions_from_the_first_real_token_matches_hf(tmp_path):
    """The positions also set the causal mask here: a left-padded row whose positions count from its first real
    token (HF's convention) had each token see the pad slots before it and not its own, logits 26 off HF's, silently
    (an audit). The positions are RoPE's only now, and the slots set causality, as in HF. Full attention only: HF's
    own indexer takes its causality from the positions (its TODO on left padding), which m3jax does not copy."""
    cfg = ref.tiny_config(sparse_attention_config=dict(sparse_num_index_heads=2, sparse_index_dim=16,
                                                       sparse_block_size=8, sparse_topk_blocks=2,
                                                       sparse_local_block=1, sparse_attention_freq=[0, 0, 0, 0]))
    hf = ref.build_model(cfg, seed=3)
    model = m3jax.from_pretrained(ref.save(hf, str(tmp_path / "native"), "native"))
    ids, pads = ref.random_ids(cfg, 2, SEQ, seed=6), [5, 21]
    mask, pos = left_padded(ids, pads)
    got = np.asarray(forward(model, jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(pos)))
    want = ref.hf_logits(hf, ids, mask, pos)
    for row, p in enumerate(pads):
        assert rel_err(got[row, p:], want[row, p:]) < 1e-5, row


@variants(suite=("release_like",))  # the other variants: -m extended
def test_positions_shifted_by_a_row_constant_change_no_real_token(case):
    """RoPE sees only distances, and the slots set causality and the indexer's blocks: a left-padded row's real
    tokens are the same with positions counted from its first real token as with the default 0..S-1. (The pads'
    positions are shifted too, below 0: the indexer pools pad keys' scores with the rest, as HF's does, so pads at
    HF's position 0 would change which blocks win.)"""
    model = case.model()
    ids, pads = ref.random_ids(case.cfg, 2, SEQ, seed=6), [5, 21]
    mask, _ = left_padded(ids, pads)
    pos = np.arange(SEQ)[None, :] - np.asarray(pads)[:, None]
    shifted = np.asarray(forward(model, jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                 positions=jnp.asarray(pos)))
    default = np.asarray(forward(model, jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    for row, p in enumerate(pads):
        assert rel_err(shifted[row, p:], default[row, p:]) < 1e-5, row


@variants(suite=("release_like",))  # the other variants: -m extended
def test_short_sequences_attend_as_full_layers_and_match_hf(case):
    """Over no more key blocks than index_topk_blocks, the indexer keeps every block a query can see (HF: the top
    min(K, nb) blocks, fully-future ones dropped): the sparse layers run as full layers and the indexer's top-k
    never runs, and the logits are still HF's, whose sparse layers select and mask (rows right-padded too). One
    key more and the layers select again."""
    cfg, model = case.cfg, case.model()
    span = cfg.index_topk_blocks * cfg.index_block_size
    top_ks = {}
    for s in (span, span + 1):
        ids = ref.random_ids(cfg, 2, s, seed=6)
        mask = np.ones_like(ids)
        mask[1, s - 5:] = 0
        got = np.asarray(forward(model, jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
        want = ref.hf_logits(case.hf, ids, mask)
        assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1, :s - 5], want[1, :s - 5]) < 1e-5, s
        top_ks[s] = str(jax.make_jaxpr(lambda m, i: m(i))(model, jnp.asarray(ids))).count("top_k")
    # the routers' top-k in both programs; the indexer's in the longer one only
    assert top_ks[span] < top_ks[span + 1], top_ks
