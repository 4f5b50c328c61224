"""The TensorBoard sink across a restart, with a stand-in for torch's SummaryWriter (tensorboard itself is an optional
extra the test environment does not install): a process that finds event files of an earlier one in its directory
opens its writer with `purge_step` at its first step, so TensorBoard hides the steps the restart redoes. Before, a
learner killed at step 320 and resumed at 263 drew 58 steps twice, its curves going back; and every event was text at
step 0, of which TensorBoard keeps 10."""

from __future__ import annotations

from ddiloco.metrics import TensorBoardSink


class Writer:
    """Records what a SummaryWriter would write; creates an event file as the real one does."""

    opened: list[Writer] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        from pathlib import Path

        self.purge_step, self.calls = purge_step, []
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"events.out.tfevents.{len(Writer.opened)}").write_bytes(b"")
        Writer.opened.append(self)

    def add_scalar(self, tag, value, step) -> None:
        self.calls.append(("scalar", tag, value, step))

    def add_text(self, tag, text, step) -> None:
        self.calls.append(("text", tag, text, step))

    def close(self) -> None:
        self.calls.append(("close",))


def test_a_restarted_process_purges_the_steps_it_redoes_and_events_carry_their_step(tmp_path):
    Writer.opened = []
    first = TensorBoardSink(tmp_path / "tensorboard", Writer)
    first.event("start", source="genesis")  # before any scalar: waits for the first step
    for step in range(1, 321):
        first.log({"learner/0/loss": 1.0 / step}, step)
    first.event("commit", round=7)
    first.close()
    assert Writer.opened[0].purge_step is None  # nothing earlier to hide
    texts = [call for call in Writer.opened[0].calls if call[0] == "text"]
    assert [(tag, step) for _, tag, _, step in texts] == [("events/start", 1), ("events/commit", 320)]

    resumed = TensorBoardSink(tmp_path / "tensorboard", Writer)  # killed at 320, resumed from its checkpoint at 263
    resumed.log({"learner/0/loss": 0.5}, 264)
    resumed.close()
    assert Writer.opened[1].purge_step == 264


def test_a_sink_that_only_had_events_still_writes_them_at_its_close(tmp_path):
    Writer.opened = []
    sink = TensorBoardSink(tmp_path / "tensorboard", Writer)
    sink.event("stopped", rounds_committed=0)
    sink.close()
    assert Writer.opened[0].calls == [("text", "events/stopped", '{"rounds_committed": 0}', 0), ("close",)]
