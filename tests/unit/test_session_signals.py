"""A session and the process's signals, over real gRPC to a syncer served in this process: the user's own SIGTERM
handler still runs (once, after the session has checkpointed and left), a session on another thread says that SIGTERM
cannot stop it cleanly, and a second session of the same learner inside the first is refused at its start."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.config import DilocoConfig
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.transport.grpc_server import start_server

RUN = RunConfig(diloco=DilocoConfig(num_fragments=2, sync_every=4), num_learners=1, inner_steps=1000)
WAIT_S = 30.0


@pytest.fixture
def syncer(tmp_path):
    """The address of a syncer serving RUN from this process (the first learner gives the genesis)."""
    service = SyncerService(RUN, None, SyncerStore(tmp_path / "syncer"), sink=NullSink())
    server, port = start_server(service, "127.0.0.1:0", token=None)
    service.start(f"127.0.0.1:{port}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        service.close(server)


@pytest.fixture
def sigterm_handler():
    """SIGTERM's handler as the test found it, back in place after the test."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield previous
    finally:
        signal.signal(signal.SIGTERM, previous)


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(sync, model, optimizer, *, on_step=lambda inner_step: None) -> None:
    generator = torch.Generator().manual_seed(0)
    while not sync.done:
        x = torch.randn(8, 4, generator=generator)
        loss = nn.functional.mse_loss(model(x), x[:, :2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x))
        on_step(sync.inner_step)


def test_the_users_sigterm_handler_runs_once_after_the_session_checkpointed_and_left(syncer, tmp_path,
                                                                                     sigterm_handler):
    # A SLURM requeue handler, installed before the session, was replaced for the whole session and never called.
    model, optimizer = model_and_optimizer()
    calls = []
    checkpoint = tmp_path / "run" / "learners" / "0" / "checkpoint"

    def users_handler(signum, frame):
        calls.append((signum, sync.final_state, checkpoint.is_dir(), frame is not None))

    signal.signal(signal.SIGTERM, users_handler)
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as sync:
        def on_step(inner_step):
            if inner_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # a second one: the user's handler still runs once
                assert calls == [], "the user's handler ran inside the session, before its clean stop"

        train(sync, model, optimizer, on_step=on_step)
        assert sync.inner_step == 3  # the session's own stop came first: done after that step
    assert calls == [(signal.SIGTERM, "stopped", True, True)]
    assert signal.getsignal(signal.SIGTERM) is users_handler


def test_without_a_handler_of_the_users_sigterm_only_stops_the_session(syncer, tmp_path, sigterm_handler):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as sync:
        train(sync, model, optimizer, on_step=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGTERM))
    assert sync.final_state == "stopped" and sync.inner_step == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_session_on_another_thread_warns_that_sigterm_cannot_stop_it_cleanly(syncer, tmp_path, caplog):
    model, optimizer = model_and_optimizer()
    opened = threading.Event()
    result = {}

    def loop():
        with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN,
                             run_dir=tmp_path / "run") as sync:
            result["sync"] = sync
            opened.set()
            train(sync, model, optimizer)

    thread = threading.Thread(target=loop, name="trainer")
    with caplog.at_level(logging.WARNING, logger="ddiloco.session_lifecycle"):
        thread.start()
        assert opened.wait(WAIT_S)
        result["sync"].request_stop()  # what the warning says the main thread's own handler may do
        thread.join(WAIT_S)
    assert not thread.is_alive() and result["sync"].final_state == "stopped"
    warnings = [r.getMessage() for r in caplog.records if "not the main thread" in r.getMessage()]
    assert warnings == ["[learner 0] ddiloco.session runs on thread 'trainer', not the main thread: Python runs "
                        "signal handlers on the main thread only, so a SIGTERM (ddiloco run's Ctrl-C, a scheduler's "
                        "preemption) ends this process without a checkpoint or a Leave (a restart resumes from the "
                        "last periodic checkpoint). Run the training loop on the main thread, or have the main "
                        "thread's SIGTERM handler call sync.request_stop()"]


def test_a_session_inside_an_open_session_of_the_same_learner_is_refused_at_its_start(syncer, tmp_path):
    # It joined as a second learner 0 and was refused by the syncer: "learner 0 is already connected ... two processes
    # were started with --learner-id 0 (stop one)", exit 3.
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as outer:
        inner = ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run")
        with pytest.raises(RuntimeError, match=r"^a second ddiloco.session\(\.\.\.\) of learner 0 while the first "
                                               r"is still open in this process: .* End the first `with"):
            inner.start()
        train(outer, model, optimizer, on_step=lambda s: s == 2 and outer.request_stop())
    assert outer.final_state == "stopped"
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as again:
        assert again.inner_step == 2  # one after the other is fine: it resumed from the first one's checkpoint
