"""The virtual-time harness: Decoupled DiLoCo and its baselines in one process, on a discrete-event clock.

Real inner steps on the real model and data, simulated time, links and failures, the same `Learner`
and `Syncer` cores as the real runtime. Modules: `engine` (event loop and log), `links`, `faults`,
`cluster` (speeds, jitter), `workload` (model, data, budget, evaluation), `decoupled` (the Decoupled
and synchronous DiLoCo driver, with `syncer_node`, the syncer's side, and `learner_slot`, one learner id
across its incarnations), `data_parallel` (the baselines), `accounting` (what the harness books
for `ddiloco.goodput`, which defines the metrics), `replay` (determinism checks), `probes`, `experiments`,
`report`, `commands` (`ddiloco experiment`).
Results: docs/results.md.
"""
