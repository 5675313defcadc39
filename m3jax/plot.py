"""python -m m3jax.plot RUN_DIR [--out FILE]: PNG curves of a run (reward, lengths, mismatch, phase times, and
the indexer recall when logged)."""

import argparse

from rl.observe import plot_run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m m3jax.plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="default: RUN_DIR/curves.png")
    args = ap.parse_args(argv)
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
