"""Tables, plots and files of an experiment: what `ddiloco experiment` writes into its run directory.

Owns presentation only (nothing here runs a simulation):

- `results.json`: `ExperimentResult.to_json()` (the same object `--json` prints);
- `results.md`: the results table and the acceptance checks, as Markdown;
- `results_NAME.png`: validation loss against tokens and against virtual time for every system (with
  the fault plan's outages as red bands, one row per learner, when there is one), and a bar chart of
  the experiment's key metric (matplotlib, Agg backend);
- per system, `SYSTEM/settings.json`, `SYSTEM/events.jsonl` (the event log, one entry per line) and,
  for Decoupled DiLoCo, `SYSTEM/rounds.jsonl` (`RoundRecord.to_json()` of every committed round).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddiloco.sim.experiments import ExperimentResult

PERCENT_METRICS = ("goodput", "merged_work_fraction", "uptime", "uptime_while_alive", "blocked_fraction",
                   "loss_gap_vs_data_parallel")
BYTE_METRICS = ("bytes_up", "bytes_down", "payload_bytes_up", "payload_bytes_down", "peak_bytes_per_step_up",
                "peak_bytes_per_step_down", "max_bytes_per_step_up", "max_bytes_per_step_down")
KEY_METRIC = {"quality": "final_val_loss", "failures": "goodput", "heterogeneous": "goodput",
              "merge": "norm_ratio", "compression": "payload_bytes_up", "fragments": "peak_bytes_per_step_up"}
"""The metric each experiment's bar chart shows."""
FIGURE_SIZE_IN = (15.0, 4.2)
OUTAGE_BAND = 0.025
"""Height (axes fraction) of each learner's row of outage bands on the loss-vs-time plot."""
FIGURE_DPI = 100


def format_value(metric: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if metric in PERCENT_METRICS:
        return f"{100 * value:.1f} %"
    if metric in BYTE_METRICS:
        return _bytes(value)
    if metric.startswith("tokens"):
        return f"{value / 1e6:.3f} M"
    if metric.endswith("_s") and isinstance(value, int | float):  # one format down a column: it read 224 and 70.5722
        return f"{value:.1f} s"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def table_rows(result: ExperimentResult) -> list[list[str]]:
    return [[system] + [format_value(c, result.system_metrics(system).get(c)) for c in result.columns]
            for system in result.systems]


def markdown(result: ExperimentResult, *, command: str = "") -> str:
    header = ["system"] + result.columns
    lines = [f"### `{result.name}`" + (" (quick)" if result.quick else ""), ""]
    if command:
        lines += [f"Command: `{command}` ({result.wall_s:.0f} s wall time)", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    if result.checks:
        lines += ["", "| check | measured | passed |", "|---|---|---|"]
        lines += [f"| {c.name} | {c.measured} | {'yes' if c.passed else 'NO'} |" for c in result.checks]
    return "\n".join(lines) + "\n"


def rich_table(result: ExperimentResult):
    from rich.table import Table

    table = Table(title=f"ddiloco experiment {result.name}" + (" --quick" if result.quick else ""))
    table.add_column("system")
    for column in result.columns:
        table.add_column(column, justify="right")
    for row in table_rows(result):
        table.add_row(*row)
    return table


def plot(result: ExperimentResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tokens, ax_time, ax_bar) = plt.subplots(1, 3, figsize=FIGURE_SIZE_IN)
    for system, sim in result.systems.items():
        tokens = [p.tokens / 1e6 for p in sim.curve]
        times = [p.time_s for p in sim.curve]
        losses = [p.val_loss for p in sim.curve]
        ax_tokens.plot(tokens, losses, marker=".", label=system)
        ax_time.plot(times, losses, marker=".", label=system)
    ax_tokens.set(xlabel="tokens (M)", ylabel="validation loss", title="loss vs tokens")
    ax_time.set(xlabel="virtual time (s)", ylabel="validation loss", title="loss vs virtual time")
    for ax in (ax_tokens, ax_time):
        low = min(p.val_loss for sim in result.systems.values() for p in sim.curve)
        ax.set_ylim(low * 0.97, low * 1.6)  # the start (ln 256 = 5.5) would flatten the interesting part
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for outage in result.settings.get("faults", []):
        # One thin band per outage along the bottom of the time axis, one row per learner.
        row = OUTAGE_BAND * outage["learner"]
        ax_time.axvspan(outage["start_s"], outage["end_s"], ymin=row, ymax=row + OUTAGE_BAND, color="tab:red",
                        alpha=0.5, lw=0)
    metric = KEY_METRIC[result.name]
    names = list(result.systems)
    values = [float(result.system_metrics(n).get(metric) or 0.0) for n in names]
    ax_bar.bar(range(len(names)), values, color="tab:blue")
    ax_bar.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
    ax_bar.set(title=metric)
    ax_bar.grid(axis="y", alpha=0.3)
    fig.suptitle(f"ddiloco experiment {result.name}" + (" (quick)" if result.quick else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
    return path


def write_run(result: ExperimentResult, out_dir: Path, *, command: str = "") -> list[Path]:
    """Write every file of the run directory; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    path = out_dir / "results.json"
    path.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n", encoding="utf-8")
    written.append(path)
    path = out_dir / "results.md"
    path.write_text(markdown(result, command=command), encoding="utf-8")
    written.append(path)
    written.append(plot(result, out_dir / f"results_{result.name}.png"))
    for system, sim in result.systems.items():
        system_dir = out_dir / system
        system_dir.mkdir(exist_ok=True)
        (system_dir / "settings.json").write_text(json.dumps(sim.settings, indent=2) + "\n", encoding="utf-8")
        with (system_dir / "events.jsonl").open("w", encoding="utf-8") as file:
            for entry in sim.log:
                file.write(json.dumps(entry) + "\n")
        written += [system_dir / "settings.json", system_dir / "events.jsonl"]
        if sim.round_log:
            with (system_dir / "rounds.jsonl").open("w", encoding="utf-8") as file:
                for record in sim.round_log:
                    file.write(json.dumps(record.to_json()) + "\n")
            written.append(system_dir / "rounds.jsonl")
    return written
