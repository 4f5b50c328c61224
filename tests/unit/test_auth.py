"""Per-learner tokens (issue 13 item 7): each learner proves its own id and no other."""

from __future__ import annotations

import pytest

from ddiloco.transport.auth import learner_of_token, learner_token, token_for_learner

RUN_TOKEN = "0123456789abcdef0123456789abcdef"


def test_a_learner_token_proves_its_id_and_no_other():
    three = learner_token(RUN_TOKEN, 3)
    assert learner_of_token(RUN_TOKEN, three) == 3
    assert learner_token(RUN_TOKEN, 3) == three  # derived, not stored: the same on every machine
    assert learner_of_token(RUN_TOKEN, three.replace("-3.", "-4.")) is None  # the id is bound into the HMAC
    assert learner_of_token("another run's token, also long", three) is None
    assert learner_of_token(RUN_TOKEN, RUN_TOKEN) is None  # the run token is nobody's learner token
    for junk in ("ddiloco-learner-", "ddiloco-learner-x.ab", "ddiloco-learner-1", "ddiloco-learner-" + "9" * 40 + ".a"):
        assert learner_of_token(RUN_TOKEN, junk) is None


def test_a_learner_presents_its_own_token_whether_given_the_run_token_or_its_own():
    assert token_for_learner(RUN_TOKEN, 2) == learner_token(RUN_TOKEN, 2)
    own = learner_token(RUN_TOKEN, 2)
    assert token_for_learner(own, 2) == own
    with pytest.raises(ValueError, match="learner 2's, not learner 5's"):
        token_for_learner(own, 5)


def test_ddiloco_run_gives_each_learner_process_only_its_own_token(tmp_path):
    import json
    import os
    import stat
    from pathlib import Path

    from ddiloco.runtime.launcher import LaunchConfig, Launcher

    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1))
    run_token = (tmp_path / "token").read_text().strip()
    argv = launcher.learner_argv(1, "127.0.0.1:1")
    path = json.loads(Path(argv[argv.index("--settings") + 1]).read_text())["token_file"]
    assert path == str(tmp_path / "learners" / "1" / "token")
    assert Path(path).read_text().strip() == learner_token(run_token, 1)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    env = launcher.learner_env(0, "127.0.0.1:1")
    assert Path(env["DDILOCO_TOKEN_FILE"]).read_text().strip() == learner_token(run_token, 0)
    evaluator = launcher.learner_env(0, "127.0.0.1:1", role="evaluator")
    assert evaluator["DDILOCO_TOKEN_FILE"] == str(tmp_path / "token")  # the operator's: status and the model only


@pytest.mark.parametrize("learner", ["-1", str(10**12)])
def test_ddiloco_token_refuses_a_learner_id_no_token_can_prove(tmp_path, capsys, learner):
    # 10**12 and above printed a token the syncer never accepts (learner_of_token reads at most 12 digits).
    from ddiloco import cli

    token = tmp_path / "token"
    token.write_text("a-run-token-of-enough-length-0123456789")
    token.chmod(0o600)
    assert cli.main(["token", "--token-file", str(token), "--learner", learner]) == 2
    assert f"--learner {learner} is invalid: expected a learner id in 0..999999999999" in capsys.readouterr().err
    assert cli.main(["token", "--token-file", str(token), "--learner", "999999999999"]) == 0
    printed = capsys.readouterr().out.strip()
    assert learner_of_token(token.read_text(), printed) == 999999999999
