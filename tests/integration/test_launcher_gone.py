"""Learners run through a wrapper (`-- bash wrap.sh` that runs python as its child, `uv run`, `conda run`) stop
cleanly: when `ddiloco run` is killed (kill -9, the OOM killer), and at a Ctrl-C.

The launcher's children die with it (`PR_SET_PDEATHSIG`), but a script behind a wrapper is a grandchild: it ran on
with PPID 1, retrying its lost syncer for ever. Now each learner watches the launcher named in its environment and,
once it is gone, stops as on SIGTERM.

A stop's SIGTERM goes to a wrapper's whole group: the wrapper (bash) dies of it at once, while the script it runs
writes its stop checkpoint. The launcher SIGKILLed the group as soon as the wrapper had gone (within its 50 ms poll),
so a learner whose checkpoint took longer (an 8 M-parameter model here) was killed mid-stop and its status stayed
`training` (both learners, each run, before the fix).

Real processes, a real `kill -9` and a real SIGINT; every process is killed by pid at the end, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import SMALL_RUN, wait_until

pytestmark = pytest.mark.integration

SCRIPT = '''
import signal
import sys
import time
from pathlib import Path
import torch
from torch import nn
import ddiloco

env = ddiloco.environment()


def on_sigterm(signum, frame):  # the script's own handler (a scheduler's requeue, a log flush), from before the session
    Path(sys.argv[1], f"handled-{env.learner_id}").write_text(str(signum))


signal.signal(signal.SIGTERM, on_sigterm)
torch.manual_seed(env.seed)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(env.learner_id)
with ddiloco.session(model, optimizer) as sync:
    while not sync.done:
        x = torch.randn(16, 8, generator=generator)
        loss = nn.functional.mse_loss(model(x), x[:, :2].sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sync.step(tokens=len(x), loss=loss.item())
        time.sleep(0.01)
'''
WRAPPER = '''#!/bin/bash
echo "wrapper starting"
"{python}" "{script}" "{marks}"
echo "wrapper: python exited $?"
'''
"""Runs the learner as its child (no exec): the learner is not the launcher's child, so PR_SET_PDEATHSIG misses it."""
GONE_WITHIN_S = 20.0
"""How long after the launcher's kill -9 its learners may run: a watch notices within a second, and a clean stop
(flush, leave, checkpoint) takes a few more on a loaded machine; the watch's own bound is 30 s."""


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ...; [] once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


@pytest.mark.timeout(120)
def test_learners_behind_a_wrapper_stop_cleanly_when_the_launcher_is_killed(tmp_path):
    script, wrapper, run_dir = tmp_path / "train.py", tmp_path / "wrap.sh", tmp_path / "run"
    script.write_text(SCRIPT)
    wrapper.write_text(WRAPPER.format(python=sys.executable, script=script, marks=tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *SMALL_RUN,
                                 "--inner-steps", "1000000", "--", "bash", str(wrapper)],
                                cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    learners: list[int] = []
    try:
        def training() -> list[int] | None:
            statuses = [read_json(run_dir / "learners" / str(i) / "status.json") or {} for i in range(2)]
            if all(s.get("state") == "training" and s.get("inner_step", 0) > 0 for s in statuses):
                return [s["pid"] for s in statuses]
            return None

        learners = wait_until(training, "both learners training", alive=[launcher])
        assert all(int(stat_fields(pid)[1]) != launcher.pid for pid in learners)  # the wrapper's children
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(map(alive, learners)) and time.monotonic() < deadline:
            time.sleep(0.1)
        still = [pid for pid in learners if alive(pid)]
        assert not still, f"learners {still} still running {GONE_WITHIN_S} s after their launcher's kill -9"
        for i in range(2):
            status = read_json(run_dir / "learners" / str(i) / "status.json")
            assert status["state"] == "stopped", status  # a clean stop: checkpointed, not killed
            log = (run_dir / "logs" / f"learner-{i}.log").read_text()
            assert f"its launcher (ddiloco run, pid {launcher.pid}) is gone: stopping as on SIGTERM" in log
            # As on SIGTERM, the script's own handler ran too, once the session had ended (a direct child of the
            # launcher gets a real SIGTERM from the kernel, which runs it).
            assert (tmp_path / f"handled-{i}").read_text() == str(int(signal.SIGTERM))
    finally:
        for pid in learners:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


LARGER_MODEL = "nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 4096), nn.Tanh(), nn.Linear(4096, 2)"
"""8.4 M parameters: its checkpoint (model and AdamW state) takes longer than the launcher's poll."""


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(150)
def test_a_ctrl_c_lets_learners_behind_a_wrapper_write_their_stop_checkpoint(tmp_path):
    script, wrapper, run_dir = tmp_path / "train.py", tmp_path / "wrap.sh", tmp_path / "run"
    script.write_text(SCRIPT.replace("nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)", LARGER_MODEL))
    wrapper.write_text(WRAPPER.format(python=sys.executable, script=script, marks=tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "run", "--run-dir", str(run_dir), *SMALL_RUN,
                                 "--inner-steps", "1000000", "--", "bash", str(wrapper)],
                                cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def training() -> bool | None:
            statuses = [read_json(run_dir / "learners" / str(i) / "status.json") or {} for i in range(2)]
            return all(s.get("state") == "training" and s.get("inner_step", 0) > 0 for s in statuses) or None

        wait_until(training, "both learners training", alive=[launcher])
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=90) == 130
        for i in range(2):
            status = read_json(run_dir / "learners" / str(i) / "status.json")
            assert status["state"] == "stopped", status  # checkpointed, not SIGKILLed with the wrapper's group
            assert status["stop_requested"] is True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
