"""Which joins the syncer service refuses before its Syncer core sees them, and a new run's genesis from --init.

Three rules over what the service knows, without I/O or locks of their own (the service holds its lock where they
read the core or its subscriptions):

- `join_refusal`: a learner id outside the run, an algorithm config or a model that differs from the run's;
- `duplicate_process`: a second live process of one learner id, or a join that does not name its process while a live
  process holds the id; a process that died or fell silent is replaced;
- `genesis_for_join`: a new run's first join gets the parameters of the `--init` file, restricted to the learner's
  own parameter names and checked against their shapes, or is asked for its own (`NO_GENESIS`).

What the core refuses on a join (`ddiloco.admission`), and making a genesis durable, stay with the core and the
service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddiloco.clock import Clock
from ddiloco.messages import Join
from ddiloco.run_config import RunConfig, fixed_differences
from ddiloco.runtime.syncer_state import GenesisRecord, genesis_from_init
from ddiloco.syncer import Syncer
from ddiloco.transport.grpc_codec import config_difference, shortened
from ddiloco.transport.grpc_common import NO_GENESIS
from ddiloco.transport.subscription import Subscription
from ddiloco.transport.syncer_handler import AnotherProcess

MIN_DUPLICATE_WINDOW_S = 3.0
"""A learner's process heard from within two of its heartbeat periods (and at least this long) is alive: another
process joining with its id is refused."""


def join_refusal(run_config: RunConfig, syncer: Syncer | None, join: Join, diloco_config: dict) -> str | None:
    """Why `join` does not belong to this run, or None. `syncer`: None before the genesis (no model to differ)."""
    if join.learner_id >= run_config.num_learners:
        return (f"learner_id {join.learner_id} is outside 0..{run_config.num_learners - 1}: the run has "
                f"{run_config.num_learners} learners (data shards)")
    # The run config a learner declared first: it names every setting that differs (the algorithm's among them) with
    # the advice to start it with the run's config.json, where the algorithm's check names one (it went flag by flag).
    declared = _declared_differences(run_config, join.run_config)
    if declared is not None:
        return declared
    difference = config_difference(run_config.diloco, diloco_config)
    if difference is not None:
        return f"algorithm config differs: {difference}"
    model = syncer.spec.difference(join.model_spec) if syncer is not None else None
    if model is not None:
        return f"model differs from the syncer's: {model}"
    return None


def _declared_differences(run_config: RunConfig, declared: Mapping[str, Any] | None, *,
                          who: str = "learner", sections: tuple[str, ...] | None = None) -> str | None:
    """Why the run config a learner declared (the built-in learner's: its model and data were built from it) is not this
    run's, or None. Unchecked, a learner started by hand without the run's config.json (its own run directory on its
    host) that joins first with the default model would make that model the run's genesis for good, and every learner
    with the run's settings would then be refused as a different model. `sections`: compare only these (all that a run
    cannot change when None)."""
    if declared is None:
        return None
    try:
        theirs = RunConfig.from_dict(dict(declared))
    except (TypeError, ValueError) as exc:
        return f"the run config this {who} declared cannot be read by this syncer: {shortened(str(exc))}"
    differences = fixed_differences(run_config, theirs, sections=sections)
    if not differences:
        return None
    return (f"this {who}'s settings differ from the run's: {', '.join(differences)}; start it with the run's "
            "config.json (--config FILE, a copy of the syncer's DIR/config.json)")


def watch_refusal(run_config: RunConfig, declared: Mapping[str, Any] | None) -> str | None:
    """Why an evaluator that declared the run config its model and validation data were built from (the built-in
    evaluator) is refused, or None: a model or data setting differs from the run's. Admitted, one started by hand with
    other settings of the same shapes (4 heads for 2) would load the global model into another architecture, and one
    with another validation share would measure other data, without a word."""
    return _declared_differences(run_config, declared, who="evaluator", sections=("model", "data"))


def duplicate_process(run_config: RunConfig, syncer: Syncer | None, learner_id: int, session: str, *,
                      old: Subscription | None, clock: Clock) -> AnotherProcess | None:
    """Why a join must be refused as a second live process of one learner, or None. `session`: the joining process
    (empty: it sent none); `old`: the learner's open subscription. It belongs to another process, and that process is
    alive: heard from (heartbeats, updates) within two heartbeat periods. A process that died (its stream ended) or
    fell silent (a crashed machine whose connection is half open) is replaced by the new one.

    A join without a session cannot show it is the live process, so it is refused too (it used to replace that
    process's subscription, silently, and a client joining in a loop made the learner rejoin each time); every ddiloco
    client names its process (`SyncerClient.session`). A subscription without a session can be told apart from no
    other, and is replaced as before."""
    info = syncer.learners.get(learner_id) if syncer is not None else None
    if old is None or not old.session or old.session == session:
        return None
    window = max(MIN_DUPLICATE_WINDOW_S, 2 * run_config.learner.heartbeat_every_s)
    if info is None or not info.alive or clock.now() - info.last_seen >= window:
        return None
    age = clock.now() - old.since
    held = (f"learner {learner_id} is already connected: process {shown_session(old.session)} from {old.peer}, "
            f"joined {age:.0f} s ago")
    if not session:
        return AnotherProcess(f"{held}; this join does not name its process (no ddiloco-session metadata), so it "
                              "cannot take that process's place while it is alive: join with ddiloco's client, or "
                              "stop the other process")
    return AnotherProcess(f"{held}; two processes were started with --learner-id {learner_id} (stop one)")


def shown_session(session: str) -> str:
    """A process's session as a refusal shows it to another caller: its host and pid (`host/1234`), not the random
    part that sets it apart from a later process of the same pid (`SyncerClient.session`). With the whole of it, a
    caller holding the learner's token could name itself as the live process and act for it."""
    host_pid, _, rest = session.rpartition("/")
    return host_pid if host_pid and rest else session


def replaced_process(learner_id: int, session: str, *, holder: Subscription | None, clock: Clock) -> str | None:
    """Why a call of process `session` for `learner_id` is refused, or None. `holder`: the learner's subscription,
    which another process took after this one's stream ended or it fell silent (`duplicate_process`); this process
    still calling (a SIGSTOPped process continued, a partition healed) would have its update merged beside the new
    process's, which trains the same data, its heartbeats keep the learner alive and its Leave end the new process's
    membership. A call that names no process while the holder names its own is refused too: every ddiloco client
    names its process on every call (wire schema 6), and such calls (a Leave in a loop) made the live process leave
    and join again 195 times in 8 s. A subscription that names no process cannot be told apart, and any call passes."""
    if holder is None or not holder.session or holder.session == session:
        return None
    age = clock.now() - holder.since
    held = (f"learner {learner_id} is held by process {shown_session(holder.session)} from {holder.peer}, joined "
            f"{age:.0f} s ago")
    if not session:
        return (f"{held}; this call names no process (no ddiloco-session metadata), so it cannot act for it: every "
                "ddiloco client names its process on each call")
    return (f"{held}; this process ({session}) was replaced (its stream had ended or it fell silent), so it stops and "
            "leaves the learner's checkpoint to that process")


def genesis_for_join(join: Join, init: dict[str, torch.Tensor] | None, init_source: str) -> GenesisRecord | str:
    """A new run's first join: the genesis from the --init file's tensors `init`, NO_GENESIS to ask the learner
    for its own parameters, or why the file does not fit the learner's model."""
    if init is None:
        return NO_GENESIS
    by_name = join.model_spec.by_name()
    made = genesis_from_init(init, list(by_name), join.embeddings, {name: spec.shape for name, spec in by_name.items()},
                             init_source, join.aliases, join.buffers)
    if isinstance(made, str):
        return f"model differs from the run's --init file: {made}"
    return made
