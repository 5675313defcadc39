"""python -m m3jax.plot RUN_DIR [--out FILE]: PNG curves of a run (reward, lengths, mismatch, phase times, and
the indexer recall / alignment KL when logged).

python -m m3jax.plot RUN_DIR RUN_DIR ... --metrics indexer/recall reward/mean [--labels a b ...] --out FILE:
those metrics of several runs side by side, one curve per run."""

import argparse
import difflib
import functools
import os

from m3jax.cli_args import path_argument
from rl.observe import plot_compare, plot_run


def png_path_problem(path: str) -> str | None:
    """Why an image cannot be written at `path` (a directory, in a directory that does not exist, or a suffix that
    is no format matplotlib writes), else None: found before anything is drawn or printed, where matplotlib would
    raise at the end."""
    if os.path.isdir(path):
        return "is a directory; expected the path of the PNG file to write"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            return (f"its suffix .{suffix} is no image format matplotlib writes; expected .png or one of "
                    f"{', '.join('.' + f for f in sorted(formats))}")
    return None


def logged_metrics(run_dirs: list[str]) -> set[str]:
    from rl.observe import read_metrics
    return {k for d in run_dirs for row in read_metrics(d) for k in row}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m m3jax.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", type=path_argument, nargs="+", metavar="RUN_DIR",
                    help="run directories (run.out_dir) whose metrics to plot")
    ap.add_argument("--out", type=path_argument, default=None, help="default: RUN_DIR/curves.png (one run)")
    ap.add_argument("--metrics", nargs="+", default=None, help="compare these metrics across the runs")
    ap.add_argument("--labels", nargs="+", default=None, help="one legend label per run (default: directory names)")
    args = ap.parse_args(argv)
    missing = [d for d in args.run_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        ap.error(f"no metrics.jsonl in {', '.join(missing)}: expected the run.out_dir of a run")
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        ap.error(f"--labels: {len(args.labels)} label(s) for {len(args.run_dirs)} run(s); expected one per run")
    if args.out is not None:
        if not os.path.isdir(args.out) and not os.path.splitext(args.out)[1][1:]:
            # as matplotlib would (a bare trailing dot too), so that the file printed is the file written
            args.out = args.out.rstrip(".") + ".png"
        if problem := png_path_problem(args.out):
            ap.error(f"--out {args.out}: {problem}")
    if args.metrics is not None:
        logged = logged_metrics(args.run_dirs)
        unknown = [m for m in args.metrics if m not in logged]
        if unknown:
            near = sorted({n for m in unknown for n in difflib.get_close_matches(m, logged, n=3)})
            some = near or sorted(logged)[:12]
            ap.error(f"--metrics: {', '.join(unknown)} not logged in these runs' metrics.jsonl; "
                     f"{'close' if near else 'logged'}: {', '.join(some)}"
                     + ("" if near or len(logged) <= 12 else f", ... ({len(logged)} in all)"))
    if args.metrics is None:
        if len(args.run_dirs) != 1:
            ap.error("several runs need --metrics (the metrics to compare) and --out")
        draw = functools.partial(plot_run, args.run_dirs[0], args.out)
    elif args.out is None:
        ap.error("--metrics needs --out (the PNG to write)")
    else:
        draw = functools.partial(plot_compare, args.run_dirs, args.metrics, args.out, args.labels)
    try:
        print(draw())
    except OSError as e:  # a directory it may not write into, a full disk: the write is atomic, nothing is left
        where = args.out or os.path.join(args.run_dirs[0], "curves.png")
        ap.exit(1, f"error: {where} cannot be written ({e.strerror or e})\n")


if __name__ == "__main__":
    main()
