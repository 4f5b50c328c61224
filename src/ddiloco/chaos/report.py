"""The report of a chaos run: report.md, results.json and plots, from the analysis and invariants.

Owns presentation only: the numbers come from `ddiloco.chaos.analysis` (per system) and
`ddiloco.chaos.invariants`, the plan from DIR/plan.json. Plots use matplotlib's Agg backend, so a
machine without a display can write them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ddiloco.chaos.analysis import DATA_PARALLEL, SYSTEMS
from ddiloco.chaos.invariants import check_invariants
from ddiloco.checkpoint import read_json

REPORT = "report.md"
RESULTS = "results.json"
SETTINGS = "settings.json"
"""How `ddiloco chaos` ran the systems (`ChaosSettings`), saved beside plan.json."""
PLOTS = ("val_loss.png", "progress.png", "goodput_uptime.png")
DEFINITIONS = """\
- **goodput**: useful learner-seconds / allocated learner-seconds (M x the window). The window runs from
  the first inner step of any learner (rank) to the stop. Decoupled / sync DiLoCo: each learner's inner
  steps in the window, less those lost (rejected, dropped, crashed with a process, replaced by a re-join's
  Welcome, accepted but never merged), each fragment weighted by its share of the parameters, times the
  learner's nominal step time. Data-parallel: steps kept (not rolled back by a restart) x nominal step
  time. Nominal step time: the median interval between consecutive steps, so slowed, waiting or hung
  steps count only a normal step's worth; at most the window / the steps in it, so that no learner is
  booked more than the window.
- **uptime**: share of the window's bins in which the global model advanced (a committed round; DP: a
  step above every earlier one); the definitions are `ddiloco.goodput`'s.
- **stall**: from a fault's start to the next advance of the global model; **rejoin**: from its end to
  the target's next contribution (a round merging the learner; the next round for the syncer; the
  rank's next step for DP). "-" when it did not happen before the stop.
- **rounds/min**: committed rounds per minute (DP: kept steps per minute). **bytes**: syncer payload
  bytes sent + received (DP: all-reduce bytes, computed from the model size).
"""


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _ordered(results: dict[str, Any]) -> list[str]:
    return [s for s in SYSTEMS if s in results] + sorted(s for s in results if s not in SYSTEMS)


def collect_invariants(run_dir: Path, systems: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    return {name: check_invariants(run_dir / name) for name in systems if (run_dir / name).is_dir()}


def summarize_invariants(details: dict[str, dict[str, dict[str, Any]]]) -> dict[str, bool]:
    """{check: True only if it holds in every system it applies to}."""
    out: dict[str, bool] = {}
    for checks in details.values():
        for name, result in checks.items():
            out[name] = out.get(name, True) and bool(result["ok"])
    return out


def _markdown(results: dict[str, Any], details: dict[str, Any], plan: dict[str, Any] | None,
              settings: dict[str, Any] | None = None, interrupted: dict[str, Any] | None = None) -> str:
    systems = _ordered(results)
    lines = ["# Chaos run", ""]
    if interrupted:
        not_run = f"; not run: {', '.join(interrupted['not_run'])}" if interrupted["not_run"] else ""
        lines += [f"**Partial comparison**: the run was interrupted ({interrupted['signal']}) during "
                  f"{interrupted['cut_short']}, which is left out{not_run}. Only the systems below ran their plan "
                  "to the end.", ""]
    if plan:
        lines += [f"Plan: {len(plan.get('faults', []))} faults over {plan.get('duration_s')} s per system, "
                  f"{plan.get('num_learners')} learners, seed {plan.get('seed')} ({plan.get('source') or 'given'}).",
                  ""]
    if settings:
        restarts = "warm (standby processes)" if settings.get("warm_restarts") else "cold (new interpreters)"
        lines += [f"Restarts: {restarts}; data-parallel checkpoint every {settings.get('dp_checkpoint_every_s')} s; "
                  f"{settings.get('threads')} torch thread(s) per process.", ""]
    lines += ["## Systems", ""]
    lines += _table(["system", "goodput", "uptime", "final val loss", "rounds/min", "bytes", "faults", "restarts"],
                    [[s, _fmt(r["goodput"], ".1%"), _fmt(r["uptime"], ".1%"), _fmt(r.get("final_val_loss"), ".4f"),
                      _fmt(r["rounds_per_min"], ".1f") + ("" if r.get("progress_unit") == "rounds"
                                                          else f" ({r.get('progress_unit')})"),
                      _fmt(r["bytes"], ",d"), str(r.get("faults_injected", len(r["faults"]))),
                      str(r.get("restarts"))] for s, r in ((s, results[s]) for s in systems)])
    lines += ["## Recovery per fault", ""]
    rows = []
    for s in systems:
        for f in results[s]["faults"]:
            rows.append([s, str(f.get("index")), str(f.get("kind")), str(f.get("target")), _fmt(f["start_s"], ".1f"),
                         _fmt(f["duration_s"], ".1f"), _fmt(f["stall_s"], ".2f"), _fmt(f["rejoin_s"], ".2f")])
    # From the launch, where the measured window starts: later than the plan's `at` by the processes' start-up.
    lines += _table(["system", "fault", "kind", "target", "start (s after launch)", "duration (s)", "stall (s)",
                     "rejoin (s)"],
                    rows) if rows else ["No fault was executed.", ""]
    lines += ["## Invariants", ""]
    rows = [[s, name, "ok" if r["ok"] else "**FAILED**", r["detail"].replace("|", "/")]
            for s in systems if s in details for name, r in details[s].items()]
    lines += _table(["system", "invariant", "result", "detail"], rows) if rows else ["No invariant checked.", ""]
    if plan:
        lines += ["## Plan", ""]
        lines += _table(["at (s)", "kind", "target", "duration (s)", "restart", "value"],
                        [[_fmt(f["at_s"], ".1f"), f["kind"],
                          "syncer" if f["target"] is None else f"learner-{f['target']}",
                          _fmt(f["duration_s"], ".1f"), str(f["restart"]).lower(), _fmt(f["value"], "g")]
                         for f in plan.get("faults", [])])
    lines += ["## Definitions", "", DEFINITIONS,
              "Plots: " + ", ".join(f"[{name}]({name})" for name in PLOTS), ""]
    return "\n".join(lines)


def _plots(run_dir: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = _ordered(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in systems:
        points = results[s]["val_loss"]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=s)
    ax.set_xlabel("wall time since the first inner step (s)")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss vs wall time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / PLOTS[0], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(systems), 1, figsize=(7, 2.4 * max(1, len(systems))), squeeze=False)
    for ax, s in zip(axes[:, 0], systems, strict=True):
        r = results[s]
        for f in r["faults"]:
            end = f["end_s"] if f["end_s"] > f["start_s"] else f["start_s"] + r["window_s"] / 200
            ax.axvspan(f["start_s"], end, color="tab:red", alpha=0.15)
            ax.annotate(str(f.get("kind")), (f["start_s"], 0), xycoords=("data", "axes fraction"),
                        fontsize=6, rotation=90, va="bottom")
        # From the window's start (nothing committed yet) to its end, so the last flat stretch shows.
        points = ([[0.0, 0]] if s != DATA_PARALLEL else []) + r["progress"]
        points = points + [[r["window_s"], points[-1][1]]] if points else points
        ax.step([p[0] for p in points], [p[1] for p in points], where="post")
        unit = "global step" if s == DATA_PARALLEL else r.get("progress_unit", "rounds")
        ax.set_ylabel(unit)
        ax.set_title(s, fontsize=9)
    axes[-1, 0].set_xlabel("wall time since the first inner step (s); faults shaded")
    fig.tight_layout()
    fig.savefig(run_dir / PLOTS[1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    xs = range(len(systems))
    ax.bar([x - width / 2 for x in xs], [results[s]["goodput"] for s in systems], width, label="goodput")
    ax.bar([x + width / 2 for x in xs], [results[s]["uptime"] for s in systems], width, label="uptime")
    ax.set_xticks(list(xs), systems)
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title("Goodput and uptime under the same faults")
    fig.tight_layout()
    fig.savefig(run_dir / PLOTS[2], dpi=100)
    plt.close(fig)


def write_report(run_dir: str | Path, results: dict[str, dict[str, Any]],
                 invariants: dict[str, dict[str, dict[str, Any]]] | None = None, *,
                 interrupted: dict[str, Any] | None = None) -> Path:
    """Write DIR/report.md, DIR/results.json and the plots; returns the report's path.

    `results` is {system: analysis results} (`ddiloco.chaos.analysis.analyze_run`); `invariants`
    {system: check_invariants(...)}, checked here from the system directories when not given. `interrupted`
    ({"signal", "cut_short": SYSTEM, "not_run": [SYSTEM, ...]}): a signal stopped the run, and `results` holds the
    systems that had finished; the report says it is partial, results.json keeps it under "interrupted".
    """
    run_dir = Path(run_dir)
    details = invariants if invariants is not None else collect_invariants(run_dir, _ordered(results))
    plan = read_json(run_dir / "plan.json")
    settings = read_json(run_dir / SETTINGS)
    document = {"systems": results, "invariants": summarize_invariants(details), "invariant_details": details,
                "plan": plan, "settings": settings}
    if interrupted is not None:
        document["interrupted"] = interrupted
    (run_dir / RESULTS).write_text(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n",
                                   encoding="utf-8")
    _plots(run_dir, results)
    path = run_dir / REPORT
    path.write_text(_markdown(results, details, plan, settings, interrupted), encoding="utf-8")
    return path
