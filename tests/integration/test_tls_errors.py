"""TLS and `--link` mistakes of processes started by hand, each named in one line at once: a learner or evaluator
whose TLS handshake with the syncer will fail again (an untrusted certificate, a name it does not hold, TLS on one
side only) stops in seconds, not after its connect timeout; a CA file that is not a certificate, a server name
without TLS, a syncer key that is not its certificate's, a link slower than the heartbeat timeout are refused at the
start (exit 2); an evaluator watches a TLS syncer; a link that takes minutes to bring the model says so.

Real processes, real gRPC on 127.0.0.1 with ephemeral ports, real self-signed certificates made with `openssl` in
the test's directory; every wait has a hard deadline and the fixture kills every process it started, by PID.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ddiloco.checkpoint import read_json
from tests.helpers import TINY_MODEL_FLAGS, self_signed_pair, wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")]

RUN_FLAGS = (*TINY_MODEL_FLAGS, "--num-fragments", "2", "--sync-every", "8", "--max-wait-s", "0.5")
CONNECT_TIMEOUT_S = "300"
"""Longer than any wait below: a process that stops within them did not wait out its connect timeout."""
QUICK_EXIT_S = 90.0
"""Hard limit on processes that must stop by themselves soon after their start (several import torch at once, on a
loaded 2-core machine; about 15 s each when it is idle)."""
EXIT_USAGE = 2
EXIT_UNREACHABLE = 4


@pytest.fixture
def certs(tmp_path):
    return self_signed_pair(tmp_path, "syncer"), self_signed_pair(tmp_path, "other")


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_syncer(procs, run_dir: Path, name: str, *extra: str, learners: int = 1) -> str:
    popen = procs.start(name, "syncer", "--run-dir", str(run_dir), "--learners", str(learners), *RUN_FLAGS, *extra)
    info = wait_until(lambda: (read_json(run_dir / "syncer.json") or {}).get("pid") == popen.pid
                      and read_json(run_dir / "syncer.json"), f"{name} serving", alive=[popen])
    return info["address"]


def exits_soon(procs, started: dict, deadline_s: float = QUICK_EXIT_S) -> dict[str, tuple[int, str]]:
    """name -> (exit status, log) of processes that must all stop by themselves within `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    results = {}
    for name, popen in started.items():
        try:
            code = popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {deadline_s} s:\n{procs.log(name)[-2000:]}")
        results[name] = code, procs.log(name)
    return results


def last_line(log: str) -> str:
    assert "Traceback" not in log, log[-3000:]
    return log.strip().splitlines()[-1]


HANDSHAKE_CASES = {
    # case: (the syncer serves TLS, the client's TLS flags ("CA" / "OTHER_CA": the syncer's or another CA), the fix)
    "wrong-ca": (True, ("--tls-ca", "OTHER_CA"), "--tls-ca"),
    "wrong-name": (True, ("--tls-ca", "CA", "--tls-server-name", "other.example"), "--tls-server-name"),
    "no-ca": (True, (), "TLS is on one side only"),
    "tls-to-plain": (False, ("--tls-ca", "CA"), "TLS is on one side only"),
}


@pytest.mark.timeout(300)  # three processes importing torch on a loaded machine
@pytest.mark.parametrize("case", list(HANDSHAKE_CASES))
def test_a_tls_handshake_that_will_fail_again_stops_the_client_in_seconds(procs, tmp_path, certs, case):
    # A learner and an evaluator, side by side against one syncer: each stops by itself, naming the fix.
    (cert, key), (other_cert, _) = certs
    serves_tls, tls, fix = HANDSHAKE_CASES[case]
    run_dir = tmp_path / "run"
    address = start_syncer(procs, run_dir, "syncer", *(("--tls-cert", cert, "--tls-key", key) if serves_tls else ()))
    tls = [{"CA": cert, "OTHER_CA": other_cert}.get(flag, flag) for flag in tls]
    started = {role: procs.start(role, role, "--syncer", address, "--run-dir", str(run_dir), *who,
                                 "--connect-timeout-s", CONNECT_TIMEOUT_S, *tls)
               for role, who in (("learner", ("--learner-id", "0", "--threads", "1")), ("evaluator", ()))}
    for role, (code, log) in exits_soon(procs, started).items():
        line = last_line(log)
        assert code == EXIT_UNREACHABLE, (role, log[-3000:])
        assert "TLS handshake failed" in line and fix in line, (role, line)


@pytest.mark.parametrize("case", ["learner-garbage-ca", "evaluator-garbage-ca", "name-without-ca",
                                  "evaluator-name-without-ca", "mismatched-key", "garbage-key", "garbage-cert"])
def test_tls_files_and_flags_that_cannot_work_are_refused_at_the_start(tmp_path, certs, capsys, case):
    # In this process (`ddiloco.cli.main`): each is refused before anything listens or connects.
    (cert, key), (_, other_key) = certs
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    client = ["--syncer", f"127.0.0.1:{unused_port()}", "--run-dir", str(tmp_path / "run")]
    argv, expected = {
        "learner-garbage-ca": (["learner", *client, "--learner-id", "0", "--tls-ca", str(garbage)],
                               "holds no PEM certificate"),
        "evaluator-garbage-ca": (["evaluator", *client, "--tls-ca", str(garbage)], "holds no PEM certificate"),
        "name-without-ca": (["learner", *client, "--learner-id", "0", "--tls-server-name", "localhost"],
                            "--tls-server-name"),
        "evaluator-name-without-ca": (["evaluator", *client, "--tls-server-name", "localhost"], "--tls-server-name"),
        "mismatched-key": (["syncer", "--run-dir", str(tmp_path / "run"), "--tls-cert", cert, "--tls-key", other_key],
                           "does not match"),
        "garbage-key": (["syncer", "--run-dir", str(tmp_path / "run"), "--tls-cert", cert, "--tls-key", str(garbage)],
                        "holds no PEM private key"),
        "garbage-cert": (["syncer", "--run-dir", str(tmp_path / "run"), "--tls-cert", str(garbage), "--tls-key", key],
                         "holds no PEM certificate"),
    }[case]
    from ddiloco.cli import main

    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in last_line(err) and "cannot listen" not in err, err
    assert not (tmp_path / "run" / "syncer.json").exists()


@pytest.mark.timeout(300)
def test_an_evaluator_watches_a_tls_syncer(procs, tmp_path, certs):
    (cert, key), _ = certs
    run_dir = tmp_path / "run"
    address = start_syncer(procs, run_dir, "syncer", "--tls-cert", cert, "--tls-key", key)
    learner = procs.start("learner", "learner", "--syncer", address, "--learner-id", "0", "--run-dir", str(run_dir),
                          "--threads", "1", "--inner-steps", "16", "--tls-ca", cert)
    evaluator = procs.start("evaluator", "evaluator", "--syncer", address, "--run-dir", str(run_dir),
                            "--every-s", "0.5", "--tls-ca", cert, "--tls-server-name", "localhost")
    status = wait_until(lambda: read_json(run_dir / "evaluator" / "status.json"), "an evaluation over TLS",
                        alive=[evaluator])
    assert status["evaluations"] >= 1 and status["val_loss"] > 0
    assert learner.wait(timeout=QUICK_EXIT_S) == 0, procs.log("learner")[-3000:]
    evaluator.send_signal(signal.SIGTERM)
    assert evaluator.wait(timeout=QUICK_EXIT_S) == 0, procs.log("evaluator")[-3000:]


@pytest.mark.timeout(300)
def test_a_link_the_learner_could_not_stay_on_is_refused_and_a_slow_one_announced(procs, tmp_path):
    address = f"127.0.0.1:{unused_port()}"

    def learner(name, link, *extra):
        return procs.start(name, "learner", "--syncer", address, "--learner-id", "0", "--run-dir",
                           str(tmp_path / name), "--threads", "1", "--link", link, *extra)

    started = {"far": learner("far", "1gbit,40s"),
               "slow": learner("slow", "10kbit,10ms", "--connect-timeout-s", "3")}
    results = exits_soon(procs, started)
    code, log = results["far"]
    assert code == EXIT_USAGE and "heartbeat timeout" in last_line(log), log[-3000:]
    code, log = results["slow"]
    warnings = [line for line in log.splitlines() if "to bring the global model" in line]
    assert code == EXIT_UNREACHABLE and len(warnings) == 1 and "min" in warnings[0], log[-3000:]
