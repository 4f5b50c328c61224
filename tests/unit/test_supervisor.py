"""The launcher and supervisor with real processes and real signals, but fake children.

The children are `fake_ddiloco` of tests/fake_learners.py: they keep the process contract's files and exit codes,
and nothing else, so these tests cover restarts, backoff, refusals and clean shutdown in a few seconds. Each test
scripts its children's behaviour in `DIR/fake_plan.json`. The real `ddiloco syncer` / `learner` run in
tests/integration/test_run.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ddiloco.backoff import Backoff
from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.launcher import Launcher
from ddiloco.runtime.learner_exits import describe_exit_with, reason_line
from ddiloco.runtime.supervised_roles import ChildState, SupervisorConfig
from ddiloco.runtime.supervisor import Supervisor
from tests.fake_learners import (
    FAST,
    WAIT_S,
    all_pids,
    assert_all_gone,
    make_run,
    poll_until,
    run_parser,
    start_driver,
    wait_for_learners,
)


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    backoff = Backoff(0.5, 8.0, stable_after_s=30.0)
    assert [backoff.after_run(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.after_run(30.0) == 0.5
    assert backoff.after_run(0.1) == 1.0


@pytest.mark.parametrize("field, value", [("poll_interval_s", 0.0), ("backoff_initial_s", -1.0),
                                          ("max_restarts", -1), ("stable_after_s", -1.0), ("standby_learners", -1),
                                          ("standby_refill_delay_s", -1.0)])
def test_supervisor_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SupervisorConfig(**{field: value})


def test_learners_run_to_done_then_the_syncer_is_stopped(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, learners=2)
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    assert [s.state for s in supervisor.learners] == [ChildState.DONE, ChildState.DONE]
    assert [s.restarts for s in supervisor.slots] == [0, 0, 0, 0]  # syncer, 2 learners, evaluator
    assert supervisor.evaluator is not None and supervisor.evaluator.state == ChildState.STOPPED
    assert supervisor.syncer.state == ChildState.STOPPED
    assert supervisor.syncer.process.returncode == 0  # it got SIGTERM and exited cleanly
    assert_all_gone(all_pids(supervisor))
    calls = [json.loads(line) for line in (launcher.paths.root / "fake_calls.jsonl").read_text().splitlines()]
    learner_settings = [c["settings"] for c in calls if c["role"] == "learner"]
    address = supervisor.syncer_address
    assert sorted(s["learner_id"] for s in learner_settings) == [0, 1]
    assert all(s["syncer"] == address and s["threads"] == 1 and s["token_file"] for s in learner_settings)
    assert {c["omp"] for c in calls} == {"1"}
    assert [e.kind for e in events][:2] == ["started", "address"]


def test_crashed_learner_is_restarted_after_backoff_and_resumes(tmp_path, fake_command):
    plan = {"learners": {"1": {"crash_at_step": 5, "crash_message": "RuntimeError: my data loader broke"}}}
    launcher = make_run(tmp_path, fake_command, plan=plan)
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    crashed = supervisor.learners[1]
    assert crashed.state == ChildState.DONE
    assert crashed.restarts == 1 and crashed.exit_codes == [1, 0]
    exited = [e.message for e in events if e.kind == "exited" and e.name == "learner-1"]
    assert exited == ["exited with exit code 1: RuntimeError: my data loader broke"]  # why, without the log
    checkpoint = read_json_object(launcher.paths.learner_dir(1) / "fake_checkpoint.json")
    assert checkpoint == {"inner_step": 20, "starts": 2}  # resumed at step 5, not from scratch
    scheduled = [e for e in events if e.kind == "restart_scheduled"]
    assert [(e.name, e.fields["delay_s"]) for e in scheduled] == [("learner-1", FAST.backoff_initial_s)]
    assert supervisor.learners[0].restarts == 0


def test_a_learner_that_crashes_after_finishing_its_session_is_done_not_restarted(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, plan={"learners": {"1": {"abort_after_done": True}}})
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    aborted = supervisor.learners[1]
    assert aborted.state == ChildState.DONE and aborted.restarts == 0
    assert aborted.exit_codes == [-signal.SIGABRT]
    (done,) = [e for e in events if e.kind == "done" and e.learner_id == 1]
    assert done.fields["exit_code"] == -signal.SIGABRT and "after its session had finished" in done.message
    assert not [e for e in events if e.kind == "restart_scheduled"]


def test_a_done_status_left_by_an_earlier_start_does_not_make_a_crash_done(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, plan={"learners": {"1": {"crash_at_step": 5}}})
    stale = launcher.paths.learner_status(1)
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text(json.dumps({"time": time.time() - 100.0, "state": "done", "inner_step": 20}))
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    crashed = supervisor.learners[1]
    assert crashed.state == ChildState.DONE and crashed.exit_codes == [1, 0] and crashed.restarts == 1


def test_sigkilled_learner_is_restarted(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, inner_steps=300)
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.start()
    try:
        status = lambda: read_json_object(launcher.paths.learner_status(0)) or {}
        poll_until(supervisor, lambda: status().get("inner_step", 0) >= 3, "learner 0 to train")
        victim = supervisor.learners[0].pid
        os.kill(victim, signal.SIGKILL)
        poll_until(supervisor, lambda: supervisor.learners[0].pid not in (None, victim), "learner 0 to restart")
        assert supervisor.learners[0].exit_codes == [-signal.SIGKILL]
        assert supervisor.learners[0].restarts == 1
        poll_until(supervisor, lambda: supervisor.finished, "the run to finish")
        assert supervisor.learners[0].state == ChildState.DONE
    finally:
        supervisor.shutdown()
    assert_all_gone(all_pids(supervisor))


def test_a_sigkilled_learner_is_replaced_by_a_warm_standby(tmp_path, fake_command):
    # A standby runs `python -m MODULE`: the fake becomes a module on the children's PYTHONPATH.
    script = Path(fake_command[1])
    launcher = make_run(tmp_path, (sys.executable, "-m", script.stem), inner_steps=300)
    launcher = Launcher(dataclasses.replace(launcher.config, extra_env={"PYTHONPATH": str(script.parent)}))
    events = []
    config = dataclasses.replace(FAST, standby_learners=1, standby_refill_delay_s=0.0)
    supervisor = Supervisor(config, launcher=launcher, on_event=events.append)
    supervisor.start()
    try:
        status = lambda: read_json_object(launcher.paths.learner_status(0)) or {}
        poll_until(supervisor, lambda: status().get("inner_step", 0) >= 3, "learner 0 to train")
        [standby] = supervisor.standby.pids
        assert standby not in supervisor.learners[0].pids  # first starts are cold
        victim = supervisor.learners[0].pid
        os.kill(victim, signal.SIGKILL)
        poll_until(supervisor, lambda: supervisor.learners[0].pid not in (None, victim), "learner 0 to restart")
        assert supervisor.learners[0].pid == standby
        started = [e for e in events if e.kind == "started" and e.name == "learner-0"]
        assert [e.fields["standby"] for e in started] == [False, True]
        poll_until(supervisor, lambda: len(supervisor.standby.pids) == 2, "the standby to be replaced")
        poll_until(supervisor, lambda: supervisor.finished, "the run to finish")
        assert supervisor.learners[0].state == ChildState.DONE and supervisor.learners[0].restarts == 1
        calls = [json.loads(line) for line in (launcher.paths.root / "fake_calls.jsonl").read_text().splitlines()]
        assert standby in [c["pid"] for c in calls if c["role"] == "learner"]  # it ran the learner itself
        assert "start in standby pid" in launcher.paths.log("learner-0").read_text()
    finally:
        supervisor.shutdown()
    assert_all_gone(supervisor.pids)
    assert set(supervisor.standby.pids) <= set(supervisor.pids)


def test_a_held_learner_is_not_restarted_before_its_hold_ends(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, inner_steps=300)
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.start()
    try:
        status = lambda: read_json_object(launcher.paths.learner_status(0)) or {}
        poll_until(supervisor, lambda: status().get("inner_step", 0) >= 3, "learner 0 to train")
        victim, slot = supervisor.learners[0].pid, supervisor.learners[0]
        hold_s = 1.0
        held_until = time.monotonic() + hold_s
        supervisor.hold(slot, held_until)
        os.kill(victim, signal.SIGKILL)
        poll_until(supervisor, lambda: slot.state == ChildState.BACKOFF, "learner 0 to be noticed dead")
        assert slot.restart_at is not None and slot.restart_at >= held_until  # not the 0.05 s backoff
        # ... and the console says when: it said "restarts in 0.1 s" for a learner held down for 100 s.
        scheduled = [e.message for e in events if e.kind == "restart_scheduled" and e.name == "learner-0"]
        assert len(scheduled) == 1 and scheduled[0].endswith("s (held down) (restart 1)"), scheduled
        assert float(scheduled[0].split()[2]) > 0.5, scheduled
        poll_until(supervisor, lambda: slot.pid not in (None, victim), "learner 0 to restart after the hold")
        assert time.monotonic() >= held_until
        assert supervisor.learners[1].restarts == 0
    finally:
        supervisor.shutdown()
    assert_all_gone(all_pids(supervisor))


def test_refused_learner_is_not_restarted_and_the_reason_is_kept(tmp_path, fake_command):
    message = "refused by the syncer: parameter 'lm_head.weight' is float32[256, 64], expected float32[256, 128]"
    launcher = make_run(tmp_path, fake_command, plan={"learners": {"0": {"exit_code": 3, "message": message}}})
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    refused, other = supervisor.learners
    assert refused.state == ChildState.REFUSED and refused.restarts == 0
    assert refused.reason == message.removeprefix("refused by the syncer: ")  # the launcher's line says that, once
    assert other.state == ChildState.DONE


def test_usage_error_and_crash_loops_are_given_up(tmp_path, fake_command):
    plan = {"learners": {"0": {"exit_code": 2, "message": "error: --bad-flag"},
                         "1": {"crash_at_step": 1, "crashes": 100}}}
    launcher = make_run(tmp_path, fake_command, plan=plan)
    config = dataclasses.replace(FAST, max_restarts=2)
    supervisor = Supervisor(config, launcher=launcher)
    supervisor.run()
    usage, looping = supervisor.learners
    assert usage.state == ChildState.FAILED and usage.restarts == 0 and "--bad-flag" in usage.reason
    assert looping.state == ChildState.FAILED and looping.restarts == 2 and looping.exit_codes == [1, 1, 1]


def test_dead_syncer_is_restarted_on_the_same_port(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, inner_steps=10_000)
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.start()
    try:
        poll_until(supervisor, lambda: supervisor.syncer.state == ChildState.RUNNING, "the syncer to serve")
        address, first = supervisor.syncer_address, supervisor.syncer.pid
        learner_pids = [s.pid for s in supervisor.learners]
        os.kill(first, signal.SIGKILL)
        poll_until(supervisor, lambda: supervisor.syncer.state == ChildState.RUNNING
                   and supervisor.syncer.pid != first, "the syncer to come back")
        assert supervisor.syncer.restarts == 1
        assert supervisor.syncer_address == address
        assert [s.pid for s in supervisor.learners] == learner_pids  # learners were left alone
    finally:
        supervisor.shutdown()
    assert_all_gone(all_pids(supervisor))


def test_shutdown_kills_what_ignores_sigterm_and_everything_it_spawned(tmp_path, fake_command):
    plan = {"learners": {"0": {"ignore_sigterm": True, "grandchild": True}}}
    launcher = make_run(tmp_path, fake_command, inner_steps=100_000, plan=plan)
    # Long enough for the polite learner to exit on SIGTERM on a loaded machine (0.5 s was not, at load 5).
    config = dataclasses.replace(FAST, learner_stop_timeout_s=3.0)
    supervisor = Supervisor(config, launcher=launcher)
    supervisor.start()
    grandchild_file = launcher.paths.learner_dir(0) / "grandchild.json"
    try:
        poll_until(supervisor, grandchild_file.exists, "learner 0 to spawn a helper")
        poll_until(supervisor, lambda: launcher.paths.learner_status(1).exists(), "learner 1 to train")
        supervisor.request_stop("test")
    finally:
        supervisor.shutdown()
    grandchild = read_json_object(grandchild_file)["pid"]
    stubborn, polite = supervisor.learners
    assert stubborn.exit_codes == [] and stubborn.process.returncode == -signal.SIGKILL
    assert polite.process.returncode == 0
    assert not process_group_alive(grandchild)
    assert_all_gone([*all_pids(supervisor), grandchild])


def test_a_syncer_that_cannot_start_fails_the_run(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, plan={"syncer": {"exit_code": 2, "message": "error: bad --bind"}})
    supervisor = Supervisor(FAST, launcher=launcher)
    supervisor.run()
    assert supervisor.failure is not None and "bad --bind" in supervisor.failure
    assert supervisor.learners[0].pids == []  # never started without a syncer


# ---- `ddiloco run` itself, with fake children ------------------------------------------------------

def run_args(run_dir: Path, *extra: str):
    return run_parser().parse_args(["run", "--run-dir", str(run_dir), "--learners", "2", "--inner-steps", "15",
                                      "--no-progress", *extra])


def test_run_command_writes_the_run_directory(tmp_path, fake_command, capsys):
    from ddiloco.runtime import run_commands
    run_dir = tmp_path / "run"
    code = run_commands.run(run_args(run_dir, "--json"), command=fake_command, supervisor_config=FAST)
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["outcome"] == "completed" and summary["final_val_loss"] == 1.5
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert [summary["learners"][i]["state"] for i in ("0", "1")] == ["done", "done"]
    for name in ("config.json", "metrics.jsonl", "val_loss.png", "participation.png", "bytes.png"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "config.json").read_text())["inner_steps"] == 15
    sources = {json.loads(line)["source"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert sources == {"evaluator", "launcher", "learner/0", "learner/1"}  # the fake syncer logs nothing
    assert "[learner-1] exited (done)" in out
    with pytest.raises(ValueError, match="already exists"):
        run_commands.run(run_args(run_dir), command=fake_command, supervisor_config=FAST)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_run_stops_every_child_and_writes_the_summary(tmp_path, fake_command, signum):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "100000")
    try:
        wait_for_learners(run_dir, popen, 3)
        popen.send_signal(signum)
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
    assert popen.returncode == 128 + signum, out
    processes = read_json_object(run_dir / "launcher" / "processes.json")
    pids = [pid for started in processes["children"].values() for pid in started]
    assert len(pids) == 5  # syncer, 3 learners, evaluator
    assert_all_gone(pids)
    summary = read_json_object(run_dir / "summary.json")
    assert summary["outcome"] == "interrupted"
    assert f"--resume {run_dir}" in out


def test_a_stop_that_waits_for_a_learner_says_which_and_a_second_request_kills_it_at_once(tmp_path, fake_command):
    # A learner inside a long section (no step() call) does not see its SIGTERM: the launcher waited out its stop
    # timeout without a word, then SIGKILLed it.
    launcher = make_run(tmp_path, fake_command, inner_steps=100_000, plan={"learners": {"0": {"ignore_sigterm": True}}})
    events, waiting = [], threading.Event()

    def on_event(event):
        events.append(event)
        if event.kind == "waiting":
            waiting.set()

    supervisor = Supervisor(dataclasses.replace(FAST, learner_stop_timeout_s=600.0), launcher=launcher,
                            on_event=on_event)
    supervisor.start()
    stopping = threading.Thread(target=supervisor.shutdown)
    try:
        poll_until(supervisor, lambda: all(launcher.paths.learner_status(i).exists() for i in (0, 1)),
                   "the learners to train")
        supervisor.request_stop("SIGINT")
        stopping.start()
        assert waiting.wait(WAIT_S), [event.message for event in events]
        supervisor.request_stop("SIGINT")  # the second Ctrl-C
        stopping.join(WAIT_S)
        assert not stopping.is_alive(), "a second stop request did not kill at once"
    finally:
        if stopping.is_alive():
            supervisor.request_stop("SIGINT")
            stopping.join()
        elif not stopping.ident:
            supervisor.shutdown()
    stubborn = supervisor.learners[0]
    notice = next(event for event in events if event.kind == "waiting")
    assert notice.message == (f"still waiting for learner-0 (pid {stubborn.pids[-1]}) to stop: a learner stops at its "
                              "next step() call; SIGKILL 600 s after the SIGTERM, or at once on a second Ctrl-C")
    assert stubborn.process.returncode == -signal.SIGKILL
    assert_all_gone(all_pids(supervisor))


def test_a_ctrl_c_of_run_that_waits_for_a_learner_prints_so_and_a_second_one_ends_it(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "100000",
                                  plan={"learners": {"0": {"ignore_sigterm": True}}})
    lines = []
    try:
        wait_for_learners(run_dir, popen, 3)
        popen.send_signal(signal.SIGINT)
        # Bounded: without the notice the run ends by itself once its 30 s stop timeout SIGKILLs the learner.
        while not lines or "still waiting for" not in lines[-1]:
            line = popen.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        popen.send_signal(signal.SIGINT)
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
    assert "[run] still waiting for learner-0 (pid " in lines[-1]
    assert "SIGKILL 30 s after the SIGTERM, or at once on a second Ctrl-C" in lines[-1]
    assert popen.returncode == 128 + signal.SIGINT, "".join(lines) + out
    assert read_json_object(run_dir / "summary.json")["outcome"] == "interrupted"


def test_children_die_with_a_sigkilled_launcher(tmp_path, fake_command):
    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "100000")
    learner_pids, syncer_pid = [], popen.pid
    try:
        learner_pids = wait_for_learners(run_dir, popen, 3)
        syncer_pid = read_json_object(run_dir / "syncer.json")["pid"]
        popen.kill()
        popen.communicate(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while any(process_group_alive(pid) for pid in [*learner_pids, syncer_pid]):
            assert time.monotonic() < deadline, "children outlived their launcher"
            time.sleep(FAST.poll_interval_s)
    finally:
        for pid in [*learner_pids, syncer_pid]:
            if process_group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_run_refuses_a_negative_standby_count_before_starting_anything(tmp_path, capsys):
    from ddiloco.cli import main

    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--no-progress", "--standby-learners", "-1"]) == 2
    assert "--standby-learners=-1 is invalid: expected an integer >= 0" in capsys.readouterr().err
    assert not run_dir.exists()


def test_an_exit_message_quotes_the_last_line_of_an_error_exit_only():
    assert describe_exit_with(1, ["Traceback ...", "ValueError: bad shard"]) == "exit code 1: ValueError: bad shard"
    assert describe_exit_with(-9, ["[learner 0] step 40"]) == "signal SIGKILL"  # the log's last line is not why
    assert describe_exit_with(1, []) == "exit code 1"
    long = describe_exit_with(1, ["x" * 1000])
    assert long.startswith("exit code 1: xxx") and long.endswith("... (1000 characters)") and len(long) < 400


def test_an_exit_message_quotes_the_error_before_the_lines_a_rank_group_logs_after_it():
    # A learner of several ranks: its rank group logs that a rank exited after that rank's traceback, and the console
    # quoted that line ("rank 1 (pid 5) exited with status 1"), not the error.
    tail = ["    raise ReplicasDivergedError(",
            "ddiloco.learner_group.ReplicasDivergedError: the 2 ranks of this learner hold different values",
            "2026-12-05 11:08:19,001 W ddiloco.runtime.rank_group: [rank-group] rank 1 (pid 5) exited with status 1: "
            "stopping the other ranks"]
    assert describe_exit_with(1, tail) == ("exit code 1: ddiloco.learner_group.ReplicasDivergedError: the 2 ranks of "
                                           "this learner hold different values")
    assert reason_line(["[learner 0] refused: another model"]) == "[learner 0] refused: another model"
    assert reason_line(["KeyboardInterrupt", "done"]) == "KeyboardInterrupt"


def test_a_learner_whose_loop_ends_before_the_budget_is_done_and_says_so(tmp_path, fake_command):
    launcher = make_run(tmp_path, fake_command, plan={"learners": {"1": {"loop_ends_at_step": 7}}})
    events = []
    supervisor = Supervisor(FAST, launcher=launcher, on_event=events.append)
    supervisor.run()
    assert [s.state for s in supervisor.learners] == [ChildState.DONE, ChildState.DONE]
    assert supervisor.learners[1].restarts == 0  # its status says no stop was asked for: its own loop ended
    done = {e.name: e.message for e in events if e.kind == "done"}
    assert done["learner-0"] == "exited (done)"
    assert done["learner-1"] == ("exited (done: its loop ended at inner step 7 of 20, before the budget; "
                                 "not restarted)")
