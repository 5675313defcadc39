"""`record_config`: the run's resolved config kept in its directory (`<run.out_dir>/config.yaml`), and what a resumed
run changed of it.

A run directory holds checkpoints, metrics and exports; without the config that made them it cannot be reproduced
or compared, and a resume under edited settings (a learning rate, a loss option: nothing a checkpoint's state
shape records) would pass unnoticed. The file is `--print-config`'s text, so `python -m m3jax.train --config
<run.out_dir>/config.yaml` runs the same config again.
"""

from __future__ import annotations

import os

import yaml

CONFIG_FILE = "config.yaml"


def record_config(run_dir: str, cfg) -> list[tuple[str, object, object]]:
    """Write `cfg` (an `rl.config.RunConfig`) as `run_dir/config.yaml`, atomically, and return the settings that
    differ from the config.yaml already there as (dotted key, before, now), in the file's order ([] for a new run,
    or an unreadable earlier file)."""
    from rl.config import to_yaml

    text = to_yaml(cfg)
    path = os.path.join(run_dir, CONFIG_FILE)
    changed = []
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                before = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            before = None
        if isinstance(before, dict):
            changed = differences(before, yaml.safe_load(text))
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return changed


def differences(before: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, before, now) for every leaf that differs between two nested mappings (a key on one side only
    counts, with None on the other)."""
    out = []
    for key in list(before) + [k for k in now if k not in before]:
        a, b = before.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out
