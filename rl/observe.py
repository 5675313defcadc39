"""What people see: the progress (`rl.progress`), metrics.jsonl and TensorBoard in the run directory (and W&B,
`rl.wandb_run`), PNG curves."""

from __future__ import annotations

import json
import logging
import math
import os

from rl.tensorboard_events import EventFile

PLOTS = {  # panel title -> metrics drawn in it
    "reward": ("reward/mean", "reward/std"),
    "held-out evaluation": ("val/pass@1", "val/pass@k", "val/reward_mean"),
    "response length": ("response/length_mean", "response/truncated_frac"),
    "train/inference mismatch and clipping": ("gen_kl_error", "token_mult_prob_error", "clip_frac",
                                              "is_out_of_band_frac"),
    "policy entropy": ("entropy_approx", "entropy"),  # entropy: exact, with logging.entropy or grpo.entropy_coef
    "seconds per phase": ("time/generate", "time/logprobs", "time/train", "time/reward", "time/other",
                          "time/eval"),
}
RECALL_PANEL = "indexer recall: full-attention mass in the kept blocks"  # only in runs that log indexer/recall
ALIGN_PANEL = "indexer alignment KL (model.indexer_loss_coef)"  # only in runs that train the indexer
DROPS_PANEL = "MoE assignments dropped (model.moe_capacity_factor)"  # only in runs that log moe/dropped_frac
MFU_PANEL = "model FLOP utilisation (perf/mfu)"  # only where the devices' peak is known (rl.perf)


def panels(rows: list[dict]) -> dict:
    """PLOTS, plus each reward's own mean in the reward panel when the run has several rewards (and the drawn
    reward, dapo/reward_mean_drawn, under dynamic sampling), the indexer-recall
    panel (indexer/recall and its indexer/recall/layer_j curves) when the run logged it
    (logging.indexer_recall_every), the alignment KL's when the run trained the indexer, and a panel of the MoE drops
    (moe/dropped_frac and its moe/dropped_frac/layer_j curves) when the run logged them (logging.moe_drops_every),
    and one of the model FLOP utilisation when the run knew its devices' peak (`rl.perf`)."""
    out = dict(PLOTS)
    parts = sorted({k for r in rows for k in r
                    if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2})
    if len(parts) > 1:  # several rewards: each one's own mean beside the weighted sum
        out["reward"] = (*PLOTS["reward"], *parts)
    if any("dapo/reward_mean_drawn" in r for r in rows):  # dynamic sampling: reward/mean is over the kept groups,
        out["reward"] = (*out["reward"], "dapo/reward_mean_drawn")  # this is the policy's (every drawn sample)
    for panel, metric in ((RECALL_PANEL, "indexer/recall"), (DROPS_PANEL, "moe/dropped_frac")):
        if any(metric in r for r in rows):
            layers = sorted({k for r in rows for k in r if k.startswith(f"{metric}/layer_")},
                            key=lambda k: int(k.rsplit("_", 1)[1]))
            out[panel] = (metric, *layers)
    if any("indexer/align_kl" in r for r in rows):
        out[ALIGN_PANEL] = ("indexer/align_kl",)
    if any("perf/mfu/train" in r for r in rows):
        out[MFU_PANEL] = ("perf/mfu/train", "perf/mfu/logprobs")
    return out


class RunLogger:
    def __init__(self, run_dir: str, *, tensorboard: bool = True, progress_bar: bool = True, total_steps: int = 0,
                 first_step: int = 0, open_wandb=None, resumed_row: dict | None = None):
        """open_wandb: a callable returning a started W&B run (`rl.wandb_run.open_run`) to mirror every row to;
        called on the process that writes (process 0) only.

        A run that starts at `first_step` re-logs every step after it, so the rows past it (a run killed after its
        last checkpoint wrote them) are removed from metrics.jsonl and purged from TensorBoard: each step keeps one
        row. `resumed_row`: the row of `first_step` as its checkpoint recorded it, written if metrics.jsonl lacks it
        (a kill between the save and the row's write lost it for good)."""
        import jax
        self.run_dir = run_dir
        self._jsonl = self._tb = self._bar = self._wandb = None
        self._val = None  # the last held-out pass@1, shown on the progress bar
        # Every host of a multi-host job runs the same loop with the same metrics; one of them writes.
        if jax.process_index() != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        cut = cut_partial_row(path)
        if cut:
            logging.getLogger(__name__).warning("%s ended in a row cut short (%d bytes, a crash while writing it): "
                                                "removed, so the resumed run's rows start on a line of their own",
                                                path, cut)
        dropped, has_first, self._val = keep_rows_through(path, first_step if first_step > 0 else -1)
        if dropped:
            logging.getLogger(__name__).info("%s: removed %d row(s) past step %d, which this run logs again", path,
                                             dropped, first_step)
        self._jsonl = open(path, "a")
        if tensorboard:
            tb_dir = os.path.join(run_dir, "tensorboard")  # purge_step: events from it on are hidden (logged again)
            self._tb = EventFile(tb_dir, purge_step=first_step + 1 if first_step > 0
                                 else 0 if os.path.isdir(tb_dir) else None)
        if open_wandb is not None:
            self._wandb = open_wandb()
        if resumed_row is not None and first_step > 0 and not has_first:  # TensorBoard and W&B lost it too
            self.log(first_step, resumed_row, advance=False)
        if progress_bar:
            from rl.progress import open_progress
            self._bar = open_progress(total_steps, first_step)

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        """One row of metrics.jsonl (and TensorBoard); `advance`: the row ends a step (moves the progress
        bar), unlike the evaluation of the initial policy at step 0."""
        if self._jsonl is None:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            # NaN and inf too, as metrics.jsonl and W&B keep them (TensorBoard marks them on the curve): left out, a
            # skipped update's loss or a step's NaN per-token figures were a gap the line drew across.
            values = {k: v for k, v in clean.items() if isinstance(v, float)}
            if values:
                self._tb.scalars(step, values)
        if self._wandb is not None:
            from rl.wandb_run import scalars
            self._wandb.log(scalars(clean), step=step)
        self._val = clean.get("val/pass@1", self._val)
        if self._bar is not None and advance:
            self._bar.step(step, clean.get("reward/mean", float("nan")), clean.get("throughput/tokens_per_s", 0),
                           self._val, evaluated="val/pass@1" in clean)

    def close(self) -> None:
        """Close every output, also where one cannot write its last bytes (a full disk): the run's own error says
        what stopped it, and the outputs after a failed one still close."""
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError:  # each row is flushed as it is logged: the row whose flush failed has raised there
                pass
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:  # each event is flushed as it is logged: the one whose flush failed has raised there
                pass
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


def cut_partial_row(path: str) -> int:
    """Truncate `path` after its last newline where it does not end in one (a row a crash cut short); returns the
    bytes removed (0 for a whole file or none)."""
    if not os.path.exists(path):
        return 0
    with open(path, "r+b") as f:
        end = pos = f.seek(0, os.SEEK_END)
        f.seek(max(end - 1, 0))
        if end == 0 or f.read(1) == b"\n":
            return 0
        keep = 0
        while pos > 0:
            chunk = min(1 << 16, pos)
            f.seek(pos - chunk)
            at = f.read(chunk).rfind(b"\n")
            if at >= 0:
                keep = pos - chunk + at + 1
                break
            pos -= chunk
        f.truncate(keep)
        return end - keep


def keep_rows_through(path: str, last_step: int) -> tuple[int, bool, float | None]:
    """Keep only the rows of metrics.jsonl at `path` whose step is at most `last_step` (a line that is not a row
    stays); -> (rows removed, whether a row of `last_step` is kept, the last val/pass@1 kept: what the progress
    shows until the resumed run's next evaluation). The file is replaced atomically."""
    if not os.path.exists(path):
        return 0, False, None
    kept, dropped, has_last, val = [], 0, False, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = row["step"]
            except (json.JSONDecodeError, TypeError, KeyError):
                kept.append(line)
                continue
            if isinstance(step, (int, float)) and step > last_step:
                dropped += 1
            else:
                kept.append(line)
                has_last |= step == last_step
                val = row.get("val/pass@1", val)
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped, has_last, val


def read_metrics(run_dir: str) -> list[dict]:
    """metrics.jsonl rows, the last record of each step winning (a resumed run re-logs some steps). A line that
    is not a row (cut short by a crash, bytes that are not text, a step that is not a number) is skipped with a
    warning naming it: a step of "abc" beside the numbers failed the sort with a traceback."""
    rows, bad = {}, []
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    step = row["step"]
                except (json.JSONDecodeError, TypeError, KeyError):
                    bad.append(number)
                    continue
                if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
                    bad.append(number)
                    continue
                rows[step] = row
    if bad:
        logging.getLogger(__name__).warning("%s: skipped line%s %s (not a metrics row)", path,
                                            "s" if len(bad) > 1 else "", ", ".join(map(str, bad[:10])))
    return [rows[k] for k in sorted(rows)]


def _panel(ax, title: str, curves: list, empty: str) -> None:
    """One panel: a curve per (rows, metric, label, colour or None) over step; `empty` when none was logged."""
    for rows, key, label, color in curves:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:  # a metric of some steps only (evaluations): mark its points
            ax.plot(*zip(*pts), label=label, color=color, marker="o" if 2 * len(pts) < len(rows) else None,
                    markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)


def _save(fig, out: str) -> None:
    """fig written to `out` whole or not at all: a drawing that failed part-way (a full disk) left a cut image over
    the last good one. The format is the name's extension (the temporary name has none to infer it from)."""
    import matplotlib
    fmt = os.path.splitext(out)[1][1:].lower() or matplotlib.rcParams["savefig.format"]
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, dpi=100, format=fmt)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def plot_run(run_dir: str, out: str | None = None) -> str:
    """One PNG with reward, held-out evaluation, lengths, mismatch/clipping diagnostics and phase times against step,
    and the indexer recall when the run logged it (written by process 0 only in a multi-host job, like the
    metrics)."""
    import jax
    out = out or os.path.join(run_dir, "curves.png")
    if jax.process_index() != 0:
        return out
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    plots = panels(rows)
    ncols = 3
    nrows = -(-len(plots) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(plots):]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, plots.items()):
        _panel(ax, title, [(rows, key, key, None) for key in keys], "not logged in this run")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def draw_curves(run_dir: str) -> str | None:
    """`plot_run` at a run's end: the PNG's path, or None with a warning where drawing it failed (a full disk, a
    path taken by a directory, a broken font cache). The curves are drawn from metrics.jsonl, which stays, so the run
    whose steps, checkpoints and metrics are all written still ends well, on every process: as an error, a failed
    drawing ended process 0 of a multi-host job alone, after the others had reported success."""
    try:
        return plot_run(run_dir)
    except Exception as e:  # noqa: BLE001 - the warning says what failed and how to draw them again
        logging.getLogger(__name__).warning(
            "the curves were not drawn (%s: %s); python -m m3jax.plot %s draws them from its metrics.jsonl",
            type(e).__name__, e, run_dir)
        logging.getLogger(__name__).debug("the drawing's traceback", exc_info=True)
        return None


def plot_compare(run_dirs: list[str], keys: list[str], out: str, labels: list[str] | None = None) -> str:
    """One PNG with a panel per metric in `keys`, each run of `run_dirs` a curve (labelled by `labels` or the
    run directory's name): e.g. indexer/recall with and without model.indexer_loss_coef."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [os.path.basename(os.path.abspath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs: give one label per run")
    runs = [read_metrics(d) for d in run_dirs]
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes.flat, keys):  # a run keeps its colour in every panel, whether or not it logged the key
        _panel(ax, key, [(rows, key, label, f"C{i}") for i, (rows, label) in enumerate(zip(runs, labels))],
               "not logged in these runs")
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out
