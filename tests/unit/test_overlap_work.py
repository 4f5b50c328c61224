"""The learner's work after a publish (the tau-step overlap) when the round's result arrives: kept on top
of the new global value (`DilocoConfig.keep_overlap_work`, the default) or overwritten."""

import dataclasses

import pytest
import torch

from ddiloco.compression import get_codec
from ddiloco.config import DilocoConfig
from ddiloco.learner import Learner
from ddiloco.messages import FragmentState, Welcome
from ddiloco.round_schedule import RoundSchedule
from tests.helpers import TinyNet, make_batches, params_of, sgd, train_step

CONFIG = DilocoConfig(num_fragments=1, fragment_strategy="single", sync_every=4, overlap_steps=2,
                      codec="fp32", downlink_codec="fp32")


def _joined_learner(config: DilocoConfig) -> Learner:
    learner = Learner(config, learner_id=0, model=TinyNet(seed=1), optimizer=None)
    learner.optimizer = sgd(learner.model)
    start = params_of(TinyNet(seed=2))
    learner.receive(Welcome(0, (FragmentState(0, 0, start),), config.fingerprint()))
    return learner


def _train(learner: Learner, batches) -> list:
    updates = []
    for batch in batches:
        updates += learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
    return updates


def _new_global(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, 0.25) for name, t in params_of(learner.model).items()}


def test_steps_trained_after_a_publish_are_kept_on_the_new_global_value_and_published_next():
    learner = _joined_learner(CONFIG)
    batches = make_batches(8, seed=3)
    (update,) = _train(learner, batches[:4])                  # publishes at inner step 4, from version 0
    at_publish = params_of(learner.model)
    assert _train(learner, batches[4:6]) == []                # the overlap: 2 steps not in the update
    local = params_of(learner.model)
    new = _new_global(learner)
    learner.receive(FragmentState(0, 1, new))
    for name, value in params_of(learner.model).items():
        torch.testing.assert_close(value, new[name] + (local[name] - at_publish[name]), rtol=0, atol=0)  # bit for bit
    assert learner.steps_since == [2] and learner.tokens_since == [update.tokens // 2]
    assert learner.unpublished() == [2]
    # The next update measures from the new value: it carries the kept steps and counts them.
    (following,) = _train(learner, batches[6:8])              # due at inner step 8
    assert following.base_version == 1 and following.steps == 4 and following.tokens == update.tokens
    codec = get_codec(CONFIG.codec)
    for name, value in params_of(learner.model).items():
        torch.testing.assert_close(codec.decode(following.payload[name], tuple(value.shape)), new[name] - value,
                                   rtol=0, atol=0)


def test_overwrite_loses_the_overlap_steps_as_the_paper_learner_does():
    config = DilocoConfig(**{**CONFIG.to_dict(), "keep_overlap_work": False})
    learner = _joined_learner(config)
    batches = make_batches(4, seed=3)
    _train(learner, batches)
    new = _new_global(learner)
    learner.receive(FragmentState(0, 1, new))
    for name, value in params_of(learner.model).items():
        torch.testing.assert_close(value, new[name], rtol=0, atol=0)
    assert learner.steps_since == [0] and learner.unpublished() == [0]


def test_a_welcome_overwrites_the_overlap_steps():
    learner = _joined_learner(CONFIG)
    _train(learner, make_batches(4, seed=3))
    new = _new_global(learner)
    learner.receive(Welcome(0, (FragmentState(0, 1, new),), CONFIG.fingerprint()))
    for name, value in params_of(learner.model).items():
        torch.testing.assert_close(value, new[name], rtol=0, atol=0)
    assert learner.steps_since == [0]


# ---- the rounds' pace (Dynamic Local Updates) ------------------------------------------------------------

PACED = DilocoConfig(num_fragments=2, sync_every=8, overlap_steps=8, codec="fp32", downlink_codec="fp32",
                     pace_rounds=True)
"""Rounds 4 inner steps apart; tau long enough that no learner waits in these tests."""


def _results_every(learner: Learner, own_steps: int, rounds: int) -> list:
    """Train `learner`, handing it the next round's result after every `own_steps` of its inner steps (as the
    others' rounds would arrive); returns its updates."""
    updates, batches = [], make_batches(own_steps * rounds, seed=5)
    global_ = params_of(learner.model)
    for r in range(rounds):
        updates += _train(learner, batches[r * own_steps:(r + 1) * own_steps])
        p, version = r % 2, r // 2 + 1
        learner.receive(FragmentState(p, version, {n: global_[n] for n in learner.plan.fragments[p]}))
    return updates


def _paced_learner() -> Learner:
    learner = Learner(PACED, learner_id=0, model=TinyNet(seed=1), optimizer=None)
    learner.optimizer = sgd(learner.model)
    learner.receive(Welcome(0, tuple(FragmentState(p, 0, {n: t for n, t in params_of(TinyNet(seed=2)).items()
                                                          if n in learner.plan.fragments[p]}) for p in range(2)),
                            PACED.fingerprint()))
    return learner


def test_a_learner_slower_than_the_rounds_publishes_after_fewer_of_its_own_steps():
    learner = _paced_learner()
    _results_every(learner, 3, 40)                                 # rounds every 3 of its steps, H / P = 4
    assert learner.schedule.round_pace == pytest.approx(0.75, abs=0.03)
    steps_at = [u.inner_step for u in _results_every(learner, 3, 12)]
    assert set(b - a for a, b in zip(steps_at, steps_at[1:], strict=False)) <= {2, 3, 4}
    assert (steps_at[-1] - steps_at[0]) / (len(steps_at) - 1) == pytest.approx(3.0, abs=0.35)


def test_a_learner_in_pace_with_the_rounds_keeps_its_schedule():
    learner = _paced_learner()
    updates = _results_every(learner, 4, 40)
    assert learner.schedule.round_pace == pytest.approx(1.0, abs=0.01) and learner.schedule.phase == 0
    assert [u.inner_step for u in updates] == [4 * (r + 1) for r in range(40)]


def test_a_learner_that_waited_for_the_syncer_does_not_count_the_wait_as_its_pace():
    # Its link is slow: after each publish it blocks (tau = 1) until the result arrives, and meanwhile the
    # other fragment's round result arrives too. Counted as pace, two results per 5 of its steps would read 0.6.
    learner = _paced_learner()
    learner.config = dataclasses.replace(PACED, overlap_steps=1)
    batches, global_ = iter(make_batches(200, seed=5)), params_of(learner.model)
    for _ in range(20):
        while learner.can_step:
            _train(learner, [next(batches)])
        (waited_for,) = learner.blocking_fragments()
        for p in (1 - waited_for, waited_for):
            state = {n: global_[n] for n in learner.plan.fragments[p]}
            learner.receive(FragmentState(p, learner.versions[p] + 1, state))
    assert learner.stats.updates_sent >= 20
    assert learner.schedule.round_pace == 1.0


# ---- following the rounds' close (`Learner._follow_close`) ------------------------------------------------

def _slow_paced_learner() -> Learner:
    learner = _paced_learner()
    _results_every(learner, 3, 40)                                 # measured slower: pace 0.75 < 0.95
    assert learner.schedule.round_pace < 0.9
    return learner


def _unpaced_learner() -> Learner:
    learner = _paced_learner()
    learner.schedule.pace_rounds = False                            # as if made with pace_rounds off
    _results_every(learner, 4, 8)                                  # past every fragment's first round
    return learner


def _step_until_update(learner: Learner, batches) -> tuple:
    """Train until the learner publishes; returns that update and the inner steps it took."""
    for n, batch in enumerate(batches, start=1):
        updates = learner.after_inner_step(train_step(learner.model, learner.optimizer, batch))
        if updates:
            (update,) = updates
            return update, n
    raise AssertionError("no update")


def _result_after(learner: Learner, extra_steps: int, *, on_time=(0,), phase: float | None = None,
                  margins=None) -> tuple[float, float]:
    """Publish the next update, train `extra_steps` more inner steps, then hand the learner that round's result
    naming `on_time` (its phase set to `phase` first, if given); returns its phase just before and just after the
    result (only the result can move it in between)."""
    batches = iter(make_batches(40, seed=9))
    update, _ = _step_until_update(learner, batches)
    for _ in range(extra_steps):
        assert learner.after_inner_step(train_step(learner.model, learner.optimizer, next(batches))) == []
    p, global_ = update.fragment, params_of(learner.model)
    if phase is not None:
        learner.schedule.phase = phase
    before = learner.schedule.phase
    learner.receive(FragmentState(p, update.base_version + 1, {n: global_[n] for n in learner.plan.fragments[p]},
                                  on_time, margins))
    return before, learner.schedule.phase


@pytest.mark.parametrize("make", [_unpaced_learner, _slow_paced_learner])
@pytest.mark.parametrize("extra_steps", [0, 1, 2])
def test_a_learner_whose_update_missed_its_round_moves_its_schedule_forward_a_step(make, extra_steps):
    # The result names the learners merged on time; not named, its update reached the round after the close
    # (e.g. another learner came back from a failure ahead of it in phase and closed the round with K = 1).
    learner = make()
    late = learner.stats.phase_moves_late
    before, after = _result_after(learner, extra_steps, on_time=(3, 5))
    assert after == before + 1.0 and learner.stats.phase_moves_late == late + 1


def test_each_late_result_in_a_row_moves_the_schedule_one_step_more_up_to_half_a_rounds_spacing():
    # A learner that falls behind the rounds by more than a step per round (a straggler) is late again after a
    # one-step move, and with one step per late result it settles at the close, late in most rounds (real
    # processes: 83-85 %). Each late result in a row moves it one step more; a result that names it starts over.
    learner = _unpaced_learner()
    spacing = PACED.sync_every // PACED.num_fragments
    moves = []
    for _ in range(4):
        before, after = _result_after(learner, 0, on_time=(3,))
        moves.append(after - before)
    assert moves == [1.0, 2.0, 2.0, 2.0] and spacing == 4           # at most 2 = spacing / 2
    assert learner.stats.phase_moves_late == 4
    before, after = _result_after(learner, 0, on_time=(0, 3))
    assert after == before                                           # on time: no move
    before, after = _result_after(learner, 0, on_time=(3,))
    assert after - before == 1.0                                     # the count started again


@pytest.mark.parametrize("make", [_unpaced_learner, _slow_paced_learner])
def test_a_learner_named_on_time_keeps_its_phase_even_when_the_result_comes_in_the_same_step(make):
    learner = make()
    before, after = _result_after(learner, 0, on_time=(0, 3))
    assert after == before and learner.stats.phase_moves_late == 0


def test_an_on_time_learner_with_little_of_the_grace_window_left_moves_ahead_by_what_it_lacks():
    # A learner that falls behind the rounds by less than the window per round is on time a few rounds in a row,
    # then late: the margin the result reports lets it move before that.
    learner = _unpaced_learner()
    learner.config = dataclasses.replace(learner.config, round_margin_steps=1.5, round_margin_gain=0.0)
    before, after = _result_after(learner, 0, on_time=(0, 3), margins=(0.25, 2.0))
    assert after == pytest.approx(before + 1.25) and learner.stats.phase_moves_margin == 1
    before, after = _result_after(learner, 0, on_time=(3, 0), margins=(0.0, 1.5))     # its own: enough left
    assert after == before and learner.stats.phase_moves_margin == 1
    before, after = _result_after(learner, 0, on_time=(0, 3), margins=None)           # not known
    assert after == before
    assert learner.stats.phase_moves_late == 0


def test_a_learner_short_of_its_margin_round_after_round_learns_to_move_that_far_every_round():
    # The margin move alone leaves a learner d steps per round slower than the clock-setting learners arriving d short
    # of its margin in every round (real processes: 28-36 % slower, d = 1.1-1.4 steps, so about 0.3 steps left and
    # late in a third of its rounds). Its drift follows the shortfall by the gain and moves it every round.
    learner = _unpaced_learner()
    learner.config = dataclasses.replace(learner.config, round_margin_steps=1.5, round_margin_gain=0.5)
    learner.schedule.round_pace = 0.5                                # it measured itself slower than the rounds
    moves = []
    for margins in [(0.5, 3.0), (1.0, 3.0), (2.5, 3.0)]:           # short 1.0, short 0.5, 1.0 beyond the target
        before, after = _result_after(learner, 0, on_time=(0, 3), margins=margins)
        moves.append(after - before)
    # drift 0 -> 0.5 -> 0.75 -> 0.25; each result moves by the drift so far plus the shortfall
    assert moves == pytest.approx([1.0, 0.5 + 0.5, 0.75]) and learner.schedule.drift == pytest.approx(0.25)
    before, after = _result_after(learner, 0, on_time=(3,), margins=(3.0,))  # late: counts as no margin left
    assert after - before == pytest.approx(0.25 + 1.0) and learner.schedule.drift == pytest.approx(1.0)
    assert learner.stats.phase_moves_margin == 2 and learner.stats.phase_moves_late == 1


def test_a_learner_that_keeps_the_rounds_pace_never_drifts():
    # The learners that set the rounds' clock must publish on their own step counts: a drift there would pull every
    # round forward (harness, two learners 36 % slower: 127 rounds instead of 96 without this bound).
    learner = _unpaced_learner()
    learner.config = dataclasses.replace(learner.config, round_margin_steps=1.5, round_margin_gain=0.5)
    assert learner.schedule.round_pace >= 0.99
    before, after = _result_after(learner, 0, on_time=(3, 0), margins=(3.0, 0.5))
    assert after - before == pytest.approx(1.0) and learner.schedule.drift == 0.0  # the margin move, no drift


def test_a_schedules_drift_stays_within_its_pace_deficit_and_half_a_rounds_spacing_and_survives_a_restart():
    schedule = RoundSchedule(16, 4, pace_rounds=False)
    schedule.round_pace = 0.9                                        # 0.1 x 4 steps short per round
    for _ in range(10):
        schedule.keep_margin(0.0, target=1.5, gain=1.0)
    assert schedule.drift == pytest.approx(0.4)
    schedule.round_pace = 0.25
    for _ in range(10):
        schedule.keep_margin(0.0, target=1.5, gain=1.0)
    assert schedule.drift == schedule.late_move_limit == 2
    restored = RoundSchedule(16, 4, pace_rounds=False)
    restored.load_state_dict(schedule.state_dict())
    assert restored.drift == 2 and restored.phase == schedule.phase
    for _ in range(10):
        schedule.keep_margin(5.0, target=1.5, gain=1.0)
    assert schedule.drift == 0.0
    restored.take_position(8)                                        # a fresh position forgets the drift
    assert restored.drift == 0.0 and restored.phase == 0.0
    restored.load_state_dict({"next_round": 3, "phase": 1.0})        # a checkpoint from before the drift
    assert restored.drift == 0.0


def test_with_round_margin_steps_0_a_margin_moves_nothing():
    learner = _unpaced_learner()
    learner.config = dataclasses.replace(learner.config, round_margin_steps=0.0)
    assert _result_after(learner, 0, on_time=(0,), margins=(0.0,)) == (0.0, 0.0)


def test_a_result_that_does_not_say_who_was_on_time_moves_nothing():
    learner = _unpaced_learner()
    assert _result_after(learner, 0, on_time=None) == (0.0, 0.0)
    assert _result_after(learner, 0, on_time=()) == (0.0, 1.0)      # known, and nobody was on time


def test_where_rounds_wait_for_every_learner_nobody_moves():
    learner = _unpaced_learner()
    learner.schedule.follows_rounds = False                                  # K = M (`LearnerRules`)
    assert _result_after(learner, 0, on_time=(3,)) == (0.0, 0.0)


def test_a_slow_paced_learner_whose_update_went_out_early_moves_its_schedule_back_a_step():
    learner = _slow_paced_learner()
    early = learner.stats.phase_moves_early
    before, after = _result_after(learner, 2)                      # two of its steps after the update
    assert after == before - 1.0 and learner.stats.phase_moves_early == early + 1


def test_a_learner_that_reads_itself_slow_and_leads_the_rounds_publishes_later_than_its_step_count():
    # Its phase may go below 0: a learner whose pace reads low while its updates open the rounds (one of the
    # clock-setting learners, whose estimate fell when others closed rounds early) must not stay ahead of them.
    learner = _slow_paced_learner()
    assert _result_after(learner, 2, phase=0.0) == (0.0, -1.0)


def test_a_slow_paced_learner_whose_update_was_in_time_keeps_its_phase():
    learner = _slow_paced_learner()
    before, after = _result_after(learner, 1)
    assert after == before


def test_a_learner_in_pace_never_moves_back():
    # The learners that set the rounds' clock must not move: one moving back would leave the rounds to others.
    learner = _paced_learner()
    _results_every(learner, 4, 40)
    before, after = _result_after(learner, 3)
    assert after == before
    assert learner.stats.phase_moves_late == learner.stats.phase_moves_early == 0


def test_without_pace_rounds_a_learner_measured_slow_never_moves_back():
    learner = _slow_paced_learner()
    learner.schedule.pace_rounds = False                            # as if made with pace_rounds off
    assert learner.schedule.round_pace < 0.9
    before, after = _result_after(learner, 2)                      # what moves a paced one back (above)
    assert after == before and learner.stats.phase_moves_early == 0


def test_the_kept_steps_are_added_in_a_float32_parameter_itself_and_through_a_copy_in_another_dtype():
    from ddiloco.fragment_access import LocalParameters

    torch.manual_seed(0)
    params = {"f32": torch.randn(64), "bf16": torch.randn(64).to(torch.bfloat16)}
    before = {name: value.clone() for name, value in params.items()}
    storage = params["f32"].data_ptr()
    at_publish = {name: value.float() + 0.125 * torch.randn(64) for name, value in params.items()}
    bases = {name: torch.randn(64) for name in params}
    LocalParameters(params).carry(0, at_publish, bases)
    expected = {name: bases[name] + (before[name].float() - at_publish[name]) for name in params}
    assert torch.equal(params["f32"], expected["f32"]) and params["f32"].data_ptr() == storage  # in place
    assert params["bf16"].dtype == torch.bfloat16 and torch.equal(params["bf16"], expected["bf16"].to(torch.bfloat16))
