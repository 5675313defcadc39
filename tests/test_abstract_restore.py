"""Commands that restore a checkpoint build the train state by shape alone (`build_policy(abstract=True)`), so the host
does not hold the state twice: the export and the checkpoint evaluation restore into `jax.ShapeDtypeStruct`s placed
as the built state would be, and read nothing of model.path. Before, each built the whole state (a random init, or a
full read of model.path) and then restored a second one beside it: an export of a 0.95 GB model peaked at 5x its
parameters on the host (BENCHMARKS.md, host memory audit)."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

import m3jax
from rl import checkpoint as ckpt_lib
from rl.config import checkpoint_dir, load_config
from rl.eval_checkpoint import from_checkpoint
from rl.policy import build_policy, export_latest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MESH = ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "grpo.micro_batch_size=64"]


def tiny_cfg(tmp_path, *overrides):
    return load_config(TINY, [f"run.out_dir={tmp_path / 'run'}", "logging.tensorboard=false", *overrides])


@pytest.mark.parametrize("precision", [["precision.master=none"],
                                       ["precision.master=compact", "precision.moment_dtype=bfloat16"]])
@pytest.mark.parametrize("mesh", [[], MESH], ids=["one_device", "mesh"])
def test_the_abstract_state_is_the_built_one_by_shape(tmp_path, precision, mesh):
    cfg = tiny_cfg(tmp_path, *precision, *mesh)
    built, abstract = build_policy(cfg, kernel_timing="off"), build_policy(cfg, kernel_timing="off", abstract=True)
    want, got = jax.tree.leaves_with_path(built.state), jax.tree.leaves_with_path(abstract.state)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, x), (_, a) in zip(want, got):
        assert isinstance(a, jax.ShapeDtypeStruct), path
        assert (a.shape, a.dtype) == (x.shape, x.dtype), path
        assert a.sharding.is_equivalent_to(x.sharding, x.ndim), (path, a.sharding, x.sharding)
    assert abstract.graphdef == built.graphdef


def saved_run(tmp_path, *overrides):
    """A tiny run's config and its step-3 checkpoint of a built policy's state -> (cfg, that state)."""
    cfg = tiny_cfg(tmp_path, *overrides)
    state = build_policy(cfg, kernel_timing="off").state
    saver = ckpt_lib.Checkpointer(checkpoint_dir(cfg), async_save=False)
    saver.save(3, state, {"step": 3, "data": {}, "weight_version": 3})
    saver.close()
    return cfg, state


@pytest.fixture
def restored_likes(monkeypatch):
    """The `like` state of every checkpoint restore made while the test runs (`restored_likes.states`: the states
    they returned)."""
    likes = Restores()
    restore_latest = ckpt_lib.Checkpointer.restore_latest

    def spy(self, like, **kwargs):
        likes.append(like)
        got = restore_latest(self, like, **kwargs)
        likes.states.append(got[0])
        return got
    monkeypatch.setattr(ckpt_lib.Checkpointer, "restore_latest", spy)
    return likes


class Restores(list):
    def __init__(self):
        super().__init__()
        self.states = []


def assert_params_only(state):
    """A reader's restore reads no optimizer state (twice the fp32 params in Adam's moments): it stays by shape."""
    kinds = {type(x).__name__ for x in jax.tree.leaves(state.opt_state)}
    assert kinds == {"ShapeDtypeStruct"}, f"the reader restored the optimizer state ({kinds})"


def assert_shapes_only(likes):
    assert len(likes) == 1
    kinds = {type(x).__name__ for x in jax.tree.leaves(likes[0])}
    assert kinds == {"ShapeDtypeStruct"}, f"the restore target holds {kinds}: a second state built beside the restore"


def test_an_export_restores_into_shapes_alone(tmp_path, restored_likes):
    cfg, state = saved_run(tmp_path)
    step, path = export_latest(cfg, str(tmp_path / "export"))
    assert step == 3
    assert_shapes_only(restored_likes)
    assert_params_only(restored_likes.states[0])
    exported = nnx.state(m3jax.from_pretrained(path), nnx.Param)
    for (key, want), (_, got) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(exported), strict=True):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()), err_msg=str(key))


def test_a_checkpoint_evaluation_restores_into_shapes_alone(tmp_path, restored_likes):
    """On a mesh, with bf16 params and their 16-bit remainders (the params come back from the saved fp32 master);
    the newest step and a named one."""
    cfg, state = saved_run(tmp_path, *MESH, "precision.master=compact")
    got = from_checkpoint(cfg)
    assert got.step == 3
    assert_shapes_only(restored_likes)
    assert_params_only(restored_likes.states[0])
    for read in (got, from_checkpoint(cfg, step=3)):  # restore_latest, restore_step
        for (key, want), (_, x) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(read.params), strict=True):
            assert x.get_value().sharding.is_equivalent_to(want.get_value().sharding, x.get_value().ndim), key
            np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(want.get_value()), err_msg=str(key))


def test_an_export_reads_nothing_of_the_model_path(tmp_path, monkeypatch):
    """A run fine-tuned from a HF checkpoint: its export restores the run's own checkpoint, and before read the
    whole of model.path (852 GB for the release) only to drop it."""
    m3jax.save_pretrained(m3jax.M3ForCausalLM(tiny_cfg(tmp_path).model.m3_config(), rngs=nnx.Rngs(1)),
                          str(tmp_path / "hf"))
    cfg, _ = saved_run(tmp_path, f"model.path={tmp_path / 'hf'}", "model.tiny=null")

    def refused(*args, **kwargs):
        raise AssertionError("the export read model.path")
    monkeypatch.setattr(m3jax, "from_pretrained", refused)
    assert export_latest(cfg, str(tmp_path / "export"))[0] == 3


def test_a_resumed_run_restores_into_shapes_alone(tmp_path, restored_likes, monkeypatch):
    """A resume restores into the state built by shape, and hands the restored weights to the engines through
    `sync_weights` with the run's probe check, as every other push (a resume's went unchecked: a helper's soak of the
    vLLM pool)."""
    import rl.trainer
    from rl.trainer import GRPOTrainer
    pushes, sync = [], rl.trainer.sync_weights
    monkeypatch.setattr(rl.trainer, "sync_weights",
                        lambda engine, state, version, probe=None: pushes.append((version, probe)) or sync(
                            engine, state, version, probe))
    cfg = tiny_cfg(tmp_path, "run.total_steps=4")
    first = GRPOTrainer(cfg)
    saved = jax.tree.map(np.asarray, first.state)
    first.save(2)
    first.checkpointer.close()
    first.engine.shutdown()
    restored_likes.clear()
    restored_likes.states.clear()
    second = GRPOTrainer(cfg)
    assert_shapes_only(restored_likes)
    assert second.resume() == 2
    assert pushes == [(2, second.probe)]
    assert len(restored_likes) == 1  # restored once, when the trainer was built
    for (path, want), (_, got) in zip(jax.tree.leaves_with_path(saved), jax.tree.leaves_with_path(second.state),
                                      strict=True):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
    assert all(x is y for x, y in zip(jax.tree.leaves(second.engine.params), jax.tree.leaves(second.state.params)))
    second.checkpointer.close()
    second.engine.shutdown()


def test_an_export_or_evaluation_under_another_model_config_is_refused(tmp_path):
    """A setting that keeps every shape (the experts per token) passed the restore's shape check: an export wrote a
    config.json its weights were not trained under, and an evaluation scored another model (a helper's audit). The
    checkpoint's recorded model is compared, as a resume compares it."""
    from rl.checkpoint import CheckpointMismatch
    from rl.resume_checks import trained_under
    cfg = tiny_cfg(tmp_path)
    saver = ckpt_lib.Checkpointer(checkpoint_dir(cfg), async_save=False)
    saver.save(3, build_policy(cfg, kernel_timing="off").state,
               {"step": 3, "data": {}, "weight_version": 3, **trained_under(cfg)})
    saver.close()
    other = tiny_cfg(tmp_path, "model.tiny.num_experts_per_tok=1")
    want = (r"checkpoint step 3 in .* was trained as another model than this config builds: "
            r"model.tiny.num_experts_per_tok 2 there, 1 here: {} it with the checkpoint's values")
    with pytest.raises(CheckpointMismatch, match=want.format("export")):
        export_latest(other, str(tmp_path / "export"))
    assert not os.path.exists(tmp_path / "export")
    with pytest.raises(CheckpointMismatch, match=want.format("evaluate")):
        from_checkpoint(other)
    assert export_latest(cfg, str(tmp_path / "export"))[0] == 3  # the run's own config exports
