"""Short runs of the tiny trainer shared by the replay tests: build one, run two steps, compare metrics."""

from pathlib import Path

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def tiny_trainer(tmp_path, name, *overrides):
    """A GRPOTrainer of configs/tiny.yaml with 4 prompts x 4 samples per step, one micro-batch, no tensorboard."""
    from rl.config import load_config
    from rl.trainer import GRPOTrainer
    cfg = load_config(str(TINY), [f"run.out_dir={tmp_path / name}", "grpo.prompts_per_step=4", "grpo.group_size=4",
                                  "grpo.micro_batch_size=8", "logging.tensorboard=false", *overrides])
    return GRPOTrainer(cfg)


def two_steps(trainer):
    """The metrics of two steps; the engine is shut down either way."""
    try:
        return [trainer.step(s) for s in range(2)]
    finally:
        trainer.engine.shutdown()


def first_step(tmp_path, name, *overrides):
    """The timing-free metrics of the first step of `tiny_trainer(tmp_path, name, *overrides)`."""
    trainer = tiny_trainer(tmp_path, name, *overrides)
    try:
        return numbers(trainer.step(0))
    finally:
        trainer.engine.shutdown()


def numbers(metrics):
    """The metrics that do not depend on timing."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "throughput/", "perf/"))}
