"""Fault plans of a chaos run: which fault hits which process, when, for how long.

Owns the user format and the drawn plans; the types (`Fault`, `FaultPlan`, shared with the virtual-time
harness) are `ddiloco.fault_plan`'s. Carrying a fault out (signals, control files) is the runner's
business, judging what it cost is `ddiloco.chaos.analysis`. Every system of a chaos run (Decoupled
DiLoCo, synchronous DiLoCo, data-parallel) runs under the same plan, so they face the same faults.

A plan comes from a user file (`load_plan`), from a failure model (`model_plan`), or is the fixed
`--quick` plan (`quick_plan`). The user format, YAML (.yaml/.yml) or JSON:

    duration: 120s          # how long each system runs
    seed: 0                 # optional: seeds drop/corrupt draws
    faults:
      - {at: 20s, kind: crash, target: learner-1}
      - {at: 30s, kind: crash, target: learner-2, restart: false, duration: 15s}
      - {at: 50s, kind: straggler, target: learner-0, duration: 20s, factor: 3}
      - {at: 70s, kind: latency, target: learner-3, duration: 20s, latency: 200ms}
      - {at: 75s, kind: bandwidth, target: learner-3, duration: 20s, bandwidth: 10mbit}
      - {at: 80s, kind: drop, target: learner-1, duration: 10s, probability: 0.5}
      - {at: 90s, kind: syncer_crash}

Times are seconds, or numbers with `ms`, `s` or `min`; bandwidths are bytes per second, or take the
units of `ddiloco.transport.link.parse_link` (`10mbit`, `1gb`). Faults are numbered from 0 in the
order the file lists them, and every error names the file, that number and the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ddiloco.checks import invalid
from ddiloco.failures import FailureModel
from ddiloco.fault_control import VALUE_EXPECTED
from ddiloco.fault_plan import KINDS, SYNCER, TIMED_KINDS, VALUE_KEYS, Fault, FaultPlan, check_fits
from ddiloco.transport.link import parse_link

_TIME_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "min": 60.0}
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
_LEARNER = re.compile(r"^learner-([0-9]+)$")
_FAULT_KEYS = {"at", "kind", "target", "duration", "restart", *VALUE_KEYS.values()}
_PLAN_KEYS = {"duration", "faults", "seed"}


# ---- the user format ----------------------------------------------------------------------------------

def parse_time_s(value: Any, what: str, *, positive: bool = False) -> float:
    """A number of seconds, or a string with a unit: `200ms`, `20s`, `2min`; finite, >= 0 (> 0 if `positive`)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is invalid: expected seconds or a time such as 20s, 200ms, 2min")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _TIME.match(str(value).lower())
        if match is None or match.group(2) not in _TIME_UNITS:
            raise ValueError(f"{what} {value!r} is invalid: expected seconds or a time such as 20s, 200ms, 2min")
        seconds = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if not (math.isfinite(seconds) and (seconds > 0 if positive else seconds >= 0)):
        raise ValueError(f"{what} {value!r} is invalid: expected a time {'>' if positive else '>='} 0")
    return seconds


def parse_bandwidth_bytes_per_s(value: Any) -> float:
    """Bytes per second, or a string with `parse_link`'s units (`10mbit` is 1.25e6 bytes/s)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    try:
        return parse_link(f"{value},0s").bandwidth_bps / 8
    except ValueError as exc:
        raise ValueError(f"bandwidth {value!r} is invalid: expected bytes per second or a rate such as "
                         "10mbit, 1gbit, 100mb") from exc


def parse_target(value: Any, kind: str) -> int | None:
    if kind == "syncer_crash":
        if value not in (None, SYNCER):
            raise ValueError(f"target {value!r} is invalid for syncer_crash: expected syncer (or no target)")
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _LEARNER.match(str(value)) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"target {value!r} is invalid for {kind}: expected learner-N or N")
    return int(match.group(1))


def _reject_unknown_keys(mapping: Mapping, allowed: set[str], *, where: str = "") -> None:
    unknown = sorted(set(map(str, mapping)) - allowed)
    if unknown:
        raise ValueError(f"{where}unknown key {', '.join(map(repr, unknown))}: expected some of "
                         f"{', '.join(sorted(allowed))}")


def fault_from_user(entry: Any) -> Fault:
    """One entry of the user format's `faults` list (errors name the field, not the position)."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{entry!r} is invalid: expected a mapping such as {{at: 20s, kind: crash, target: 1}}")
    _reject_unknown_keys(entry, _FAULT_KEYS)
    if "kind" not in entry:
        raise ValueError(f"kind is missing: expected one of {', '.join(KINDS)}")
    kind = entry["kind"]
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is unknown: expected one of {', '.join(KINDS)}")
    if "at" not in entry:
        raise ValueError("at is missing: expected the time the fault starts, e.g. at: 20s")
    for key in VALUE_KEYS.values():
        if key in entry and VALUE_KEYS.get(kind) != key:
            raise ValueError(f"{key} is invalid for {kind}: "
                             + (f"it takes {VALUE_KEYS[kind]}" if kind in VALUE_KEYS else "it takes no parameter"))
    value = entry.get(VALUE_KEYS[kind]) if kind in VALUE_KEYS else None
    if kind == "latency" and value is not None:
        value = parse_time_s(value, "latency")
    elif kind == "bandwidth" and value is not None:
        value = parse_bandwidth_bytes_per_s(value)
    elif value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{VALUE_KEYS[kind]} {value!r} is invalid for {kind}: it is not a number{_text_hint(value)}; "
                         f"expected {VALUE_EXPECTED[kind]}")
    restart = entry.get("restart", True)
    if not isinstance(restart, bool):
        raise ValueError(f"restart {restart!r} is invalid: expected true or false")
    if "target" not in entry and kind != "syncer_crash":
        raise ValueError(f"target is missing for {kind}: expected learner-N or N")
    return Fault(at_s=parse_time_s(entry["at"], "at"), kind=kind, target=parse_target(entry.get("target"), kind),
                 duration_s=parse_time_s(entry.get("duration", 0), "duration"), restart=restart,
                 value=None if value is None else float(value))


def _text_hint(value: Any) -> str:
    """Why a number may have been read as text: YAML 1.1 takes an exponent without a dot (1e308) for a string."""
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return " (YAML reads a number with an exponent but no dot, such as 1e3, as text: write 1.0e3)"


def load_plan(path: str | Path, num_learners: int) -> FaultPlan:
    """Read and validate a user plan for a run of `num_learners` learners (see the module docstring)."""
    path = Path(path)
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the fault plan ({exc.strerror or exc})") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"{name}: unknown plan format {path.suffix!r}: expected .yaml, .yml or .json")
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: expected a mapping with duration and faults at the top")
    _reject_unknown_keys(data, _PLAN_KEYS, where=f"{name}: ")
    if "duration" not in data:
        raise ValueError(f"{name}: duration is missing: expected how long each system runs, e.g. duration: 120s")
    try:
        duration_s = parse_time_s(data["duration"], "duration", positive=True)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name}: seed {seed!r} is invalid: expected an integer")
    entries = data.get("faults") or []
    if not isinstance(entries, list):
        raise ValueError(f"{name}: faults is invalid: expected a list of faults")
    faults = []
    for index, entry in enumerate(entries):
        where = f"{name}, fault {index}"
        try:
            fault = fault_from_user(entry)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        check_fits(fault, num_learners, duration_s, where)
        faults.append(fault)
    return FaultPlan(duration_s=duration_s, num_learners=num_learners, faults=tuple(faults), seed=seed,
                     source=str(path))


# ---- the --quick plan ---------------------------------------------------------------------------------

QUICK_DURATION_S = 40.0
_QUICK = (  # (at_s, kind, learner slot, duration_s, restart, value); target = slot mod M
    (8.0, "crash", 0, 0.0, True, None),
    (10.0, "straggler", 1, 5.0, True, 3.0),
    (12.0, "partition", 2, 4.0, True, None),
    (16.0, "hang", 3, 5.0, True, None),
    (19.0, "syncer_crash", None, 0.0, True, None),
    (22.0, "crash", 4, 6.0, False, None),
    (23.0, "latency", 5, 6.0, True, 0.2),
    (26.0, "drop", 7, 4.0, True, 0.5),
    (28.0, "corrupt", 9, 4.0, True, 0.5),
)
"""Slots are chosen so that with two learners the learner under a crash, hang or partition always has
a healthy partner (and faults alternate between the two); start-up of the processes takes the first
seconds, and every fault is over by 32 s so the last 8 s show the recovery."""


def quick_plan(num_learners: int, *, seed: int = 0) -> FaultPlan:
    """The `--quick` plan: 40 s per system, one fault of each kind that fits, over by 32 s."""
    if not (isinstance(num_learners, int) and num_learners >= 2):
        raise ValueError(f"num_learners={num_learners!r} is invalid for the quick plan: expected >= 2 "
                         "(one learner must stay up while another is down)")
    faults = tuple(Fault(at_s=at, kind=kind, target=None if slot is None else slot % num_learners,
                         duration_s=duration, restart=restart, value=value)
                   for at, kind, slot, duration, restart, value in _QUICK)
    return FaultPlan(duration_s=QUICK_DURATION_S, num_learners=num_learners, faults=faults, seed=seed,
                     source="quick")


# ---- the failure model --------------------------------------------------------------------------------

DRAWN_START_AFTER_S = 10.0
"""A drawn plan (failure model, soak) injects nothing in its first seconds: start-up is set-up."""
DRAWN_MARGIN_S = 10.0
"""...nor in its last ones: the margin leaves time to see the last recovery."""
DEFAULT_VALUES = {"straggler": 3.0, "latency": 0.2, "bandwidth": 1.25e6, "drop": 0.5, "corrupt": 0.5}
"""Parameters of drawn faults other than crash: 3x slower, 200 ms, 10 Mbit/s, half the messages."""
DOWN_KINDS = ("crash", "hang")
"""Drawn kinds that stop a learner contributing; at most max_down_at_once of them overlap."""


def model_plan(duration_s: float, num_learners: int, mtbi_per_chip_s: float, chips_per_learner: int, seed: int, *,
               start_after_s: float = DRAWN_START_AFTER_S, margin_s: float = DRAWN_MARGIN_S,
               recovery_scale_s: float = 10.0,
               recovery_shape: float = 0.8, recovery_exponent: float = 1.5, max_recovery_s: float = 300.0,
               max_down_at_once: int | None = None, kind_weights: Mapping[str, float] | None = None,
               restart: bool = False) -> FaultPlan:
    """Faults drawn from a failure model, the real-process counterpart of `ddiloco.sim.faults`.

    Each learner (a group of `chips_per_learner` chips, any of which failing takes it down) fails as
    a Poisson process of rate chips_per_learner / mtbi_per_chip_s: gaps between failures are
    exponential with mean mtbi_per_chip_s / chips_per_learner, counted while the learner is up, and
    failures start within [start_after_s, duration_s - margin_s] (start-up is set-up, and the margin
    leaves time to see the recovery). Each failure lasts a recovery time drawn from the exponentiated
    Weibull of `FailureModel`, F(x) = (1 - exp(-(x / scale)^k))^alpha, capped at max_recovery_s, and
    is by default a `crash` with restart False held down for that time (a machine being replaced).
    `kind_weights` ({kind: weight}, learner kinds only) draws each failure's kind in proportion to the
    weights instead; other kinds get DEFAULT_VALUES. A failure that would leave more than
    `max_down_at_once` (default M - 1) learners crashed or hung at once is dropped, so someone always
    trains. One seeded generator: the same arguments give the same plan. With `restart` True a crash
    is a process crash instead: the supervisor (or the data-parallel agent) restarts it at once, and
    the recovery time is whatever the real restart takes (the drawn time is not used).
    """
    if not (isinstance(chips_per_learner, int) and chips_per_learner >= 1):
        raise invalid("chips_per_learner", chips_per_learner, "an integer >= 1")
    if not (isinstance(num_learners, int) and num_learners >= 1):
        raise invalid("num_learners", num_learners, "an integer >= 1")
    if not (math.isfinite(start_after_s) and start_after_s >= 0):
        raise invalid("start_after_s", start_after_s, "a time >= 0")
    if not (math.isfinite(margin_s) and margin_s >= 0 and duration_s - margin_s > start_after_s):
        raise ValueError(f"margin_s={margin_s!r} is invalid with duration_s={duration_s!r} and start_after_s="
                         f"{start_after_s!r}: expected start_after_s < duration_s - margin_s")
    weights = dict(kind_weights) if kind_weights is not None else {"crash": 1.0}
    for kind, weight in weights.items():
        if kind not in KINDS or kind == "syncer_crash":
            raise ValueError(f"kind_weights: kind {kind!r} is invalid: expected learner kinds "
                             f"{', '.join(k for k in KINDS if k != 'syncer_crash')}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"kind_weights: weight {weight!r} of {kind} is invalid: expected a number >= 0")
    total_weight = sum(weights.values())
    if total_weight <= 0:
        raise ValueError("kind_weights is invalid: expected at least one weight > 0")
    model = FailureModel(mtbi_s=mtbi_per_chip_s / chips_per_learner, chips_per_slice=1,
                         recovery_scale_s=recovery_scale_s, recovery_shape=recovery_shape,
                         recovery_exponent=recovery_exponent, max_recovery_s=max_recovery_s)
    limit = num_learners - 1 if max_down_at_once is None else max_down_at_once
    kinds = list(weights)
    probabilities = np.array([weights[k] for k in kinds]) / total_weight
    rng = np.random.default_rng(seed)
    last_start_s = duration_s - margin_s
    candidates: list[Fault] = []
    for learner in range(num_learners):
        t = start_after_s
        while True:
            t += rng.exponential(model.mtbi_s)
            if t > last_start_s:
                break
            held_s = model.sample_recovery_s(rng)
            kind = kinds[int(rng.choice(len(kinds), p=probabilities))]
            if kind == "crash" and restart:
                held_s = 0.0
            candidates.append(Fault(at_s=float(t), kind=kind, target=learner, duration_s=float(held_s),
                                    restart=kind != "crash" or restart, value=DEFAULT_VALUES.get(kind)))
            t += held_s
    kept: list[Fault] = []
    for fault in sorted(candidates, key=lambda f: (f.at_s, f.target)):
        down = sum(1 for f in kept if f.kind in DOWN_KINDS and f.at_s <= fault.at_s < f.end_s)
        if fault.kind not in DOWN_KINDS or down < limit:
            kept.append(fault)
    arguments = {"duration_s": duration_s, "num_learners": num_learners, "mtbi_per_chip_s": mtbi_per_chip_s,
                 "chips_per_learner": chips_per_learner, "seed": seed, "start_after_s": start_after_s,
                 "margin_s": margin_s, "recovery_scale_s": recovery_scale_s, "recovery_shape": recovery_shape,
                 "recovery_exponent": recovery_exponent, "max_recovery_s": max_recovery_s,
                 "max_down_at_once": limit, "kind_weights": weights, "restart": restart}
    return FaultPlan(duration_s=duration_s, num_learners=num_learners, faults=tuple(kept), seed=seed,
                     source="model", model=arguments)


# ---- the soak ------------------------------------------------------------------------------------------

def soak_plan(duration_s: float, num_learners: int, *, kill_every_s: float, seed: int,
              start_after_s: float = DRAWN_START_AFTER_S, margin_s: float = DRAWN_MARGIN_S) -> FaultPlan:
    """Process kills at random for a soak run (`ddiloco chaos --soak`): gaps between kills exponential with mean
    `kill_every_s`, within [start_after_s, duration_s - margin_s], each a `kill -9` of a learner (restarted at
    once by the supervisor) or of the syncer (`syncer_crash`), the target uniform over the M learners and the
    syncer. One seeded generator: the same arguments give the same plan."""
    if not (math.isfinite(kill_every_s) and kill_every_s > 0):
        raise invalid("kill_every_s", kill_every_s, "seconds > 0")
    if not (isinstance(num_learners, int) and num_learners >= 1):
        raise invalid("num_learners", num_learners, "an integer >= 1")
    if not duration_s - margin_s > start_after_s:
        raise ValueError(f"duration_s={duration_s!r} is invalid: expected more than {start_after_s + margin_s:g} s "
                         "(start-up and the final margin)")
    rng = np.random.default_rng(seed)
    faults = []
    t = start_after_s
    while (t := t + rng.exponential(kill_every_s)) <= duration_s - margin_s:
        target = int(rng.integers(num_learners + 1))
        faults.append(Fault(at_s=float(t), kind="syncer_crash") if target == num_learners
                      else Fault(at_s=float(t), kind="crash", target=target, restart=True))
    arguments = {"duration_s": duration_s, "num_learners": num_learners, "kill_every_s": kill_every_s,
                 "seed": seed, "start_after_s": start_after_s, "margin_s": margin_s}
    return FaultPlan(duration_s=duration_s, num_learners=num_learners, faults=tuple(faults), seed=seed,
                     source="soak", model=arguments)


__all__ = ["KINDS", "SYNCER", "TIMED_KINDS", "VALUE_KEYS", "Fault", "FaultPlan", "load_plan", "model_plan",
           "quick_plan", "soak_plan"]
