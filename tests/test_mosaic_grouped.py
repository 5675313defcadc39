"""sharding.mosaic_grouped: the custom VJP around jax's Mosaic GPU ragged-dot kernels. The kernels lower only for a
Hopper GPU, so here they are replaced by their contracts at their least forgiving (`reference_kernels`: rows past
the groups NaN, as the kernel leaves them unwritten; the weight gradient reading padding rows against a zeroed
output gradient): the VJP must call each kernel on the right operands and zero what the kernels leave. Values and
gradients equal jax.lax.ragged_dot's on an expert-parallel receive buffer's layouts. The kernel is refused, by
name, where it cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax import tiny
from sharding.grouped_matmul import ROWS_BY_GROUP, grouped_matmul, resolve_kernel
from sharding.mosaic_grouped import check_shapes, mosaic_grouped_matmul, reference_kernels

SIZES = {  # group sizes in a 48-row buffer: padding past the filled rows in all but "full"
    "balanced": [10, 12, 9, 11], "empty experts": [0, 21, 0, 7], "one hot expert": [0, 0, 33, 0],
    "full": [12, 12, 12, 12], "nothing routed": [0, 0, 0, 0]}


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("case", SIZES)
def test_values_and_gradients_equal_ragged_dot(case):
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    n, d_in, d_out = 48, 24, 40
    rows = jnp.asarray(rng.normal(size=(n, d_in)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(4, d_out, d_in)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(n, d_out)), jnp.float32)  # nonzero on the padding rows too
    kernels = reference_kernels()

    def loss(f):
        return lambda r, w: jnp.sum(f(r, w) * cot)
    mosaic = lambda r, w: mosaic_grouped_matmul(r, w, sizes, kernels)  # noqa: E731
    oracle = lambda r, w: jax.lax.ragged_dot_general(r, w, sizes, ROWS_BY_GROUP)  # noqa: E731
    got, want = mosaic(rows, weights), oracle(rows, weights)
    assert np.isfinite(np.asarray(got)).all(), "a padding row the kernel leaves unwritten reached the output"
    assert _rel(got, want) < 1e-6
    filled = int(sizes.sum())
    np.testing.assert_array_equal(np.asarray(got[filled:]), 0.0)
    got_g = jax.grad(loss(mosaic), argnums=(0, 1))(rows, weights)
    want_g = jax.grad(loss(oracle), argnums=(0, 1))(rows, weights)
    for g, w in zip(got_g, want_g):
        assert np.isfinite(np.asarray(g)).all()
        assert _rel(g, w) < 1e-6
    np.testing.assert_array_equal(np.asarray(got_g[0][filled:]), 0.0)  # padding rows get no gradient


@pytest.mark.parametrize("n,sizes", [(12, [3, 5]), (300, [70, 0, 41]), (300, [0, 250, 50]), (300, [100, 97, 0]),
                                     (300, [100, 28, 0])])
def test_the_weight_gradient_ignores_nonfinite_padding_rows(n, sizes):
    """The weight-gradient kernel masks only its lhs (the output gradient) at a group's edges and loads whole
    blocks of the input rows, so the padding rows in the last group's last block must be zeroed first: 0 x NaN
    would poison that group (a short buffer, a full one, filled rows ending inside a block and on a block boundary,
    with empty groups)."""
    sizes = jnp.asarray(sizes, jnp.int32)
    filled = int(sizes.sum())
    rows = jnp.ones((n, 16), jnp.float32).at[filled:].set(jnp.nan)
    cot = jnp.ones((n, 8), jnp.float32).at[filled:].set(jnp.inf)  # the output gradient's padding too
    weights = jnp.ones((sizes.shape[0], 8, 16), jnp.float32)
    g = jax.grad(lambda w: jnp.sum(jnp.where(cot > 0, mosaic_grouped_matmul(rows, w, sizes, reference_kernels()), 0)
                                   * cot))(weights)
    want = np.broadcast_to(np.asarray(sizes, np.float32)[:, None, None], g.shape)
    np.testing.assert_array_equal(np.asarray(g), want)


def test_what_the_kernels_cannot_take_is_refused_by_name():
    ok = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    check_shapes(ok, jax.ShapeDtypeStruct((4, 384, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match="must be one dtype of bfloat16 / float16"):
        check_shapes(jax.ShapeDtypeStruct((8, 256), jnp.float32), jax.ShapeDtypeStruct((4, 384, 256), jnp.float32))
    with pytest.raises(ValueError, match="input width K 200 must be a multiple of 64; input width K 200 must be a "
                                         "multiple of 128; output width O 96 must be a multiple of 128"):
        check_shapes(jax.ShapeDtypeStruct((8, 200), jnp.bfloat16), jax.ShapeDtypeStruct((4, 96, 200), jnp.bfloat16))


def test_refused_off_a_gpu_before_any_weight_exists():
    with pytest.raises(ValueError, match="'mosaic' .* cannot run on 'cpu'"):
        resolve_kernel("mosaic", "cpu")
    assert resolve_kernel("mosaic", "gpu") == "mosaic"
    rows, w = jnp.ones((4, 128), jnp.bfloat16), jnp.ones((2, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot run on 'cpu'"):
        grouped_matmul(rows, w, jnp.asarray([2, 2]), kernel="mosaic", backend="cpu")
    cfg = tiny.m3_config(hidden_size=128, intermediate_size=128)
    with pytest.raises(ValueError, match="cannot run on 'cpu'"):
        m3jax.M3ForCausalLM(cfg, moe_kernel="mosaic")


def test_a_model_the_kernels_cannot_take_is_refused_at_construction():
    """On a layout built for GPUs (the compile-only case), widths or a dtype the kernels cannot take are named
    before any parameter is made."""
    from sharding.layout import Layout
    with pytest.raises(ValueError, match="moe_kernel=mosaic .* must be one dtype of bfloat16 / float16"):
        m3jax.M3ForCausalLM(tiny.m3_config(hidden_size=128, intermediate_size=128), moe_kernel="mosaic",
                            layout=Layout(platform="gpu"))
    with pytest.raises(ValueError, match="output width O 32 must be a multiple of 128"):
        m3jax.M3ForCausalLM(tiny.m3_config(hidden_size=128, intermediate_size=16), moe_kernel="mosaic",
                            layout=Layout(platform="gpu"), dtype=jnp.bfloat16)


def test_the_config_offers_every_kernel_the_model_takes():
    from rl.config.model_section import ModelSection
    from m3jax.model.expert_tuning import CHOICES
    assert tuple(ModelSection.__dataclass_fields__["moe_kernel"].metadata["choices"]) == CHOICES


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 2, 2, 2)])
def test_inside_the_expert_parallel_shard_map_it_lowers_for_cuda(shape, monkeypatch):
    """Experts over 2 axes (and, with a tensor axis, width-sharded weights against replicated rows): the MoE
    gradient of a layout built for GPUs, exported for CUDA, lowers its six matmuls (gate_up and down: forward,
    input and weight gradients) to Mosaic GPU kernels. Inside the map the kernels' outputs are typed unvarying
    and the gradients must vary as the weights do: the first 1-node recipe compile for H200s failed there."""
    import dataclasses
    import types

    import jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu as weight_kernel
    from jax import export

    from m3jax.model.moe import moe_block
    from sharding.mesh import MeshConfig, build_mesh
    from tests.test_expert_parallel import CFG, E, params

    # the weight-gradient kernel sizes its grid from jax.devices()[0].core_count: a GPU's (an H100 / H200 has 132)
    monkeypatch.setattr(weight_kernel, "jax", types.SimpleNamespace(
        **{n: getattr(jax, n) for n in dir(jax) if not n.startswith("__") and n != "devices"},
        devices=lambda *_: [types.SimpleNamespace(core_count=132)]))
    # widths of 128 per shard: a tensor axis of 2 splits the experts' intermediate width
    cfg = dataclasses.replace(CFG, hidden_size=128, intermediate_size=256, shared_intermediate_size=16)
    layout = dataclasses.replace(build_mesh(MeshConfig(*shape), cfg), platform="gpu")
    ks = jax.random.split(jax.random.key(1), 3)
    p = {**params(), "router": jax.random.normal(ks[0], (E, 128)), "shared_gate_up": jnp.zeros((2, 16, 128)),
         "shared_down": jnp.zeros((128, 16)), "experts_gate_up": jax.random.normal(ks[1], (E, 2, 256, 128)),
         "experts_down": jax.random.normal(ks[2], (E, 128, 256))}
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    x = jnp.zeros((8, 16, 128), jnp.bfloat16)
    grad = jax.jit(jax.value_and_grad(
        lambda p, x: jnp.sum(moe_block(p, x, cfg, layout, None, "padded", "mosaic").astype(jnp.float32) ** 2),
        argnums=(0, 1)))
    text = export.export(grad, platforms=("cuda",))(p, x).mlir_module()
    assert text.count("mosaic_gpu") >= 6, text.count("mosaic_gpu")


def test_the_planner_plans_it_as_a_grouped_gemm():
    """As the Pallas kernel: real rows (tiles past the filled ones multiply nothing), the expert hidden held."""
    from m3jax.plan.memory import Batch
    assert Batch(micro_batch=1, seq_len=64, moe_kernel="mosaic", platform="gpu").expert_matmul == "grouped"
