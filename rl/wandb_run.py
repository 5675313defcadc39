"""The metrics mirrored to Weights & Biases (`logging.wandb_project`), one W&B run per run directory.

A resumed run (the same `run.out_dir`) continues the same W&B run: its id is kept in `run.out_dir/wandb_run_id`
(written once, atomically) and passed back with `resume="allow"`. `logging.wandb_mode: offline` writes the run
under `run.out_dir/wandb` without a network (a cluster's compute nodes); `wandb sync` uploads it later.
"""

from __future__ import annotations

import os
import secrets

ID_FILE = "wandb_run_id"


def run_id(run_dir: str, new_id=lambda: secrets.token_hex(6)) -> str:
    """The W&B run id of this run directory: the one kept there, else `new_id()` (12 random hex digits, characters
    W&B accepts in an id), kept for the next start."""
    path = os.path.join(run_dir, ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            kept = f.read().strip()
        if kept:
            return kept
    rid = new_id()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(rid + "\n")
    os.replace(tmp, path)
    return rid


def open_run(run_dir: str, cfg):
    """The started W&B run of `cfg` (an rl.config.RunConfig whose logging.wandb_project is set): named run.name,
    configured with the resolved config, under run_dir. Call on one process (the one that writes metrics)."""
    import wandb

    from rl.config import as_dict

    lg = cfg.logging
    os.makedirs(run_dir, exist_ok=True)
    return wandb.init(project=lg.wandb_project, entity=lg.wandb_entity, mode=lg.wandb_mode, dir=run_dir,
                      name=cfg.run.name, config=as_dict(cfg), id=run_id(run_dir),
                      resume="allow", settings=wandb.Settings(quiet=True))  # no run history / summary tables on
    # the terminal at the end (README: the terminal shows the bar, the project's messages and warnings)


def scalars(metrics: dict) -> dict:
    """The numeric entries of a metrics row (NaN and inf included: W&B shows them, and a NaN loss is news)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float)}
