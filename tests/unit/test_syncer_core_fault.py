"""A fault of the syncer core's own (an exception from `Syncer.receive` or `advance`) ends the syncer's process with
EXIT_CORE_FAULT and says why, so that the supervisor restarts it from its durable state. Before, the exception went
into a gRPC handler (the learner got UNKNOWN) or killed the timer thread, and the run stalled with the core half way
through a round it had made durable (found with a ZeroDivisionError in a round's close). Real processes: each case
runs in a child interpreter, whose exit status is the one a supervisor sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.runtime.syncer_service import EXIT_CORE_FAULT

REPO = Path(__file__).parents[2]

SCRIPT = """
import logging, sys
from ddiloco.clock import VirtualClock
from ddiloco.config import DilocoConfig, QuorumConfig
from ddiloco.messages import Heartbeat, Join
from ddiloco.metrics import NullSink
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_service import SyncerService
from ddiloco.runtime.syncer_state import SyncerStore
from ddiloco.syncer import Syncer
from tests.helpers import TinyNet, params_of

logging.basicConfig(level=logging.INFO)
config, quorum = DilocoConfig(num_fragments=2, codec="fp32"), QuorumConfig(min_quorum=1)
syncer = Syncer(config, quorum, initial_params=params_of(TinyNet(seed=1)))
clock = VirtualClock()
service = SyncerService(RunConfig(diloco=config, quorum=quorum, num_learners=1), syncer, SyncerStore(sys.argv[2]),
                        sink=NullSink(), clock=clock)
service.join(Join(0, syncer.spec, config.fingerprint()), config.to_dict(), "test")


def broken(*args):
    raise ZeroDivisionError("float division by zero")


if sys.argv[1] == "heartbeat":
    syncer.receive = broken
    service.heartbeat(Heartbeat(0, 1))
else:  # the timer thread: a deadline that has passed (before it starts: a jump of its clock later reads as a pause
    # of the syncer's own, which no learner's deadline counts, `SyncerService._timer_loop`)
    syncer.advance = broken
    clock.advance_to(quorum.heartbeat_timeout_s + 1.0)
    service.start("127.0.0.1:0")
    import time
    time.sleep(30)
print("still running")
"""


@pytest.mark.parametrize("where", ["heartbeat", "timer"])
def test_a_fault_of_the_core_ends_the_syncer_for_a_restart(tmp_path, where):
    script = tmp_path / "core_fault.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), where, str(tmp_path / "run")], cwd=REPO, timeout=120,
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == EXIT_CORE_FAULT, done.stdout + done.stderr
    assert "still running" not in done.stdout
    assert "the syncer core failed on" in done.stderr and "ZeroDivisionError: float division by zero" in done.stderr
