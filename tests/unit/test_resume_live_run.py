"""`ddiloco run --resume DIR` of a run that is still going is refused at once, naming the live process, before
anything in DIR is written; the files a run leaves behind when it ends (`kill -9` included) never block a resume.

Real processes: a `ddiloco run` with the fake children of tests/fake_learners.py, a process holding the syncer's lock,
and this test's own process standing in for a launcher whose pid was reused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import atomic_write_json, read_json_object
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.process_lock import DirectoryLock
from ddiloco.runtime.ray_cluster import process_start_time
from ddiloco.runtime.run_dir import claim_run_dir, require_not_running
from ddiloco.runtime.run_paths import RunPaths
from tests.fake_learners import FAST, WAIT_S, run_parser, start_driver, wait_for_learners


def launcher_records(run_dir: Path) -> dict[str, bytes]:
    """The files a second launcher used to overwrite, by path."""
    paths = RunPaths(run_dir)
    files = [paths.processes, paths.learner_command, paths.config, paths.summary,
             *sorted((run_dir / "settings").glob("*.json"))]
    return {str(path): path.read_bytes() for path in files if path.exists()}


def resume_args(run_dir: Path):
    """`ddiloco run --resume DIR` with a budget that a learner of the fake run has already reached: done at once."""
    return run_parser().parse_args(["run", "--resume", str(run_dir), "--no-progress", "--inner-steps", "1"])


def test_resume_of_a_run_whose_launcher_is_alive_is_refused_and_a_sigkilled_one_resumes(tmp_path, fake_command):
    from ddiloco.runtime import run_commands

    popen, run_dir = start_driver(tmp_path, fake_command, "--inner-steps", "100000")
    children: list[int] = []
    try:
        children = wait_for_learners(run_dir, popen, 3)
        before = launcher_records(run_dir)
        with pytest.raises(ValueError) as refused:
            run_commands.run(resume_args(run_dir), command=fake_command, supervisor_config=FAST)
        assert str(refused.value) == (f"--resume {run_dir}: the run is still going (its launcher, ddiloco run pid "
                                      f"{popen.pid}, is alive): stop it first (Ctrl-C where it runs, or kill it) and "
                                      "resume once it has ended")
        assert launcher_records(run_dir) == before  # a summary.json among them, had it written one

        popen.kill()  # its records stay behind, naming a dead launcher
        popen.communicate(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while any(process_group_alive(pid) for pid in children):
            assert time.monotonic() < deadline, "children outlived their launcher"
            time.sleep(FAST.poll_interval_s)
    finally:
        for pid in [popen.pid, *children]:
            if process_group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        popen.wait()
    assert run_commands.run(resume_args(run_dir), command=fake_command, supervisor_config=FAST) == 0
    assert read_json_object(RunPaths(run_dir).processes)["launcher_pid"] == os.getpid()


def test_a_recorded_launcher_pid_counts_only_while_it_names_the_same_process(tmp_path):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    launcher = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        started = process_start_time(launcher.pid)
        atomic_write_json(paths.processes, {"launcher_pid": launcher.pid, "launcher_started": started, "children": {}})
        with pytest.raises(ValueError, match=f"its launcher, ddiloco run pid {launcher.pid}, is alive"):
            require_not_running(run_dir)
        # The same pid, reused by another process after the run ended: a different start time.
        atomic_write_json(paths.processes, {"launcher_pid": launcher.pid, "launcher_started": started - 1,
                                            "children": {}})
        require_not_running(run_dir)
        # This process, resuming a run it ran itself (`ddiloco run` called again from Python).
        atomic_write_json(paths.processes, {"launcher_pid": os.getpid(), "launcher_started":
                                            process_start_time(os.getpid()), "children": {}})
        require_not_running(run_dir)
    finally:
        launcher.stdin.close()
        launcher.wait(timeout=WAIT_S)


HOLD = """
import sys
from ddiloco.runtime.{module} import {lock}
assert {lock}(sys.argv[1]).try_acquire()
print("held", flush=True)
sys.stdin.read()
"""
"""A process that takes a lock of the run directory, says so, and holds it until its stdin closes."""


@contextlib.contextmanager
def lock_held(run_dir, *, module: str, lock: str):
    """Another process holding `module.lock` on `run_dir` for the block; gone, its lock released, after it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(module=module, lock=lock), str(run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.stdin.close()  # it exits; the kernel releases its lock
        holder.wait(timeout=WAIT_S)


def test_resume_of_a_directory_a_syncer_serves_is_refused_until_it_is_gone(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with lock_held(run_dir, module="syncer_standby", lock="SyncerLock") as holder, pytest.raises(
            ValueError, match=f"its syncer, pid {holder.pid}, holds {run_dir / 'syncer.lock'}"):
        require_not_running(run_dir)
    assert (run_dir / "syncer.lock").exists()
    require_not_running(run_dir)



LINED_UP_RESUME = """
import functools
import sys
import time
from pathlib import Path

from ddiloco import cli
from ddiloco.runtime import run_commands, run_dir
from ddiloco.runtime.supervised_roles import SupervisorConfig

fake, barrier, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
checked = run_dir.require_not_running


def lined_up(directory, **options):
    # Both launchers pass the liveness check before either records its processes: the instant the race needs.
    checked(directory, **options)
    (barrier / f"passed-{name}").touch()
    while not (barrier / "go").exists():  # the test creates it once both passed, or one was refused
        time.sleep(0.01)


run_dir.require_not_running = lined_up
run_commands.run = functools.partial(run_commands.run, command=(sys.executable, fake),
                                     supervisor_config=SupervisorConfig(poll_interval_s=0.02, backoff_initial_s=0.05))
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_two_resumes_started_in_the_same_instant_let_one_run_and_refuse_the_other_in_one_line(tmp_path, fake_command):
    run_dir = tmp_path / "run"
    driver, barrier = tmp_path / "lined_up_resume.py", tmp_path / "barrier"
    driver.write_text(LINED_UP_RESUME)
    barrier.mkdir()
    # A run that ended, in a process of its own (one in this process would be a live launcher).
    subprocess.run([sys.executable, str(driver), fake_command[1], str(barrier), "first", "run", "--run-dir",
                    str(run_dir), "--learners", "2", "--inner-steps", "3", "--no-progress"], check=True,
                   capture_output=True, timeout=WAIT_S, cwd=Path(__file__).parents[2])
    resumes = {name: subprocess.Popen([sys.executable, str(driver), fake_command[1], str(barrier), name, "run",
                                       "--resume", str(run_dir), "--no-progress", "--inner-steps", "1"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, cwd=Path(__file__).parents[2])
               for name in ("a", "b")}
    try:
        deadline = time.monotonic() + WAIT_S
        while not (all((barrier / f"passed-{name}").exists() for name in resumes)
                   or any(popen.poll() is not None for popen in resumes.values())):
            assert time.monotonic() < deadline, "neither launcher reached its liveness check"
            time.sleep(FAST.poll_interval_s)
        (barrier / "go").touch()
        outputs = {name: popen.communicate(timeout=WAIT_S) for name, popen in resumes.items()}
    finally:
        for popen in resumes.values():
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    codes = {name: popen.returncode for name, popen in resumes.items()}
    assert sorted(codes.values()) == [0, 2], (codes, outputs)
    winner, loser = sorted(resumes, key=lambda name: codes[name])
    # The winner waits at its check, so it has not recorded itself: the loser knows it only by the lock.
    assert outputs[loser][1] == (f"ddiloco run: error: --resume {run_dir}: the run is still going (another ddiloco run "
                                 "started on it in the same instant and holds it): stop it first (Ctrl-C where it "
                                 "runs, or kill it) and resume once it has ended\n")
    assert read_json_object(RunPaths(run_dir).processes)["launcher_pid"] == resumes[winner].pid


def test_a_launcher_claims_its_directory_until_it_exits_writing_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with lock_held(run_dir, module="process_lock", lock="DirectoryLock") as holder:
        with pytest.raises(ValueError, match=rf"--resume {run_dir}: the run is still going \(another ddiloco run "
                                             r"started on it in the same instant and holds it\)"):
            claim_run_dir(run_dir, resume=True)
        # Once the holder has recorded itself, it is named.
        atomic_write_json(RunPaths(run_dir).processes, {"launcher_pid": holder.pid,
                                                        "launcher_started": process_start_time(holder.pid)})
        with pytest.raises(ValueError, match=rf"the run is still going \(its launcher, ddiloco run pid {holder.pid}, "
                                             r"is alive\)"):
            claim_run_dir(run_dir, resume=True)
        with pytest.raises(ValueError, match=rf"run directory {run_dir} is in use: another ddiloco run \(pid "
                                             rf"{holder.pid}\) started in it at the same time; choose another"):
            claim_run_dir(run_dir, resume=False)
    RunPaths(run_dir).processes.unlink()  # what this test wrote
    RunPaths(run_dir).processes.parent.rmdir()
    lock = claim_run_dir(run_dir, resume=True)
    try:
        assert not DirectoryLock(run_dir).try_acquire()  # one holder: another open of the directory is refused
    finally:
        lock.release()
    assert DirectoryLock(run_dir).try_acquire()
    assert [path.name for path in run_dir.iterdir()] == []


def test_a_copy_of_a_live_runs_directory_can_be_resumed_while_the_original_runs(tmp_path):
    # The copy's processes.json names the original's launcher, alive: the copy was refused as "still going", though
    # that launcher holds the original's lock, not the copy's.
    original, copy = tmp_path / "run", tmp_path / "copy"
    original.mkdir()
    with lock_held(original, module="process_lock", lock="DirectoryLock") as launcher:
        record = {"launcher_pid": launcher.pid, "launcher_started": process_start_time(launcher.pid), "children": {}}
        atomic_write_json(RunPaths(original).processes, record)
        with pytest.raises(ValueError, match=f"its launcher, ddiloco run pid {launcher.pid}, is alive"):
            claim_run_dir(original, resume=True)
        shutil.copytree(original, copy)
        claim_run_dir(copy, resume=True).release()
