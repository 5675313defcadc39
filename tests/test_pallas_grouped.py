"""The Pallas (Triton backend) grouped matmul, `moe_kernel: pallas` (sharding.pallas_grouped).

No GPU here: values and gradients run in Pallas's interpreter against jax.lax.ragged_dot, the oracle; the
Triton lowering of all three kernels (forward, input and weight gradients) is checked by exporting the
gradient for CUDA, which lowers each kernel to Triton IR without a device. Speed is scripts/gpu_check.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.grouped_matmul import ROWS_BY_GROUP, executed_rows, grouped_matmul
from sharding.pallas_grouped import pallas_grouped_matmul, tile_groups


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


CASES = {
    "empty experts": (64, 32, 48, [5, 0, 30, 0]),
    "one hot expert": (100, 40, 24, [0, 0, 100]),
    "all rows in one group, none padding": (96, 64, 64, [96]),
    "nothing filled": (37, 16, 16, [0, 0, 0]),
    "groups ending inside tiles": (200, 64, 80, [64, 64, 1, 0, 70]),
}


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_ragged_dot(case):
    n, k, o, sizes = CASES[case]
    rng = np.random.default_rng(len(sizes))
    sizes = jnp.asarray(sizes, jnp.int32)
    filled = int(sizes.sum())
    rows = jnp.asarray(rng.normal(size=(n, k)), jnp.float32).at[filled:].set(0)  # padding rows
    weights = jnp.asarray(rng.normal(size=(len(sizes), o, k)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(n, o)), jnp.float32)

    def run(f):
        loss = lambda r, w: jnp.sum(f(r, w) * cot)  # noqa: E731
        return jax.jit(f)(rows, weights), jax.jit(jax.grad(loss, argnums=(0, 1)))(rows, weights)

    got, (d_rows, d_w) = run(lambda r, w: pallas_grouped_matmul(r, w, sizes, block=16))
    want, (want_rows, want_w) = run(lambda r, w: jax.lax.ragged_dot_general(r, w, sizes, ROWS_BY_GROUP))
    assert not np.any(np.asarray(got)[filled:]) and not np.any(np.asarray(d_rows)[filled:])
    if filled:
        assert _rel(got, want) < 1e-5 and _rel(d_rows, want_rows) < 1e-5 and _rel(d_w, want_w) < 1e-5
    else:
        assert not np.any(np.asarray(got)) and not np.any(np.asarray(d_w))
    # an expert without rows gets no weight gradient
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(d_w[g]))


def test_the_moe_kernel_option_runs_it():
    rng = np.random.default_rng(0)
    rows, weights = jnp.asarray(rng.normal(size=(40, 32)), jnp.float32), jnp.asarray(rng.normal(size=(3, 16, 32)), jnp.float32)
    sizes = jnp.asarray([10, 0, 20], jnp.int32)
    assert _rel(grouped_matmul(rows, weights, sizes, kernel="pallas"),
                grouped_matmul(rows, weights, sizes, kernel="ragged_dot")) < 1e-5


def test_work_follows_the_filled_rows():
    """Each row tile loops over the groups overlapping it; tiles past the filled rows over none: at most
    ceil(F / bm) + G - 1 (tile, group) matmul programs per output tile, whatever the buffer's size."""
    bm, n = 16, 16 * 40
    for sizes in ([5, 0, 30, 0], [64, 64, 1, 0, 70], [0, 0, 100], [16, 16, 16]):
        sizes = np.asarray(sizes, np.int32)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        first, stop = map(np.asarray, tile_groups(jnp.asarray(starts), jnp.asarray(ends), n, bm))
        pairs = [(t, g) for t in range(n // bm) for g in range(first[t], stop[t]) if sizes[g]]
        filled = int(sizes.sum())
        assert all(t * bm < filled for t, _ in pairs)  # no tile past the filled rows multiplies
        for t in range(n // bm):  # every row of a tile is covered by the groups it loops over
            rows = range(t * bm, min((t + 1) * bm, filled))
            assert all(any(starts[g] <= r < ends[g] for g in range(first[t], stop[t])) for r in rows)
        assert len(pairs) * bm <= executed_rows(filled, len(sizes), "tiled", n, tile=bm)


def test_the_kernels_lower_to_triton_for_cuda(monkeypatch):
    """Exported for CUDA (no device needed): forward, input gradient and weight gradient each become a Triton
    kernel; a lowering rule Pallas's Triton backend lacks would fail here. Each Triton module is also run through
    MLIR's verifier, which XLA's GPU compiler runs when it parses the kernel: an scf.for with bounds of two integer
    types passed the export and failed only there (compiled for an H200 without a GPU, session 25)."""
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    verified = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError, naming the op, on an invalid kernel
        verified.append(True)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    n, k, o = 512, 256, 192
    rows, weights = jnp.zeros((n, k), jnp.bfloat16), jnp.zeros((4, o, k), jnp.bfloat16)
    sizes, cot = jnp.asarray([100, 0, 200, 50], jnp.int32), jnp.zeros((n, o), jnp.bfloat16)

    def f(rows, weights, sizes):
        def loss(r, w):
            return jnp.sum((pallas_grouped_matmul(r, w, sizes, interpret=False) * cot).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1))(rows, weights)

    exported = export.export(jax.jit(f), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    text = exported(rows, weights, sizes).mlir_module()
    names = sorted(line.split('name = "')[1].split('"')[0] for line in text.splitlines()
                   if "xla.gpu.triton" in line and 'name = "' in line)
    assert names == ["grouped_rows", "grouped_rows", "grouped_weights"], names
    assert len(verified) == 3


def test_the_planner_plans_it_as_a_grouped_gemm():
    """Real rows (tiles past the filled ones multiply nothing), the expert hidden held as under ragged_dot."""
    from m3jax.plan.memory import Batch
    assert Batch(micro_batch=1, seq_len=64, moe_kernel="pallas").expert_matmul == "grouped"
    assert Batch(micro_batch=1, seq_len=64, moe_kernel="tiled").expert_matmul == "tiled"


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 2, 2, 2)])
def test_inside_the_expert_parallel_shard_map_it_lowers_for_cuda_and_refuses_the_interpreter(shape, monkeypatch):
    """Experts over 2 axes (and, with a tensor axis, width-sharded weights against replicated rows): the
    model's MoE gradient exported for CUDA lowers every kernel to Triton; on CPU, where only the interpreter
    could run it, the same program is refused with one clear error."""
    from jax import export

    import sharding.pallas_grouped as pg
    from m3jax.model.moe import moe_block
    from sharding.mesh import MeshConfig, build_mesh
    from tests.test_expert_parallel import CFG, params

    layout = build_mesh(MeshConfig(*shape), CFG)
    p, x = params(), jnp.zeros((8, 16, CFG.hidden_size))
    grad = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(moe_block(p, x, CFG, layout, None, "padded", "pallas") ** 2),
                                      argnums=(0, 1)))
    with pytest.raises(ValueError, match="moe_kernel=pallas off a GPU"):
        grad(p, x)
    real = pg.pallas_grouped_matmul
    monkeypatch.setattr(pg, "pallas_grouped_matmul", lambda *a, **k: real(*a, **{**k, "interpret": False}))
    exported = export.export(grad, platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(p, x)
    assert exported.mlir_module().count("xla.gpu.triton") == 6  # gate_up and down: forward, d rows, d W


def test_lowers_at_m3_widths():
    """The block choice at the release's widths (d 6144, expert intermediate 3072, 8 local experts, 4096 rows):
    every dimension a multiple of its block, so no operand is padded (a copy of the weights per call)."""
    from jax import export
    rows = jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16)
    up, down = jax.ShapeDtypeStruct((8, 3072, 6144), jnp.bfloat16), jax.ShapeDtypeStruct((8, 6144, 3072), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def f(rows, up, down, sizes):
        def loss(r, u, dn):
            h = pallas_grouped_matmul(r, u, sizes, interpret=False)
            return jnp.sum(pallas_grouped_matmul(h, dn, sizes, interpret=False).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(rows, up, down)

    text = export.export(jax.jit(f), platforms=("cuda",),
                         disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        rows, up, down, sizes).mlir_module()
    assert text.count("xla.gpu.triton") == 6 and "stablehlo.pad" not in text
