"""Why a learner's process ended, read from its log (`learner_exits`): the reason an exit message quotes, and whether an
exit 0 before the run's budget was the script's own loop ending or a stop the launcher did not ask for.

The log lines are copied from real runs of a torchrun script under `ddiloco run --nproc-per-learner 2` (torch
prefixes a rank's uncaught exception with `[rankN]: `; the rank group logs which rank failed first, before or after
the other ranks' tracebacks) and of a learner whose loop ended early (the session's WARNING).
"""

from __future__ import annotations

from ddiloco.runtime.learner_exits import describe_exit_with, reason_line, stopped_from_outside

RANK0_RAISES = [
    "[probe] L0 r0 start inner_step=0 data.n=0 opt_state=0 pid=30846",
    "[probe] L0 r1 start inner_step=0 data.n=0 opt_state=0 pid=30847",
    "[probe] L0 r0 fault raise at 5",
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/tmp/probe_ranks/ddp_probe.py", line 76, in <module>',
    "[rank0]:     main()",
    '[rank0]:   File "/tmp/probe_ranks/ddp_probe.py", line 64, in main',
    '[rank0]:     if fault == "raise": raise RuntimeError("probe fault")',
    "[rank0]:                          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "[rank0]: RuntimeError: probe fault",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/tmp/probe_ranks/ddp_probe.py", line 76, in <module>',
    "[rank1]:     main()",
    '[rank1]:   File "/tmp/probe_ranks/ddp_probe.py", line 69, in main',
    "[rank1]:     loss = F.mse_loss(trained(x), y); opt.zero_grad(); loss.backward(); opt.step()",
    '[rank1]:   File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward',
    "[rank1]:     torch.autograd.backward(",
    '[rank1]:   File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in _engine_run_backward',
    "[rank1]:     return Variable._execution_engine.run_backward(  # Calls into the C++ engine",
    "[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:24491. This is typically caused by a remote worker crashing.",
    "2026-12-05 16:12:14,837 WARNING __main__: [rank-group] rank 0 (pid 30846) exited with status 1: stopping the "
    "other ranks",
]
"""Rank 0's script raised; rank 1 failed after it in a collective (a consequence); then the rank group's line."""

DIVERGED = ("ddiloco.learner_group.ReplicasDivergedError: the 2 ranks of this learner hold different values of "
            "parameter '0.weight'")
RANK1_DIVERGES = [
    "[rank1]: Traceback (most recent call last):",
    "[rank1]:   File \"/work/main/src/ddiloco/learner_group.py\", line 265, in check_replicas",
    "[rank1]:     raise ReplicasDivergedError(",
    f"[rank1]: {DIVERGED}",
    "[rank0]: Traceback (most recent call last):",
    "[rank0]:   File \"/work/main/src/ddiloco/learner_group.py\", line 265, in check_replicas",
    "[rank0]:     raise ReplicasDivergedError(",
    f"[rank0]: {DIVERGED}",
    "2026-12-05 15:49:45,563 WARNING __main__: [rank-group] rank 1 (pid 12164) exited with status 1: stopping the "
    "other ranks",
]

REFUSED = ("[learner 0] refused by the syncer: FAILED_PRECONDITION: bad_schema: wire schema version 5, but the syncer "
           "speaks 4: run the same ddiloco version everywhere")
RANK1_REFUSED = [
    REFUSED,
    REFUSED,
    "2026-12-05 15:41:14,380 WARNING __main__: [rank-group] rank 1 (pid 5943) exited with status 3: stopping the "
    "other ranks",
]

RANK1_KILLED = [
    "[probe] L0 r1 start inner_step=0 data.n=0 opt_state=0 pid=5473",
    "2026-12-05 15:41:01,529 WARNING __main__: [rank-group] rank 1 (pid 5473) exited with status 137: stopping the "
    "other ranks",
    "[rank0]: Traceback (most recent call last):",
    "[rank0]:     work.wait()",
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:942.",
]
"""kill -9 of rank 1: the rank group says so first, then rank 0 fails in its collective with the dead rank."""


def test_the_reason_is_the_exception_of_the_rank_that_failed_first():
    assert reason_line(RANK0_RAISES) == "RuntimeError: probe fault"
    assert describe_exit_with(1, RANK0_RAISES) == "exit code 1: RuntimeError: probe fault"
    assert reason_line(RANK1_DIVERGES) == DIVERGED


def test_a_refused_rank_is_quoted_with_the_syncers_reason():
    assert reason_line(RANK1_REFUSED) == REFUSED


def test_a_rank_killed_by_a_signal_is_the_reason_not_the_collective_that_failed_after_it():
    assert reason_line(RANK1_KILLED) == "rank 1 (pid 5473) exited with status 137 (signal SIGKILL)"


def test_a_short_tail_without_the_failed_ranks_exception_quotes_the_rank_group_not_another_rank():
    # A Ray learner's exit carries its last 5 log lines: rank 0's exception is above them, rank 1's is a consequence.
    assert reason_line(RANK0_RAISES[-5:]) == "rank 0 (pid 30846) exited with status 1"


def test_without_ranks_the_last_exception_line_or_the_last_line_is_the_reason():
    assert reason_line(["Traceback ...", "ValueError: bad shard", "[learner 0] bye"]) == "ValueError: bad shard"
    assert reason_line(["[learner 0] refused: another model"]) == "[learner 0] refused: another model"
    assert reason_line(["[rank0]: Traceback ...", "[rank0]: KeyError: 'w'"]) == "KeyError: 'w'"


STOPPED_AT_7 = {"state": "stopped", "inner_step": 7, "inner_steps": 20, "stop_requested": True}


def test_a_stop_before_the_budget_that_the_session_was_asked_for_came_from_outside():
    assert stopped_from_outside(STOPPED_AT_7)
    assert not stopped_from_outside({**STOPPED_AT_7, "stop_requested": False})  # its own loop ended there
    assert not stopped_from_outside({**STOPPED_AT_7, "state": "done", "inner_step": 20})
    assert not stopped_from_outside({})  # no status of this start: nothing says it stopped
    # Stopped again where its last start stopped, without a step in between: done.
    assert not stopped_from_outside(STOPPED_AT_7, last_stop_step=7)
    assert stopped_from_outside({**STOPPED_AT_7, "inner_step": 12}, last_stop_step=7)


def test_a_refusal_is_quoted_without_saying_refused_by_the_syncer_twice():
    # `refused by the syncer: [learner 1] refused by the syncer: FAILED_PRECONDITION: ...` on the console and in the
    # summary: the launcher's words around the session's own.
    from ddiloco.runtime.learner_exits import refusal_reason

    said = "FAILED_PRECONDITION: refused: model differs: 'head.weight' is float32[72, 32], expected float32[64, 32]"
    for tail in (["2026-12-06 13:00:43,238 E ddiloco.learner_session: [learner 1] refused by the syncer: " + said],
                 ["ddiloco learner: refused by the syncer: " + said],
                 ["Traceback (most recent call last):", "ddiloco.learner_session.RefusedError: " + said]):
        assert refusal_reason(tail) in (said, "ddiloco.learner_session.RefusedError: " + said), tail
    assert refusal_reason(RANK1_REFUSED) == REFUSED.removeprefix("[learner 0] refused by the syncer: ")
