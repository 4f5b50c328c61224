"""Throttle: the first event of each key per period in full, the rest counted, the keys held bounded."""

import pytest

from ddiloco.throttle import Throttle

OTHERS = ("*", "others")


def test_the_first_of_each_key_per_period_passes_and_the_rest_are_counted():
    throttle = Throttle(10.0, max_keys=8, overflow_key=OTHERS)
    assert [throttle.admit("a", now=0.0) for _ in range(3)] == [True, False, False]
    assert throttle.admit("b", now=1.0) and not throttle.admit("a", now=9.9)
    assert throttle.drain(now=9.9) == {}                # the period is not over
    assert throttle.drain(now=10.0) == {"a": 3}         # b had nothing more to say
    assert throttle.drain(now=30.0) == {}
    assert throttle.admit("a", now=30.0)                # a new period: in full again
    assert not throttle.admit("a", now=31.0)
    assert throttle.drain(now=31.0, final=True) == {"a": 1}


def test_keys_past_the_limit_share_the_overflow_key():
    throttle = Throttle(10.0, max_keys=2, overflow_key=OTHERS)
    assert throttle.admit("a", now=0.0) and throttle.admit("b", now=0.0)
    assert throttle.admit("c", now=0.0)                 # the first overflow is shown, as OTHERS
    assert not any(throttle.admit(key, now=0.0) for key in ("d", "e", "c", "a"))
    assert throttle.drain(now=10.0) == {OTHERS: 3, "a": 1}


@pytest.mark.parametrize("period_s, max_keys, needle", [(0.0, 1, "period_s=0.0"), (1.0, 0, "max_keys=0")])
def test_bad_settings_are_refused_naming_the_field(period_s, max_keys, needle):
    with pytest.raises(ValueError, match=needle):
        Throttle(period_s, max_keys=max_keys, overflow_key=OTHERS)
