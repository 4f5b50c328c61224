"""Progress a learner reported but did not checkpoint: its checkpoint at its stop could not be written (a full disk), or
it was killed after its last one. A `--resume` continues it from its newest checkpoint, which the learner's log, its
status.json and the run's summary say (`ddiloco.learner_checkpoint`, `ddiloco.runtime.report`). The real run is a
tmpfs too small for another checkpoint; here the write raises ENOSPC."""

from __future__ import annotations

import errno
import json
import logging

import torch
from rich.console import Console

import ddiloco
import ddiloco.learner_checkpoint
from ddiloco.runtime.report import build_summary
from ddiloco.runtime.report_table import print_summary
from ddiloco.runtime.run_paths import RunPaths
from tests.helpers import TinyNet
from tests.runtime_dir import write_json, write_jsonl

CONFIG = ddiloco.DilocoConfig(num_fragments=2, sync_every=4, codec="fp32")
BUDGET = 100


def train_until_stopped(run_dir, shared, *, stop_at: int) -> None:
    """Learner 0 trains from its checkpoint (if any) to inner step `stop_at`, then is asked to stop (a Ctrl-C)."""
    model = TinyNet(seed=1)
    with ddiloco.session(model, torch.optim.SGD(model.parameters(), lr=0.1), hub=shared, learner_id=0,
                         inner_steps=BUDGET, run_dir=run_dir, checkpoint_every_s=3600.0) as sync:
        while not sync.done:
            sync.step(tokens=4)
            if sync.inner_step == stop_at:
                sync.request_stop()


def test_a_checkpoint_at_the_stop_that_cannot_be_written_says_what_a_resume_continues_from(tmp_path, monkeypatch,
                                                                                         caplog):
    shared = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    train_until_stopped(tmp_path, shared, stop_at=2)  # its checkpoint at inner step 2
    stopped_at_2 = json.loads((tmp_path / "learners" / "0" / "status.json").read_text())

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ddiloco.learner_checkpoint, "save_split_state", full_disk)
    with caplog.at_level(logging.ERROR, logger="ddiloco.learner_checkpoint"):
        train_until_stopped(tmp_path, shared, stop_at=5)  # resumed at 2; its stop checkpoint fails
    assert ("[learner 0 | inner 5] its checkpoint at its stop could not be written ([Errno 28] No space left on "
            "device): its progress since inner step 2 is not saved, a resume continues from inner step 2"
            ) in [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    status = json.loads((tmp_path / "learners" / "0" / "status.json").read_text())
    assert (status["state"], status["inner_step"], status["checkpoint_inner_step"]) == ("stopped", 5, 2)
    assert (stopped_at_2["inner_step"], stopped_at_2["checkpoint_inner_step"]) == (2, 2)

    summary = build_summary(RunPaths(tmp_path), num_learners=1, outcome="interrupted", wall_time_s=1.0)
    assert (summary["learners"]["0"]["inner_step"], summary["learners"]["0"]["checkpoint_inner_step"]) == (5, 2)


def killed_after_its_checkpoint(root) -> RunPaths:
    """Learner 0 SIGKILLed at inner step 2929 (its last status.json), its newest checkpoint at 2235; learner 1 stopped
    with its checkpoint at its stop, 2900."""
    paths = RunPaths(root)
    for learner_id, step, saved in ((0, 2929, (1500, 2235)), (1, 2900, (2100, 2900))):
        write_json(paths.learner_status(learner_id), {"state": "training", "inner_step": step, "inner_steps": 5000})
        for serial in saved:  # the file names are what the report reads
            write_json(paths.learner_dir(learner_id) / "checkpoint" / f"state_{serial:09d}.json", {})
    return paths


def test_the_summary_shows_the_step_a_resume_continues_from_after_a_kill(tmp_path):
    paths = killed_after_its_checkpoint(tmp_path / "run")
    summary = build_summary(paths, num_learners=2, outcome="interrupted", wall_time_s=1.0,
                            final_states={0: ("stopped", ""), 1: ("stopped", "")})
    console = Console(width=200, record=True)
    print_summary(summary, console)
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.startswith("│")}
    assert "2929 (saved 2235)" in rows["0"] and "saved" not in rows["1"]
    assert ("learner 0 reached inner step 2929, but its newest checkpoint holds inner step 2235: a --resume continues "
            "it from 2235 (killed or failed after it, or its checkpoint at its stop could not be written: "
            "logs/learner-0.log says which)") in " ".join(text.split())
    zero, one = summary["learners"]["0"], summary["learners"]["1"]
    assert (zero["inner_step"], zero["checkpoint_inner_step"]) == (2929, 2235)
    assert (one["inner_step"], one["checkpoint_inner_step"]) == (2900, 2900)


def test_a_learner_whose_first_checkpoint_cannot_be_written_says_a_resume_takes_the_runs_position(tmp_path,
                                                                                                  monkeypatch, caplog):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ddiloco.learner_checkpoint, "save_split_state", read_only)
    shared = ddiloco.InProcessHub(config=CONFIG, quorum=ddiloco.QuorumConfig(grace="none"))
    with caplog.at_level(logging.ERROR, logger="ddiloco.learner_checkpoint"):
        train_until_stopped(tmp_path, shared, stop_at=3)
    assert ("[learner 0 | inner 3] its checkpoint at its stop could not be written ([Errno 30] Read-only file "
            "system): it has no checkpoint, so a resume takes the run's position, with its optimizer and state= "
            "objects afresh") in [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    status = json.loads((tmp_path / "learners" / "0" / "status.json").read_text())
    assert (status["inner_step"], status["checkpoint_inner_step"]) == (3, None)


def test_the_summary_says_what_updates_rejected_as_non_finite_mean(tmp_path):
    # A fragment whose merge was non-finite round after round never synced, and the run said only "completed", with
    # "rejected 4" in its table.
    paths = killed_after_its_checkpoint(tmp_path / "run")
    write_json(paths.syncer_status, {"rejections": {"non_finite": 6}})
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=1.0)
    console = Console(width=400, record=True)
    print_summary(summary, console)
    assert ("the syncer rejected 6 updates as non-finite: a learner's values were NaN or infinite, or a round's merge "
            "would have made a parameter so, and that round was not committed (logs/syncer.log names the fragment and "
            "the tensor)") in console.export_text()


def test_the_summary_says_a_learner_that_trained_has_no_checkpoint(tmp_path):
    # Its row read `61 (63 trained)` and nothing more (after a double Ctrl-C, or a disk full from the start): the
    # worst case of unsaved progress had no line at all.
    paths = killed_after_its_checkpoint(tmp_path / "run")
    for serial in (1500, 2235):
        (paths.learner_dir(0) / "checkpoint" / f"state_{serial:09d}.json").unlink()
    for learner_id, steps in ((0, 63), (1, 2900)):
        write_jsonl(paths.learner_dir(learner_id) / "work.jsonl", [{"event": "start", "time": 0.0, "inner_step": 0}])
        write_jsonl(paths.learner_metrics(learner_id), [{"step": n, "time": float(n), f"learner/{learner_id}/tokens": n}
                                                        for n in range(1, steps + 1)])
    summary = build_summary(paths, num_learners=2, outcome="interrupted", wall_time_s=1.0)
    console = Console(width=400, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert ("learner 0 trained 63 inner steps but has no checkpoint: a --resume takes the run's position for it, with "
            "its optimizer and data afresh (killed before its first checkpoint, or its checkpoints could not be "
            "written: logs/learner-0.log says which)") in text
    assert "learner 1 trained" not in text
