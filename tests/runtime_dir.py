"""A decoupled run's directory written by hand (`make_runtime_dir`), for the tests of the chaos analysis and of
goodput: the logs a `ddiloco run` under a chaos plan leaves, with its goodput, uptime and recovery computed by hand
in the docstring; and the small writers of such directories' files and records.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddiloco.checkpoint import save_state


def write_jsonl(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value), encoding="utf-8")


def steps(learner_id: int, numbers, first_time: float, step_s: float) -> list[dict]:
    return [{"step": n, "time": first_time + i * step_s, f"learner/{learner_id}/loss": 3.0,
             f"learner/{learner_id}/tokens": 128, f"learner/{learner_id}/step_s": step_s}
            for i, n in enumerate(numbers)]


def pub(t, fragment, base, inner, new):
    return {"event": "publish", "time": t, "fragment": fragment, "base_version": base, "inner_step": inner,
            "steps": new, "new_steps": new, "tokens": 128 * new}


def fate(t, fragment, base, inner, outcome, reason=""):
    return {"event": "fate", "time": t, "fragment": fragment, "base_version": base, "inner_step": inner,
            "fate": outcome, "reason": reason}


def update(t, learner, fragment, base, inner, accepted, reason=""):
    return {"event": "update", "time": t, "learner_id": learner, "fragment": fragment, "base_version": base,
            "inner_step": inner, "accepted": accepted, "reason": reason}


def participant(learner, base, inner):
    return {"learner_id": learner, "base_version": base, "staleness": 0, "steps": 8, "tokens": 1024,
            "weight": 1.0, "inner_step": inner}


def make_runtime_dir(root: Path) -> Path:
    """Two learners, two fragments of equal share, window [1010, 1100] (T = 90 s, allocated 180).

    learner 0 (step 1 s, one clean incarnation, 80 steps): rejected 16 x 0.5, dropped 16 x 0.5,
    accepted-but-unmerged 16 x 0.5 -> useful (80 - 24) x 1 = 56 s.
    learner 1 (step 2 s): incarnation 0 killed at inner step 10 (f0 published at 8, f1 published at 10
    without a fate), incarnation 1 resumes at 8: crashed = the re-done steps 9..10 once (2) + f1's steps
    1..8 of the fateless publish x 0.5 (4) = 6; incarnation 1 (steps 9..20) re-joins once
    with unpublished [4, 6]: resync 5 -> useful (22 - 11) x 2 = 22 s.  goodput = 78 / 180.
    Commits at 1027, 1056, 1080: 3 of 18 five-second bins -> uptime 15 / 90.
    """
    d = root / "decoupled"
    write_json(d / "chaos" / "run.json", {"system": "decoupled", "num_learners": 2, "started": 1000.0,
                                          "ended": 1100.0, "pids": [11, 12, 13, 14], "left_behind": []})
    write_jsonl(d / "chaos" / "faults.jsonl", [
        {"index": 0, "kind": "crash", "target": "learner-1", "at_s": 31, "duration_s": 0, "restart": True,
         "value": None, "started": 1031.0, "ended": 1031.0, "pids": [13]},
        {"index": 1, "kind": "syncer_crash", "target": "syncer", "at_s": 60, "duration_s": 0, "restart": True,
         "value": None, "started": 1060.0, "ended": 1060.0, "pids": [11]},
        {"index": 2, "kind": "partition", "target": "learner-0", "at_s": 85, "duration_s": 10, "restart": True,
         "value": None, "started": 1085.0, "ended": 1095.0, "pids": []},
    ])
    write_jsonl(d / "learners" / "0" / "metrics.jsonl", steps(0, range(1, 81), 1011.0, 1.0))
    write_jsonl(d / "learners" / "0" / "work.jsonl", [
        {"event": "start", "time": 1005.0, "pid": 12, "inner_step": 0, "shares": [0.5, 0.5]},
        {"event": "welcome", "time": 1009.0, "inner_step": 0, "versions": [0, 0], "unpublished": [0, 0]},
        pub(1018.0, 0, 0, 8, 8), fate(1019.0, 0, 0, 8, "accepted"),
        pub(1026.0, 1, 0, 16, 16), fate(1027.0, 1, 0, 16, "rejected", "stale"),
        pub(1034.0, 0, 1, 24, 16), fate(1035.0, 0, 1, 24, "dropped", "syncer unreachable"),
        pub(1042.0, 1, 0, 32, 16), fate(1043.0, 1, 0, 32, "accepted"),
        pub(1050.0, 0, 1, 40, 16), fate(1051.0, 0, 1, 40, "accepted"),
        {"event": "end", "time": 1091.0, "inner_step": 80, "state": "done", "unpublished": [40, 48]},
    ])
    write_jsonl(d / "learners" / "1" / "metrics.jsonl",
                steps(1, range(1, 11), 1012.0, 2.0) + steps(1, range(9, 21), 1052.0, 2.0))
    write_jsonl(d / "learners" / "1" / "work.jsonl", [
        {"event": "start", "time": 1000.0, "pid": 13, "inner_step": 0, "shares": [0.5, 0.5]},
        {"event": "welcome", "time": 1009.0, "inner_step": 0, "versions": [0, 0], "unpublished": [0, 0]},
        pub(1026.0, 0, 0, 8, 8), fate(1026.5, 0, 0, 8, "accepted"),
        pub(1030.0, 1, 0, 10, 10),
        {"event": "start", "time": 1040.0, "pid": 15, "inner_step": 8, "shares": [0.5, 0.5]},
        {"event": "welcome", "time": 1049.0, "inner_step": 8, "versions": [1, 0], "unpublished": [0, 0]},
        {"event": "welcome", "time": 1064.0, "inner_step": 14, "versions": [2, 0], "unpublished": [4, 6]},
        pub(1070.0, 1, 0, 18, 4), fate(1071.0, 1, 0, 18, "accepted"),
        {"event": "end", "time": 1075.0, "inner_step": 20, "state": "done", "unpublished": [6, 2]},
    ])
    write_jsonl(d / "syncer" / "metrics.jsonl", [
        {"event": "start", "time": 1001.0, "source": "init", "rounds_committed": 0},
        update(1019.0, 0, 0, 0, 8, True), update(1026.5, 1, 0, 0, 8, True),
        {"event": "commit", "time": 1027.0, "round": 0, "fragment": 0, "version": 1, "learners": [0, 1]},
        update(1027.0, 0, 1, 0, 16, False, "stale"),
        update(1043.0, 0, 1, 0, 32, True), update(1051.0, 0, 0, 1, 40, True),
        {"event": "commit", "time": 1056.0, "round": 1, "fragment": 0, "version": 2, "learners": [0]},
        {"event": "start", "time": 1062.0, "source": "checkpoint", "rounds_committed": 2},
        update(1071.0, 1, 1, 0, 18, True),
        {"event": "commit", "time": 1080.0, "round": 2, "fragment": 1, "version": 1, "learners": [1]},
        {"event": "stopped", "time": 1099.5, "rounds_committed": 3},
    ])
    write_jsonl(d / "evaluator" / "metrics.jsonl", [
        {"step": 0, "time": 1005.0, "eval/val_loss": 5.0}, {"step": 3, "time": 1099.0, "eval/val_loss": 3.5}])
    write_jsonl(d / "rounds.jsonl", [
        {"round": 0, "fragment": 0, "version": 1, "participants": [participant(0, 0, 8), participant(1, 0, 8)]},
        {"round": 1, "fragment": 0, "version": 2, "participants": [participant(0, 1, 40)]},
        {"round": 2, "fragment": 1, "version": 1, "participants": [participant(1, 0, 18)]},
    ])
    save_state(d / "checkpoints" / "syncer", {"global": {"w": torch.zeros(2)}}, serial=3)
    write_json(d / "syncer_status.json", {"bytes_sent": 1000, "bytes_received": 234})
    return d
