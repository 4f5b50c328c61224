"""A learner whose budget ends while its syncer is away (killed, restarting) waits for the syncer's return and sends
its last work then, instead of exiting `done` with it dropped as unreachable (probe: a syncer kill -9 near the end of
a run lost 23-26 % of both learners' tokens, the run `completed` without a word). Real processes started by hand, a
real SIGKILL, the syncer restarted on the same address; the rule's unit tests are in tests/unit/test_last_work.py."""

from __future__ import annotations

import signal

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import wait_until
from tests.standalone_syncer import start_syncer, unused_port

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]  # 20-30 s; the rule's unit tests run by default

BUDGET = 200
"""With the built-in TinyGPT (about 15 inner steps a second here): the syncer is gone for most of it."""


def test_last_work_waits_for_the_syncer_to_come_back(procs, tmp_path, run_token):
    run_dir = tmp_path / "run"
    flags = ("--learners", "1", "--num-fragments", "2", "--sync-every", "8", "--inner-steps",
             str(BUDGET), "--bind", f"127.0.0.1:{unused_port()}")
    syncer, address = start_syncer(procs, run_dir, run_token, *flags)
    learner = procs.start("learner", "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                          str(run_dir), "--token-file", str(run_token), "--threads", "1", "--max-wait-s", "60")
    status_file = run_dir / "learners" / "0" / "status.json"
    wait_until(lambda: ((read_json(status_file) or {}).get("inner_step") or 0) > 20, "the learner to train",
               alive=[learner])
    syncer.send_signal(signal.SIGKILL)
    syncer.wait(timeout=30)
    wait_until(lambda: "did not reach the syncer: waiting" in procs.log("learner"), "the learner to wait with its "
               "last work", alive=[learner])
    assert learner.poll() is None, procs.log("learner")[-3000:]
    syncer2, _ = start_syncer(procs, run_dir, run_token, *flags, name="syncer2")
    assert learner.wait(timeout=60) == 0, procs.log("learner")[-3000:]
    log = procs.log("learner")
    assert "its last work reached the syncer" in log and "never reached the syncer" not in log, log[-3000:]
    # Every token it trained is in the global model: the updates dropped during the outage were carried by the last
    # work (an undelivered update's work goes out with the fragment's next one), and that was delivered.
    # syncer_status.json is rewritten periodically: its first line after the restart may predate the last rounds.
    tokens = read_json(status_file)["tokens"]
    merged = lambda: (read_json(run_dir / "syncer_status.json") or {}).get("learners", {}).get("0", {}).get(
        "tokens_merged")
    wait_until(lambda: merged() == tokens, f"the syncer's status to count all {tokens} tokens merged", alive=[syncer2])
