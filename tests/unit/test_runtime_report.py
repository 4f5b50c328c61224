"""The end-of-run report and the progress view, from hand-written run directories (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from ddiloco.backoff import Backoff
from ddiloco.checkpoint import atomic_write_json, read_jsonl
from ddiloco.runtime.progress import format_bytes, learner_row, learner_state, learners_table, syncer_table
from ddiloco.runtime.report import build_summary, merge_metrics, write_report
from ddiloco.runtime.report_table import print_summary
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.supervised_roles import ChildState, Slot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_lines(path: Path, records, *, torn_tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)


def participant(learner_id: int, staleness: int = 0) -> dict:
    return {"learner_id": learner_id, "base_version": 0, "staleness": staleness, "steps": 8, "tokens": 16_384,
            "weight": 1.0}


def fake_run(tmp_path: Path) -> RunPaths:
    """Two learners; learner 1 restarted once; three rounds; two validation losses."""
    paths = RunPaths(tmp_path / "run")
    write_lines(paths.syncer_metrics, [{"event": "commit", "time": 101.0, "round": 0}])
    write_lines(paths.evaluator_metrics, [
        {"step": 0, "time": 100.0, "eval/val_loss": 5.5}, {"step": 3, "time": 104.0, "eval/val_loss": 4.25}])
    write_lines(paths.learner_metrics(0), [{"step": 1, "time": 100.5, "learner/0/loss": 5.4}])
    # A learner killed with SIGKILL may leave half a line behind.
    write_lines(paths.learner_metrics(1), [{"step": 1, "time": 100.7, "learner/1/loss": 5.3}],
                torn_tail='{"step": 2, "ti')
    write_lines(paths.launcher_metrics, [
        {"event": "run_started", "time": 99.0},
        {"event": "restart_scheduled", "time": 102.0, "name": "learner-1", "delay_s": 0.5},
        {"event": "restart_scheduled", "time": 102.5, "name": "syncer", "delay_s": 0.5},
        {"event": "run_finished", "time": 105.0, "wall_time_s": 6.0},
    ])
    write_lines(paths.rounds, [
        {"round": 0, "fragment": 0, "version": 1, "participants": [participant(0), participant(1)]},
        {"round": 1, "fragment": 1, "version": 1, "participants": [participant(0)]},
        {"round": 2, "fragment": 0, "version": 2, "participants": [participant(0), participant(1, staleness=1)]},
    ])
    atomic_write_json(paths.syncer_status, {
        "time": 104.0, "rounds_committed": 3, "versions": [2, 1], "bytes_received": 3_000, "bytes_sent": 9_000,
        "rejections": {"stale": 1}, "val_loss": 4.25,
        "learners": {"0": {"accepted": 3, "rejected": 0, "tokens_merged": 49_152, "joins": 1},
                     "1": {"accepted": 2, "rejected": 1, "tokens_merged": 32_768, "joins": 2}}})
    for learner_id, step in ((0, 40), (1, 40)):
        atomic_write_json(paths.learner_status(learner_id), {
            "pid": 10 + learner_id, "state": "done", "inner_step": step, "inner_steps": 40, "loss": 4.4,
            "tokens": 81_920, "updates_accepted": 1, "bytes_sent": 1_500, "bytes_received": 4_500})
    return paths


def test_merge_keeps_every_complete_line_tagged_and_in_time_order(tmp_path):
    paths = fake_run(tmp_path)
    assert merge_metrics(paths) == 9
    merged = list(read_jsonl(paths.metrics))
    assert [r["time"] for r in merged] == sorted(r["time"] for r in merged)
    assert {r["source"] for r in merged} == {"syncer", "evaluator", "launcher", "learner/0", "learner/1"}
    assert merge_metrics(paths) == 9  # rewritten from the sources, not appended


def test_summary_counts_from_the_run_files(tmp_path):
    paths = fake_run(tmp_path)
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("done", "")})
    assert summary["rounds_committed"] == 3
    assert summary["final_val_loss"] == 4.25
    assert summary["wall_time_total_s"] == 6.0 and summary["sessions"] == 1
    assert summary["syncer"]["restarts"] == 1
    zero, one = summary["learners"]["0"], summary["learners"]["1"]
    assert (zero["restarts"], zero["updates_accepted"], zero["updates_rejected"], zero["rounds_contributed"]) \
        == (0, 3, 0, 3)
    assert (one["restarts"], one["updates_accepted"], one["updates_rejected"], one["rounds_contributed"]) \
        == (1, 2, 1, 2)
    assert one["tokens"] == 81_920 and one["tokens_merged"] == 32_768


def test_counts_the_status_files_missed_at_a_kill_come_from_the_syncers_durable_records(tmp_path):
    # status.json files are rewritten once a second: after a kill -9 (or a double Ctrl-C) a learner's said 87 updates
    # sent where the syncer had accepted 90 of them, and the syncer's said versions [4, 4, 4, 3] (15) beside 16
    # rounds committed in the round log.
    paths = fake_run(tmp_path)
    atomic_write_json(paths.syncer_status, {**json.loads(paths.syncer_status.read_text()), "versions": [1, 1]})
    status = json.loads(paths.learner_status(1).read_text())
    atomic_write_json(paths.learner_status(1), {**status, "updates_sent": 2})
    summary = build_summary(paths, num_learners=2, outcome="interrupted", wall_time_s=6.0)
    assert summary["syncer"]["versions"] == [2, 1]  # rounds.jsonl: fragment 0 at version 2
    assert summary["learners"]["1"]["updates_sent"] == 3  # the syncer heard of 2 accepted and 1 rejected


def test_report_writes_summary_and_three_pngs(tmp_path):
    paths = fake_run(tmp_path)
    summary = write_report(paths, num_learners=2, outcome="completed", wall_time_s=6.0)
    assert json.loads(paths.summary.read_text()) == summary
    for name in ("val_loss.png", "participation.png", "bytes.png"):
        assert (paths.root / name).read_bytes()[:8] == PNG_MAGIC, name


def test_participation_colours_each_staleness_from_zero_and_counts_each_learners_rounds(tmp_path):
    import matplotlib.pyplot as plt

    from ddiloco.runtime.report_plots import participation_figure

    paths = fake_run(tmp_path)  # learner 0 in rounds 0, 1, 2; learner 1 in 0 and 2 (one version late)
    fig = participation_figure(paths, num_learners=2)
    ax, bar = fig.axes
    points = ax.collections[0]
    assert list(points.get_array()) == [0, 0, 0, 0, 1]
    assert points.norm.vmin == -0.5 and points.norm.vmax == 1.5 and points.cmap.N == 2  # a colour per staleness
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0 (3)", "1 (2)"] and "of 3" in ax.get_ylabel()
    assert list(bar.get_yticks()) == [0, 1]
    plt.close(fig)
    write_lines(paths.rounds, [{"round": 0, "fragment": 0, "version": 1, "participants": [participant(0)]}])
    fig = participation_figure(paths, num_learners=2)  # nothing late: the scale still starts at 0, not below it
    assert fig.axes[0].collections[0].norm.vmin == -0.5 and list(fig.axes[1].get_yticks()) == [0, 1]
    plt.close(fig)


def test_the_bytes_plots_title_and_legend_stay_inside_the_figure_and_off_the_bars(tmp_path):
    import matplotlib.pyplot as plt

    from ddiloco.runtime.report_plots import bytes_figure

    summary = build_summary(fake_run(tmp_path), num_learners=2, outcome="completed", wall_time_s=6.0)
    summary["syncer"]["bytes_watched"] = 7_659_520  # an evaluator's bytes make the title longest
    fig = bytes_figure(summary)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    inside, title = fig.bbox, ax.title.get_window_extent(renderer)
    assert inside.x0 <= title.x0 and title.x1 <= inside.x1 and title.y1 <= inside.y1
    legend = ax.get_legend().get_window_extent(renderer)
    for bar in ax.patches:
        box = bar.get_window_extent(renderer)
        assert not (box.overlaps(legend) and box.height > 0), "the legend covers a bar"
    plt.close(fig)


def test_report_of_an_empty_run_still_has_plots(tmp_path):
    paths = RunPaths(tmp_path / "empty")
    paths.root.mkdir()
    summary = write_report(paths, num_learners=3, outcome="interrupted", wall_time_s=0.5)
    assert summary["rounds_committed"] == 0 and summary["final_val_loss"] is None
    assert sorted(summary["learners"]) == ["0", "1", "2"]
    assert (paths.root / "val_loss.png").read_bytes()[:8] == PNG_MAGIC


def test_summary_table_shows_every_learner_and_the_run(tmp_path):
    paths = fake_run(tmp_path)
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("refused", "model differs")})
    console = Console(width=200, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert "refused (model differs)" in text
    assert "3 rounds committed" in text and "4.2500" in text
    assert "initial model" not in text  # no learner proposed one (a status file from before the count)
    summary["learners"]["1"]["genesis_bytes_sent"] = 1_000
    console = Console(width=200, record=True)
    print_summary(summary, console)
    caption = " ".join(console.export_text().split())  # the caption folds at the table's width
    assert "learner 1's bytes sent include the initial model it proposed (1.0 kB)" in caption


def test_a_reason_in_brackets_is_shown_as_written(tmp_path):
    paths = fake_run(tmp_path)
    reason = "WARNING __main__: [rank-group] rank 1 (pid 7) exited with status 1"
    summary = build_summary(paths, num_learners=2, outcome="failed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("failed", reason)}, failure="[learner 1] failed")
    console = Console(width=300, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert f"failed ({reason})" in text and "[learner 1] failed" in text  # rich took them for markup and dropped them


def slot(state: ChildState, pid: int | None = None) -> Slot:
    s = Slot("learner-1", 1, Backoff(0.5, 8.0, stable_after_s=30.0), state=state)
    if pid is not None:
        s.process = SimpleNamespace(pid=pid, returncode=None)  # what `Slot.pid` reads of a ChildProcess
    return s


def test_learner_state_prefers_the_process_view_until_its_own_status_arrives():
    assert learner_state(slot(ChildState.PENDING), None, 0.0) == "pending"
    backoff = slot(ChildState.BACKOFF)
    backoff.restart_at = 3.0
    assert learner_state(backoff, None, 1.0) == "restart in 2.0s"
    running = slot(ChildState.RUNNING, pid=42)
    assert learner_state(running, {"pid": 41, "state": "done"}, 0.0) == "starting"  # an old process's file
    assert learner_state(running, {"pid": 42, "state": "waiting"}, 0.0) == "waiting"
    assert learner_state(slot(ChildState.REFUSED), {"state": "training"}, 0.0) == "refused"


def test_rows_and_tables_render_what_the_contract_provides(tmp_path):
    paths = fake_run(tmp_path)
    syncer_status = json.loads(paths.syncer_status.read_text())
    status = json.loads(paths.learner_status(1).read_text())
    row = learner_row(slot(ChildState.RUNNING, pid=11), status, syncer_status, 0.0)
    assert (row.state, row.inner_step, row.rounds, row.restarts) == ("done", 40, 2, 0)
    console = Console(width=200, record=True)
    console.print(learners_table([row]))
    console.print(syncer_table(slot(ChildState.RUNNING), syncer_status))
    text = console.export_text()
    assert "40/40" in text and "stale 1" in text and "3.0 kB / 9.0 kB" in text
    assert [format_bytes(n) for n in (12, 1_500, 2_500_000, 7e12)] == ["12 B", "1.5 kB", "2.5 MB", "7000.0 GB"]


def test_a_stalled_learner_is_shown_in_both_tables(tmp_path):
    # Alive to the syncer but without updates (a loop that hangs): rounds do not wait for it, and the console says so.
    paths = fake_run(tmp_path)
    syncer_status = json.loads(paths.syncer_status.read_text())
    status = json.loads(paths.learner_status(1).read_text()) | {"pid": 11, "state": "training"}
    syncer_status |= {"alive_learners": [0, 1], "stalled_learners": [1], "min_quorum": 2, "effective_quorum": 1}
    syncer_status["learners"]["1"] = syncer_status["learners"].get("1", {}) | {"alive": True, "stalled": True}
    row = learner_row(slot(ChildState.RUNNING, pid=11), status, syncer_status, 0.0)
    assert row.state == "stalled (training)"
    console = Console(width=200, record=True)
    console.print(learners_table([row]))
    console.print(syncer_table(slot(ChildState.RUNNING), syncer_status))
    text = console.export_text()
    assert "stalled (training)" in text and "1/2 of 2 alive, 1 stalled" in text
    # Once its process ended it is not shown as stalled (the syncer's view lags the launcher's).
    assert learner_row(slot(ChildState.BACKOFF, pid=11), status, syncer_status, 0.0).state == "backoff"


def test_a_learner_the_syncer_lost_is_shown_away_until_it_joins_again(tmp_path):
    # A learner stopped (SIGSTOP, a suspended VM) or cut off: the syncer times it out, and the console went quiet about
    # it (a probe); it reads "away" while the syncer does not count it and it is cut off or not writing its status.
    paths = fake_run(tmp_path)
    syncer_status = json.loads(paths.syncer_status.read_text()) | {"time": 1000.0}
    syncer_status["learners"]["1"] = syncer_status["learners"].get("1", {}) | {"alive": False}
    fresh = json.loads(paths.learner_status(1).read_text()) | {"pid": 11, "state": "training", "time": 999.0}

    def state(status: dict, alive: bool = False) -> str:
        syncer_status["learners"]["1"]["alive"] = alive
        return learner_row(slot(ChildState.RUNNING, pid=11), status, syncer_status, 0.0).state

    assert state(fresh | {"connected": False}) == "away (training)"  # it knows it is cut off
    assert state(fresh | {"connected": True, "time": 900.0}) == "away (training)"  # stopped: its file is stale
    # Joined again, the syncer's file not yet written: not away.
    assert state(fresh | {"connected": True}) == "training"
    assert state(fresh | {"connected": False}, alive=True) == "training"  # the syncer has it: its own view lags
    assert state(fresh | {"connected": False, "state": "joining"}) == "joining"
    console = Console(width=200, record=True)
    console.print(learners_table([learner_row(slot(ChildState.RUNNING, pid=11), fresh | {"connected": False},
                                              syncer_status, 0.0)]))
    assert "away (training)" in console.export_text()


def test_the_live_view_shows_a_stop_wait_at_once(tmp_path):
    # While the run stops no tick redraws the live view: the line saying whom the launcher waits for must.
    from io import StringIO

    from ddiloco.runtime.progress import ProgressView
    from ddiloco.runtime.supervised_roles import Event

    paths = fake_run(tmp_path)
    supervisor = SimpleNamespace(syncer=slot(ChildState.RUNNING), learners=[slot(ChildState.RUNNING, pid=11)])
    out = StringIO()
    console = Console(file=out, width=200, force_terminal=True)
    with ProgressView(paths, supervisor, console=console, live=True) as view:
        view.on_event(Event("waiting", "run", None, "still waiting for learner-1 (pid 11) to stop"))
        assert "still waiting for learner-1 (pid 11) to stop" in out.getvalue()


def test_a_session_whose_launcher_was_killed_counts_in_the_total_wall_time_up_to_its_last_event(tmp_path):
    # It wrote no run_finished: its time counted 0, and the total was the last session's alone.
    paths = fake_run(tmp_path)
    write_lines(paths.launcher_metrics, [
        {"event": "run_started", "time": 10.0},
        {"event": "restart_scheduled", "time": 30.0, "name": "learner-1", "delay_s": 0.5},  # then kill -9
        {"event": "run_started", "time": 99.0},
        {"event": "run_finished", "time": 105.0, "wall_time_s": 6.0},
    ])
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0)
    assert (summary["wall_time_total_s"], summary["sessions"]) == (26.0, 2)


def test_the_validation_plot_says_when_every_validation_loss_was_not_finite(tmp_path, monkeypatch):
    # It said "no validation loss recorded" beside 14 recorded, each NaN (null in the metrics).
    import ddiloco.runtime.report_plots as report

    paths = fake_run(tmp_path)
    write_lines(paths.evaluator_metrics, [{"step": 0, "time": 100.0, "eval/val_loss": None},
                                          {"step": 3, "time": 104.0, "eval/val_loss": None}])
    merge_metrics(paths)
    said: list[str] = []
    monkeypatch.setattr(report, "_no_data", lambda ax, text: said.append(text))
    report.plot_val_loss(paths, tmp_path / "val_loss.png")
    assert said == ["none of the 2 validation losses was finite (NaN or inf)"]


def test_a_narrow_terminal_folds_the_summary_tables_numbers_instead_of_cutting_them(tmp_path):
    # At 80 columns the tokens column read `122,…` and the headers `lear…`, `acce…`.
    paths = fake_run(tmp_path)
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0)
    console = Console(width=60, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert "…" not in text and "81," in text and "920" in text, text  # every digit there, if folded


def test_the_summary_names_the_run_directory_absolutely_whatever_path_reached_it(tmp_path, monkeypatch):
    # `ddiloco run --resume r3` wrote "run_dir": "r3" where the run's first session had written the absolute path.
    fake_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    summary = build_summary(RunPaths(Path("run")), num_learners=2, outcome="completed", wall_time_s=6.0)
    assert summary["run_dir"] == str(tmp_path / "run")


def test_a_learner_whose_model_went_non_finite_is_named_under_the_table(tmp_path):
    # Before: a learner whose loss was NaN at every step read "done" with 19,200 tokens, the run "completed", and only
    # its log (79 lines) and summary.json's non_finite_recoveries (78) said it had contributed nothing.
    paths = fake_run(tmp_path)
    status = json.loads(paths.learner_status(1).read_text())
    atomic_write_json(paths.learner_status(1), {**status, "non_finite_recoveries": 78})
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("done", "")})
    console = Console(width=400, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert ("learner 1's model went non-finite (NaN or infinite) 78 times; each time it was put back to the global "
            "model and its work since was dropped: 2 rounds had its updates (logs/learner-1.log says when)") in text
    assert "learner 0's model went non-finite" not in text


def test_updates_accepted_is_the_learners_own_count_beside_the_rounds_it_took_part_in(tmp_path):
    # Before: summary.json's updates_accepted was the syncer's count of rounds the learner took part in (76), the
    # learner's status its accepted updates (83): an update that missed its round is accepted and folded into the
    # learner's next one, one round for two updates, and seven updates seemed to vanish.
    paths = fake_run(tmp_path)
    status = json.loads(paths.learner_status(0).read_text())
    atomic_write_json(paths.learner_status(0), {**status, "updates_sent": 5, "updates_accepted": 5})
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("done", "")})
    zero = summary["learners"]["0"]
    assert (zero["updates_sent"], zero["updates_accepted"], zero["rounds_contributed"]) == (5, 5, 3)


def test_the_live_view_names_the_round_its_validation_loss_was_measured_at(tmp_path):
    # Before: "[syncer] 216 rounds, val loss 5.543", the loss of round 0 (the evaluator measures every 10 s), read as
    # the current model's; the live table's "val loss" column the same.
    from ddiloco.checkpoint import atomic_write_json
    from ddiloco.runtime.progress import ProgressView

    paths = fake_run(tmp_path)
    atomic_write_json(paths.evaluator_status, {"rounds_committed": 0, "val_loss": 5.5432})
    supervisor = SimpleNamespace(syncer=slot(ChildState.RUNNING), learners=[slot(ChildState.RUNNING, pid=11)])
    console = Console(width=300, record=True)
    view = ProgressView(paths, supervisor, console=console, live=False)
    snapshot = view.snapshot()
    console.print(view.render(snapshot))
    view._print_changes(float("inf"), snapshot)
    text = console.export_text()
    assert "3 rounds, val loss 5.543 at round 0" in text, text
    assert "5.543 at round 0" in text.split("3 rounds,")[0], text  # the table's column too


def test_the_loss_curves_break_where_a_resume_started_a_session(tmp_path):
    # Before: the validation line and each learner's training line joined the last point before a stop to the first
    # after the --resume, straight across the 40 s the run was stopped, with nothing marking it.
    import math

    from ddiloco.runtime.report_plots import loss_series

    paths = fake_run(tmp_path)
    write_lines(paths.launcher_metrics, [{"event": "run_started", "time": 99.0},
                                         {"event": "run_started", "time": 150.0}])
    write_lines(paths.evaluator_metrics, [{"step": 0, "time": 100.0, "eval/val_loss": 5.0},
                                          {"step": 3, "time": 151.0, "eval/val_loss": 4.0}])
    merge_metrics(paths)
    series = loss_series(paths)
    assert series.resumed_at == [150.0]
    times, values = series.val
    assert list(times) == [100.0, 150.0, 151.0] and values[0] == 5.0 and math.isnan(values[1]) and values[2] == 4.0
    for learner_times, learner_values in series.train.values():
        assert 150.0 in learner_times and math.isnan(learner_values[list(learner_times).index(150.0)])


def test_a_learner_whose_updates_were_capped_is_named_under_the_table(tmp_path):
    # One learner with 250 times the others' learning rate took the global model off (validation loss 2.74 where the
    # untrained model scores 1.74, the run "completed"); its 39 capped updates were in logs/syncer.log only.
    paths = fake_run(tmp_path)
    status = json.loads(paths.syncer_status.read_text())
    status["learners"]["1"]["capped"] = 39
    atomic_write_json(paths.syncer_status, status)
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0,
                            final_states={0: ("done", ""), 1: ("done", "")})
    assert (summary["learners"]["0"]["updates_capped"], summary["learners"]["1"]["updates_capped"]) == (0, 39)
    console = Console(width=400, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert "39 of learner 1's updates were far larger than their fragments' previous rounds" in text
    assert "of learner 0's updates" not in text


def test_losses_that_span_orders_of_magnitude_are_drawn_on_a_log_axis(tmp_path, monkeypatch):
    # A learner whose loss reached 9e6 (a learning rate far too high) flattened every other curve onto a linear axis,
    # the validation loss going up with it included.
    import matplotlib.axes

    import ddiloco.runtime.report_plots as report

    assert report.loss_axis_scale([5.5, 4.2, 3.9]) == "linear"
    assert report.loss_axis_scale([5.5, 9e6, 0.4]) == "log"
    assert report.loss_axis_scale([0.0, 9e6]) == "linear" and report.loss_axis_scale([]) == "linear"
    scales = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yscale",
                        lambda self, value, **kw: scales.append(value))
    paths = fake_run(tmp_path)
    write_lines(paths.evaluator_metrics, [{"step": 0, "time": 100.0, "eval/val_loss": 5.5},
                                          {"step": 3, "time": 104.0, "eval/val_loss": 9e6}])
    merge_metrics(paths)
    report.plot_val_loss(paths, tmp_path / "val_loss.png")
    assert scales == ["log"]


def test_a_resumed_runs_caption_says_which_wall_time_is_this_sessions():
    # `wall time 21.6 s (syncer restarts 1)`: this session's time beside the whole run's rounds and restarts.
    from ddiloco.runtime.report_table import _wall_time_text

    assert _wall_time_text({"wall_time_s": 21.6, "sessions": 1, "wall_time_total_s": 21.6}) == "wall time 21.6 s"
    assert (_wall_time_text({"wall_time_s": 21.6, "sessions": 3, "wall_time_total_s": 95.25})
            == "wall time 21.6 s this session (95.2 s in its 3 sessions)")


def test_update_counts_a_kill_left_behind_in_status_json_come_from_the_work_ledger(tmp_path):
    # An audit: after 3 kill -9 of a learner, summary.json said 85 updates sent and accepted, its status.json's count
    # (each kill lost that file's last second); its work ledger, appended at each publish and fate, held 89 and 89.
    paths = fake_run(tmp_path)
    status = json.loads(paths.learner_status(0).read_text())
    atomic_write_json(paths.learner_status(0), {**status, "updates_sent": 3, "updates_accepted": 3})
    with (paths.learner_dir(0) / "work.jsonl").open("a") as ledger:
        for step in range(1, 8):
            ledger.write(json.dumps({"event": "publish", "fragment": 0, "inner_step": step}) + "\n")
            fate = "withheld" if step == 7 else "accepted"  # a non-finite one, never sent after all
            ledger.write(json.dumps({"event": "fate", "fragment": 0, "inner_step": step, "fate": fate}) + "\n")
    summary = build_summary(paths, num_learners=2, outcome="completed", wall_time_s=6.0)
    zero = summary["learners"]["0"]
    assert (zero["updates_sent"], zero["updates_accepted"]) == (6, 6)


def test_a_restarted_learner_without_a_checkpoint_is_not_shown_joining_at_step_0(tmp_path):
    # A probe read "joining at inner step 0/300", then the learner trained on from 171: it had no checkpoint of its own
    # and took the run's position at its Welcome. A first start, or a restart from a checkpoint, shows its step.
    from ddiloco.checkpoint import atomic_write_json
    from ddiloco.runtime.progress import ProgressView

    paths = fake_run(tmp_path)
    learner = slot(ChildState.RUNNING, pid=11)
    supervisor = SimpleNamespace(syncer=slot(ChildState.RUNNING), learners=[learner])
    console = Console(width=300, record=True)
    view = ProgressView(paths, supervisor, console=console, live=False)
    atomic_write_json(paths.learner_status(1), {"state": "joining", "inner_step": 0, "inner_steps": 300, "pid": 11})
    view._print_changes(0.0, view.snapshot())
    learner.restarts = 1
    view._shown_states.clear()
    view._print_changes(0.0, view.snapshot())
    atomic_write_json(paths.learner_status(1), {"state": "joining", "inner_step": 120, "inner_steps": 300, "pid": 11})
    view._shown_states.clear()
    view._print_changes(0.0, view.snapshot())
    lines = [line.split("] ", 1)[1] for line in console.export_text().splitlines() if "[learner-1]" in line]
    assert lines == ["joining at inner step 0/300, loss -",
                     "joining without a checkpoint of its own: it takes the run's position",
                     "joining at inner step 120/300, loss -"], lines
