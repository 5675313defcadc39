"""Where the tiny model's jit(value_and_grad) step spends its time on CPU: XLA thunks by name.

Builds the same model and step as scripts/bench_forward_backward.py (the tiny `release_like` config, batch 2,
mean next-token cross entropy over the nnx.Param leaves), traces --iters steps with `jax.profiler`, and sums
the top-level thunks (a `while` includes its body) over the XLA:CPU worker threads, per step. With --inside a
while's name, also the thunks inside it. Tracing slows the step, so the sums exceed the untraced median
printed first; the split is what to read.

    .venv/bin/python scripts/profile_forward_backward.py --seq 256 --no-remat
    .venv/bin/python scripts/profile_forward_backward.py --seq 256 --inside while.212
    .venv/bin/python scripts/profile_forward_backward.py --seq 256 --by-source     # ms per model source line
    .venv/bin/python scripts/profile_forward_backward.py --sparse-bench "sparse gather" --seq 4096 --iters 3 --by-source

--sparse-bench NAME profiles a contestant of scripts/bench_sparse_model.py instead ("sparse gather", "full flash",
...: the 2-layer hidden-512 model, batch 1, random ids) under the same next-token loss.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402

import bench_forward_backward as fb  # noqa: E402
import bench_sparse_model as bsm  # noqa: E402
from m3jax import tiny  # noqa: E402


def thunk_times(xplane: str, inside: str | None) -> tuple[collections.Counter, ...]:
    """({top-level thunk: ns}, {thunk inside `inside`: ns}, {top-level thunk: times run}) over the XLA:CPU
    worker threads of a trace."""
    top, nested, runs = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            if "Eigen" not in line.name:  # XLA:CPU's worker threads
                continue
            ends, window = [], None
            for ev in sorted(line.events, key=lambda e: (e.start_ns, -e.duration_ns)):
                while ends and ends[-1] <= ev.start_ns:
                    ends.pop()
                if len(ends) == 1 and not ev.name.startswith("ThunkExecutor"):
                    top[ev.name] += ev.duration_ns
                    runs[ev.name] += 1
                    window = (ev.start_ns, ev.start_ns + ev.duration_ns) if ev.name == inside else window
                elif window and window[0] < ev.start_ns < window[1] and not ev.name.startswith(("Thunk", "while")):
                    nested[ev.name] += ev.duration_ns
                ends.append(ev.start_ns + ev.duration_ns)
    return top, nested, runs


def source_lines(hlo_text: str) -> dict[str, str]:
    """{instruction name: "file.py:line function"} of the innermost frame of each instruction's stack in
    the compiled HLO text (its FileNames / FunctionNames / FileLocations / StackFrames tables)."""
    tables, section = collections.defaultdict(dict), None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif section and (m := re.match(r"(\d+) (.*)", line)):
            tables[section][m.group(1)] = m.group(2)
        else:
            section = None
    where = {}
    for frame, text in tables["StackFrames"].items():
        loc = tables["FileLocations"].get(re.search(r"file_location_id=(\d+)", text).group(1), "")
        f, fn, ln = (re.search(pat, loc) for pat in (r"file_name_id=(\d+)", r"function_name_id=(\d+)", r"line=(\d+)"))
        if f and fn and ln:
            path = tables["FileNames"].get(f.group(1), "?").strip('"')
            rel = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
            where[frame] = f"{rel}:{ln.group(1)} {tables['FunctionNames'].get(fn.group(1), '?').strip(chr(34))}"
    return {m.group(1): where.get(m.group(2), "?")
            for m in re.finditer(r"%([\w.-]+) = .*?stack_frame_id=(\d+)", hlo_text)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-remat", action="store_true")
    ap.add_argument("--unrolled", action="store_true", help="model.scan_layers=false: each stack's layers unrolled")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--inside", help="also list the thunks inside this top-level thunk (e.g. while.212)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--hlo", help="write the compiled HLO text here (to look up what a thunk name computes)")
    ap.add_argument("--by-source", action="store_true",
                    help="also sum the top-level thunks per model source line (a while counts at its own line)")
    ap.add_argument("--sparse-bench", metavar="NAME", choices=("sparse gather", "sparse masked", "full flash",
                                                               "full dense"),
                    help="profile this contestant of scripts/bench_sparse_model.py (batch 1; its own remat and "
                         "attention settings: --no-remat and --attention-impl do not apply)")
    args = ap.parse_args()

    if args.sparse_bench:
        model, args.batch = bsm.build(args.sparse_bench), 1
        ids = tiny.random_ids(tiny.m3_config(**bsm.DIMS), 1, args.seq)
    else:
        hf = tiny.hf_model(tiny.hf_config("release_like"), seed=0)
        model = tiny.m3_from_hf(hf, remat=not args.no_remat, attention_impl=args.attention_impl,
                                scan_layers=not args.unrolled)
        ids = tiny.random_ids(hf.config, args.batch, args.seq, seed=args.seq)
    step, params = fb.flax_step(model)
    ids = jax.numpy.asarray(ids)
    t0 = time.perf_counter()
    compiled = step.lower(params, ids).compile()  # once: its HLO text is the one the trace runs
    compile_s = time.perf_counter() - t0
    hlo_text = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(hlo_text)

    def one():
        return jax.block_until_ready(compiled(params, ids))
    for _ in range(3):
        one()
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        one()
        times.append(time.perf_counter() - t)
    what = (f"sparse bench {args.sparse_bench!r}" if args.sparse_bench else
            f"remat {not args.no_remat}, attention {args.attention_impl}, scan_layers {not args.unrolled}")
    print(f"S {args.seq}, batch {args.batch}, {what}: "
          f"untraced median {statistics.median(times) * 1e3:.2f} ms (compile {compile_s:.1f} s)")
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(args.iters):
            one()
        jax.profiler.stop_trace()
        top, nested, runs = thunk_times(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0], args.inside)
    per = 1e6 * args.iters
    print(f"traced: {sum(top.values()) / per:.2f} ms of top-level thunks per step, {runs.total() / args.iters:.0f} "
          f"thunks run per step")
    where = source_lines(hlo_text) if args.by_source else {}
    for name, ns in top.most_common(args.top):
        print(f"  {ns / per:7.3f} ms  {name}" + (f"  ({where.get(name, '?')})" if where else ""))
    for name, ns in nested.most_common(args.top):
        print(f"  {ns / per:7.3f} ms  inside {args.inside}: {name}")
    if args.by_source:
        by_line, line_runs = collections.Counter(), collections.Counter()
        for name, ns in top.items():
            by_line[where.get(name, "?")] += ns
            line_runs[where.get(name, "?")] += runs[name]
        print("by source line (innermost frame of the thunk's HLO instruction; thunks run per step):")
        for line, ns in by_line.most_common(args.top or None):
            print(f"  {ns / per:7.3f} ms  {line_runs[line] / args.iters:5.0f}  {line}")


if __name__ == "__main__":
    main()
