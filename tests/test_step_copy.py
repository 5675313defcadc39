"""`mesh.fsdp_step_axes`: a step gathers the weights over those FSDP axes once, into a copy every micro-batch reads.

On the 32-node recipe the data axis crosses nodes: without the copy each of a step's 32 micro-batches gathers
every non-expert weight over InfiniBand, twice (forward and the rematerialised backward). The tests here check
that the copy changes where the gathers run and nothing else: the update equals one device's, the compiled
micro-batch loop gathers over context only (the same program without the copy gathers over data in it), and the
logprob pass reads the copy too.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import m3jax
from sharding import precision
from sharding.hlo_collectives import collectives, first_group
from sharding.layout import Layout
from sharding.mesh import MeshConfig, MeshError, build_mesh, mesh_config_of, validate
from sharding.rules import RULES, rules_for, without_axes
from sharding.train_step import init_state, make_train_step, state_shardings, step_copy_shardings
from tests import reference as ref
from tests.test_train_step import make_batch, ragged_batch

# data 2 x context 4; experts over both; FSDP over (context, data), data gathered once per step
HPZ = MeshConfig(2, 4, 1, 1, expert_axes=("data", "context"), fsdp_axes=("context", "data"), fsdp_step_axes=("data",))
PLAIN = MeshConfig(2, 4, 1, 1, expert_axes=("data", "context"), fsdp_axes=("context", "data"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = ref.build_model(ref.tiny_config("release_like"), seed=5)
    return ref.save(hf, str(tmp_path_factory.mktemp("ckpt")), "native")


def test_the_copy_drops_the_step_axes_from_the_weights_only():
    rules = rules_for(("data", "context"), ("context", "data"))
    copy = dict(without_axes(rules, ("data",)))
    assert copy["embed"] == "context"  # the FSDP row loses data, every other row stays:
    assert copy["experts"] == ("data", "context")  # tokens travel to the experts,
    assert copy["table_vocab"] == ("data", "tensor")  # a lookup reads its own rows of the table,
    assert copy["act_batch"] == dict(RULES)["act_batch"]  # and activations are not weights
    layout = build_mesh(HPZ)
    assert layout.fsdp_step_axes == ("data",) and mesh_config_of(layout) == HPZ
    assert dict(layout.step_copy().rules)["embed"] == "context"
    assert build_mesh(PLAIN).step_copy() is None
    assert build_mesh(MeshConfig(1, 8, 1, 1, fsdp_axes=("context", "data"), fsdp_step_axes=("data",))).step_copy() \
        is None  # data has one device: nothing to gather once
    assert Layout().step_copy() is None


@pytest.mark.parametrize("fsdp, step", [(("data",), ("data",)), (("data", "context"), ("data",)),
                                        (("context", "data"), ("data", "data"))])
def test_step_axes_must_be_a_proper_tail_of_the_fsdp_axes(fsdp, step):
    with pytest.raises(MeshError, match=r"mesh.fsdp_step_axes = .*expected a proper tail of mesh.fsdp_axes"):
        validate(MeshConfig(2, 4, 1, 1, fsdp_axes=fsdp, fsdp_step_axes=step))


def test_the_hlo_reader_spells_groups_all_three_ways():
    mesh = build_mesh(PLAIN).mesh  # device id = 4 x data + context
    assert first_group("x = f32[8] all-gather(y), replica_groups={{0,4},{1,5}}") == [0, 4]
    assert first_group("x = f32[8] all-gather(y), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}") == [0, 4]
    line = ("x = f32[8] all-gather(y), replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=8], "
            "device_ids=([2,4]T(1,0)) {'axis_2'}, dimensions={0}")
    assert first_group(line) == [0, 4, 1, 5, 2, 6, 3, 7]
    from sharding.hlo_collectives import group_axes
    assert group_axes([0, 4], mesh) == ("data",) and group_axes([0, 1, 2, 3], mesh) == ("context",)


def _sgd_step_on(mesh_cfg, ckpt, batch, widths=()):
    """(update of the params, metrics, compiled HLO of the scan step or None) of one SGD step on mesh_cfg."""
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    layout = build_mesh(mesh_cfg, seq_len=np.shape(batch["input_ids"])[-1], batch=np.shape(batch["input_ids"])[1])
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32, mesh=layout)
    graphdef, state = init_state(model, opt)
    shardings = state_shardings(layout, state)
    state = jax.device_put(state, shardings)
    before = jax.tree.map(np.asarray, state.params)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings, donate=False, widths=widths)
    hlo = None
    if not widths:
        placed = {k: jax.device_put(v, jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(
            None, ("data", "expert"), "context"))) for k, v in batch.items()}
        with jax.set_mesh(layout.mesh):
            hlo = collectives(step.jitted.lower(state, placed).compile().as_text(), layout.mesh)
    new, metrics = step(state, batch)
    return jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before), metrics, hlo


def _single_device_update(ckpt, batch):
    opt = precision.with_master_weights(optax.sgd(1.0), "none")
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    graphdef, state = init_state(model, opt)
    before = jax.tree.map(np.asarray, state.params)
    new, metrics = make_train_step(graphdef, opt, donate=False)(state, batch)
    return jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before), metrics


def _assert_same_update(got, want):
    (du, m), (dw, w) = got[:2], want[:2]
    assert abs(float(m["loss"]) - float(w["loss"])) <= 1e-6 * abs(float(w["loss"]))
    for a, b in zip(jax.tree.leaves(du), jax.tree.leaves(dw), strict=True):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30)


def test_micro_batches_read_one_copy_gathered_once_and_make_the_single_device_update(ckpt):
    cfg = m3jax.from_pretrained(ckpt).cfg
    batch = make_batch(cfg, 2, 4, seq=64, seed=7)
    got = _sgd_step_on(HPZ, ckpt, batch)
    _assert_same_update(got, _single_device_update(ckpt, batch))
    plain = _sgd_step_on(PLAIN, ckpt, batch)

    def gathers(hlo):
        return collections.Counter((c.in_loop, c.axes) for c in hlo if c.op == "all-gather")

    with_copy, without = gathers(got[2]), gathers(plain[2])
    # without the copy, the loops gather weights over the data axis (alone or with context) ...
    assert sum(n for (loop, axes), n in without.items() if loop and "data" in axes) > 0, without
    # ... with it, no loop does; the step's one gather over data is outside them
    assert not [k for k in with_copy if k[0] and "data" in k[1]], with_copy
    # gradients still reach the state's shards: the reductions over data are there
    assert any("data" in c.axes for c in got[2] if c.op in ("all-reduce", "reduce-scatter"))


@pytest.mark.extended  # the default run's cut-width check with the copy: tests/test_recipe_miniature.py (the recipe's
@pytest.mark.slow  # widths and step copy on data 2 x context 4, resumed bit for bit); one compile per width here
def test_cut_micro_batches_read_the_copy_and_make_the_single_device_update(ckpt):
    cfg = m3jax.from_pretrained(ckpt).cfg
    batch = ragged_batch(cfg)
    got = _sgd_step_on(HPZ, ckpt, batch, widths=(16, 32))
    _assert_same_update(got, _single_device_update(ckpt, batch))


def test_the_logprob_pass_reads_the_copy(ckpt, monkeypatch):
    import rl.logprobs
    from rl.generation.base import SamplingParams
    from rl.logprobs import make_logprob_pass

    copies = []

    def spy(copy_shardings):  # the pass's copy, as `sharding.train_step.step_copier` makes it
        copy = real(copy_shardings)
        return lambda params: copies.append(copy(params)) or copies[-1]

    real = rl.logprobs.step_copier
    monkeypatch.setattr(rl.logprobs, "step_copier", spy)
    layout = build_mesh(HPZ, seq_len=64, batch=4)
    model = m3jax.from_pretrained(ckpt, dtype=jnp.float32, mesh=layout)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    batch = make_batch(model.cfg, 2, 4, seq=64, seed=3)
    batch = {"input_ids": batch["input_ids"], "targets": batch["targets"],
             "attention_mask": jnp.ones_like(batch["input_ids"])}
    sampling = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=1)
    got = np.asarray(make_logprob_pass(nnx.graphdef(model), sampling, layout)(params, rest, batch))
    one = m3jax.from_pretrained(ckpt, dtype=jnp.float32)
    want = np.asarray(make_logprob_pass(nnx.graphdef(one), sampling, Layout())(*nnx.split(one, nnx.Param, ...)[1:],
                                                                                batch))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(copies) == 2  # one per pass (the one-device pass's copy is its params)
    copy = copies[0]  # every weight placed as the step copy places it
    want_sh = step_copy_shardings(layout, params)
    for leaf, sh in zip(jax.tree.leaves(copy), jax.tree.leaves(want_sh), strict=True):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    assert model.stacks[0].q_proj[...].sharding.spec[-1] == ("context", "data")  # the state's stay cut over both
