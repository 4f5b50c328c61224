"""ddiloco: Decoupled DiLoCo for resilient, low-communication distributed pre-training.

Independent learners train their own copy of a model at their own pace; a CPU syncer merges
fragment-wise pseudo-gradients once a minimum quorum has reported, weights them by tokens, averages
them with radial-directional averaging and applies an outer Nesterov step.
Paper: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training", arXiv 2604.21428.

The public API (docs/your_model.md):

- `ddiloco.environment()`: this process's place in a run (learner id, number of learners, device, role);
- `ddiloco.session(model, optimizer, state=...)`: wrap a training loop; `sync.step(tokens=...)` per step;
- `ddiloco.watch(model, evaluate)`: evaluate the global model while the run trains;
- `ddiloco.InProcessHub`, `ddiloco.DilocoConfig`, `ddiloco.QuorumConfig`: the syncer in one process.
"""

import os

__version__ = "0.1.0"

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
"""Set before anything imports grpc. With gRPC's fork support on, every fork of a process whose gRPC threads run
(a torch DataLoader starting its workers inside a session, each epoch) printed "Other threads are currently calling
into gRPC, skipping fork() handlers" into the learner's log; no ddiloco process uses gRPC in a forked child. A value
the environment already holds is kept."""
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
"""gRPC core's own log lines below ERROR go: a learner retrying a TLS syncer it does not trust printed `I1206 ...
ssl_transport_security.cc] Handshake failed ...` to stderr at every attempt (23 lines in 40 s) beside ddiloco's one
line naming the fix. `GRPC_VERBOSITY=INFO` (or DEBUG) in the environment brings them back."""

_SESSION, _EVALUATOR = "ddiloco.learner_session", "ddiloco.evaluator"
_EXPORTS = {
    "DilocoConfig": "ddiloco.config", "LearnerConfig": "ddiloco.config", "QuorumConfig": "ddiloco.config",
    "RunConfig": "ddiloco.run_config", "InProcessHub": "ddiloco.inprocess",
    "RefusedError": "ddiloco.exit_status", "Session": _SESSION, "UnreachableError": "ddiloco.exit_status",
    "session": "ddiloco.session_setup", "Watcher": _EVALUATOR, "watch": _EVALUATOR,
}
"""Public name -> the module that owns it. Imported on first use, so `import ddiloco` (and the `ddiloco`
command's --help) does not pay for importing torch."""

# `environment` and `LearnerEnvironment` are bound now, not on first use: the submodule `ddiloco.environment` has the
# function's name, and the first import of it (by `ddiloco.session`, say) set the package's attribute to the module,
# so `ddiloco.environment()` then raised "'module' object is not callable". Imported here first, the name stays the
# function's (the module needs the standard library only).
from ddiloco.environment import LearnerEnvironment as LearnerEnvironment  # noqa: E402 (after the fork setting)
from ddiloco.environment import environment as environment  # noqa: E402

__all__ = sorted([*_EXPORTS, "LearnerEnvironment", "environment"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
