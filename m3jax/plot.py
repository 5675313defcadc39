"""python -m m3jax.plot RUN_DIR [--out FILE]: PNG curves of a run (reward, lengths, mismatch, phase times, and
the indexer recall / alignment KL when logged).

python -m m3jax.plot RUN_DIR RUN_DIR ... --metrics indexer/recall reward/mean [--labels a b ...] --out FILE:
those metrics of several runs side by side, one curve per run."""

import argparse
import os

from rl.observe import plot_compare, plot_run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m m3jax.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--out", default=None, help="default: RUN_DIR/curves.png (one run)")
    ap.add_argument("--metrics", nargs="+", default=None, help="compare these metrics across the runs")
    ap.add_argument("--labels", nargs="+", default=None, help="one legend label per run (default: directory names)")
    args = ap.parse_args(argv)
    missing = [d for d in args.run_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        ap.error(f"no metrics.jsonl in {', '.join(missing)}: expected the run.out_dir of a run")
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        ap.error(f"--labels: {len(args.labels)} label(s) for {len(args.run_dirs)} run(s); expected one per run")
    if args.metrics is None:
        if len(args.run_dirs) != 1:
            ap.error("several runs need --metrics (the metrics to compare) and --out")
        print(plot_run(args.run_dirs[0], args.out))
        return
    if args.out is None:
        ap.error("--metrics needs --out (the PNG to write)")
    print(plot_compare(args.run_dirs, args.metrics, args.out, args.labels))


if __name__ == "__main__":
    main()
