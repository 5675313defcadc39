"""python -m m3jax.eval --config configs/<name>.yaml [key.sub=value ...] [--step N|best | --hf DIR]

Score a saved policy on the config's held-out evaluation (the `eval` section) without training: the
run's newest checkpoint, checkpoint step N, the best evaluation's checkpoint (checkpoint.keep_best), or a
Hugging Face directory. Prints one `metric value` line per metric and exits. Generation is the JAX engine
(rl.eval_checkpoint); a checkpoint of a JAX-backend run prints what that run logged at the same step. Reads
the run directory only: no lock, no run.log, no checkpoint is created or removed (the terminal shows the
project's INFO lines and warnings).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from m3jax.cli_args import description, path_argument
from rl.checkpoint_keep import step_argument
from rl.config import ConfigError, add_arguments, from_args, to_yaml
from sharding.cpu_threads import reserve_collective_threads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3jax.eval", description=description(__doc__))
    add_arguments(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--step", type=step_argument, metavar="N", help="checkpoint step to score (default: the "
                        "newest; best: the best held-out evaluation's, which checkpoint.keep_best kept)")
    source.add_argument("--hf", type=path_argument, metavar="DIR",
                        help="score this Hugging Face directory instead of a checkpoint")
    args = parser.parse_intermixed_args(argv)
    if args.print_config and (args.step is not None or args.hf is not None):  # it printed and scored nothing
        parser.error("--print-config prints the config and exits: it scores nothing, so --step / --hf do not go "
                     "with it")
    reserve_collective_threads(os.environ)  # simulated CPU devices: before jax starts its CPU backend
    try:
        cfg = from_args(args, training=False)
        # checked as a run that evaluates, even where training does not (eval.every_steps 0, no at_start): the
        # eval section's own rules and those across sections (positions, temperature), before any checkpoint loads
        dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, at_start=True))
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    from rl import logs
    logs.setup(None, cfg.logging.level)  # no log file: nothing is written into the run directory
    try:
        return _score(cfg, args)
    finally:
        logs.teardown()


def _score(cfg, args) -> int:
    from sharding.mesh import set_memory_fraction

    note = set_memory_fraction(cfg.mesh.device_memory_fraction)  # before anything starts JAX's backend
    if note:
        print(f"warning: {note}", file=sys.stderr)
    # Heavy imports only once the config is known to be good.
    from rl import eval_checkpoint
    from rl.input_errors import input_errors

    try:
        policy = (eval_checkpoint.from_hf(cfg, args.hf) if args.hf
                  else eval_checkpoint.from_checkpoint(cfg, args.step))
        tokenizer = eval_checkpoint.tokenizer_for(cfg, args.hf)
        metrics = eval_checkpoint.score(cfg, policy, tokenizer)
    except input_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    what = f"--hf {args.hf}" if args.hf else f"step {policy.step} of {cfg.run.out_dir}"
    print(f"# {what}: {metrics['val/prompts']} prompts x {metrics['val/samples_per_prompt']} samples")
    for k, v in metrics.items():
        print(f"{k} {v}")  # floats in full (repr): comparable with metrics.jsonl
    best = policy.meta.get("best")
    if best:
        print(f"# best {best['metric']} {best['value']:.6g} at step {best['step']} (the run's own evaluations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
