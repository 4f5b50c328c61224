"""`ddiloco run --ray` on a real local Ray instance: actors, a kill -9, Ray's restart, and nothing left behind.

The run starts its own Ray instance (`ray.init(address="local", num_cpus=...)`, the launcher's local start)
with a syncer actor and two learner actors, each running the same `ddiloco` process the local launcher runs. A kill -9
of learner 1's process makes its actor end itself, Ray restarts the actor (a new actor worker process),
and the new learner process resumes and contributes to rounds again. After a Ctrl-C every process the run
had (Ray's GCS, raylet, agents and workers, and the ddiloco children) is gone. Skipped only where Ray is
not installed (`pip install -e '.[ray]'`; CI installs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json_object
from ddiloco.round_log import RoundLog
from ddiloco.runtime.ray_cluster import descendants, still_running
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import ODD_MODEL_SCRIPT

pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.acceptance]

REPO = Path(__file__).parents[2]
WAIT_S = 180.0
"""Hard limit on one wait: Ray's start and three processes importing torch on a loaded 2-core machine."""
POLL_S = 0.1
TINY = ["--model-width", "32", "--model-num-heads", "2", "--model-num-layers", "1", "--model-context-len", "32",
        "--data-context-len", "32", "--data-batch-size", "4", "--num-fragments", "2", "--sync-every", "8",
        "--threads", "1", "--checkpoint-every-s", "1"]


class RunWatch:
    """`ddiloco run --ray` as a real process, and every descendant it has had (seen at each poll)."""

    def __init__(self, run_dir: Path, *flags: str, tiny: bool = True) -> None:
        """`tiny`: the built-in TinyGPT at its smallest (`TINY`); False for a run of a script of its own."""
        self.run_dir = run_dir
        self.seen: dict[int, int] = {}
        self.names: dict[int, str] = {}
        # Its own session, like a job started from a shell: a signal sent to it reaches only it.
        argv = [sys.executable, "-m", "ddiloco.cli", "run", "--ray", "--run-dir", str(run_dir), "--no-progress",
                *(TINY if tiny else ()), *flags]
        self.popen = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)

    def note(self) -> None:
        """Every descendant now, and its latest command line.

        A name is read again at each poll: a process first seen between its fork and its exec still shows its
        parent's command line, and one seen as it exits (a zombie) shows an empty one (CI once saw Ray's GCS
        server only that way).
        """
        for pid, started in descendants(self.popen.pid).items():
            if self.seen.setdefault(pid, started) != started:
                continue  # the pid was reused by a process this run never started
            try:
                name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                name = ""
            if name or pid not in self.names:
                self.names[pid] = name or "?"

    def wait_for(self, condition, what: str):
        deadline = time.monotonic() + WAIT_S
        while not (value := condition()):
            self.note()
            if self.popen.poll() is not None:
                pytest.fail(f"ddiloco run exited ({self.popen.returncode}) while waiting for {what}:\n"
                            f"{self.popen.communicate()[0]}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
            time.sleep(POLL_S)
        return value

    def end(self) -> str:
        """Its output once it has ended by itself (SIGKILL after `WAIT_S`: never left running)."""
        try:
            return self.popen.communicate(timeout=WAIT_S)[0]
        except subprocess.TimeoutExpired:
            return self.finish()

    def finish(self) -> str:
        """SIGINT, then its output once it has ended. Never leaves it running."""
        try:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGINT)
            return self.popen.communicate(timeout=WAIT_S)[0]
        finally:
            if self.popen.poll() is None:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


def assert_nothing_left(run: RunWatch) -> None:
    deadline = time.monotonic() + WAIT_S
    while still_running(run.seen) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    left = {pid: run.names[pid] for pid in still_running(run.seen)}
    assert not left, f"processes left behind: {left}"


def learner_status(run_dir: Path, learner_id: int) -> dict:
    return read_json_object(RunPaths(run_dir).learner_status(learner_id)) or {}


def work(run_dir: Path, learner_id: int) -> list[dict]:
    path = RunPaths(run_dir).learner_dir(learner_id) / "work.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def contributions(run_dir: Path, learner_id: int) -> list[int]:
    """The inner steps of learner `learner_id`'s updates merged in committed rounds."""
    return [p["inner_step"] for line in RoundLog(run_dir).lines() for p in line["participants"]
            if p["learner_id"] == learner_id]


def actor_state(run_dir: Path, name: str) -> dict:
    return read_json_object(RunPaths(run_dir).root / "launcher" / "ray" / f"{name}.json") or {}


@pytest.mark.timeout(600)
def test_a_kill9_learner_is_restarted_by_ray_contributes_again_and_nothing_is_left(tmp_path):
    run_dir = tmp_path / "run"
    run = RunWatch(run_dir, "--learners", "2", "--inner-steps", "1000000", "--no-evaluate")
    try:
        run.wait_for(lambda: contributions(run_dir, 1) and actor_state(run_dir, "learner-1").get("pid")
                     == learner_status(run_dir, 1).get("pid"), "learner 1 to contribute")
        before = actor_state(run_dir, "learner-1")
        victim = before["pid"]
        os.kill(victim, signal.SIGKILL)
        after = run.wait_for(lambda: (s := actor_state(run_dir, "learner-1")).get("incarnation") == 1
                             and s.get("pid") != victim and s, "Ray to restart learner 1's actor")
        # A new actor worker process (Ray's restart), not the old actor starting a second child.
        assert after["worker_pid"] != before["worker_pid"]
        run.wait_for(lambda: learner_status(run_dir, 1).get("pid") == after["pid"]
                     and learner_status(run_dir, 1).get("state") == "training", "the new learner 1 to train")
        # Past every inner step the killed process ever published at: only the new process's work.
        starts = [i for i, line in enumerate(work(run_dir, 1)) if line["event"] == "start"]
        assert len(starts) == 2
        killed_reached = max((line["inner_step"] for line in work(run_dir, 1)[:starts[1]]
                              if line["event"] == "publish"), default=-1)
        run.wait_for(lambda: max(contributions(run_dir, 1)) > killed_reached,
                     "a round merging the restarted learner's update")
        run.note()
    finally:
        out = run.finish()
    assert run.popen.returncode == 128 + signal.SIGINT, out
    summary = read_json_object(RunPaths(run_dir).summary)
    assert summary["outcome"] == "interrupted"
    assert summary["learners"]["1"]["restarts"] == 1 and summary["learners"]["0"]["restarts"] == 0
    assert summary["syncer"]["restarts"] == 0
    ray_processes = [name for name in run.names.values() if "raylet" in name or "gcs_server" in name]
    assert len(ray_processes) >= 2, run.names  # the snapshot saw Ray's own processes, not only ddiloco's
    assert_nothing_left(run)


def watch_until_it_ends(run: RunWatch) -> str:
    """Its output, once it has ended by itself; every descendant it had is noted on the way."""
    deadline = time.monotonic() + WAIT_S
    while run.popen.poll() is None and time.monotonic() < deadline:
        run.note()
        time.sleep(POLL_S)
    return run.end()


@pytest.mark.timeout(600)
def test_a_learner_whose_script_fails_at_import_is_given_up_after_three_starts_not_restarted_by_ray(tmp_path):
    # The local supervisor's rule (tests/unit/test_supervisor_start_failures.py), through Ray: without it Ray
    # restarted the role up to max_restarts (100) times.
    script = tmp_path / "train.py"
    script.write_text("import my_model  # a module that does not exist\n")
    run_dir = tmp_path / "run"
    run = RunWatch(run_dir, "--learners", "1", "--no-evaluate", "--", sys.executable, str(script), tiny=False)
    out = watch_until_it_ends(run)
    assert run.popen.returncode == 1, out
    summary = read_json_object(RunPaths(run_dir).summary)
    learner = summary["learners"]["0"]
    assert learner["state"] == "failed" and learner["restarts"] == 2, summary
    assert learner["reason"].startswith("ModuleNotFoundError: No module named 'my_model' (3 starts in a row ended "
                                        "before its session started, the last with exit code 1"), learner
    assert actor_state(run_dir, "learner-0")["incarnation"] == 2
    assert_nothing_left(run)


@pytest.mark.timeout(600)
def test_a_learner_failing_at_the_same_step_at_every_restart_is_given_up_not_restarted_by_ray(tmp_path):
    # The local supervisor's second crash-loop rule (tests/integration/test_odd_models.py), through Ray: the count
    # rides from one actor incarnation to the next.
    script = tmp_path / "odd.py"
    script.write_text(ODD_MODEL_SCRIPT)
    run_dir = tmp_path / "run"
    run = RunWatch(run_dir, "--learners", "1", "--inner-steps", "40", "--no-evaluate", "--threads", "1", "--",
                   sys.executable, str(script), "short_schedule", tiny=False)
    out = watch_until_it_ends(run)
    assert run.popen.returncode == 1, out
    learner = read_json_object(RunPaths(run_dir).summary)["learners"]["0"]
    assert learner["state"] == "failed" and learner["restarts"] == 3, learner
    assert learner["reason"].startswith("ValueError: Tried to step 16 times"), learner
    assert "3 restarts in a row failed without training past inner step 12" in learner["reason"], learner
    assert actor_state(run_dir, "learner-0")["incarnation"] == 3
    assert_nothing_left(run)


@pytest.mark.timeout(600)
def test_a_learner_that_aborts_after_finishing_its_session_is_done_not_restarted_by_ray(tmp_path):
    # A native library aborting at interpreter exit (gloo or NCCL teardown can) after the session wrote its final
    # status: the learner lost nothing, and a restart would only finish again.
    script = tmp_path / "train_then_abort.py"
    script.write_text(f"import os, runpy, sys\nsys.argv = [{str(REPO / 'examples' / 'mlp.py')!r}]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\nos.abort()\n")
    run_dir = tmp_path / "run"
    run = RunWatch(run_dir, "--learners", "1", "--inner-steps", "32", "--no-evaluate", "--threads", "1", "--",
                   sys.executable, str(script), tiny=False)
    out = watch_until_it_ends(run)
    assert run.popen.returncode == 0, out
    summary = read_json_object(RunPaths(run_dir).summary)
    learner = summary["learners"]["0"]
    assert learner["state"] == "done" and learner["restarts"] == 0, summary
    assert "exited with signal SIGABRT after its session had finished: done, not restarted" in out
    assert actor_state(run_dir, "learner-0")["incarnation"] == 0
    assert_nothing_left(run)


PREEMPTED = """
import os, signal, sys
from pathlib import Path
import torch
from torch import nn
import ddiloco

marker = Path(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        if sync.inner_step == 10 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)  # from outside ddiloco run, as a preemption would be
        x = torch.randn(8, 4)
        loss = nn.functional.mse_loss(model(x), x[:, :2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x), loss=loss.item())
"""
"""A learner that SIGTERMs itself once, at inner step 10 (a marker file): its session stops cleanly (exit 0)."""


def test_a_learner_stopped_by_a_sigterm_from_outside_is_restarted_by_ray_and_reaches_its_budget(tmp_path):
    script = tmp_path / "preempted.py"
    script.write_text(PREEMPTED)
    run_dir = tmp_path / "run"
    run = RunWatch(run_dir, "--learners", "1", "--inner-steps", "30", "--num-fragments", "1", "--sync-every", "5",
                   "--no-evaluate", "--threads", "1", "--", sys.executable, str(script), str(tmp_path / "marker"),
                   tiny=False)
    out = watch_until_it_ends(run)
    assert run.popen.returncode == 0 and (tmp_path / "marker").exists(), out
    learner = read_json_object(RunPaths(run_dir).summary)["learners"]["0"]
    # Before, the actor kept the exit 0: done at inner step 11 of 30, and the run completed.
    assert learner["state"] == "done" and learner["inner_step"] == 30, (learner, out)
    assert actor_state(run_dir, "learner-0")["incarnation"] == 1
    assert_nothing_left(run)
