"""A session and the process's signals, over real gRPC to a syncer served in this process: the user's own SIGTERM
handler still runs (once, after the session has checkpointed and left), a session on another thread says that SIGTERM
cannot stop it cleanly, a second session of the same learner inside the first is refused at its start, and the watch
of the launcher stops a session whose launcher is gone."""

from __future__ import annotations

import _thread
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.config import DilocoConfig
from ddiloco.environment import environment
from ddiloco.launcher_watch import EXIT_LAUNCHER_GONE, LauncherWatch, process_start_time
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.launcher import LaunchConfig, Launcher
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


@contextlib.contextmanager
def handler_kept(signum: int):
    """The signal's handler as the test found it, back in place after the test."""
    previous = signal.getsignal(signum)
    try:
        yield previous
    finally:
        signal.signal(signum, previous)


@pytest.fixture
def sigterm_handler():
    with handler_kept(signal.SIGTERM) as previous:
        yield previous


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


SIGTERM_INSIDE = """
import os, signal, sys
import torch
from torch import nn
import ddiloco
from ddiloco.config import DilocoConfig
from ddiloco.run_config import RunConfig

syncer, run_dir = sys.argv[1:]
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
config = RunConfig(diloco=DilocoConfig(num_fragments=2, sync_every=4), num_learners=1, inner_steps=1000)
with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=config, run_dir=run_dir) as sync:
    while not sync.done:
        loss = model(torch.randn(8, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=8)
        if sync.inner_step == 2:
            # The SIGTERM lands while this thread holds the stop flag's own lock, as it does for a few bytecodes in each
            # wait on it (a chaos straggler's step) and in each set(): the handler runs at a bytecode boundary inside.
            with sync._stop._cond:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):
                    pass
print(sync.final_state, sync.inner_step, flush=True)
"""


def test_a_sigterm_that_lands_while_the_main_thread_holds_the_stop_flags_lock_still_stops_the_session(syncer,
                                                                                                      tmp_path):
    # The handler runs on the main thread wherever that thread is. It set a threading.Event, whose lock the main thread
    # may hold at that moment: it waited for it on that same thread, for good.
    popen = subprocess.Popen([sys.executable, "-c", SIGTERM_INSIDE, syncer, str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # 60 s, under pytest-timeout's 120 s: a hung learner is killed here, not left behind
        out, _ = popen.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        popen.kill()
        out, _ = popen.communicate()
        pytest.fail(f"the learner hung in its SIGTERM handler (killed after 60 s):\n{out[-3000:]}")
    assert popen.returncode == 0 and out.splitlines()[-1] == "stopped 2", out[-3000:]


def test_a_start_interrupted_while_it_waits_for_the_syncer_leaves_no_thread_behind(tmp_path):
    # A Ctrl-C while the session waited for its syncer left its four threads retrying that syncer behind the script:
    # in a notebook, the next session joined beside them.
    def interrupt_once_joining():
        while not any(thread.name == "learner-recv" for thread in threading.enumerate()):
            threading.Event().wait(0.01)
        _thread.interrupt_main()

    model, optimizer = model_and_optimizer()
    threading.Thread(target=interrupt_once_joining, daemon=True).start()
    with pytest.raises(KeyboardInterrupt), ddiloco.session(model, optimizer, syncer="127.0.0.1:1", learner_id=0,
                                                           config=RUN, run_dir=tmp_path / "run"):
        pytest.fail("the session started without a syncer")
    left = [t.name for t in threading.enumerate() if t.name.startswith("learner-") and t.is_alive()]
    assert left == []
    status = json.loads((tmp_path / "run" / "learners" / "0" / "status.json").read_text())
    assert status["state"] == "failed", status


@pytest.fixture
def sighup_handler():
    with handler_kept(signal.SIGHUP) as previous:
        yield previous


def test_a_sighup_stops_the_session_as_sigterm_does_and_its_default_comes_back(syncer, tmp_path, sighup_handler):
    # A learner run by hand in a terminal that closed died at once, its work since its last checkpoint lost.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as sync:
        train(sync, model, optimizer, on_step=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGHUP))
    assert sync.final_state == "stopped" and sync.inner_step == 2
    status = json.loads((tmp_path / "run" / "learners" / "0" / "status.json").read_text())
    assert status["checkpoint_inner_step"] == 2
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_a_sigchld_handler_is_held_off_from_a_sigterm_to_the_sessions_end_and_comes_back(syncer, tmp_path,
                                                                                         sigterm_handler):
    # torch's DataLoader raises from its SIGCHLD handler once a worker died: a SIGTERM to every process of the job
    # (scancel) killed the workers, and the handler raised in the session's close, before its checkpoint at the stop.
    raised = []

    def dataloader_like(signum, frame):
        raised.append(signum)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    def on_step(inner_step):
        if inner_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGCHLD)  # the worker's death, after the learner's own SIGTERM

    with handler_kept(signal.SIGCHLD):
        signal.signal(signal.SIGCHLD, dataloader_like)
        model, optimizer = model_and_optimizer()
        with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN,
                             run_dir=tmp_path / "run") as sync:
            train(sync, model, optimizer, on_step=on_step)
        assert signal.getsignal(signal.SIGCHLD) is dataloader_like and raised == []
    assert sync.final_state == "stopped" and sync.inner_step == 2
    status = json.loads((tmp_path / "run" / "learners" / "0" / "status.json").read_text())
    assert status["checkpoint_inner_step"] == 2


def test_a_first_ctrl_c_stops_the_session_a_second_interrupts_and_the_handler_comes_back(syncer, tmp_path):
    # A Ctrl-C raised KeyboardInterrupt wherever the loop was: a learner run by hand ended `failed`, without its
    # checkpoint at the stop.
    with handler_kept(signal.SIGINT):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        model, optimizer = model_and_optimizer()
        with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN,
                             run_dir=tmp_path / "run") as sync:
            train(sync, model, optimizer, on_step=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGINT))
        assert sync.final_state == "stopped" and sync.inner_step == 2
        assert json.loads((tmp_path / "run" / "learners" / "0" / "status.json").read_text())[
            "checkpoint_inner_step"] == 2
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        model, optimizer = model_and_optimizer()
        with pytest.raises(KeyboardInterrupt), ddiloco.session(model, optimizer, syncer=syncer, learner_id=0,
                                                               config=RUN, run_dir=tmp_path / "run") as sync:
            train(sync, model, optimizer, on_step=lambda s: s == 4 and [os.kill(os.getpid(), signal.SIGINT)
                                                                        for _ in range(2)])
        assert sync.final_state == "failed" and sync.inner_step == 4
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sighup_handler_of_the_users_or_nohups_is_left_alone(syncer, tmp_path, sighup_handler):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as sync:
        train(sync, model, optimizer, on_step=lambda s: s == 2 and os.kill(os.getpid(), signal.SIGHUP) or
              (s == 4 and sync.request_stop()))
    assert sync.final_state == "stopped" and sync.inner_step == 4
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_handlers_the_users_code_sets_during_the_session_stay_after_it(syncer, tmp_path):
    # A preemption library set up lazily inside the loop installs its own handlers: the session's end put back the
    # ones from before it (SIG_DFL, default_int_handler), and the library never heard of a later signal.
    def users(signum, frame):
        pass

    with handler_kept(signal.SIGTERM), handler_kept(signal.SIGINT), handler_kept(signal.SIGHUP):
        for signum, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler),
                                (signal.SIGHUP, signal.SIG_DFL)):
            signal.signal(signum, handler)
        model, optimizer = model_and_optimizer()

        def on_step(inner_step):
            if inner_step == 2:
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(signum, users)
            if inner_step == 4:
                sync.request_stop()

        with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN,
                             run_dir=tmp_path / "run") as sync:
            train(sync, model, optimizer, on_step=on_step)
        assert sync.final_state == "stopped"
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)] == [users] * 3


def test_a_session_made_and_dropped_without_being_entered_holds_no_thread_and_no_file(tmp_path):
    # Each such session started its publisher thread and kept its metrics.jsonl and work.jsonl open for the life of
    # the process (a probe: 3 threads and 6 files for 3 sessions).
    import gc

    def open_files():
        names = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [name for name in names if name.startswith(str(tmp_path))]

    threads = set(threading.enumerate())
    for number in range(2):
        model, optimizer = model_and_optimizer()
        ddiloco.session(model, optimizer, syncer="127.0.0.1:1", learner_id=0, config=RUN,
                        run_dir=tmp_path / f"run{number}")
    gc.collect()
    assert [t.name for t in set(threading.enumerate()) - threads] == [] and open_files() == []


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


# ---- the launcher's watch ---------------------------------------------------------------------------------------


def test_the_launcher_names_itself_in_its_childrens_environment(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=1, threads=1, use_token=False))
    env = environment(launcher.learner_env(0, "127.0.0.1:1"))
    assert env.launcher == (os.getpid(), process_start_time(os.getpid()))
    assert environment({}).launcher is None  # a process not started by a launcher watches nothing


@contextlib.contextmanager
def a_process():
    popen = subprocess.Popen(["sleep", "60"])
    try:
        yield popen
    finally:
        popen.kill()
        popen.wait()


@pytest.mark.parametrize("stop_returns", [True, False], ids=["its_stop_returns", "its_stop_never_returns"])
def test_a_watch_stops_once_its_launcher_is_gone_and_exits_after_the_bound(stop_returns):
    # A learner's stop once hung in its own SIGTERM handler (`interrupts.StopFlag`), and the watch's call into that stop
    # hung with it: the process ran on for good instead of ending itself 30 s later.
    exited = []
    ended, gone, never = threading.Event(), threading.Event(), threading.Event()

    def on_gone():
        gone.set()
        if not stop_returns:
            never.wait()

    with a_process() as launcher:
        watch = LauncherWatch(launcher.pid, process_start_time(launcher.pid), name="learner 0", on_gone=on_gone,
                              poll_s=0.01, exit_after_s=0.05, exit=lambda code: (exited.append(code), ended.set()))
        watch.start()
        assert not gone.wait(0.1)  # alive: nothing happens
        launcher.kill()
        launcher.wait()
        assert gone.wait(WAIT_S) and ended.wait(WAIT_S)
    never.set()
    assert exited == [EXIT_LAUNCHER_GONE]


def test_a_session_that_ends_once_its_launcher_is_gone_is_not_ended_by_the_watch():
    exited = []
    with a_process() as launcher:
        watch = LauncherWatch(launcher.pid, process_start_time(launcher.pid), name="learner 0",
                              on_gone=lambda: watch.stop(), poll_s=0.01, exit_after_s=0.05, exit=exited.append)
        watch.start()
        launcher.kill()
        launcher.wait()
        watch._thread.join(WAIT_S)
    assert watch.gone.is_set() and exited == []


def test_a_reused_pid_is_not_the_launcher_and_a_stopped_watch_does_nothing():
    gone = threading.Event()
    with a_process() as other:
        reused = LauncherWatch(other.pid, process_start_time(other.pid) - 1, name="learner 0", on_gone=gone.set,
                               poll_s=0.01, exit=lambda code: None)
        reused.start()
        assert gone.wait(WAIT_S)  # the same pid but another start time: the launcher is gone
        reused.stop()
    stopped = threading.Event()
    with a_process() as launcher:
        watch = LauncherWatch(launcher.pid, process_start_time(launcher.pid), name="learner 0", on_gone=stopped.set,
                              poll_s=0.01, exit=lambda code: None)
        watch.start()
        watch.stop()
        watch._thread.join(WAIT_S)
    assert not stopped.is_set()


def test_a_session_whose_launcher_is_gone_stops_as_on_sigterm(syncer, tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()
    with a_process() as launcher:
        monkeypatch.setenv("DDILOCO_LAUNCHER_PID", str(launcher.pid))
        monkeypatch.setenv("DDILOCO_LAUNCHER_STARTED", str(process_start_time(launcher.pid)))
        with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN,
                             run_dir=tmp_path / "run") as sync:
            def on_step(inner_step):
                if inner_step == 2:
                    launcher.kill()
                    launcher.wait()

            train(sync, model, optimizer, on_step=on_step)
    assert sync.final_state == "stopped" and 2 <= sync.inner_step < RUN.inner_steps


def test_an_evaluator_whose_launcher_is_gone_returns(syncer, tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()
    with ddiloco.session(model, optimizer, syncer=syncer, learner_id=0, config=RUN, run_dir=tmp_path / "run") as sync:
        train(sync, model, optimizer, on_step=lambda s: s == 4 and sync.request_stop())  # a genesis and a round
    with a_process() as launcher:
        monkeypatch.setenv("DDILOCO_LAUNCHER_PID", str(launcher.pid))
        monkeypatch.setenv("DDILOCO_LAUNCHER_STARTED", str(process_start_time(launcher.pid)))

        def evaluate(model):
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            return 1.0

        watcher = ddiloco.watch(model, evaluate, syncer=syncer, config=RUN, every_s=0.05)
    assert watcher.evaluations >= 1
