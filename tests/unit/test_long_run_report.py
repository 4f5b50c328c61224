"""The end-of-run report of a long run: metrics streamed, not held (`benchmarks/bench_report.py` measures it), with
the same result as a merge in memory; what a line said of itself kept."""

from __future__ import annotations

import json
import random
from pathlib import Path

import ddiloco.runtime.report as report
import ddiloco.runtime.report_plots as report_plots
from ddiloco.checkpoint import read_jsonl
from ddiloco.runtime.report import merge_metrics
from ddiloco.runtime.report_plots import plot_val_loss
from ddiloco.runtime.run_paths import RunPaths


def write_lines(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_line_keeps_the_source_it_names_beside_the_process_it_came_from(tmp_path):
    # The syncer's `start` and `genesis` events name where the state came from in `source`: the merge overwrote it
    # with "syncer", and metrics.jsonl no longer said which learner (or --init file) the run's genesis came from.
    paths = RunPaths(tmp_path / "run")
    write_lines(paths.syncer_metrics, [{"event": "start", "time": 1.0, "source": "init"},
                                       {"event": "genesis", "time": 2.0, "source": "learner 1 (ipv4:127.0.0.1:5)"}])
    merge_metrics(paths)
    assert [(r["source"], r["event_source"]) for r in read_jsonl(paths.metrics)] == [
        ("syncer", "init"), ("syncer", "learner 1 (ipv4:127.0.0.1:5)")]


def test_the_streamed_merge_is_every_line_in_time_order_ties_in_source_order(tmp_path):
    rng = random.Random(0)
    paths = RunPaths(tmp_path / "run")
    sources = {"syncer": paths.syncer_metrics, "evaluator": paths.evaluator_metrics,
               "launcher": paths.launcher_metrics, "learner/0": paths.learner_metrics(0),
               "learner/1": paths.learner_metrics(1)}
    written = {}
    for source, path in sources.items():
        times = sorted(rng.choice((1.0, 2.0, 2.5, 3.0)) + rng.randrange(50) for _ in range(200))
        written[source] = [{"time": t, "n": i, "from": source} for i, t in enumerate(times)]
        write_lines(path, written[source])
    expected = sorted((r for s in report.metric_sources(paths) for r in written[s]), key=lambda r: r["time"])
    assert merge_metrics(paths) == 1000
    assert [(r["from"], r["n"]) for r in read_jsonl(paths.metrics)] == [(r["from"], r["n"]) for r in expected]

    # A source out of time order (a clock set back between sessions) is still merged into time order.
    write_lines(paths.learner_metrics(1), [*written["learner/1"], {"time": 0.5, "n": 200, "from": "learner/1"}])
    assert merge_metrics(paths) == 1001
    times = [r["time"] for r in read_jsonl(paths.metrics)]
    assert times == sorted(times) and times[0] == 0.5


def test_a_training_loss_longer_than_the_plot_is_drawn_as_the_means_of_its_steps(tmp_path, monkeypatch):
    # A long run's learner has a loss per inner step: a million points drawn one by one took seconds and memory for a
    # plot 770 pixels wide.
    paths = RunPaths(tmp_path / "run")
    write_lines(paths.launcher_metrics, [{"event": "run_started", "time": 50.0}])
    write_lines(paths.learner_metrics(0), [{"step": s, "time": 100.0 + s, "learner/0/loss": float(s)}
                                           for s in range(1, 96)])
    write_lines(paths.learner_metrics(1), [{"step": 1, "time": 101.0, "learner/1/loss": 7.0}])
    merge_metrics(paths)
    drawn = []
    monkeypatch.setattr(report_plots, "PLOT_MAX_POINTS", 10)
    from matplotlib.axes import Axes
    real_plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, x, y, **kw: drawn.append((list(x), list(y), kw["label"]))
                        or real_plot(ax, x, y, **kw))
    plot_val_loss(paths, tmp_path / "val_loss.png")
    (x0, y0, label0), (x1, y1, label1) = drawn
    assert label0 == "learner 0 train (mean of each 10 steps)" and len(y0) == 10
    assert y0[0] == sum(range(1, 11)) / 10 and y0[-1] == sum(range(91, 96)) / 5  # the last run of 5
    assert x0[0] == 100.0 + 5.5 - 50.0  # seconds since the run's first line, as before
    assert (x1, y1, label1) == ([51.0], [7.0], "learner 1 train")  # short: as it was
