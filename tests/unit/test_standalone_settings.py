"""What a process started by hand is told, checked before it starts: the run's seed against what torch takes, and a
script's `DDILOCO_NUM_LEARNERS` against the run's config.json."""

from __future__ import annotations

import pytest
import torch

from ddiloco.environment import environment
from ddiloco.run_config import MAX_SEED, RunConfig

PAST_TORCH = 2**64 + 1
"""A seed `torch.manual_seed` refuses ("Overflow when unpacking long long")."""


@pytest.mark.parametrize("seed", [PAST_TORCH, MAX_SEED + 1, -1])
def test_a_seed_outside_the_range_is_refused_naming_the_range(seed):
    with pytest.raises(ValueError) as caught:
        RunConfig(seed=seed)
    message = str(caught.value)
    assert f"seed={seed} is invalid" in message and f"0..{MAX_SEED}" in message, message


def test_a_seed_outside_the_range_in_a_config_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(f'{{"seed": {PAST_TORCH}}}')
    with pytest.raises(ValueError, match=f"run config {path}: seed={PAST_TORCH} is invalid"):
        RunConfig.load(path)


def test_the_largest_seed_and_seeds_derived_from_it_are_taken_by_torch():
    RunConfig(seed=MAX_SEED)
    for offset in (0, 1, 2**31, 2**62):  # seed + learner id, + an incarnation stride, ...
        torch.Generator().manual_seed(MAX_SEED + offset)


def _run_env(tmp_path, learners: str, *, config_learners: int = 2) -> dict[str, str]:
    RunConfig(num_learners=config_learners).save(tmp_path / "config.json")
    return {"DDILOCO_LEARNER_ID": "1", "DDILOCO_NUM_LEARNERS": learners, "DDILOCO_RUN_DIR": str(tmp_path)}


def test_a_learner_count_that_differs_from_the_runs_config_is_refused_naming_both(tmp_path):
    with pytest.raises(ValueError) as caught:
        environment(_run_env(tmp_path, "4"))
    message = str(caught.value)
    assert "DDILOCO_NUM_LEARNERS=4" in message and "num_learners 2" in message, message
    assert str(tmp_path / "config.json") in message, message


def test_the_count_named_by_ddiloco_config_is_the_one_checked(tmp_path):
    RunConfig(num_learners=3).save(tmp_path / "other.json")
    env = {**_run_env(tmp_path, "3"), "DDILOCO_CONFIG": str(tmp_path / "other.json")}
    assert environment(env).num_learners == 3
    with pytest.raises(ValueError, match="num_learners 3"):
        environment({**env, "DDILOCO_NUM_LEARNERS": "2"})


def test_the_runs_own_count_or_no_config_at_all_passes(tmp_path):
    assert environment(_run_env(tmp_path, "2")).num_learners == 2
    no_config = {"DDILOCO_LEARNER_ID": "1", "DDILOCO_NUM_LEARNERS": "4", "DDILOCO_RUN_DIR": str(tmp_path / "none")}
    assert environment(no_config).num_learners == 4


def test_a_session_given_another_learners_token_is_refused_before_it_connects(tmp_path):
    import ddiloco
    from ddiloco.transport.auth import learner_token
    from tests.helpers import TinyNet, sgd

    model = TinyNet()
    with pytest.raises(ValueError, match="the token given is learner 1's, not learner 0's"):
        # port 1: nothing listens there, and nothing must be dialled
        ddiloco.session(model, sgd(model), syncer="127.0.0.1:1", learner_id=0, run_dir=tmp_path,
                        token=learner_token("standalone-settings-token-0123", 1), config=RunConfig(num_learners=2))


@pytest.mark.parametrize(("variable", "value", "expected"), [
    # "could not convert string to float: 'abc'", naming no variable.
    ("DDILOCO_EVAL_EVERY_S", "abc", "DDILOCO_EVAL_EVERY_S='abc' is invalid: expected a number of seconds >= 0"),
    # Accepted; a later check named the keyword argument, not the variable.
    ("DDILOCO_CHECKPOINT_EVERY_S", "-5",
     "DDILOCO_CHECKPOINT_EVERY_S='-5' is invalid: expected a number of seconds > 0"),
    ("DDILOCO_CHECKPOINT_EVERY_S", "nan", "DDILOCO_CHECKPOINT_EVERY_S='nan' is invalid"),
    ("DDILOCO_THREADS", "-3", "DDILOCO_THREADS=-3 is invalid: expected an integer >= 1"),
])
def test_a_bad_period_or_thread_count_in_the_environment_is_refused_naming_the_variable(variable, value, expected):
    with pytest.raises(ValueError) as refused:
        environment({variable: value})
    assert str(refused.value).startswith(expected), str(refused.value)


def test_periods_and_threads_from_the_environment_are_read():
    env = environment({"DDILOCO_EVAL_EVERY_S": "0", "DDILOCO_CHECKPOINT_EVERY_S": "2.5", "DDILOCO_THREADS": "3"})
    assert (env.eval_every_s, env.checkpoint_every_s, env.threads) == (0.0, 2.5, 3)
