"""`ddiloco syncer` and `ddiloco learner` started by hand (docs/clusters.md, "By hand"): what each refuses at its
start, in one line and before it writes or joins anything; and what a restarted syncer writes to config.json.

Real processes, real gRPC on 127.0.0.1 with ephemeral ports, real signals; every wait has a hard deadline and the
fixture kills every process it started, by PID.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from ddiloco.checkpoint import read_json
from ddiloco.runtime.syncer_state import GENESIS_FILE
from ddiloco.transport.auth import learner_token
from tests.helpers import SMALL_RUN, TINY_MODEL_FLAGS, ddiloco_run, wait_until
from tests.standalone_syncer import TOKEN, start_syncer, unused_port, write_token

pytestmark = pytest.mark.integration

RUN_FLAGS = (*TINY_MODEL_FLAGS, "--learners", "2", "--num-fragments", "2", "--sync-every", "8", "--max-wait-s", "0.5",
             "--heartbeat-timeout-s", "3", "--heartbeat-every-s", "0.5")
EXIT_WAIT_S = 40.0
"""Hard limit on a process that should stop by itself at its start (it imports torch first)."""
EXIT_USAGE = 2
EXIT_REFUSED = 3


def stop(popen) -> None:
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=EXIT_WAIT_S) == 0


def exits(procs, name: str, popen) -> tuple[int, str]:
    """(exit status, log) of a process that must stop by itself within EXIT_WAIT_S."""
    try:
        code = popen.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still running after {EXIT_WAIT_S} s:\n{procs.log(name)[-2000:]}")
    return code, procs.log(name)


def error_line(log: str) -> str:
    """The one line a refused command ends with; a traceback fails the test."""
    assert "Traceback" not in log, log[-3000:]
    return log.strip().splitlines()[-1]


@pytest.mark.acceptance  # the default suite's 15 minutes
def test_a_learner_whose_model_differs_from_the_runs_config_is_refused_before_it_becomes_the_genesis(
        procs, tmp_path, run_token):
    run_dir = tmp_path / "run"
    _, address = start_syncer(procs, run_dir, run_token, *RUN_FLAGS, "--inner-steps", "16")
    rogue = procs.start("rogue", "learner", "--syncer", address, "--learner-id", "0", "--run-dir", str(run_dir),
                        "--token-file", str(run_token), "--threads", "1", "--model-width", "64")
    code, log = exits(procs, "rogue", rogue)
    line = error_line(log)
    assert code == EXIT_USAGE, log[-3000:]
    assert "--model-width 64 (the run has 32)" in line and str(run_dir / "config.json") in line, line
    assert not (run_dir / GENESIS_FILE).exists()
    # On another host, in a run directory of its own (no config.json to compare with), with the run's settings but
    # one: the syncer refuses the settings it declares. Before, its model became the run's genesis, for good.
    elsewhere = procs.start("elsewhere", "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                            str(tmp_path / "host-b" / "run"), "--token-file", str(run_token), "--threads", "1",
                            *TINY_MODEL_FLAGS, "--learners", "2", "--num-fragments", "2", "--sync-every", "8",
                            "--model-width", "64")
    code, log = exits(procs, "elsewhere", elsewhere)
    assert code == EXIT_REFUSED, log[-3000:]
    assert "this learner's settings differ from the run's: --model-width 64 (the run has 32)" in log, log[-3000:]
    assert not (run_dir / GENESIS_FILE).exists()
    # Without the run's algorithm settings too: every difference in one refusal, with the advice. Before, the first
    # algorithm setting alone (`num_fragments is 4 on the learner but 2 on the syncer`), then the next, flag by flag.
    bare = procs.start("bare", "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                       str(tmp_path / "host-c" / "run"), "--token-file", str(run_token), "--threads", "1",
                       *TINY_MODEL_FLAGS, "--learners", "2")
    code, log = exits(procs, "bare", bare)
    assert code == EXIT_REFUSED, log[-3000:]
    refusal = next(line for line in log.splitlines() if "this learner's settings differ" in line)
    assert "--num-fragments 4 (the run has 2)" in refusal and "--sync-every" in refusal, refusal
    assert "--config FILE" in refusal, refusal
    # The run's own settings (and a budget of its own, which may differ) are taken: this learner is the genesis.
    own = procs.start("own", "learner", "--syncer", address, "--learner-id", "1", "--run-dir", str(run_dir),
                      "--token-file", str(run_token), "--threads", "1", "--inner-steps", "8")
    code, log = exits(procs, "own", own)
    assert code == 0, log[-3000:]
    assert (run_dir / GENESIS_FILE).exists()


def test_an_evaluator_whose_model_or_data_differs_from_the_runs_is_refused(procs, tmp_path, run_token):
    # Before: an evaluator started by hand on another host with other model settings of the same shapes (4 heads of 8
    # for the run's 2 of 16) loaded the global model into another architecture, and one with another validation share
    # measured other data (the learners' training data included): either way a loss that was not the run's, without a
    # word.
    run_dir = tmp_path / "run"
    _, address = start_syncer(procs, run_dir, run_token, *RUN_FLAGS, "--inner-steps", "16")
    for name, flags, difference in (("heads", ("--model-num-heads", "4"), "--model-num-heads 4 (the run has 2)"),
                                    ("data", ("--data-val-fraction", "0.2"), "--data-val-fraction 0.2 (the run has "
                                              "0.05)")):
        evaluator = procs.start(f"evaluator-{name}", "evaluator", "--syncer", address, "--run-dir",
                                str(tmp_path / "host-b" / name), "--token-file", str(run_token), "--threads", "1",
                                *TINY_MODEL_FLAGS, "--num-fragments", "2", "--sync-every", "8", *flags)
        code, log = exits(procs, f"evaluator-{name}", evaluator)
        assert code == EXIT_REFUSED, log[-3000:]
        assert f"this evaluator's settings differ from the run's: {difference}" in log, log[-3000:]
        assert "--config FILE" in log, log[-3000:]


def test_a_restarted_syncer_writes_what_may_change_and_refuses_what_may_not_naming_both_values(
        procs, tmp_path, run_token):
    run_dir = tmp_path / "run"
    first, _ = start_syncer(procs, run_dir, run_token, "--learners", "2", "--outer-lr", "0.7", "--inner-steps", "50")
    stop(first)
    again, _ = start_syncer(procs, run_dir, run_token, "--min-quorum", "2", "--inner-steps", "80", name="again")
    saved = read_json(run_dir / "config.json")
    assert saved["quorum"]["min_quorum"] == 2 and saved["inner_steps"] == 80, saved
    assert saved["num_learners"] == 2 and saved["diloco"]["outer_lr"] == 0.7, saved
    stop(again)
    before = (run_dir / "config.json").read_bytes()
    for name, flags, needle in (("lr", ("--outer-lr", "0.5"), "--outer-lr 0.5 (the run has 0.7)"),
                                ("learners", ("--learners", "3", "--min-quorum", "3"), "--learners 3 (the run has 2)")):
        popen = procs.start(name, "syncer", "--run-dir", str(run_dir), "--token-file", str(run_token), *flags)
        code, log = exits(procs, name, popen)
        line = error_line(log)
        assert code == EXIT_USAGE and needle in line, log[-3000:]
    assert (run_dir / "config.json").read_bytes() == before


def test_a_syncer_that_cannot_bind_leaves_no_config_in_a_fresh_directory(procs, tmp_path, run_token):
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        popen = procs.start("syncer", "syncer", "--run-dir", str(run_dir), "--token-file", str(run_token),
                            "--bind", f"127.0.0.1:{port}", "--learners", "2")
        code, log = exits(procs, "syncer", popen)
    assert code == EXIT_USAGE and f"cannot listen on 127.0.0.1:{port}" in error_line(log), log[-3000:]
    assert not (run_dir / "config.json").exists()
    assert not run_dir.exists()  # nor its metrics or lock: `ddiloco run --run-dir` took it for a run to resume
    # ... so that the next start, with other flags, makes the run it asks for.
    popen, _ = start_syncer(procs, run_dir, run_token, "--learners", "3", name="next")
    assert read_json(run_dir / "config.json")["num_learners"] == 3
    stop(popen)


def test_a_syncer_given_a_learners_token_as_its_run_token_is_refused(procs, tmp_path, run_token):
    learner_file = write_token(tmp_path / "learner0", learner_token(TOKEN, 0))
    run_dir = tmp_path / "run"
    popen = procs.start("syncer", "syncer", "--run-dir", str(run_dir), "--token-file", str(learner_file),
                        "--learners", "2")
    code, log = exits(procs, "syncer", popen)
    line = error_line(log)
    assert code == EXIT_USAGE and "holds a learner's token, not the run token" in line, log[-3000:]
    assert not (run_dir / "config.json").exists()


def test_a_learner_given_another_learners_token_is_refused_before_it_connects(procs, tmp_path):
    learner_file = write_token(tmp_path / "learner1", learner_token(TOKEN, 1))
    popen = procs.start("learner", "learner", "--syncer", f"127.0.0.1:{unused_port()}", "--learner-id", "0",
                        "--run-dir", str(tmp_path / "run"), "--token-file", str(learner_file), "--threads", "1")
    code, log = exits(procs, "learner", popen)
    line = error_line(log)
    assert code == EXIT_USAGE and "learner 1's, not learner 0's" in line, log[-3000:]


def test_a_run_with_a_seed_torch_cannot_take_is_refused_before_it_starts(tmp_path):
    run_dir = tmp_path / "run"
    code, output = ddiloco_run(run_dir, *SMALL_RUN, "--inner-steps", "30", "--no-evaluate",
                               "--seed", str(2**64 + 1), command=[sys.executable, "-c", "pass"], timeout_s=EXIT_WAIT_S)
    assert code == EXIT_USAGE and "seed=18446744073709551617 is invalid" in output, output[-3000:]
    assert not (run_dir / "config.json").exists()


def test_a_syncer_run_by_hand_stops_cleanly_on_sighup(procs, tmp_path, run_token):
    # A closed terminal ended a syncer run by hand at once, with no final state: its restart had rounds to replay.
    # Started with SIGHUP's default, as from a terminal: under nohup (CI's runner) the child inherits SIG_IGN, which
    # the syncer rightly leaves alone.
    run_dir = tmp_path / "run"
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        popen, _ = start_syncer(procs, run_dir, run_token, "--learners", "2")
    finally:
        signal.signal(signal.SIGHUP, inherited)
    popen.send_signal(signal.SIGHUP)
    code, log = exits(procs, "syncer", popen)
    assert code == 0 and "received SIGHUP: stopping" in log, log[-3000:]


def test_a_learner_run_by_hand_stops_cleanly_on_ctrl_c(procs, tmp_path, run_token):
    # docs/runtime.md: SIGTERM / SIGINT stop a learner after its current step, with its checkpoint, exit 0. A Ctrl-C
    # raised KeyboardInterrupt wherever the loop was: the learner was `failed`, exit 130, its checkpoint the last
    # periodic one. Started with SIGINT's default, as from a terminal (a job a shell put in the background, as CI's
    # runner may be, inherits SIG_IGN).
    run_dir = tmp_path / "run"
    _, address = start_syncer(procs, run_dir, run_token, *RUN_FLAGS, "--inner-steps", "1000000")
    inherited = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        learner = procs.start("learner", "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                              str(run_dir), "--token-file", str(run_token), "--threads", "1",
                              "--checkpoint-every-s", "1000")
    finally:
        signal.signal(signal.SIGINT, inherited)
    status_file = run_dir / "learners" / "0" / "status.json"
    wait_until(lambda: ((read_json(status_file) or {}).get("inner_step") or 0) > 10, "the learner to train",
               alive=[learner])
    learner.send_signal(signal.SIGINT)
    code, log = exits(procs, "learner", learner)
    status = read_json(status_file)
    assert code == 0 and status["state"] == "stopped", (status, log[-3000:])
    assert status["checkpoint_inner_step"] == status["inner_step"] > 10, status  # saved at the stop
    assert "Ctrl-C" in log and "KeyboardInterrupt" not in log, log[-3000:]
