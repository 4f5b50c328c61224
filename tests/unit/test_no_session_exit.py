"""A learner script that exits with status 0 without ever opening a `ddiloco.session` (docs/your_model.md's script
once defined `main()` and never called it) is named as such on the console: the run ended `completed: 0 rounds
committed` with every learner `exited (done)`, as if it had trained.

Real processes: the fake syncer of tests/fake_learners.py and a learner script that does nothing.
"""

from __future__ import annotations

from tests.fake_learners import FAST, run_parser

SCRIPT = """
def main():
    raise SystemExit("never reached: main() is not called")
"""


def test_a_script_that_never_opens_a_session_is_said_to_have_trained_nothing(tmp_path, fake_command, capsys,
                                                                             monkeypatch):
    from ddiloco.runtime import run_commands

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SCRIPT)
    args = run_parser().parse_args(["run", "--no-progress", "--learners", "2", "--threads", "1",
                                    "--run-dir", str(tmp_path / "run")])
    args.script = ["python", "train.py"]
    run_commands.run(args, command=fake_command, supervisor_config=FAST)
    out = capsys.readouterr().out
    for learner in (0, 1):
        assert (f"[learner-{learner}] exited (done, but without a ddiloco session: the script exited with status 0 "
                "before it called ddiloco.session, so it trained nothing here") in out, out
