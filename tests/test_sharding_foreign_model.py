"""sharding/ with a model that is not M3 (README: "model-agnostic"): its own logical axis names through
MeshConfig.extra_rules, a plain optax optimizer, and one clear error for each way its annotations can be wrong
(an audit drove a foreign model through the package: a crash, a bare KeyError and a silent misplacement)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sharding.mesh import MeshConfig, MeshError, build_mesh
from sharding.train_step import init_state, make_train_step, state_shardings

V, D, H = 32, 16, 24
HIDDEN = (("hidden", "tensor"),)  # the model's own logical name, not in m3jax's table


@dataclasses.dataclass
class Spec:
    shape: tuple
    axes: tuple


SPECS = {"embed": Spec((V, D), ("table_vocab", "embed")), "w_in": Spec((D, H), ("embed", "hidden")),
         "w_out": Spec((H, D), ("hidden", "embed")), "head": Spec((V, D), ("vocab", "embed"))}


class Described:  # sharding.mesh.ShardedModel
    def __init__(self, specs=SPECS):
        self.specs = specs

    def param_specs(self):
        return self.specs

    def mesh_fields(self):
        return []


class MLP(nnx.Module):
    def __init__(self, specs=SPECS, seed=0):
        for key, (name, s) in zip(jax.random.split(jax.random.key(seed), len(specs)), specs.items()):
            setattr(self, name, nnx.Param(0.3 * jax.random.normal(key, s.shape), logical_axes=s.axes))

    def __call__(self, ids, attention_mask=None):
        x = self.embed[...][ids]
        x = x + jax.nn.gelu(x @ self.w_in[...]) @ self.w_out[...]
        return x @ self.head[...].T


def batch():
    ids = np.random.default_rng(0).integers(0, V, (2, 4, 9))
    return {"input_ids": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:]),
            "loss_mask": jnp.ones((2, 4, 8), jnp.float32)}


def test_a_foreign_model_with_its_own_axis_names_trains_sharded_as_on_one_device():
    """Its names added by MeshConfig.extra_rules (the table held m3jax's only), a plain optax optimizer (the step read
    `opt_state.master` of optax's tuple: AttributeError), the step equal to plain jax + optax on one device."""
    mesh = MeshConfig(data=2, tensor=4, extra_rules=HIDDEN)
    layout = build_mesh(mesh, Described())
    opt = optax.adam(1e-2)
    graphdef, state = init_state(MLP(), opt)
    shardings = state_shardings(layout, state)
    assert shardings.params["w_in"].spec == jax.sharding.PartitionSpec("data", "tensor")
    state = jax.device_put(state, shardings)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings, donate=False)
    new, metrics = step(state, batch())

    model, b = MLP(), batch()
    _, params = nnx.split(model, nnx.Param)

    def loss(p):
        m = nnx.merge(nnx.graphdef(model), p)
        logp = jax.nn.log_softmax(m(b["input_ids"]), -1)
        return -jnp.take_along_axis(logp, b["targets"][..., None], -1).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    want = optax.apply_updates(params, updates)
    np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-6)
    for name in SPECS:
        np.testing.assert_allclose(np.asarray(new.params[name][...]), np.asarray(want[name][...]), rtol=1e-5,
                                   atol=1e-7, err_msg=name)


def test_a_parameter_without_logical_axes_is_named():
    """nnx.Linear's kernel carries no logical axes: a bare KeyError('logical_axes') named no variable."""
    class Plain(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(D, H, rngs=nnx.Rngs(0))
    _, state = init_state(Plain(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"parameter proj/(kernel|bias) Param\((16, 24|24,)\) has no logical_axes: declare it "
                                         r"nnx.Param\(value, logical_axes="):
        state_shardings(build_mesh(MeshConfig(data=8)), state)


def test_a_parameter_with_fewer_axis_names_than_dimensions_is_refused():
    """A stacked weight whose "layers" name was forgotten: its layer axis was cut over data and its embedding over
    tensor, silently (jax takes a short spec as replicated trailing dimensions)."""
    short = {**SPECS, "w_in": Spec((2, D, H), ("embed", "hidden"))}
    mesh = MeshConfig(data=2, tensor=2, expert=2, extra_rules=HIDDEN)
    with pytest.raises(MeshError, match=r"parameter w_in of shape \(2, 16, 24\) names 2 logical axes "
                                        r"\('embed', 'hidden'\): expected one per dimension"):
        build_mesh(mesh, Described(short))
    _, state = init_state(MLP(short), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"w_in of shape \(2, 16, 24\) names 2 logical axes"):
        state_shardings(build_mesh(mesh), state)


@pytest.mark.parametrize("rows, said", [
    ((("hidden", "model"),), r"target 'model' is not a mesh axis"),
    ((("embed", "tensor"),), r"logical axis 'embed' has a row in the rules table already"),
    ((("hidden",),), r"expected \(logical axis name, mesh axes\)"),
])
def test_a_wrong_rules_row_is_one_error_before_any_sharding(rows, said):
    with pytest.raises(MeshError, match=said):
        build_mesh(MeshConfig(data=8, extra_rules=rows))


def test_a_layout_row_naming_no_axis_of_its_mesh_is_refused():
    """with_rule("mlp", "model") was taken, and failed later as KeyError('model') or jax's "Resource axis"."""
    layout = build_mesh(MeshConfig(data=2, expert=2, tensor=2))
    with pytest.raises(ValueError, match=r"rules row \('mlp', 'model'\): its target 'model' is not a mesh axis"):
        layout.with_rule("mlp", "model")


def test_an_unknown_axis_name_says_how_to_add_it():
    layout = build_mesh(MeshConfig(data=8))
    with pytest.raises(KeyError, match=r"logical axis 'hidden' has no row .*MeshConfig\(extra_rules="):
        layout.spec(("embed", "hidden"))


@pytest.mark.parametrize("mesh, rows, positions, said", [
    (MeshConfig(data=2, tensor=4, extra_rules=HIDDEN), 3, 8, "3 rows on mesh axes data of 2 shards"),
    (MeshConfig(data=2, context=2, tensor=2, extra_rules=HIDDEN), 4, 7, "7 positions on mesh axes context of 2"),
])
@pytest.mark.parametrize("widths", [(), (8,)])
def test_a_batch_the_mesh_does_not_divide_is_named(mesh, rows, positions, said, widths):
    """jax's IndivisibleError ("array axis 1 is partitioned 4 times, but the dimension size is 6") named no setting
    (an audit); the model itself already said which axis."""
    layout = build_mesh(mesh, Described())
    opt = optax.sgd(0.1)
    graphdef, state = init_state(MLP(), opt)
    shardings = state_shardings(layout, state)
    step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings, donate=False, widths=widths)
    ids = jnp.zeros((1, rows, positions), jnp.int32)
    bad = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones(ids.shape), "attention_mask": jnp.ones(ids.shape)}
    with pytest.raises(ValueError, match=f"train step batch: {said}"):
        step(jax.device_put(state, shardings), bad)


def test_a_mesh_without_m3jaxs_axes_and_a_null_extra_rules():
    """A jax Mesh of another program's axes given where a layout is built: MeshError naming what it lacks (the rules
    check first said "rules row ... not a mesh axis", a ValueError, a review); extra_rules None is no rows."""
    from sharding.layout import as_layout
    with pytest.raises(MeshError, match=r"mesh axes \('x',\) lack \['data', 'context', 'expert', 'tensor'\]"):
        as_layout(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]))
    assert MeshConfig(data=8, extra_rules=None).extra_rules == ()
    with pytest.raises(MeshError, match="rules row 'hidden': expected"):
        build_mesh(MeshConfig(data=8, extra_rules="hidden"))
