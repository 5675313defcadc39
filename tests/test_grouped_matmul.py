"""sharding.grouped_matmul: the tiled and bucketed kernels equal jax.lax.ragged_dot_general (the oracle),
values and gradients (rows and weights), for the grouped matmul and the fused grouped MLP, on the layouts an
expert-parallel receive buffer produces: empty experts, one hot expert, padding rows past the filled
total, groups not multiples of the tile, buckets overflowing or never filled; and the MoE model gives the
same logits and gradients with every kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sharding.bucketed_grouped import bucket_rows, overflow_tile
from sharding.grouped_matmul import ROWS_BY_GROUP, executed_rows, grouped_matmul, grouped_mlp, resolve_kernel
from sharding.tiled_grouped import segments

RTOL = 1e-5  # fp32: max |got - want| / max |want|


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _act(h):  # row-wise, like SwiGLU: [.., 2A] -> [.., A]
    a = h.shape[-1] // 2
    return jax.nn.silu(h[..., :a]) * (h[..., a:] + 1.0)


# group sizes are an argument: cases with the same shapes share one compiled program
@functools.partial(jax.jit, static_argnames=("op", "kernel", "tile", "expected"))
def _value_and_grads(op, kernel, tile, sizes, args, cot, expected=None):
    def loss(args):
        if op == "matmul":
            out = grouped_matmul(*args, sizes, kernel=kernel, tile=tile, expected_rows=expected)
        else:
            out = grouped_mlp(*args, sizes, _act, kernel=kernel, tile=tile, expected_rows=expected)
        return jnp.sum(out * cot), out
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(args)
    return out, grads


# the tiled kernel; the bucketed one with buckets of the buffer's even share, and with 8-row buckets (every
# larger group overflows into the walk)
KERNEL_CASES = (("tiled", None), ("bucketed", None), ("bucketed", 3))


def _check(sizes, n, tile, d_in=24, d_out=40, seed=0):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(sizes, jnp.int32)
    e, filled = sizes.shape[0], int(sizes.sum())
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    rows, cot = normal(n, d_in), normal(n, d_out)
    cases = {"matmul": (rows, normal(e, d_out, d_in)),
             "mlp": (rows, normal(e, 2 * 16, d_in) / 4, normal(e, d_out, 16) / 4)}
    for op, args in cases.items():
        want, want_g = _value_and_grads(op, "ragged_dot", tile, sizes, args, cot)
        for kernel, expected in KERNEL_CASES:
            case = (op, kernel, expected)
            got, got_g = _value_and_grads(op, kernel, tile, sizes, args, cot, expected)
            assert _rel(got, want) <= RTOL, case
            for i, (g, w) in enumerate(zip(got_g, want_g)):
                assert _rel(g, w) <= RTOL, (case, i)
            # padding rows: zero value and zero gradient (exactly, not just close)
            assert not np.asarray(got[filled:]).any() and not np.asarray(got_g[0][filled:]).any(), case
            # empty experts get exactly zero weight gradients
            assert all(not np.asarray(g[np.asarray(sizes) == 0]).any() for g in got_g[1:]), case


@pytest.mark.parametrize("sizes, n, tile", [
    ([5, 0, 13, 0, 9, 1], 64, 8),     # empty experts, boundaries inside tiles, 36 rows of padding
    pytest.param([3, 7, 0, 11], 21, 8, marks=pytest.mark.slow),  # no padding, last tile partial (21 rows, tile 8)
    ([0, 0, 37, 0], 160, 16),         # one hot expert holding every filled row, 4x padding
    pytest.param([0, 29, 0], 29, 8, marks=pytest.mark.slow),  # one hot expert, every row filled
    pytest.param([1] * 8, 48, 16, marks=pytest.mark.slow),  # more groups than tiles: several in one tile
    pytest.param([0, 0, 0], 24, 8, marks=pytest.mark.slow),  # nothing filled: all zeros
    pytest.param([4, 6], 7, 128, marks=pytest.mark.slow),  # buffer shorter than the tile; sizes sum past N
], ids=["empty-experts", "no-padding", "hot-expert-padded", "hot-expert-full", "tiny-groups", "none-filled",
        "short-buffer"])
def test_tiled_and_bucketed_equal_ragged_dot(sizes, n, tile):
    if sum(sizes) > n:  # ragged_dot's groups may not run past the buffer: compare on the clipped sizes
        sizes = list(np.diff(np.minimum(np.cumsum([0] + sizes), n)))
    _check(sizes, n, tile)


def test_random_group_sizes():
    rng = np.random.default_rng(3)
    for seed in range(3):  # the shapes of the empty-experts case: its compiled programs are reused
        filled = int(rng.integers(1, 64))
        sizes = rng.multinomial(filled, rng.dirichlet(np.ones(6) * 0.5))
        _check(sizes, 64, 8, seed=seed)


def test_clipped_sizes_match_ragged_dot_on_overflow():
    """Group sizes summing past N (never produced by sharding.expert, but cheap to define): the tiled and
    bucketed kernels clip at N like the oracle does on the clipped sizes."""
    rows, w = jnp.ones((10, 4)), jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)
    want = jax.lax.ragged_dot_general(rows, w, jnp.array([6, 4]), ROWS_BY_GROUP)
    for kernel, expected in KERNEL_CASES:
        got = grouped_matmul(rows, w, jnp.array([6, 9]), kernel=kernel, tile=4, expected_rows=expected)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{kernel} {expected}")


def test_segments_walk_only_filled_tiles():
    """The loop's trip count: each group's rows in tiles from its own first row, ceil(n_e / tile) per group;
    never the buffer's tiles past the filled total."""
    sizes = jnp.array([5, 0, 13, 0, 9, 1], jnp.int32)  # 28 rows filled of 1024
    first_row, group_of, _, _, live = segments(sizes, 1024, 8)
    live = int(live)
    assert live == 6  # 1 + 2 + 2 + 1 (tiles aligned to multiples of 8 would take 7: tiles 0..3 + 3 boundaries)
    assert [int(r) for r in first_row[:live]] == [0, 5, 13, 18, 26, 27]
    assert [int(g) for g in group_of[:live]] == [0, 2, 2, 4, 4, 5]
    assert live * 8 <= executed_rows(28, 6, "tiled", 1024, tile=8) == 8 * (4 + 5)
    # a segment running past N is walked from N - tile: the last rows of a full buffer
    first_row, _, _, _, live = segments(jnp.array([3, 6], jnp.int32), 9, 8)
    assert int(live) == 2 and [int(r) for r in first_row[:2]] == [0, 3]
    # the bucketed kernel's overflow walk: each group's first `skip` rows are left out
    first_row, group_of, _, _, live = segments(sizes, 1024, 4, skip=8)
    assert int(live) == 3 and [int(r) for r in first_row[:3]] == [13, 17, 26]  # 5 rows of group 2, 1 of group 4
    assert [int(g) for g in group_of[:3]] == [2, 2, 4]


def test_bucketed_rows_follow_the_balanced_load():
    """The bucketed kernel's executed rows: G buckets of C rows plus the overflow's tiles on a quarter-bucket
    tile; a balanced load (F <= G C) executes G C rows, ~F, where the tiled walk's bound nearly doubles it."""
    assert bucket_rows(128) == 128 and bucket_rows(129) == 136 and bucket_rows(1.5) == 8
    assert overflow_tile(128, 128) == 32 and overflow_tile(8, 128) == 8 and overflow_tile(4096, 128) == 128
    assert executed_rows(1024, 8, "bucketed") == 1024 < executed_rows(1024, 8, "tiled") == 1920
    # a pool 16x the real rows changes nothing: the buckets are sized by the balanced load, not the buffer
    assert executed_rows(1024, 8, "bucketed", buffer_rows=16384) == 1024
    # 8-row buckets for 1,000 rows: 64 bucket rows, the 936 others through 8-row tiles
    assert executed_rows(1000, 8, "bucketed", bucket=8) == 64 + 8 * (117 + 7)


def test_bf16_close_to_fp32():
    rng = np.random.default_rng(0)
    sizes = jnp.array([10, 0, 22], jnp.int32)
    rows = jnp.asarray(rng.normal(size=(48, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
    want = grouped_matmul(rows, w, sizes, kernel="ragged_dot")
    got = grouped_matmul(rows.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, kernel="tiled", tile=8)
    assert got.dtype == jnp.bfloat16 and _rel(got.astype(jnp.float32), want) < 2e-2


def test_kernel_choice():
    assert resolve_kernel("auto", "cpu") == "bucketed" and resolve_kernel("auto", "gpu") == "ragged_dot"
    assert resolve_kernel("ragged_dot", "cpu") == "ragged_dot" and resolve_kernel("pallas", "cpu") == "pallas"
    with pytest.raises(ValueError, match="expected one of"):
        resolve_kernel("dense")


@pytest.mark.slow  # four model compiles; in the fast loop the parity tests run the bucketed kernel (auto on CPU)
def test_moe_model_kernels_equal_ragged_dot():
    """One-device model forward and gradients: kernels tiled, bucketed and pallas (interpreted) == ragged_dot
    (fp32)."""
    from m3jax.tiny import m3_config, m3_model, random_ids
    cfg = m3_config(layers=1, dense_layers=0, full_attention_layers=1, vocab_size=64, hidden_size=32,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=16,
                    num_local_experts=4, num_experts_per_tok=2)
    ids = jnp.asarray(random_ids(cfg, 2, 24))
    out = {}
    for kernel in ("ragged_dot", "tiled", "bucketed", "pallas"):
        model = m3_model(cfg, seed=0, remat=False, moe_kernel=kernel)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits
        out[kernel] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (_, want), want_g = out["ragged_dot"]
    for kernel in ("tiled", "bucketed", "pallas"):
        (_, got), got_g = out[kernel]
        assert _rel(got, want) <= RTOL, kernel
        for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got_g),
                                     jax.tree_util.tree_leaves_with_path(want_g)):
            assert _rel(g, w) <= RTOL, (kernel, jax.tree_util.keystr(path))


def test_config_choices_are_the_kernels():
    import dataclasses

    from rl.config.model_section import ModelSection
    from m3jax.model.expert_tuning import CHOICES
    field = next(f for f in dataclasses.fields(ModelSection) if f.name == "moe_kernel")
    assert tuple(field.metadata["choices"]) == CHOICES and ModelSection().model_options()["moe_kernel"] == "auto"


def test_planner_follows_the_kernel():
    """The 32-node recipe's executed FLOPs and memory: tiled counts the filled rows rounded up to tiles
    (plus its backward's gate/up recompute) where the dense ragged_dot lowering counts the whole pool."""
    import dataclasses

    from m3jax.plan.job import load_job, plan
    from m3jax.plan.flops import Hardware, expert_rows_factor
    recipe = load_job("configs/recipes/m3-32node.yaml", [], "release")
    assert recipe.batch.expert_matmul == "tiled"  # the recipe selects the tiled kernel
    job = dataclasses.replace(recipe, model_options={**recipe.model_options, "moe_kernel": "ragged_dot"})
    tiled = recipe
    assert job.batch.expert_matmul == "dense" and tiled.batch.expert_matmul == "tiled"  # XLA's GPU lowering
    assert 1.0 <= expert_rows_factor(tiled.model, tiled.mesh, tiled.batch) < 1.01
    dense, fast = plan(job, Hardware()), plan(tiled, Hardware())
    ratio = fast["flops"]["executed_total"] / fast["flops"]["model_total"]
    assert ratio < dense["flops"]["executed_total"] / dense["flops"]["model_total"] / 10
    # the head's phase binds both plans (the same head); the MoE layer's phase is where the kernel shows
    from m3jax.config import MOE_MLP, SPARSE_ATTENTION
    from m3jax.plan.activations import layer_phases
    from m3jax.plan.memory import _shard_dims

    def moe_phase(j):
        terms = layer_phases(j.model, j.mesh, SPARSE_ATTENTION, MOE_MLP, j.batch, 2, j.batch.exchange,
                             _shard_dims(j.mesh, None))["mlp"]
        return sum(terms.values())

    assert fast["memory"]["total"] <= dense["memory"]["total"] and moe_phase(tiled) < moe_phase(job)
    # the bucketed kernel plans balanced buckets: its executed rows are the real rows rounded up to 8 per expert
    bucketed = dataclasses.replace(recipe, model_options={**recipe.model_options, "moe_kernel": "bucketed"})
    assert bucketed.batch.expert_matmul == "bucketed"
    assert 1.0 <= expert_rows_factor(bucketed.model, bucketed.mesh, bucketed.batch) < 1.01
    assert moe_phase(bucketed) < moe_phase(job)


def test_pallas_and_mosaic_count_their_row_tiles():
    """Both kernels run a program per row tile that loops over the groups inside it, so each group's partial tile
    costs a whole tile, as the tiled walk's: the planner counts that, not only the real rows."""
    import dataclasses

    from m3jax.plan.job import load_job
    from m3jax.plan.flops import expert_rows_factor
    assert executed_rows(100, 3, "mosaic") == executed_rows(100, 3, "tiled", tile=128) == 128 * 3
    assert executed_rows(100, 3, "pallas", 1024) == executed_rows(100, 3, "tiled", 1024, tile=64) == 64 * 4
    assert executed_rows(20, 2, "pallas", 20) == 32 * 2  # a 20-row buffer: a 32-row block
    recipe = load_job("configs/recipes/m3-32node.yaml", [], "release")
    rows = {}
    for kernel in ("tiled", "pallas", "mosaic"):  # 40 tokens a context shard: partial tiles show
        batch = dataclasses.replace(recipe.batch, moe_kernel=kernel, seq_len=40 * recipe.mesh.context)
        rows[kernel] = expert_rows_factor(recipe.model, recipe.mesh, batch)
    assert rows["mosaic"] == rows["tiled"] > rows["pallas"] > 1.0
