"""The summary table `ddiloco run` prints at a run's end, and the notes under it: what `summary.json` says
(`ddiloco.runtime.report` builds it), for a person, with what is worth a line of its own (a learner whose checkpoint
is behind its progress, one that went non-finite or was capped, an evaluator that stopped early)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ddiloco.runtime.progress import format_bytes
from ddiloco.runtime.report import unsaved_progress


def rounds_since_val_loss(summary: Mapping[str, Any]) -> int | None:
    """Rounds the run committed after its latest validation loss was measured, where there are any (a session without
    an evaluator, or one stopped before its final evaluation); None otherwise, or when the summary does not say."""
    measured_at = summary.get("final_val_loss_round")
    if summary.get("final_val_loss") is None or not isinstance(measured_at, int):
        return None
    behind = int(summary["rounds_committed"]) - measured_at
    return behind if behind > 0 else None


def _val_loss_text(summary: Mapping[str, Any]) -> str:
    """`final validation loss 0.2500`, or `validation loss 0.0056 at round 425` where rounds committed after it."""
    val = summary.get("final_val_loss")
    if val is None:
        return "final validation loss -"
    if rounds_since_val_loss(summary) is not None:
        return f"validation loss {val:.4f} at round {summary['final_val_loss_round']}"
    return f"final validation loss {val:.4f}"


def _wall_time_text(summary: Mapping[str, Any]) -> str:
    """`wall time 21.6 s`, and where the run had several sessions, the whole run's beside this session's: the rounds and
    restarts beside it are the whole run's, so this session's alone would read `wall time 21.6 s (syncer restarts 1)` on
    a resumed session that had no restart."""
    text = f"wall time {summary['wall_time_s']:.1f} s"
    sessions, total = summary.get("sessions") or 1, summary.get("wall_time_total_s")
    if sessions > 1 and total is not None:
        text += f" this session ({total:.1f} s in its {sessions} sessions)"
    return text


def summary_table(summary: Mapping[str, Any]) -> Table:
    caption = (f"{summary['outcome']}: {summary['rounds_committed']} rounds committed, {_val_loss_text(summary)}, "
               f"{_wall_time_text(summary)}, syncer restarts {summary['syncer']['restarts']}{_genesis_text(summary)}")
    # Reasons and paths are the learners' and the user's text: "[rank-group]" or "[learner 0]" is not rich markup.
    table = Table(title=escape(f"ddiloco run {summary['run_dir']}"), caption=escape(caption), caption_justify="left")
    for header in ("learner", "state", "restarts", "accepted", "rejected", "rounds", "inner step", "tokens",
                   "bytes sent", "bytes received"):
        # Folded, not cut, where the terminal is narrow: at 80 columns `122,880` showed as `122,…`.
        table.add_column(header, justify="left" if header == "state" else "right", overflow="fold")
    for learner_id, row in sorted(summary["learners"].items(), key=lambda item: int(item[0])):
        state = row["state"] + (f" ({row['reason']})" if row.get("reason") else "")
        table.add_row(learner_id, Text(state), str(row["restarts"]), _cell(row["updates_accepted"]),
                      _cell(row["updates_rejected"]), str(row["rounds_contributed"]), _inner_step_cell(row),
                      _cell(row["tokens"], ","), format_bytes(row["bytes_sent"]), format_bytes(row["bytes_received"]))
    return table


def _genesis_text(summary: Mapping[str, Any]) -> str:
    """`; learner 0's bytes sent include the initial model it proposed (1.9 MB)`: without it the first learner's
    uplink reads as twice the others' in a short run, for no reason the table shows."""
    proposed = [(learner_id, row["genesis_bytes_sent"]) for learner_id, row in
                sorted(summary["learners"].items(), key=lambda item: int(item[0])) if row.get("genesis_bytes_sent")]
    if not proposed:
        return ""
    who = " and ".join(f"learner {learner_id}'s" for learner_id, _ in proposed)
    sizes = ", ".join(format_bytes(size) for _, size in proposed)
    return f"; {who} bytes sent include the initial model {'it' if len(proposed) == 1 else 'each'} proposed ({sizes})"


def _inner_step_cell(row: Mapping[str, Any]) -> str:
    """`150`; `150 (40 trained)` where the steps its processes trained differ from its position (see
    `inner_steps_trained`); `150 (saved 120)` where a resume continues from an older checkpoint (`unsaved_progress`)."""
    position, trained = row.get("inner_step"), row.get("inner_steps_trained")
    notes = [] if trained is None or position is None or trained == position else [f"{trained} trained"]
    saved = unsaved_progress(row)
    if saved is not None:
        notes.append(f"saved {saved}")
    return _cell(position) + (f" ({', '.join(notes)})" if notes else "")


def _cell(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: Mapping[str, Any], console: Console) -> None:
    console.print(summary_table(summary))
    for learner_id, row in sorted(summary["learners"].items(), key=lambda item: int(item[0])):
        saved = unsaved_progress(row)
        if saved is not None:
            console.print(Text(f"learner {learner_id} reached inner step {row['inner_step']}, but its newest "
                               f"checkpoint holds inner step {saved}: a --resume continues it from {saved} (killed or "
                               "failed after it, or its checkpoint at its stop could not be written: "
                               f"logs/learner-{learner_id}.log says which)",
                               style="yellow"))
        elif row.get("checkpoint_inner_step") is None and (row.get("inner_steps_trained") or 0) > 0:
            console.print(Text(f"learner {learner_id} trained {row['inner_steps_trained']} inner steps but has no "
                               "checkpoint: a --resume takes the run's position for it, with its optimizer and data "
                               "afresh (killed before its first checkpoint, or its checkpoints could not be written: "
                               f"logs/learner-{learner_id}.log says which)", style="yellow"))
        recoveries = row.get("non_finite_recoveries") or 0
        if recoveries:  # a learner that diverged reads "done" in the table, and its loss "-"
            console.print(Text(f"learner {learner_id}'s model went non-finite (NaN or infinite) {recoveries} times; "
                               "each time it was put back to the global model and its work since was dropped: "
                               f"{row.get('rounds_contributed', 0)} rounds had its updates "
                               f"(logs/learner-{learner_id}.log says when)", style="yellow"))
        capped = row.get("updates_capped") or 0
        if capped:  # one learner far off the others moves the global model, at most this far each round
            console.print(Text(f"{capped} of learner {learner_id}'s updates were far larger than their fragments' "
                               "previous rounds and counted at the cap (--max-norm-ratio): work of many more inner "
                               "steps than a round's (trained while the syncer was away, or after the others "
                               "finished), a learning rate too high for it, or a corrupted model; each moves the "
                               "global model at most that much a round (logs/syncer.log names the rounds)",
                               style="yellow"))
    non_finite = ((summary.get("syncer") or {}).get("rejections") or {}).get("non_finite", 0)
    if non_finite:  # the table counts them among the rejections; what they mean is worth a line
        console.print(Text(f"the syncer rejected {non_finite} updates as non-finite: a learner's values were NaN or "
                           "infinite, or a round's merge would have made a parameter so, and that round was not "
                           "committed (logs/syncer.log names the fragment and the tensor)", style="yellow"))
    evaluator = summary.get("evaluator") or {}
    behind = rounds_since_val_loss(summary)
    if summary.get("evaluator", {}) is None and behind is not None:
        console.print(Text(f"this session ran no evaluator: the validation loss is the one measured at round "
                           f"{summary['final_val_loss_round']}, {behind} rounds before the last (a --resume with "
                           "--evaluate runs one)", style="yellow"))
    if evaluator.get("reason") and evaluator.get("state") in ("failed", "stopped"):  # the run finished without it,
        what = ("so the run measured no validation loss" if summary.get("final_val_loss") is None  # but its loss
                else "so the validation loss is the last it measured before")                     # stops there
        how = "failed" if evaluator["state"] == "failed" else "did not evaluate the final model"
        console.print(Text(f"the evaluator {how}, {what}: {evaluator['reason']}", style="yellow"))
    if summary.get("failure"):
        console.print(Text(summary["failure"], style="red"))
