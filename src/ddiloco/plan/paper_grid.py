"""The paper's goodput grid: its published numbers, the calibrated preset, and the simulated grid.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) reports goodput at 150 k to 2.4 M chips with a
per-chip mean time between interruptions of one year, for data-parallel with and without elasticity
and for Decoupled DiLoCo with M = 2, 4, 8, 16 learners (88 and 27 at 1.2 M chips are confirmed by
the DeepMind blog; the rest comes from one detailed write-up). The simulated values are never copied
from the paper: they come from `ddiloco.plan.goodput` with the calibrated defaults of the configs in
`ddiloco.plan.scenario` and `ddiloco.plan.failures`, whose derivation docs/planning.md gives.
`PAPER_TOLERANCE_PCT` is the acceptance bound per cell.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddiloco.plan.goodput import GoodputResult, simulate
from ddiloco.plan.scenario import Scenario, SimulationConfig

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

PAPER_GOODPUT_PCT = {
    "data_parallel": (72, 57, 38, 27, 18),
    "elastic_data_parallel": (88, 80, 69, 58, 40),
    "decoupled_m2": (94, 88, 80, 70, 54),
    "decoupled_m4": (96, 93, 89, 82, 73),
    "decoupled_m8": (98, 96, 94, 88, 80),
    "decoupled_m16": (99, 98, 96, 93, 86),
}
"""Goodput in percent, per-chip MTBI one year (arXiv 2604.21428, section 4)."""

GRID_ROWS = {
    "data_parallel": ("data_parallel", None),
    "elastic_data_parallel": ("elastic_data_parallel", None),
    "decoupled_m2": ("decoupled", 2),
    "decoupled_m4": ("decoupled", 4),
    "decoupled_m8": ("decoupled", 8),
    "decoupled_m16": ("decoupled", 16),
}
"""Row key -> (system, learners); None keeps the scenario's learners (data-parallel ignores them
unless learner speeds differ)."""

ROW_LABELS = {
    "data_parallel": "data-parallel, no elasticity",
    "elastic_data_parallel": "data-parallel, elastic",
    "decoupled_m2": "Decoupled DiLoCo, M = 2",
    "decoupled_m4": "Decoupled DiLoCo, M = 4",
    "decoupled_m8": "Decoupled DiLoCo, M = 8",
    "decoupled_m16": "Decoupled DiLoCo, M = 16",
}

PAPER_TOLERANCE_PCT = 4.0
"""Acceptance: every simulated cell within 4 goodput points of the paper's."""


def grid_simulation(seed: int = 0) -> SimulationConfig:
    """The grid's simulation budget: 5 replicas of 8 k failures per cell, about 2 s for all 30 cells
    on two cores, with 95 % intervals of a few tenths of a point."""
    return SimulationConfig(failures=8000, replicas=5, seed=seed)


def cell_scenario(base: Scenario, row: str, chips: int) -> Scenario:
    """`base` (the calibrated defaults unless overridden) at `chips` chips, laid out for `row`."""
    _, learners = GRID_ROWS[row]
    layout = base.layout
    learners = layout.learners if learners is None else learners
    layout = dataclasses.replace(layout, chips=chips, learners=learners,
                                 min_quorum=min(layout.min_quorum, learners))
    return dataclasses.replace(base, layout=layout)


@dataclass(frozen=True)
class PaperGrid:
    """Simulated results per row and chip count, beside the paper's numbers."""

    chips: tuple[int, ...]
    results: dict[str, tuple[GoodputResult, ...]]

    def simulated_pct(self) -> dict[str, list[float]]:
        return {row: [100 * r.goodput.mean for r in results] for row, results in self.results.items()}

    def gaps_pct(self) -> dict[str, list[float]]:
        """Simulated minus paper, in goodput points."""
        return {row: [s - p for s, p in zip(sim, PAPER_GOODPUT_PCT[row], strict=True)]
                for row, sim in self.simulated_pct().items()}

    def worst_gap_pct(self) -> float:
        return max(abs(g) for gaps in self.gaps_pct().values() for g in gaps)

    def to_json(self) -> dict:
        """{"chips", "simulated", "paper"} (goodput in percent) plus 95 % intervals and uptime."""
        return {
            "chips": list(self.chips),
            "simulated": {row: [round(v, 2) for v in values] for row, values in self.simulated_pct().items()},
            "paper": {row: list(PAPER_GOODPUT_PCT[row]) for row in self.results},
            "simulated_ci95": {row: [[round(100 * r.goodput.low, 2), round(100 * r.goodput.high, 2)]
                                     for r in results] for row, results in self.results.items()},
            "uptime": {row: [round(100 * r.uptime.mean, 2) for r in results] for row, results in self.results.items()},
            "worst_gap": round(self.worst_gap_pct(), 2),
            "tolerance": PAPER_TOLERANCE_PCT,
        }


def run_paper_grid(base: Scenario | None = None, sim: SimulationConfig | None = None) -> PaperGrid:
    """Simulate every cell of the paper's grid (30 cells, about 2 s with `grid_simulation()`)."""
    base = Scenario() if base is None else base
    sim = grid_simulation() if sim is None else sim
    results = {}
    for row, (system, _) in GRID_ROWS.items():
        results[row] = tuple(simulate(system, cell_scenario(base, row, chips), sim) for chips in PAPER_CHIPS)
    return PaperGrid(PAPER_CHIPS, results)
