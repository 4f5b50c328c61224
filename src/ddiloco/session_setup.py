"""`ddiloco.session(...)`: a learner's session made from the environment `ddiloco run` (or torchrun) sets and
the caller's keywords. It resolves the run config, the syncer's address, the token and TLS files, and, in a job
of several torch.distributed ranks, this learner's process group: rank 0 gets the `Session`
(`ddiloco.learner_session`, which talks to the syncer), every other rank a `FollowerSession`
(`ddiloco.follower_session`). The session itself lives in those modules; this one only decides which to make,
once the model and optimizer passed `ddiloco.model_checks`.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.checks import invalid
from ddiloco.config import DilocoConfig, LearnerConfig
from ddiloco.environment import LearnerEnvironment, environment
from ddiloco.follower_session import FollowerSession
from ddiloco.inprocess import InProcessHub
from ddiloco.learner_checkpoint import Stateful
from ddiloco.learner_group import LearnerGroup, is_distributed, unwrap
from ddiloco.learner_session import UNBOUNDED_STEPS, Session
from ddiloco.model_checks import check_model
from ddiloco.non_finite import optimizers_in
from ddiloco.run_config import RunConfig

logger = logging.getLogger(__name__)


def session(model: nn.Module, optimizer: torch.optim.Optimizer, *, state: Mapping[str, Stateful] | None = None,
            hub: InProcessHub | None = None, learner_id: int | None = None, syncer: str | None = None,
            run_dir: str | Path | None = None, token_file: str | Path | None = None, token: str | None = None,
            config: RunConfig | DilocoConfig | str | Path | None = None, inner_steps: int | None = None,
            tls_ca: str | Path | bytes | None = None, tls_server_name: str | None = None, link: str | None = None,
            group: Any = None, **options: Any) -> Session | FollowerSession:
    """A `Session` for `model` trained by `optimizer`: use it as a context manager (see the module docstring).

    Inside a torchrun job (torch.distributed initialised, or RANK and WORLD_SIZE set: it is initialised here,
    gloo on cpu, nccl on cuda), the job's ranks are one learner: rank 0 gets the `Session`, the others a
    `FollowerSession` with the same loop surface (docs/your_model.md, "A learner of several devices"). Pass the
    DDP wrapper or its module, or an FSDP2 (`fully_shard`) model; `group=` a process group of this learner's
    ranks when the world holds more than them.

    Without keywords, everything comes from the environment `ddiloco run` sets (`environment()`). Keywords
    override it: `hub=` an `InProcessHub` (in process), or `syncer="host:port"` with `learner_id=`,
    `run_dir=`, `token_file=` (or the token itself, `token=`), `config=` (a `RunConfig`, a path to a run's
    config.json, or a `DilocoConfig`), TLS (`tls_ca=` a PEM file or its bytes, `tls_server_name=`) and
    `link=` ("2.5gbit,40ms", emulated). `inner_steps` sets the budget after which `done` turns true
    (default: the run config's). More `options`: `checkpoint_every_s`, `status_every_s`, `flush_timeout_s`,
    `handle_sigterm`, `sink`, `chaos_control`, `declare_config` (True: the model and data were built from `config`,
    as the built-in learner's are, and the syncer refuses the join where its run's settings differ),
    `max_tokens_per_step`: the most `tokens` one `step()` will
    count (your largest batch), declared to the syncer when joining; a `step()` over it raises ValueError, and
    without it the run's `QuorumConfig.max_tokens_per_step` is the bound (docs/your_model.md, "Tokens per step"),
    and `rank_wait_s`: in a learner of several ranks (gloo), the longest a rank waits for the others where a rank
    out of step shows (`ddiloco.learner_group.RANK_WAIT_S`, 300 s: the session's start, a `sync.step()`).
    """
    env = environment()
    if hub is None and env.role == "evaluator":
        # Else it would join as learner 0 (the id its environment holds), and the real learner 0 be refused.
        raise ValueError("this process is the run's evaluator (`ddiloco run --evaluate` starts one more copy of the "
                         "script): call ddiloco.watch(model, evaluate) in it instead of ddiloco.session(...), e.g. "
                         "`if ddiloco.environment().role == 'evaluator': ddiloco.watch(model, evaluate)`")
    run_config = _resolve_config(config, env, hub)
    learner_id = env.learner_id if learner_id is None else learner_id
    if isinstance(learner_id, bool) or not isinstance(learner_id, numbers.Integral) or learner_id < 0:
        # (in process the hub takes any number of learners: the Session's bound would read "2147483647 learners")
        raise invalid("learner_id", learner_id, "an integer >= 0 (this learner's id)")
    learner_id = int(learner_id)
    plain = unwrap(model)  # what the run syncs; `sync.model` stays the model as given, wrapper and all
    check_model(plain, optimizer)
    rank_wait_s = options.pop("rank_wait_s", None)
    learners_group = _learner_group(plain, env, group, rank_wait_s=rank_wait_s) if hub is None else None
    if learners_group is not None:
        learners_group.meet(optimizer)  # every rank opens its session (a bounded wait), then steps are counted
    if learners_group is not None and not learners_group.leader:
        return FollowerSession(model, optimizer, diloco=run_config.diloco, learner_id=learner_id, group=learners_group,
                               inner_steps=run_config.inner_steps, state=state,
                               handle_sigterm=options.get("handle_sigterm", True),
                               max_tokens_per_step=run_config.quorum.max_tokens_per_step)
    if learners_group is not None:
        options["group"] = learners_group
    if hub is None:
        syncer = syncer or env.syncer
        if syncer is None:
            raise ValueError("ddiloco.session: no syncer to connect to. Start the script with `ddiloco run -- python "
                             "SCRIPT`, pass syncer='host:port', or hub=InProcessHub(...) to train in this process")
        run_dir = run_dir if run_dir is not None else env.run_dir
        token_file = token_file if token_file is not None else env.token_file
        link = link if link is not None else env.link
        options.setdefault("chaos_control", env.chaos_control)
        options.setdefault("checkpoint_every_s", env.checkpoint_every_s)
    if inner_steps is not None:
        run_config = _replace(run_config, inner_steps=inner_steps)
    if token is None and token_file is not None:
        from ddiloco.transport.auth import read_token_file

        token = read_token_file(token_file)
    if token is not None:
        from ddiloco.transport.auth import token_for_learner

        token_for_learner(token, learner_id)  # another learner's token: refused here, not in the session's thread
    tls = tls_ca if isinstance(tls_ca, bytes) else None
    if isinstance(tls_ca, str | Path):
        from ddiloco.transport.auth import read_ca_file

        tls = read_ca_file(tls_ca)
    made = Session(model, optimizer, config=run_config, learner_id=learner_id, state=state, hub=hub, syncer=syncer,
                   run_dir=run_dir, token=token, link=link, tls_ca=tls, tls_server_name=tls_server_name, **options)
    # A second optimizer kept in state= (a GAN's) forgets its non-finite state with the first when the learner recovers.
    made.learner.other_optimizers = tuple(optimizers_in(state, leaving_out=optimizer))
    return made


def _learner_group(model: nn.Module, env: LearnerEnvironment, group: Any, *,
                   rank_wait_s: float | None) -> LearnerGroup | None:
    """This learner's ranks, when it has several (initialising torch.distributed from torchrun's variables)."""
    import torch.distributed as dist

    if env.world_size > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if env.device.startswith("cuda") else "gloo")
    if group is None and env.world_size > 1 and dist.is_initialized() and dist.get_world_size() != env.world_size:
        # Each rank would join as the whole learner, and all but one be refused as a second process of it.
        raise ValueError(f"this learner has {env.world_size} ranks (WORLD_SIZE, --nproc-per-learner), but the process "
                         f"group holds {dist.get_world_size()}: let init_process_group read them from the environment "
                         "(dist.init_process_group('gloo'), no rank= or world_size=), or pass group= the learner's "
                         "ranks")
    return LearnerGroup(model, group=group, rank_wait_s=rank_wait_s) if is_distributed(group) else None


def _replace(config: RunConfig, **changes: Any) -> RunConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def _resolve_config(config: RunConfig | DilocoConfig | str | Path | None, env: LearnerEnvironment,
                    hub: InProcessHub | None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str | Path):
        return RunConfig.load(config)
    if isinstance(config, DilocoConfig):
        learners = _HUB_LEARNERS if hub is not None else env.num_learners
        return RunConfig(diloco=config, num_learners=learners, inner_steps=UNBOUNDED_STEPS)
    if hub is not None:
        return RunConfig(diloco=hub.config, quorum=hub.quorum, learner=LearnerConfig(), num_learners=_HUB_LEARNERS,
                         inner_steps=UNBOUNDED_STEPS)
    if env.config is not None:
        return RunConfig.load(env.config)
    if env.run_dir is not None and (env.run_dir / "config.json").is_file():
        return RunConfig.load(env.run_dir / "config.json")
    return RunConfig(num_learners=env.num_learners)


_HUB_LEARNERS = 2**31 - 1
"""An in-process hub takes any number of learners (pass config=RunConfig(...) to say how many)."""
