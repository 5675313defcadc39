"""python -m m3jax.train --config configs/<name>.yaml [key.sub=value ...] [--print-config]

GRPO on MiniMax-M3. The config (a YAML chain of base + deltas, then dotted overrides) is validated in
full before any work starts. Rerunning the same command resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rl.config import ConfigError, add_arguments, from_args, to_yaml


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3jax.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--export", metavar="DIR", help="export the latest checkpoint's policy to a HF "
                        "directory and exit (on-demand export)")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = from_args(args)
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from rl.trainer import GRPOTrainer  # heavy imports only once the config is known to be good

    try:
        trainer = GRPOTrainer(cfg)
    except NotImplementedError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.export:
        step = trainer.resume()
        print(f"exported step {step} to {trainer.export(args.export)}")
        return 0
    last = trainer.run()
    print(f"done: {cfg.run.total_steps} steps, last reward {last.get('reward/mean', float('nan')):.3f}; "
          f"run directory {cfg.run.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
