"""The exceptions that mean the user's input is wrong, so that the commands (`python -m m3jax.train`,
`python -m m3jax.eval`) print them as one `error:` line, which names what was wrong and what was expected,
instead of a traceback: a model config the model cannot take, a checkpoint that does not match its config (an
HF one, or a run's checkpoint saved under another config), a prompt file, a mesh larger than the machine, a
missing file, processes of one job holding different configs or files."""

from __future__ import annotations


def input_errors() -> tuple[type[Exception], ...]:
    """The exception classes, imported when asked (the commands import the heavy modules late)."""
    from m3jax.config import ConfigError
    from rl.config import ConfigError as RunConfigError
    from m3jax.hf.safetensors_io import CheckpointError
    from rl.checkpoint import CheckpointMismatch
    from rl.data import DatasetError
    from rl.job_agreement import JobDisagrees
    from sharding.mesh import MeshError
    return (ConfigError, RunConfigError, CheckpointError, CheckpointMismatch, DatasetError, MeshError, JobDisagrees,
            FileNotFoundError, FileExistsError)  # FileExistsError: m3jax.hf.save.check_destination's refusals
