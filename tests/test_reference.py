"""The KL's reference weights in host memory between passes (`grpo.reference_memory: host`, rl.reference): held in
the devices' pinned host memory, cut as the params are, brought back bit for bit and placed as the params for the
reference pass, untouched by the train step's donation of the params; a run trains as with them on the device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl import reference
from rl.reference import ReferenceWeights
from tests.tiny_runs import tiny_trainer, two_steps


def _params():
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    cut = NamedSharding(mesh, P("context", "data"))
    return {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8).astype(jnp.bfloat16), cut),
            "b": jax.device_put(jnp.linspace(-1, 1, 8), NamedSharding(mesh, P()))}


def test_host_reference_is_held_in_pinned_host_memory_and_comes_back_placed_as_the_params():
    params = _params()
    ref = ReferenceWeights(params, "host")
    for held, p in zip(jax.tree.leaves(ref.held), jax.tree.leaves(params)):
        assert held.sharding.memory_kind == "pinned_host"
        assert held.sharding.spec == p.sharding.spec  # cut as the params: each device keeps its own shard
    on_device = ref.for_pass()
    for got, p in zip(jax.tree.leaves(on_device), jax.tree.leaves(params)):
        assert got.sharding == p.sharding and got.sharding.memory_kind == "device"
        assert got.dtype == p.dtype and np.array_equal(np.asarray(got), np.asarray(p))
    # the w shard of one device: 8 x 8 bf16 over 8 devices, and the replicated b (8 fp32)
    assert ref.nbytes_per_device() == 8 * 8 * 2 // 8 + 8 * 4


@pytest.mark.parametrize("memory", ["device", "host"])
def test_the_reference_survives_the_train_steps_donation_of_the_params(memory):
    params = _params()
    want = jax.tree.map(np.asarray, params)
    ref = ReferenceWeights(params, memory)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)
    params = step(params)
    for got, w in zip(jax.tree.leaves(ref.for_pass()), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(got), w)


def test_host_memory_the_devices_do_not_offer_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(reference, "host_kinds", lambda params: {"device"})
    with pytest.raises(ValueError, match=r"grpo.reference_memory = host keeps the KL reference in the devices' "
                                         r"pinned_host memory; the cpu devices here offer \['device'\]: use "
                                         r"grpo.reference_memory = device"):
        ReferenceWeights(_params(), "host")


@pytest.mark.slow  # a short trainer run
def test_a_kl_run_keeps_its_initial_weights_in_host_memory_and_scores_under_them(tmp_path):
    """Two steps of a tiny KL run with the reference in host memory: the train step donates and replaces the params
    twice, the reference stays the initial weights bit for bit, and the KL of the second step is the moved policy's
    distance from them. (With the reference on the device the same two steps log the same KL: the CPU demo's
    60-step pair in BENCHMARKS.md, session 21, is bitwise the same run.)"""
    from rl.policy import build_policy
    trainer = tiny_trainer(tmp_path, "host", "grpo.kl=k3", "grpo.kl_coef=0.05", "grpo.reference_memory=host")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.reference.held)} == {"pinned_host"}
    got = two_steps(trainer)
    assert got[0]["kl"] == 0 < got[1]["kl"]  # the first step starts from the reference itself
    initial = build_policy(trainer.cfg).state.params
    for ref, want in zip(jax.tree.leaves(trainer.reference.for_pass()), jax.tree.leaves(initial)):
        assert np.array_equal(np.asarray(ref), np.asarray(want))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(trainer.state.params)))
