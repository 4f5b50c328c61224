"""How an evaluator (`ddiloco.watch`, `ddiloco evaluator`) stops: on a SIGTERM whatever it waits for, on a refusal
(exit status 3), on a syncer that never answered (exit status 4); that one that has reached its syncer comes back
to it after a restart however long that takes; and that it evaluates a model whose parameters are not float32.

The Watcher tests run it in this process against a real gRPC server on 127.0.0.1 whose handler is a stub (a syncer
before its genesis, or one that serves a fixed global model), to see each connection; the others start real
`ddiloco` processes. Every wait has a hard deadline and the fixture kills every process it started, by PID.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from ddiloco.checkpoint import read_json
from ddiloco.config import DilocoConfig, LearnerConfig
from ddiloco.evaluator import Watcher
from ddiloco.fragments import FragmentPlan
from ddiloco.messages import FragmentState, Welcome
from ddiloco.run_config import RunConfig
from ddiloco.transport.grpc_server import start_server
from tests.helpers import (
    PROCESS_WAIT_S,
    SMALL_RUN,
    TINY_MODEL_FLAGS,
    TINY_RUN,
    TinyNet,
    ddiloco_run,
    params_of,
    wait_until,
)

pytestmark = pytest.mark.integration

STOP_WITHIN_S = 3.0
"""How soon after its stop request an evaluator must have ended when there is nothing to evaluate: a couple of
slices of `interrupts.SIGNAL_CHECK_S` and one Status call, with room for a loaded machine."""
EXIT_REFUSED, EXIT_UNREACHABLE = 3, 4
CONFIG = RunConfig(diloco=DilocoConfig(num_fragments=2, codec="fp32"), learner=LearnerConfig(connect_timeout_s=0.5))
"""A TinyNet's run; a syncer that never answered is given up after half a second."""
TOKEN = "evaluator-stops-test-token-0123"


class NoGenesis:
    """The handler of a syncer that no learner has given a genesis yet: a Watch gets nothing, Status says so."""

    def __init__(self) -> None:
        self.watched = threading.Event()

    def snapshot(self, after_round, not_before):
        self.watched.set()
        return None

    def status(self) -> dict:
        return {"genesis": False}


class Serving:
    """The handler of a syncer that serves one global model (one round committed per fragment)."""

    def __init__(self, params) -> None:
        plan = FragmentPlan.for_tensors(params, CONFIG.diloco)
        self.welcome = Welcome(0, tuple(FragmentState(p, 1, {n: params[n] for n in names})
                                        for p, names in enumerate(plan.fragments)), CONFIG.diloco.fingerprint())

    def snapshot(self, after_round, not_before):
        return (0, self.welcome) if after_round < 0 else None

    def status(self) -> dict:
        return {"genesis": True}


def start_watcher(port: int) -> tuple[Watcher, threading.Thread]:
    watcher = Watcher(TinyNet(), lambda model: 1.0, address=f"127.0.0.1:{port}", config=CONFIG, every_s=0.0)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    return watcher, thread


def test_an_evaluator_stops_at_once_on_a_stop_request_before_the_run_has_a_genesis(caplog):
    handler = NoGenesis()
    server, port = start_server(handler, "127.0.0.1:0", token=None)
    caplog.set_level(logging.INFO, logger="ddiloco.evaluator")
    watcher, thread = start_watcher(port)
    try:
        assert handler.watched.wait(PROCESS_WAIT_S), "the evaluator never opened its Watch"
        watcher.request_stop()
        thread.join(STOP_WITHIN_S)
        assert not thread.is_alive(), f"the evaluator still runs {STOP_WITHIN_S} s after its stop request"
    finally:
        server.stop(0)  # ends a Watch that still waits
        thread.join(PROCESS_WAIT_S)
    assert watcher.evaluations == 0
    skipped = [r.getMessage() for r in caplog.records if "no final evaluation" in r.getMessage()]
    assert len(skipped) == 1 and "no global model yet" in skipped[0], skipped


def test_an_evaluator_that_reached_its_syncer_comes_back_to_it_after_a_restart(caplog):
    handler = Serving(params_of(TinyNet(seed=1)))
    server, port = start_server(handler, "127.0.0.1:0", token=None)
    caplog.set_level(logging.INFO, logger="ddiloco.evaluator")
    watcher, thread = start_watcher(port)
    try:
        wait_until(lambda: watcher.evaluations == 1, "the first evaluation")
        server.stop(0)
        # Past its connect_timeout_s (0.5 s), warned as lost, not given up: it had an answer before.
        wait_until(lambda: any("lost the syncer" in r.getMessage() for r in caplog.records), "the lost-syncer warning")
        server, _ = start_server(handler, f"127.0.0.1:{port}", token=None)
        wait_until(lambda: watcher.evaluations == 2, "an evaluation after the restart")
        assert thread.is_alive()
        watcher.request_stop()
        thread.join(PROCESS_WAIT_S)
        assert not thread.is_alive()
    finally:
        watcher.request_stop()
        server.stop(0)
        thread.join(PROCESS_WAIT_S)
    assert f"127.0.0.1:{port}" in next(r.getMessage() for r in caplog.records if "lost the syncer" in r.getMessage())


FAILING_SCRIPT = '''
import ddiloco
from torch import nn

model = nn.Linear(4, 4)
if ddiloco.environment().role == "evaluator":
    ddiloco.watch(model, lambda m: 0.0)
else:
    raise RuntimeError("my data loader broke")
'''
"""Every learner fails before its session (so the run never gets a genesis); the evaluator copy watches."""


@pytest.mark.acceptance  # the default suite's 15 minutes
@pytest.mark.timeout(120)
def test_a_run_whose_learners_all_fail_does_not_wait_for_its_evaluator(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(FAILING_SCRIPT)
    code, out = ddiloco_run(tmp_path / "run", *SMALL_RUN, "--inner-steps", "30", "--evaluate",
                            command=[sys.executable, str(script)], timeout_s=60.0)
    assert code != 0 and "learner-0 failed: RuntimeError: my data loader broke" in out, out
    assert "still waiting for evaluator" not in out, out
    assert "[evaluator] stopped (exit 0)" in out, out


def finished(popen: subprocess.Popen, what: str) -> int:
    try:
        return popen.wait(timeout=PROCESS_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {PROCESS_WAIT_S} s")


def test_an_evaluator_with_a_wrong_token_exits_3_with_the_syncers_reason(tmp_path, procs):
    run_dir, tokens = tmp_path / "run", {}
    for name, value in (("right", TOKEN), ("wrong", TOKEN[::-1])):
        tokens[name] = tmp_path / name
        tokens[name].write_text(value)
        os.chmod(tokens[name], 0o600)
    syncer = procs.start("syncer", "syncer", "--run-dir", str(run_dir), *TINY_MODEL_FLAGS, "--learners", "1",
                         "--token-file", str(tokens["right"]))
    address = wait_until(lambda: read_json(run_dir / "syncer.json"), "syncer.json", alive=[syncer])["address"]
    evaluator = procs.start("evaluator", "evaluator", "--syncer", address, "--run-dir", str(run_dir),
                            "--token-file", str(tokens["wrong"]))
    assert finished(evaluator, "an evaluator with a wrong token") == EXIT_REFUSED, procs.log("evaluator")
    log = procs.log("evaluator")
    assert f"refused by the syncer at {address}" in log and "wrong run token" in log, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("bound", ["run config", "flag"])
def test_an_evaluator_that_cannot_reach_its_syncer_warns_and_exits_4(tmp_path, procs, bound):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    config = tmp_path / "config.json"
    # The bound from the run config's learner.connect_timeout_s, or from --connect-timeout-s over a run config of 120 s.
    in_config = 3.0 if bound == "run config" else 120.0
    dataclasses.replace(TINY_RUN, learner=LearnerConfig(connect_timeout_s=in_config)).save(config)
    flag = () if bound == "run config" else ("--connect-timeout-s", "3")
    evaluator = procs.start("evaluator", "evaluator", "--syncer", address, "--run-dir", str(tmp_path / "run"),
                            "--config", str(config), *flag)
    assert finished(evaluator, "an evaluator with a wrong address") == EXIT_UNREACHABLE, procs.log("evaluator")
    log = procs.log("evaluator")
    assert f"cannot reach the syncer at {address} for" in log, log  # the warning, after a few attempts
    assert f"cannot reach the syncer at {address}: no answer in 3 s" in log, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_an_evaluator_evaluates_a_model_whose_parameters_are_not_float32(dtype):
    served = params_of(TinyNet(seed=1))  # the syncer's global model is float32, whatever the learners train in
    handler = Serving(served)
    server, port = start_server(handler, "127.0.0.1:0", token=None)
    model = TinyNet(seed=2).to(dtype)
    seen = []
    watcher = Watcher(model, lambda m: seen.append({n: p.detach().clone() for n, p in m.named_parameters()}) or 1.0,
                      address=f"127.0.0.1:{port}", config=CONFIG, every_s=0.0)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: watcher.evaluations >= 1 or not thread.is_alive(), "the first evaluation")
        assert watcher.evaluations >= 1, "the evaluator stopped without evaluating"
        assert all(torch.equal(seen[0][n], served[n].to(dtype)) for n in served)
    finally:
        watcher.request_stop()
        server.stop(0)
        thread.join(PROCESS_WAIT_S)
