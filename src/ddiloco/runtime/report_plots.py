"""The end of a run's plots (`report.write_report` draws them): `val_loss.png` (the global model's validation loss vs
time, each learner's training loss under it), `participation.png` (which learner was merged in which round, by the
update's staleness), `bytes.png` (bytes per direction per learner), with matplotlib's Agg backend, from the run
directory's files. A long run's metrics are streamed, not held: a line per learner per inner step."""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ddiloco.checkpoint import iter_jsonl
from ddiloco.runtime.progress import format_bytes
from ddiloco.runtime.run_paths import RunPaths

VAL_LOSS = "eval/val_loss"
"""The syncer's metric name for the global model's validation loss (process contract)."""
PLOT_DPI = 110
PLOT_SIZE_IN = (7.0, 4.0)
PLOT_MAX_POINTS = 4000
"""The most points a learner's training loss is drawn with (`_bucket_means`): about five per pixel of the plot."""
_LEARNER_LOSS = re.compile(r"^learner/(\d+)/loss$")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


class LossSeries(NamedTuple):
    """What `plot_val_loss` draws, read from a run's merged metrics."""

    train: dict[int, tuple[array, array]]
    """Each learner's (times, training losses)."""
    val: tuple[array, array]
    """The global model's (times, validation losses)."""
    resumed_at: list[float]
    """When each session after the first started (`run_started`): every series has a NaN there, so that its line
    breaks instead of joining the last point before a stop to the first after the resume."""
    not_finite: int
    """Validation losses that were not finite (written as null)."""
    start: float


def loss_series(paths: RunPaths) -> LossSeries:
    train: dict[int, tuple[array, array]] = {}
    val: tuple[array, array] = (array("d"), array("d"))
    resumed_at: list[float] = []
    not_finite, start, sessions = 0, math.inf, 0  # not finite: written as null (strict JSON)
    for record in iter_jsonl(paths.metrics):  # a long run's: millions of lines, streamed
        if not isinstance(record.get("time"), int | float):
            continue
        start = min(start, record["time"])
        started = record.get("event") == "run_started" and record.get("source") == "launcher"
        sessions += started
        if started and sessions > 1:
            resumed_at.append(record["time"])
            for times, values in (val, *train.values()):
                times.append(record["time"])
                values.append(math.nan)
        if isinstance(record.get(VAL_LOSS), int | float):
            val[0].append(record["time"])
            val[1].append(record[VAL_LOSS])
        elif VAL_LOSS in record and record[VAL_LOSS] is None:
            not_finite += 1
        for key, value in record.items():
            match = _LEARNER_LOSS.match(key)
            if match and isinstance(value, int | float):
                times, values = train.setdefault(int(match.group(1)), (array("d"), array("d")))
                times.append(record["time"])
                values.append(value)
    return LossSeries(train, val, resumed_at, not_finite, start)


def plot_val_loss(paths: RunPaths, out: Path) -> None:
    """Validation loss of the global model vs seconds since the run started, with each learner's
    training loss underneath for context; a dotted line where a --resume started a session."""
    plt = _pyplot()
    train, val, resumed_at, not_finite, start = loss_series(paths)
    fig, ax = plt.subplots(figsize=PLOT_SIZE_IN)
    plotted = list(val[1])
    for learner_id, (times, values) in sorted(train.items()):
        (times, values), steps = _bucket_means(times, values, PLOT_MAX_POINTS)
        label = f"learner {learner_id} train" + (f" (mean of each {steps} steps)" if steps > 1 else "")
        ax.plot([t - start for t in times], values, linewidth=0.6, alpha=0.4, label=label)
        plotted += values
    if val[0]:
        ax.plot([t - start for t in val[0]], val[1], marker="o", color="black", linewidth=1.8,
                label="global model, validation")
    else:
        _no_data(ax, f"none of the {not_finite} validation losses was finite (NaN or inf)" if not_finite
                 else "no validation loss recorded")
    for number, at in enumerate(resumed_at):
        ax.axvline(at - start, color="grey", linestyle=":", linewidth=1.0, label="resumed" if number == 0 else None)
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("loss (as the model's loss function measures it)")
    if loss_axis_scale(plotted) == "log":
        ax.set_yscale("log")
        ax.set_ylabel("loss, log scale (as the model's loss function measures it)")
    ax.set_title("validation loss vs time")
    if val[0] or train:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=PLOT_DPI)
    plt.close(fig)


LOG_SCALE_SPAN = 100.0
"""Losses (all positive) whose largest is more than this many times their smallest are drawn on a log axis: on a
linear one a learner whose training loss reached 9e6 flattened every other curve onto the axis, the validation loss
that went up with it included."""


def loss_axis_scale(values: Sequence[float]) -> str:
    """"log" where the positive `values` span more than LOG_SCALE_SPAN, else "linear" (a loss of 0 or below)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or min(finite) <= 0 or max(finite) <= LOG_SCALE_SPAN * min(finite):
        return "linear"
    return "log"


def _bucket_means(times: array, values: array, most: int) -> tuple[tuple[array, array], int]:
    """At most `most` points: the mean time and value of each run of consecutive points (a long run's learner has a
    training loss per inner step, far more than a plot's width shows); returns them and the points per mean (1: the
    points as they were)."""
    steps = max(1, math.ceil(len(times) / most))
    if steps == 1:
        return (times, values), 1
    means = array("d"), array("d")
    for begin in range(0, len(times), steps):
        count = min(steps, len(times) - begin)
        means[0].append(math.fsum(times[begin:begin + count]) / count)
        means[1].append(math.fsum(values[begin:begin + count]) / count)
    return means, steps


def participation_figure(paths: RunPaths, num_learners: int):
    """One mark per (round, learner merged in it), coloured by the update's staleness, one colour per number of
    versions late from 0 (a continuous scale spans -0.1 to 0.1 for a run whose every update came on time); each
    learner's label counts the rounds it was merged in. The caller saves and closes the figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=PLOT_SIZE_IN)
    xs, ys, staleness, rounds = [], [], [], 0
    merged = [0] * num_learners
    for record in iter_jsonl(paths.rounds):
        rounds += 1
        for participant in record.get("participants", []):
            xs.append(record["round"])
            ys.append(participant["learner_id"])
            staleness.append(int(participant.get("staleness", 0)))
            if 0 <= participant["learner_id"] < num_learners:
                merged[participant["learner_id"]] += 1
    if xs:
        most = max(1, max(staleness))
        points = ax.scatter(xs, ys, c=staleness, marker="|", s=60, cmap=plt.get_cmap("viridis", most + 1),
                            vmin=-0.5, vmax=most + 0.5)
        fig.colorbar(points, ax=ax, label="staleness (versions late)", ticks=range(0, most + 1, max(1, most // 8)))
    else:
        _no_data(ax, "no committed rounds")
    ax.set_yticks(range(num_learners), [f"{i} ({merged[i]})" for i in range(num_learners)])
    ax.set_ylim(-0.5, num_learners - 0.5)
    ax.set_xlabel("round")
    ax.set_ylabel(f"learner (rounds merged in, of {rounds})")
    ax.set_title("per-learner participation in rounds")
    fig.tight_layout()
    return fig


def plot_participation(paths: RunPaths, out: Path, num_learners: int) -> None:
    fig = participation_figure(paths, num_learners)
    fig.savefig(out, dpi=PLOT_DPI)
    _pyplot().close(fig)


def bytes_figure(summary: Mapping[str, Any]):
    """Bytes each learner sent (uplink, pseudo-gradients) and received (downlink, fragments). The caller saves and
    closes the figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=PLOT_SIZE_IN)
    ids = sorted(summary["learners"], key=int)
    sent = [(summary["learners"][i].get("bytes_sent") or 0) / 1e6 for i in ids]
    received = [(summary["learners"][i].get("bytes_received") or 0) / 1e6 for i in ids]
    genesis = [(summary["learners"][i].get("genesis_bytes_sent") or 0) / 1e6 for i in ids]
    width = 0.4
    ax.bar([int(i) - width / 2 for i in ids], sent, width, color="C0", label="learner -> syncer (uplink)")
    if any(genesis):  # the first learner's uplink holds the initial model it proposed, once
        ax.bar([int(i) - width / 2 for i in ids], genesis, width, fill=False, hatch="//", edgecolor="0.25", linewidth=0,
               label="of it, the initial model it proposed")
    ax.bar([int(i) + width / 2 for i in ids], received, width, color="C1",
           label="syncer -> learner (downlink)")
    syncer = summary.get("syncer", {})
    watched = f", to the evaluator {format_bytes(syncer['bytes_watched'])}" if syncer.get("bytes_watched") else ""
    # Two lines, and room above the bars for the legend: on one line the title runs off the figure's right edge, and
    # the legend covers the tallest bars.
    ax.set_title(f"bytes per direction\n(syncer: updates in {format_bytes(syncer.get('bytes_received'))}, "
                 f"fragments out {format_bytes(syncer.get('bytes_sent'))}{watched})", fontsize="medium")
    ax.set_ylim(0, 1.3 * max([*sent, *received, 1e-6]))
    ax.set_xticks([int(i) for i in ids])
    ax.set_xlabel("learner")
    ax.set_ylabel("MB")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_bytes(summary: Mapping[str, Any], out: Path) -> None:
    fig = bytes_figure(summary)
    fig.savefig(out, dpi=PLOT_DPI)
    _pyplot().close(fig)


def write_plots(paths: RunPaths, summary: Mapping[str, Any]) -> list[Path]:
    outs = [paths.root / "val_loss.png", paths.root / "participation.png", paths.root / "bytes.png"]
    plot_val_loss(paths, outs[0])
    plot_participation(paths, outs[1], int(summary["num_learners"]))
    plot_bytes(summary, outs[2])
    return outs
