"""Fake `ddiloco` children for the launcher's and supervisor's tests, and the harness that runs them.

`fake_ddiloco` keeps the process contract's files (syncer.json, status files, a checkpoint) and exit codes, and
nothing else: it starts in milliseconds and needs no torch, so tests of restarts, backoff, refusals and clean
shutdown take a few seconds. A test scripts its children's behaviour in `DIR/fake_plan.json`, or, for a `ddiloco
run` that makes its run directory itself, in the FAKE_PLAN environment variable (`start_driver`'s `plan`). The
fake runs as a script written into a directory (`write_fake_command`), never from this module: nothing here is
imported by a child. The `fake_command` fixture is in tests/unit/conftest.py.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddiloco.checkpoint import read_json_object
from ddiloco.runtime.child_process import process_group_alive
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.supervised_roles import SupervisorConfig
from ddiloco.runtime.supervisor import Supervisor

WAIT_S = 30.0
"""Hard limit on every wait for a child to reach a state."""
FAST = SupervisorConfig(poll_interval_s=0.02, backoff_initial_s=0.05, backoff_max_s=0.2, stable_after_s=60.0,
                        learner_stop_timeout_s=5.0, syncer_stop_timeout_s=5.0, syncer_start_timeout_s=20.0)


def fake_ddiloco() -> None:
    """`fake syncer|learner [contract flags]`: writes the contract's files, obeys fake_plan.json."""
    import argparse
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    step_s = 0.01
    role = sys.argv[1]
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings")  # the launcher writes each child's settings there, as ddiloco reads them
    args = argparse.Namespace(**json.loads(Path(parser.parse_args(sys.argv[2:]).settings).read_text()))
    run = Path(args.run_dir)
    plan_path = run / "fake_plan.json"
    # A `ddiloco run` makes its run directory itself: its children take their plan from the environment.
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else json.loads(os.environ.get("FAKE_PLAN", "{}"))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))

    def write(path, data):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    with (run / "fake_calls.jsonl").open("a") as calls:
        calls.write(json.dumps({"role": role, "pid": os.getpid(), "argv": sys.argv[1:], "settings": vars(args),
                                "omp": os.environ.get("OMP_NUM_THREADS")}) + "\n")
    if role == "syncer":
        behaviour = plan.get("syncer", {})
        if "exit_code" in behaviour:
            print(behaviour.get("message", "fake syncer failed"), file=sys.stderr)
            sys.exit(behaviour["exit_code"])
        host, port = args.bind.rsplit(":", 1)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, int(port)))
        listener.listen()
        address = f"{host}:{listener.getsockname()[1]}"
        time.sleep(behaviour.get("serve_after_s", 0))  # a slow start: syncer.json only then
        write(run / "syncer.json", {"pid": os.getpid(), "address": address, "started_at": time.time()})
        with (run / "rounds.jsonl").open("a") as rounds:  # committed rounds, as many as the plan says (1)
            for _ in range(behaviour.get("rounds", 1)):
                rounds.write(json.dumps({"round": 0, "fragment": 0, "version": 1, "participants": []}) + "\n")
        while not stop:
            write(run / "syncer_status.json", {"time": time.time(), "pid": os.getpid(), "address": address,
                                               "rounds_committed": 0, "versions": [0],
                                               "storage_error": behaviour.get("storage_error")})
            time.sleep(step_s * 5)
        sys.exit(0)
    if role == "evaluator":
        behaviour = plan.get("evaluator", {})
        if "exit_code" in behaviour:  # before its first evaluation
            print(behaviour.get("message", "fake evaluator failed"), file=sys.stderr)
            sys.exit(behaviour["exit_code"])
        while not stop:
            time.sleep(step_s * 5)
        metrics = run / "evaluator" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        with metrics.open("a") as file:
            file.write(json.dumps({"step": 0, "time": time.time(), "eval/val_loss": 1.5}) + "\n")
        sys.exit(0)

    learner_id = args.learner_id
    behaviour = plan.get("learners", {}).get(str(learner_id), {})
    total = json.loads(Path(args.config).read_text())["inner_steps"]
    home = run / "learners" / str(learner_id)
    checkpoint = home / "fake_checkpoint.json"
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"inner_step": 0, "starts": 0}
    state["starts"] += 1
    write(checkpoint, state)
    if "exit_code" in behaviour and state["starts"] <= behaviour.get("failed_starts", state["starts"]):
        print(behaviour.get("message", "fake learner failed"), file=sys.stderr)
        sys.exit(behaviour["exit_code"])
    if state["starts"] <= behaviour.get("killed_starts", 0):
        os.kill(os.getpid(), signal.SIGKILL)  # before its session began: a fault, not the script's
    if behaviour.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour.get("grandchild"):
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        write(home / "grandchild.json", {"pid": helper.pid})

    def status(name):
        write(home / "status.json", {"time": time.time(), "pid": os.getpid(), "learner_id": learner_id,
                                     "state": name, "inner_step": state["inner_step"], "inner_steps": total,
                                     "loss": 5.0 / (1 + state["inner_step"]), "tokens_per_s": 1000.0,
                                     "tokens": 10 * state["inner_step"], "updates_accepted": 0,
                                     "stop_requested": bool(stop)})

    while state["inner_step"] < min(total, behaviour.get("loop_ends_at_step", total)) and not stop:
        if state["inner_step"] >= behaviour.get("stuck_at_step", total + 1):  # fails there at every start
            status("failed")
            print("Traceback (most recent call last):\n  ...\n" + behaviour["crash_message"], flush=True)
            os._exit(1)
        time.sleep(step_s)
        state["inner_step"] += 1
        write(checkpoint, state)
        status("training")
        with (home / "metrics.jsonl").open("a") as file:
            file.write(json.dumps({"step": state["inner_step"], "time": time.time(),
                                   f"learner/{learner_id}/loss": 5.0 / (1 + state["inner_step"])}) + "\n")
        crash_at, crashes = behaviour.get("crash_at_step", total + 1), behaviour.get("crashes", 1)
        if state["inner_step"] >= crash_at and state["starts"] <= crashes:
            if "crash_message" in behaviour:
                print("Traceback (most recent call last):\n  ...\n" + behaviour["crash_message"], flush=True)
            os._exit(1)
    status("done" if state["inner_step"] >= total else "stopped" if "loop_ends_at_step" in behaviour
           else "disconnected")
    if behaviour.get("abort_after_done") and state["starts"] == 1:
        os.abort()  # a native library's crash at interpreter exit, after the session had finished
    sys.exit(0)


def write_fake_command(directory: Path) -> tuple[str, ...]:
    """The command that runs `fake_ddiloco`, from a script written into `directory`."""
    script = directory / "fake_ddiloco.py"
    script.write_text(inspect.getsource(fake_ddiloco) + "\n\nfake_ddiloco()\n")
    return (sys.executable, str(script))


def make_run(tmp_path: Path, command, *, learners: int = 2, inner_steps: int = 20, plan=None) -> Launcher:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"inner_steps": inner_steps, "num_learners": learners}))
    if plan is not None:
        (run_dir / "fake_plan.json").write_text(json.dumps(plan))
    return Launcher(LaunchConfig(run_dir=run_dir, num_learners=learners, threads=1, command=tuple(command)))


def poll_until(supervisor: Supervisor, condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S} s waiting for {what}"
        supervisor.poll()
        time.sleep(supervisor.config.poll_interval_s)


def all_pids(supervisor: Supervisor) -> list[int]:
    return [pid for slot in supervisor.slots for pid in slot.pids]


def assert_all_gone(pids) -> None:
    alive = [pid for pid in pids if process_group_alive(pid)]
    assert not alive, f"process groups still alive: {alive}"


def run_parser() -> argparse.ArgumentParser:
    from ddiloco.runtime import run_commands
    parser = argparse.ArgumentParser(prog="ddiloco")
    run_commands.add_parser(parser.add_subparsers(dest="command"))
    return parser


DRIVER = """
import argparse
import sys
from ddiloco.runtime import run_commands
from ddiloco.runtime.supervised_roles import SupervisorConfig
parser = argparse.ArgumentParser(prog="ddiloco")
run_commands.add_parser(parser.add_subparsers(dest="command"))
args = parser.parse_args(sys.argv[2:])
sys.exit(run_commands.run(args, command=(sys.executable, sys.argv[1]),
                          supervisor_config=SupervisorConfig(poll_interval_s=0.02, backoff_initial_s=0.05)))
"""


def start_driver(tmp_path: Path, fake_command, *flags: str, plan=None) -> tuple[subprocess.Popen, Path]:
    """`ddiloco run` with fake children, as a separate process (own session: signals reach only it)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(driver), fake_command[1], "run", "--run-dir", str(run_dir), "--learners", "3",
            "--no-progress", *flags]
    env = {**os.environ, "FAKE_PLAN": json.dumps(plan or {})}
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=Path(__file__).parents[1], env=env)
    return popen, run_dir


def driver_output(popen: subprocess.Popen) -> str:
    """The output of a `start_driver` launcher once it exits (within WAIT_S); its process group is killed if not."""
    try:
        out, _ = popen.communicate(timeout=WAIT_S)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
    return out


def wait_for_learners(run_dir: Path, popen: subprocess.Popen, count: int) -> list[int]:
    deadline = time.monotonic() + WAIT_S
    paths = RunPaths(run_dir)
    while True:
        statuses = [read_json_object(paths.learner_status(i)) for i in range(count)]
        if all(s and s.get("inner_step", 0) > 0 for s in statuses):
            return [s["pid"] for s in statuses]
        assert popen.poll() is None, popen.communicate()[0]
        assert time.monotonic() < deadline, "learners did not start training"
        time.sleep(FAST.poll_interval_s)

