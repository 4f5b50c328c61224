"""examples/slurm/ddiloco.sbatch run as SLURM would run it, with stub `srun`, `scontrol` and `ddiloco` on PATH: its
requeue signal (USR1) does not stop the syncer under learners that still train, and a second job of a run whose
syncer is alive leaves that syncer's address file alone."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

SLURM = Path(__file__).parents[2] / "examples" / "slurm"
TIMEOUT_S = 60

SRUN = """#!/usr/bin/env bash
while [ "$#" -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done  # srun's own options
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) echo n0; echo n1 ;;
    requeue) echo "requeue $2" >> "$RUN_DIR/events" ;;
esac
"""
DDILOCO = """#!/usr/bin/env bash
role=$1
RUN_DIR=${RUN_DIR:-$(for a in "$@"; do [ "${prev:-}" = --run-dir ] && echo "$a"; prev=$a; done)}
case "$role" in
    token) echo learner-token; exit 0 ;;
    syncer)
        [ -n "${SYNCER_EXITS:-}" ] && exit "$SYNCER_EXITS"
        [ -s "$RUN_DIR/config.json" ] || echo '{}' > "$RUN_DIR/config.json"
        trap 'echo "syncer stopped, learner finished: $([ -e "$RUN_DIR/finished" ] && echo yes || echo no)" \\
              >> "$RUN_DIR/events"; exit 0' TERM
        echo '{"address": "n0:50051"}' > "$RUN_DIR/syncer.json"
        while :; do sleep 0.1; done ;;
    learner)
        touch "$RUN_DIR/training"
        sleep "${LEARNER_S:-0}"
        touch "$RUN_DIR/finished" ;;
esac
"""


def start(tmp_path: Path, **env: str) -> subprocess.Popen:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("ddiloco", DDILOCO)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    environment = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[0-1]",
                   "SLURM_JOB_ID": "42", "RUN_DIR": str(run_dir), "SLURM_DIR": str(SLURM),
                   "DDILOCO": str(stubs / "ddiloco"), "STABLE_AFTER_S": "1", **env}
    if not environment["RUN_DIR"]:
        del environment["RUN_DIR"]  # the script's default
    # Its own process group: a test that fails ends the stub steps too (a timed-out one left restart.sh and the stub
    # syncer looping behind it).
    return subprocess.Popen(["bash", str(SLURM / "ddiloco.sbatch")], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return output


def test_the_requeue_signal_does_not_stop_the_syncer_under_training_learners(tmp_path):
    # The USR1 trap interrupted `wait` on the learner's step (status 138): the script took the learner for ended,
    # stopped the syncer while it trained, and exited 138.
    batch = start(tmp_path, LEARNER_S="3")
    deadline = time.monotonic() + TIMEOUT_S
    while not (tmp_path / "run" / "training").exists():
        assert batch.poll() is None and time.monotonic() < deadline, finish(batch)
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)
    output = finish(batch)
    assert batch.returncode == 0, output
    events = (tmp_path / "run" / "events").read_text().splitlines()
    assert events == ["requeue 42", "syncer stopped, learner finished: yes"], (events, output)


def test_a_second_job_leaves_the_live_syncers_address_file_alone(tmp_path):
    # It removed syncer.json before its own syncer was refused by the live one's lock: the file operators and tools
    # read the running syncer's address from was gone while that syncer served.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "syncer.json").write_text('{"address": "live"}')
    with open(run_dir / "syncer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the live syncer holds it
        output = finish(start(tmp_path, SYNCER_EXITS="1"))
    assert (run_dir / "syncer.json").read_text() == '{"address": "live"}', output


def test_a_new_submission_starts_a_new_run_and_a_requeue_resumes_its_own(tmp_path):
    # The default run directory was one per job name: a second sbatch resumed the first's finished run and trained
    # nothing. It is the job's own now, which a requeue (same job id) finds again.
    outputs = []
    for job, restarts in (("42", "0"), ("42", "1"), ("43", "0")):
        output = finish(start(tmp_path, RUN_DIR="", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NAME="exp",
                              SLURM_JOB_ID=job, SLURM_RESTART_COUNT=restarts))
        outputs.append(output)
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["slurm-exp-42", "slurm-exp-43"], outputs
    assert f"run {runs / 'slurm-exp-42'} (a new run)" in outputs[0], outputs[0]
    assert f"run {runs / 'slurm-exp-42'} (resuming: restart 1 of job 42)" in outputs[1], outputs[1]
    assert f"run {runs / 'slurm-exp-43'} (a new run)" in outputs[2], outputs[2]
