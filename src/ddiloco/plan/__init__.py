"""Planning at scale: decide a training layout before renting the hardware.

- `ddiloco.plan.goodput`: a fast simulator of goodput and uptime on 10 k to millions of chips for
  data-parallel, elastic data-parallel and Decoupled DiLoCo (Douillard et al., arXiv 2604.21428):
  `scenario` (what to simulate), `systems` (what a failure costs each system), `failures` (Poisson
  interruptions, exponentiated Weibull recovery), `timeline` (interval arithmetic) and `speed`
  (waits caused by slower learners and the quorum).
- `ddiloco.plan.paper_grid`: the paper's goodput grid, the calibrated preset, the simulated grid.
- `ddiloco.plan.bandwidth`: link bandwidth for Decoupled DiLoCo, synchronous DiLoCo, data-parallel.
- `ddiloco.plan.run_bytes`: the bytes one of ddiloco's own runs moves, per learner and direction.
- `ddiloco.plan.report`: tables and PNG plots; `ddiloco.plan.commands`: `ddiloco plan goodput` and
  `ddiloco plan bandwidth`.

Nothing here imports torch except `run_bytes`, so the planners start in a fraction of a second.
"""
