"""model.remat_policy: what a rematerialised layer keeps for its backward changes the work, never the numbers.

Logits and gradients of the tiny two-kind model (a full-attention dense layer, then two sparse MoE layers in one
scan) under no remat, full remat, save_dots and save_dots_experts agree to <= 1e-6 relative, on the default path
(dense attention on the full layer, the gather sparse path, the CPU's auto = bucketed experts) and on the recipes'
(flash); save_dots_experts also on one expert-parallel MoE block. The planner
side (m3jax.plan.remat) is checked against XLA's compiled FLOPs and temporaries of the same model in
tests/test_plan_remat.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.config import M3Config
from m3jax.model.decoder import REMAT_POLICIES, M3ForCausalLM
from rl.config.model_section import ModelSection

CFG = M3Config(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
               num_local_experts=4, num_experts_per_tok=2,
               layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
               mlp_layer_types=["dense", "sparse", "sparse"], partial_rotary_factor=0.5, index_n_heads=2,
               index_head_dim=16, index_block_size=8, index_topk_blocks=2)
SEQ = 32


def _loss_and_grad(remat: bool, policy: str, **options):
    model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0), remat=remat, remat_policy=policy, **options)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, CFG.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(ids).astype(jnp.float32)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return float(value), np.asarray(logits), jax.tree.map(np.asarray, grads)


def _close(a, b, rtol=1e-6):
    """Relative to the array's own scale (max |.|), so near-zero entries do not set the bar."""
    scale = max(float(np.max(np.abs(b))), 1e-30)
    assert float(np.max(np.abs(a - b))) <= rtol * scale


def test_policy_choices_mirror_the_model():
    field = ModelSection.__dataclass_fields__["remat_policy"]
    assert tuple(field.metadata["choices"]) == REMAT_POLICIES
    assert ModelSection().model_options()["remat_policy"] == "full"


def test_unknown_policy_fails_at_construction():
    with pytest.raises(ValueError, match="remat_policy='nope'"):
        M3ForCausalLM(CFG, rngs=nnx.Rngs(0), remat=True, remat_policy="nope")


@pytest.mark.slow  # three gradient compiles of the tiny model per path (15-21 s on the shared 2-core CPU)
@pytest.mark.parametrize("options", [{}, pytest.param({"attention_impl": "flash", "moe_kernel": "tiled"},
                                                       marks=pytest.mark.extended)],
                         ids=["default-path", "recipe-path"])
def test_values_and_gradients_match_full_and_no_remat(options):
    ref_value, ref_logits, ref_grads = _loss_and_grad(False, "full", **options)
    for policy in REMAT_POLICIES:
        value, logits, grads = _loss_and_grad(True, policy, **options)
        assert abs(value - ref_value) <= 1e-6 * abs(ref_value)
        _close(logits, ref_logits)
        jax.tree.map(_close, grads, ref_grads)


def _lowered_grad(**kw) -> str:
    model = M3ForCausalLM(CFG, rngs=nnx.Rngs(0), remat=True, **kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.zeros((1, SEQ), jnp.int32)
    f = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(f)).lower(params).as_text()


def test_every_policy_runs_the_indexer_and_the_routing_once_and_the_policies_differ():
    """The integer decisions are kept under every policy: the gradient's program holds one indexer top-k per
    sparse-layer scan (its [B, Hi, S, nb] scores), one router top-k ([T, E]) and one expert sort of the rows per
    MoE-layer scan, not a second of each in the remat; without the routing's names kept, two of each."""
    programs = {pol: _lowered_grad(remat_policy=pol) for pol in REMAT_POLICIES}
    for pol, text in programs.items():
        indexer_topk = re.findall(r"chlo\.top_k\(%\w+, k = \d+\) : tensor<\d+x\d+x\d+x\d+xf32>", text)
        router_topk = re.findall(r"chlo\.top_k\(%\w+, k = \d+\) : tensor<\d+x\d+xf32>", text)
        assert len(indexer_topk) == 1 and len(router_topk) == 1, (pol, indexer_topk, router_topk)
        assert text.count("stablehlo.sort") == 1, pol
    from m3jax.model import decoder
    from m3jax.model.sparse import INDEX_BLOCK_IDS

    real = decoder.remat_policy_fn
    try:  # the policy of before: block ids only
        decoder.remat_policy_fn = lambda name: jax.checkpoint_policies.save_only_these_names(INDEX_BLOCK_IDS)
        before = _lowered_grad(remat_policy="full")
    finally:
        decoder.remat_policy_fn = real
    assert len(re.findall(r"chlo\.top_k\(%\w+, k = \d+\) : tensor<\d+x\d+xf32>", before)) == 2
    assert before.count("stablehlo.sort") == 2
    assert len(set(programs.values())) == len(REMAT_POLICIES)
    assert programs["full"] == _lowered_grad()  # the default


def test_expert_rows_tag_is_an_identity_without_a_policy_naming_it(monkeypatch):
    """combine's checkpoint_name(MOE_EXPERT_OUT) lowers to nothing: with the tag replaced by the identity, the
    full-remat gradient's program (its policy names only the integer decisions) is the same text."""
    import sharding.expert as expert

    tagged = _lowered_grad(remat_policy="full")
    real = expert.checkpoint_name
    monkeypatch.setattr(expert, "checkpoint_name", lambda x, name: x if name == expert.MOE_EXPERT_OUT else real(x, name))
    assert _lowered_grad(remat_policy="full") == tagged


@pytest.mark.slow  # four gradient compiles of one expert-parallel MoE block (~30 s)
def test_save_dots_experts_keeps_the_rows_on_the_expert_parallel_path():
    """Inside shard_map (EP over 2 x 2 x 2, the padded exchange) the policy keeps combine's [T * k, d] rows too,
    and the gradient equals the block's without remat to 1e-6."""
    from jax._src.ad_checkpoint import saved_residuals

    from m3jax.model.decoder import remat_policy_fn
    from m3jax.model.moe import moe_block
    from sharding.mesh import MeshConfig, build_mesh
    from tests.test_expert_parallel import CFG as MOE_CFG, params

    p = params()
    x = jax.random.normal(jax.random.key(1), (8, 16, MOE_CFG.hidden_size))
    mesh = build_mesh(MeshConfig(2, 2, 2, 1), MOE_CFG)
    f = lambda p, x: jnp.sum(moe_block(p, x, MOE_CFG, mesh, None, "padded") ** 2)  # noqa: E731
    rows = x.shape[0] * x.shape[1] * MOE_CFG.num_experts_per_tok  # T * k of every rank (a global residual)
    kept = {pol: [r for r, _ in saved_residuals(jax.checkpoint(f, policy=remat_policy_fn(pol)), p, x)]
            for pol in ("save_dots", "save_dots_experts")}
    extra = [r.shape for r in kept["save_dots_experts"]]
    for r in kept["save_dots"]:
        extra.remove(r.shape)
    assert extra == [(rows, MOE_CFG.hidden_size)]
    ref = jax.jit(jax.grad(f))(p, x)
    got = jax.jit(jax.grad(jax.checkpoint(f, policy=remat_policy_fn("save_dots_experts"))))(p, x)
    jax.tree.map(_close, got, ref)
