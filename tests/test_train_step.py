"""Precision modes, micro-batching, non-finite skips and sharded equality of the train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import m3jax
from sharding import optim_step, precision
from sharding.mesh import MeshConfig, build_mesh
from sharding.train_step import init_state, make_train_step, state_shardings, token_cross_entropy
from tests import reference as ref


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = ref.build_model(ref.tiny_config("release_like"), seed=5)
    return ref.save(hf, str(tmp_path_factory.mktemp("ckpt")), "native")


def make_batch(cfg, micro: int, per_micro: int, seq: int = 40, seed: int = 0):
    ids = ref.random_ids(cfg, micro * per_micro, seq + 1, seed=seed).reshape(micro, per_micro, seq + 1)
    mask = np.ones((micro, per_micro, seq), np.float32)
    mask[..., : seq // 4] = 0  # prompt tokens carry no loss
    mask[0, 0, seq // 2:] = 0  # uneven token counts across micro-batches
    return {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.asarray(mask)}


# jitted: one compile per state layout (eagerly, every op compiles again for each parameter shape and dtype)
master_of = jax.jit(precision.master_of)
params_from_master = jax.jit(precision.params_from_master)


def committed_state(model, opt):
    """init_state, with the state committed to one device as every step's output is (an uncommitted first
    state would make the step compile a second time at step 2)."""
    graphdef, state = init_state(model, opt)
    return graphdef, jax.device_put(state, jax.devices()[0])


def bits(tree):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def assert_bitwise(a, b):
    for x, y in zip(bits(a), bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_to_bf16_and_remainder_reconstruct_every_fp32_exactly():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
                        # exact halfway values, both signs: the case round-to-nearest-even cannot encode
                        (np.arange(1, 5000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
                        -(np.arange(1, 5000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)])
    x = jnp.asarray(x)
    p = precision.to_bf16(x)
    np.testing.assert_array_equal(np.asarray(precision.join(p, precision.remainder(x, p))).view(np.uint32),
                                  np.asarray(x).view(np.uint32))
    nearest = np.abs(np.asarray(p, np.float32) - np.asarray(x)) <= \
        np.abs(np.asarray(x.astype(jnp.bfloat16), np.float32) - np.asarray(x)) * (1 + 1e-7)
    assert nearest.all()  # always a nearest bf16; only ties may differ from astype


def test_load_dtype_follows_the_optimizer():
    assert precision.param_dtype("fp32") == precision.param_dtype("compact") == jnp.bfloat16
    assert precision.param_dtype("none") == jnp.float32
    with pytest.raises(ValueError, match="'fp16'"):
        precision.param_dtype("fp16")


def test_fp32_master_keeps_small_updates_that_pure_bf16_loses():
    """1000 SGD steps of -1e-4 on a weight of 1.0: bf16 alone never moves, the master tracks fp32."""
    grads = {"w": jnp.full((64,), 1.0, jnp.bfloat16)}

    def run(opt, params):
        state = opt.init(params)
        for _ in range(1000):
            upd, state = opt.update(jax.tree.map(lambda g: g.astype(params["w"].dtype), grads), state, params)
            params = precision.apply(params, upd, state)
        return params, state

    sgd = optax.sgd(1e-4)
    pure16, _ = run(precision.with_master_weights(sgd, "none"), {"w": jnp.ones(64, jnp.bfloat16)})
    fp32, _ = run(precision.with_master_weights(sgd, "none"), {"w": jnp.ones(64, jnp.float32)})
    master, state = run(precision.with_master_weights(sgd, "fp32"), {"w": jnp.ones(64, jnp.bfloat16)})
    compact, cstate = run(precision.with_master_weights(sgd, "compact"), {"w": jnp.ones(64, jnp.bfloat16)})
    assert np.all(np.asarray(pure16["w"], np.float32) == 1.0)  # every update rounded away
    np.testing.assert_allclose(np.asarray(fp32["w"]), 0.9, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(state.master["w"]), np.asarray(fp32["w"]))
    assert_bitwise(master, jax.tree.map(precision.to_bf16, fp32))
    assert_bitwise(compact, master)
    assert_bitwise(precision.master_of(compact, cstate), state.master)


@pytest.mark.slow  # 24 steps, 2 compiles; the fast loop checks compact == fp32 master in the tests above and below
# bf16 moments (the recipe's) in the suite; fp32 moments with -m extended
@pytest.mark.parametrize("moments", [pytest.param(jnp.float32, marks=pytest.mark.extended), jnp.bfloat16])
def test_master_invariant_and_compact_equals_fp32_master_over_many_steps(ckpt, moments):
    model = m3jax.from_pretrained(ckpt, dtype=jnp.bfloat16)
    runs = {}
    for mode in ("fp32", "compact"):
        opt = optim_step.adamw(3e-3, weight_decay=0.1, moment_dtype=moments, master=mode)
        graphdef, state = committed_state(model, opt)
        step = make_train_step(graphdef, opt, donate=False)
        for i in range(12):
            state, metrics = step(state, make_batch(model.cfg, 2, 2, seed=i))
            master = master_of(state.params, state.opt_state)
            assert_bitwise(state.params, params_from_master(master, state.params))  # == bf16(master)
            assert not bool(metrics["skipped"])
        runs[mode] = state
    assert_bitwise(runs["compact"].params, runs["fp32"].params)
    assert_bitwise(master_of(runs["compact"].params, runs["compact"].opt_state),
                   runs["fp32"].opt_state.master)


@pytest.mark.slow  # compiles a step per micro-batch count; the fast loop's step checks are the sliced and master tests
def test_micro_batches_equal_one_whole_batch(ckpt):
    """k micro-batches of uneven token counts give the step of the whole batch (SGD: the update is the
    gradient itself, so this compares gradients normalised by the global token count)."""
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    batch4 = make_batch(model.cfg, 4, 2, seed=1)
    whole = jax.tree.map(lambda x: x.reshape(1, -1, *x.shape[2:]), batch4)
    out = {}
    for name, batch in (("micro", batch4), ("whole", whole)):
        graphdef, state = init_state(model, opt)
        before = jax.tree.map(np.asarray, state.params)
        state, metrics = make_train_step(graphdef, opt, donate=False)(state, batch)
        out[name] = (jax.tree.map(lambda new, old: np.asarray(new) - old, state.params, before), metrics)
    assert float(out["micro"][1]["tokens"]) == float(out["whole"][1]["tokens"]) == float(batch4["loss_mask"].sum())
    loss_micro, loss_whole = float(out["micro"][1]["loss"]), float(out["whole"][1]["loss"])
    assert abs(loss_micro - loss_whole) < 1e-6 * abs(loss_whole)
    # A mean of micro-batch means would be off by far more than summation order (batch has uneven counts).
    for a, b in zip(jax.tree.leaves(out["micro"][0]), jax.tree.leaves(out["whole"][0])):
        scale = np.max(np.abs(b))
        assert np.max(np.abs(a - b)) <= 1e-5 * scale


@pytest.mark.slow  # three step compiles (finite, nan, inf)
def test_non_finite_step_is_skipped_and_state_untouched(ckpt):
    model = m3jax.from_pretrained(ckpt, dtype=jnp.bfloat16)
    opt = optim_step.adamw(1e-3, moment_dtype=jnp.bfloat16, master="compact")

    def poisoned(model, batch):
        loss, aux = token_cross_entropy(model, batch)
        return loss * batch["scale"][0, 0], aux

    graphdef, state = committed_state(model, opt)
    step = make_train_step(graphdef, opt, poisoned, donate=False)
    batch = make_batch(model.cfg, 2, 2)
    state, _ = step(state, {**batch, "scale": jnp.ones((2, 2, 40))})
    before = jax.tree.map(np.asarray, state)
    state, metrics = step(state, {**batch, "scale": jnp.full((2, 2, 40), jnp.nan, jnp.float32)})
    assert bool(metrics["skipped"]) and int(state.skipped) == 1 and int(state.step) == 2
    assert_bitwise((state.params, state.opt_state, state.rest), (before.params, before.opt_state, before.rest))
    state, metrics = step(state, {**batch, "scale": jnp.ones((2, 2, 40))})
    assert not bool(metrics["skipped"]) and int(state.skipped) == 1


@pytest.mark.slow  # the fast loop's sharded checks: tests/test_sharding.py (gradients), tests/test_layout.py (lowering)
def test_sharded_train_step_equals_single_device(ckpt):
    """The jitted step with explicit shardings and donation on a (2,2,2,1) mesh makes the single-device
    step's update (SGD, so the update is the normalised gradient; Adam would amplify float noise in
    near-zero gradients into lr-sized differences)."""
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    ref_model = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    batch = make_batch(ref_model.cfg, 2, 4, seq=64, seed=7)
    before = jax.tree.map(np.asarray, nnx.state(ref_model, nnx.Param))
    graphdef, state = init_state(ref_model, opt)
    want, want_metrics = make_train_step(graphdef, opt, donate=False)(state, batch)

    layout = build_mesh(MeshConfig(2, 2, 2, 1), ref_model.cfg, seq_len=64, batch=4)
    mesh = layout.mesh
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32, mesh=layout)
    graphdef, state = init_state(model, opt)
    shardings = state_shardings(layout, state)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings)
    got, metrics = step(jax.device_put(state, shardings), batch)
    assert abs(float(metrics["loss"]) - float(want_metrics["loss"])) < 1e-6 * float(want_metrics["loss"])
    for a, b, p in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), jax.tree.leaves(before)):
        da, db = np.asarray(a) - p, np.asarray(b) - p
        assert np.max(np.abs(da - db)) <= 1e-5 * max(np.max(np.abs(db)), 1e-30)
    experts = got.params["stacks"][1]["experts_gate_up"][...]
    assert all(s.data.shape[1] == experts.shape[1] // 8 for s in experts.addressable_shards)


def assert_within_ulps(a, b, ulps: int):
    """Every float leaf of a within `ulps` units in the last place (of its dtype) of the leaf's largest
    magnitude from b (values that are sums of cancelling updates carry their terms' rounding); others equal."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(x, y)
            continue
        eps = float(jnp.finfo(x.dtype).eps)
        x32, y32 = x.astype(np.float32), y.astype(np.float32)
        tol = ulps * eps * max(float(np.max(np.abs(y32), initial=0.0)), float(np.finfo(np.float32).tiny))
        assert np.all(np.abs(x32 - y32) <= tol), (x.dtype, float(np.max(np.abs(x32 - y32) - tol)))


# The fast loop runs the recipe's mode (compact master, bf16 moments); the other modes are slow.
@pytest.mark.parametrize("mode,moments,groups", [pytest.param("none", jnp.float32, False, marks=pytest.mark.slow),
                                                 pytest.param("fp32", jnp.bfloat16, False, marks=pytest.mark.slow),
                                                 ("compact", jnp.bfloat16, False), ("compact", jnp.bfloat16, True),
                                                 pytest.param("compact", jnp.float32, True, marks=pytest.mark.slow)])
def test_sliced_in_place_step_equals_the_whole_tree_update(mode, moments, groups, monkeypatch):
    """adamw's `step` (what make_train_step runs: each stacked leaf updated layer slice by layer slice,
    in place) makes the optax update of the whole tree, through clipping (one global norm, or with
    `groups` the router clipped by its own norm, as the model's indexer is), a schedule and a skipped
    step. Equal up to float rounding, not bitwise: XLA:CPU compiles the slice's fused arithmetic into other
    kernels, whose division or square root differs in the last bit now and then."""
    from sharding import optim_step
    monkeypatch.setattr(optim_step, "SLICE_MIN_ELEMS", 64)  # slice the stacked leaves, not the small ones
    low = precision.param_dtype(mode)
    keys = iter(jax.random.split(jax.random.key(0), 16))
    stacked = lambda x: nnx.Param(x, logical_axes=("layers", None, None))  # noqa: E731
    params = nnx.State({"stack": {"w": stacked(jax.random.normal(next(keys), (3, 8, 16)).astype(low)),
                                  "router": stacked(jax.random.normal(next(keys), (3, 4, 16)))},  # fp32-kept
                        "head": nnx.Param(jax.random.normal(next(keys), (16, 8)).astype(low),
                                          logical_axes=("vocab", None)),  # rows: never looped over
                        "norm": nnx.Param(jnp.zeros((3,), low), logical_axes=("norm",))})
    # the stacked router is left out of weight decay (as the model's mask leaves out the indexer): the
    # sliced step picks each leaf's decay as the whole-tree update does
    no_decay = nnx.State({"stack": {"w": True, "router": False}, "head": True, "norm": True})
    opt = optim_step.adamw(optax.linear_schedule(1e-2, 3e-2, 4), weight_decay=0.1, clip_norm=0.5,
                          moment_dtype=moments, master=mode, decay_mask=no_decay,
                          clip_mask=no_decay if groups else None)
    total = jnp.float32(7.0)

    @jax.jit
    def whole(params, state, grads, keep):
        updates, new_state = opt.update(jax.tree.map(lambda g: g / total, grads), state, params)
        new = (precision.apply(params, updates, new_state), new_state)
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, (params, state))

    steps = [(jax.tree.map(lambda x, k=next(keys): jax.random.normal(k, x.shape), params), keep)
             for keep in (True, False, True, True)]
    sliced = jax.jit(lambda p, s, g, k: opt.step(g, total, s, p, k))
    jaxpr = str(jax.make_jaxpr(sliced)(params, opt.init(params), steps[0][0], True))
    assert jaxpr.count("scan[") == 2  # the two layer stacks loop; the head and the norm do not
    runs = []
    for fn in (sliced, whole):
        p, state = params, opt.init(params)
        for grads, keep in steps:
            before = (p, state)
            p, state = fn(p, state, grads, jnp.asarray(keep))
            if not keep:
                assert_bitwise((p, state), before)
        runs.append((p, state))
    (p1, s1), (p2, s2) = runs
    assert_within_ulps(precision.master_of(p1, s1), precision.master_of(p2, s2), 4)
    assert_within_ulps(s1.inner, s2.inner, 4)
    assert_within_ulps(p1, p2, 1)
    np.testing.assert_array_equal(np.asarray(s1.inner[1].count), 3)  # three kept steps


def ragged_batch(cfg, seq: int = 64, seed: int = 3):
    """2 micro-batches x 4 rows of real lengths 12..64 (right padding): attention_mask marks each row's real
    inputs, the loss its last three quarters."""
    batch = make_batch(cfg, 2, 4, seq=seq, seed=seed)
    lengths = np.array([[12, 16, 9, 14], [64, 30, 20, 41]])
    real = (np.arange(seq) < lengths[..., None]).astype(np.int32)
    loss = real * (np.arange(seq) >= lengths[..., None] // 4)
    return {**batch, "attention_mask": jnp.asarray(real), "loss_mask": jnp.asarray(loss, jnp.float32)}


@pytest.mark.extended  # the default run's check of cut widths against one device: tests/test_context_parallel_run.py
@pytest.mark.slow  # two step compiles per width (the fast loop checks the cutting itself: tests/test_phases.py)
def test_cut_micro_batches_make_the_full_width_step(ckpt):
    """widths=(16, 32, 48): micro-batch 0 (rows <= 16 positions) runs at 16, micro-batch 1 (one row of 64) at the
    full 64; the update equals the full-width scan's up to the sums' order (SGD: the update is the gradient)."""
    from sharding.widths import micro_widths

    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    batch = ragged_batch(model.cfg)
    assert micro_widths(np.asarray(batch["attention_mask"]), (16, 32, 48)) == [16, 64]
    out = []
    for widths in ((), (16, 32, 48)):
        graphdef, state = init_state(model, opt)
        before = jax.tree.map(np.asarray, state.params)
        state, metrics = make_train_step(graphdef, opt, donate=False, widths=widths)(state, batch)
        out.append((jax.tree.map(lambda new, old: np.asarray(new) - old, state.params, before), metrics))
    (want, want_m), (got, got_m) = out
    assert float(got_m["tokens"]) == float(want_m["tokens"]) == float(np.sum(batch["loss_mask"]))
    assert abs(float(got_m["loss"]) - float(want_m["loss"])) <= 1e-6 * abs(float(want_m["loss"]))
    assert abs(float(got_m["grad_norm"]) - float(want_m["grad_norm"])) <= 1e-6 * float(want_m["grad_norm"])
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.max(np.abs(a - w)) <= 1e-5 * max(np.max(np.abs(w)), 1e-30)


@pytest.mark.extended  # the default run's mesh check of the cut path: tests/test_context_parallel_run.py (a trainer
@pytest.mark.slow  # run on data 4 x context 2 against one device); this one compiles the cut step on (2,2,2,1)
def test_cut_micro_batches_on_a_mesh_make_the_single_device_step(ckpt):
    """Context 2 x blocks of 8: widths are multiples of 16; micro-batch 0 runs at 16 positions, 1 at 64."""
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    ref_model = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    batch = ragged_batch(ref_model.cfg)
    before = jax.tree.map(np.asarray, nnx.state(ref_model, nnx.Param))
    graphdef, state = init_state(ref_model, opt)
    want, want_metrics = make_train_step(graphdef, opt, donate=False)(state, batch)

    layout = build_mesh(MeshConfig(2, 2, 2, 1), ref_model.cfg, seq_len=64, batch=4)
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32, mesh=layout)
    graphdef, state = init_state(model, opt)
    shardings = state_shardings(layout, state)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings, widths=(16, 32))
    got, metrics = step(jax.device_put(state, shardings), batch)
    assert abs(float(metrics["loss"]) - float(want_metrics["loss"])) < 1e-6 * abs(float(want_metrics["loss"]))
    for a, b, p in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), jax.tree.leaves(before)):
        da, db = np.asarray(a) - p, np.asarray(b) - p
        assert np.max(np.abs(da - db)) <= 1e-5 * max(np.max(np.abs(db)), 1e-30)
    experts = got.params["stacks"][1]["experts_gate_up"][...]
    assert all(s.data.shape[1] == experts.shape[1] // 8 for s in experts.addressable_shards)
