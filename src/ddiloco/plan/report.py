"""Tables and plots of the planners' results: rich on the terminal, matplotlib (Agg) PNGs on disk.

Owns presentation only; the numbers come from `ddiloco.plan.goodput`, `ddiloco.plan.paper_grid`
and `ddiloco.plan.bandwidth`. matplotlib is imported when a plot is drawn, so the tables alone
start fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ddiloco.plan.bandwidth import GBPS, BandwidthPlan, LinkDemand
from ddiloco.plan.goodput import SYSTEM_LABELS, SYSTEMS, GoodputResult
from ddiloco.plan.paper_grid import PAPER_GOODPUT_PCT, PAPER_TOLERANCE_PCT, ROW_LABELS, PaperGrid

MIN_TABLE_WIDTH = 120
"""Tables wrap badly below this many columns; a pipe or a narrow terminal gets this width."""

PLOT_DPI = 120
LOG_AXIS_HEADROOM = 4.0
"""The log axis of the bandwidth plot starts this factor below its smallest bar."""


def console() -> Console:
    default = Console(highlight=False)
    return default if default.width >= MIN_TABLE_WIDTH else Console(highlight=False, width=MIN_TABLE_WIDTH)


def chips_label(chips: int) -> str:
    """150000 -> '150 k', 1200000 -> '1.2 M'."""
    return f"{chips / 1e6:g} M" if chips >= 1_000_000 else f"{chips / 1e3:g} k" if chips >= 1000 else str(chips)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def goodput_table(results: Sequence[GoodputResult], wall_time_ratios: Sequence[float | None] | None = None) -> Table:
    title = "Goodput (95 % confidence intervals over replicas)"
    if wall_time_ratios is not None:
        title += "; wall time x: time to train the same tokens, relative to no scavenging"
    table = Table(title=title)
    for name in ("chips", "M", "system", "goodput %", "95 % CI", "uptime %", "tokens / hour"):
        table.add_column(name, justify="left" if name == "system" else "right")
    if wall_time_ratios is not None:
        table.add_column("wall time x", justify="right")
    for i, r in enumerate(results):
        row = [f"{r.chips:,}", str(r.learners) if r.system == "decoupled" else "-", SYSTEM_LABELS[r.system],
               _pct(r.goodput.mean), f"{_pct(r.goodput.low)}-{_pct(r.goodput.high)}", _pct(r.uptime.mean),
               f"{r.tokens_per_hour.mean:.3e}"]
        if wall_time_ratios is not None:
            ratio = wall_time_ratios[i]
            row.append("-" if ratio is None else f"{ratio:.2f}x")
        table.add_row(*row)
    return table


def paper_grid_table(grid: PaperGrid, elapsed_s: float) -> Table:
    table = Table(title=f"Goodput %, simulated (paper) - worst gap {grid.worst_gap_pct():.1f} points, "
                        f"tolerance {PAPER_TOLERANCE_PCT:g}, {elapsed_s:.1f} s")
    table.add_column("system")
    for chips in grid.chips:
        table.add_column(chips_label(chips), justify="right")
    simulated = grid.simulated_pct()
    for row, values in simulated.items():
        cells = []
        for value, paper in zip(values, PAPER_GOODPUT_PCT[row], strict=True):
            mark = "" if abs(value - paper) <= PAPER_TOLERANCE_PCT else " !"
            cells.append(f"{value:.1f} ({paper}){mark}")
        table.add_row(ROW_LABELS[row], *cells)
    return table


def bandwidth_tables(plan: BandwidthPlan) -> list[Table]:
    tables = []
    for system in plan.systems:
        table = Table(title=f"{system.system}: {system.up_bytes_per_inner_step / 1e6:,.1f} MB up, "
                            f"{system.down_bytes_per_inner_step / 1e6:,.1f} MB down per learner and inner step")
        for name in ("link", "up Gbps (avg)", "down Gbps (avg)", "required Gbps"):
            table.add_column(name, justify="left" if name == "link" else "right")
        rows = [(system.learner.name, system.learner), *_collapsed(list(system.regions))]
        rows += [(system.syncer.name, system.syncer)] if system.syncer else []
        for name, link in rows:
            table.add_row(name, f"{link.up_bps / GBPS:,.3f}", f"{link.down_bps / GBPS:,.3f}",
                          f"{link.required_bps / GBPS:,.3f}")
        tables.append(table)
    return tables


COLLAPSE_LINKS_ABOVE = 8
"""Consecutive region links with the same figures beyond this many are one row of the table (`--json` keeps each):
with one region per learner by default, `--learners 100000` printed 300,000 rows in 97 s."""


def _collapsed(links: list[LinkDemand]) -> list[tuple[str, LinkDemand]]:
    """(name, link) rows: a run of more than COLLAPSE_LINKS_ABOVE consecutive links with the same figures as one row
    named by its first and last link and its count."""
    rows, start = [], 0
    while start < len(links):
        end = start + 1
        figures = (links[start].up_bps, links[start].down_bps, links[start].required_bps)
        while end < len(links) and (links[end].up_bps, links[end].down_bps, links[end].required_bps) == figures:
            end += 1
        if end - start > COLLAPSE_LINKS_ABOVE:
            rows.append((f"{links[start].name} .. {links[end - 1].name} ({end - start:,} links, each)", links[start]))
        else:
            rows.extend((link.name, link) for link in links[start:end])
        start = end
    return rows


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_paper_grid(grid: PaperGrid, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for row, results in grid.results.items():
        mean = [100 * r.goodput.mean for r in results]
        low = [100 * r.goodput.low for r in results]
        high = [100 * r.goodput.high for r in results]
        (line,) = ax.plot(grid.chips, mean, marker="o", label=ROW_LABELS[row])
        ax.fill_between(grid.chips, low, high, color=line.get_color(), alpha=0.2)
        ax.plot(grid.chips, PAPER_GOODPUT_PCT[row], linestyle="none", marker="x", markersize=8,
                color=line.get_color())
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(grid.chips, [chips_label(c) for c in grid.chips])
    ax.set_xlabel("chips (per-chip MTBI 1 year)")
    ax.set_ylabel("goodput %")
    ax.set_ylim(0, 100)
    ax.set_title("Simulated goodput (lines, 95 % CI bands) vs. paper (x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def plot_goodput(results: Sequence[GoodputResult], path: Path) -> Path:
    """Goodput against chips per system when several chip counts were simulated, else bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    chips = sorted({r.chips for r in results})
    systems = [s for s in SYSTEMS if any(r.system == s for r in results)]
    if len(chips) > 1:
        for system in systems:
            rows = sorted((r for r in results if r.system == system), key=lambda r: r.chips)
            x = [r.chips for r in rows]
            (line,) = ax.plot(x, [100 * r.goodput.mean for r in rows], marker="o", label=SYSTEM_LABELS[system])
            ax.fill_between(x, [100 * r.goodput.low for r in rows], [100 * r.goodput.high for r in rows],
                            color=line.get_color(), alpha=0.2)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(chips, [chips_label(c) for c in chips])
        ax.set_xlabel("chips")
        if "decoupled" in systems:
            ax.set_title(f"Decoupled DiLoCo with M = {results[-1].learners} learners")
        ax.legend(fontsize=8)
    else:
        means = [100 * r.goodput.mean for r in results]
        errors = [[100 * (r.goodput.mean - r.goodput.low) for r in results],
                  [100 * (r.goodput.high - r.goodput.mean) for r in results]]
        ax.bar([SYSTEM_LABELS[r.system] for r in results], means, yerr=errors, capsize=4)
        ax.set_title(f"{chips[0]:,} chips")
    ax.set_ylabel("goodput %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def plot_bandwidth(plan: BandwidthPlan, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [s.system.replace("_", " ") for s in plan.systems]
    up = [s.learner.up_bps / GBPS for s in plan.systems]
    down = [s.learner.down_bps / GBPS for s in plan.systems]
    required = [s.learner.required_bps / GBPS for s in plan.systems]
    width = 0.27
    positions = range(len(names))
    ax.bar([p - width for p in positions], up, width, label="up (average)")
    ax.bar(list(positions), down, width, label="down (average)")
    ax.bar([p + width for p in positions], required, width, label="required")
    for p, value in zip(positions, required, strict=True):
        ax.annotate(f"{value:.3g}", (p + width, value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(positions), names)
    ax.set_yscale("log")
    # Bars on a log axis start at the bottom edge: put it well below the smallest one.
    ax.set_ylim(bottom=min(v for v in up + down + required if v > 0) / LOG_AXIS_HEADROOM)
    ax.set_ylabel("Gbps per learner link")
    c = plan.config
    ax.set_title(f"{c.params:.3g} params, {c.step_time_s:g} s/step, M = {c.learners}, P = {c.num_fragments}, "
                 f"H = {c.sync_every}, tau = {c.overlap_steps}, {c.codec} up / {c.downlink_codec} down", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path
