"""A KL reference from a checkpoint (`grpo.reference_path`: a teacher for on-policy distillation)."""

import jax
import numpy as np
import pytest
from flax import nnx


def _save_tiny(path, seed, **changes):
    import m3jax
    from m3jax.hf.save import save_pretrained
    from rl.config import load_config
    m3 = load_config("configs/tiny.yaml").model.m3_config()
    m3 = type(m3)(**{**m3.__dict__, **changes}) if changes else m3
    save_pretrained(m3jax.M3ForCausalLM(m3, rngs=nnx.Rngs(seed)), str(path))
    return str(path)


def _trainer(tmp_path, *overrides):
    from rl.config import load_config
    from rl.trainer import GRPOTrainer
    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path / 'run'}", "grpo.prompts_per_step=4",
                                            "grpo.group_size=4", "grpo.micro_batch_size=16", "grpo.kl=k2",
                                            "grpo.kl_coef=0.1", "eval.every_steps=0", "eval.at_start=false",
                                            "logging.tensorboard=false", "logging.progress_bar=false", *overrides])
    return GRPOTrainer(cfg)


@pytest.mark.slow  # two tiny trainers, one step each
def test_the_reference_is_the_checkpoint_and_the_kl_measures_the_distance_to_it(tmp_path):
    import m3jax
    teacher_dir = _save_tiny(tmp_path / "teacher", seed=7)
    trainer = _trainer(tmp_path, f"grpo.reference_path={teacher_dir}")
    try:
        want = nnx.state(m3jax.from_pretrained(teacher_dir), nnx.Param)
        for a, b in zip(jax.tree.leaves(trainer.reference.held), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        taught = trainer.step(0)
    finally:
        trainer.engine.shutdown()
    own = _trainer(tmp_path / "own")
    try:
        alone = own.step(0)
    finally:
        own.engine.shutdown()
    assert alone["kl"] == 0.0 and taught["kl"] > 0.01  # the policy is its own reference at step 1, not the teacher
    assert taught["reward/mean"] == alone["reward/mean"]  # the same samples: only the loss's KL term differs


def test_a_reference_of_another_architecture_is_refused_by_name(tmp_path):
    from rl.config import ConfigError, load_config
    other = _save_tiny(tmp_path / "wide", seed=0, hidden_size=32, head_dim=8, index_head_dim=8)
    kl = ["grpo.kl=k2", "grpo.kl_coef=0.1"]
    with pytest.raises(ConfigError, match=r"grpo.reference_path = .*differs from the policy's in hidden_size 32 "
                                          r"\(policy 64\)"):
        load_config("configs/tiny.yaml", [f"grpo.reference_path={other}", *kl])
    with pytest.raises(ConfigError, match=r"grpo.reference_path = .*no config.json there"):
        load_config("configs/tiny.yaml", [f"grpo.reference_path={tmp_path / 'none'}", *kl])
    # a config loaded without the path checks: the trainer still refuses the weights, by parameter
    from rl.trainer import GRPOTrainer
    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path / 'run'}", f"grpo.reference_path={other}", *kl],
                      check_paths=False)
    with pytest.raises(ValueError, match=r"grpo.reference_path = .*parameter .* is float32\[.*the policy's"):
        GRPOTrainer(cfg)


def test_config_rules():
    from rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="grpo.reference_path.*no KL term"):
        load_config("configs/tiny.yaml", ["grpo.reference_path=/x"])
    with pytest.raises(ConfigError, match="reset would replace the reference checkpoint"):
        load_config("configs/tiny.yaml", ["grpo.reference_path=/x", "grpo.kl=k2", "grpo.kl_coef=0.1",
                                          "grpo.reference_reset_every_steps=5"])
