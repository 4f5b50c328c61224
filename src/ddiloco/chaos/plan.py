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
units of `ddiloco.transport.link.parse_link` (`10mbit`, `1gb`). A YAML number with an exponent is a number
in every spelling (`1e3`, `1.0e3`, `1E+3`), as in YAML 1.2 and JSON, where PyYAML's YAML 1.1 would read
all but `1.0e+3` as text. Bounds: `duration` at most MAX_RUN_S (a week), each fault's too; a fault starts
before the plan's end; a latency at most the plan's duration, a bandwidth that sends 1 MB within it, a
straggler factor at most MAX_SLOWDOWN (`ddiloco.fault_control.value_bounds`); `seed` in 0..2**63 - 1. A
key given twice is refused, not overwritten. Faults are numbered from 0 in the order the file lists them,
and every error names the file, that number and the field.
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
from ddiloco.fault_control import MAX_RUN_S, value_expected
from ddiloco.fault_plan import KINDS, SYNCER, TIMED_KINDS, VALUE_KEYS, Fault, FaultPlan, check_fits, check_value
from ddiloco.transport.link import parse_link

_TIME_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "min": 60.0}
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
_LEARNER = re.compile(r"^learner-([0-9]+)$")
_FAULT_KEYS = {"at", "kind", "target", "duration", "restart", *VALUE_KEYS.values()}
_PLAN_KEYS = {"duration", "faults", "seed"}
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
"""A number with an exponent in any spelling; PyYAML's own float needs a dot and a signed exponent (1.0e+3)."""


class _DuplicateKey(ValueError):
    """A key given twice in one mapping of a plan file (YAML or JSON would silently keep the last)."""

    def __init__(self, key: Any, *, line: int | None = None, first_line: int | None = None) -> None:
        where = "" if line is None else f"line {line}: "
        first = "" if first_line is None else f" (first on line {first_line})"
        super().__init__(f"{where}key {key!r} appears twice in one mapping{first}: expected each key once")


class _PlanLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with numbers with an exponent read as numbers and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the safe loader's own error names it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _DuplicateKey(key, line=line, first_line=first)
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


# add_implicit_resolver copies the class's resolvers before adding, so yaml.SafeLoader itself is unchanged.
_PlanLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


# ---- the user format ----------------------------------------------------------------------------------

def parse_time_s(value: Any, what: str, *, positive: bool = False, max_s: float = math.inf) -> float:
    """A number of seconds, or a string with a unit: `200ms`, `20s`, `2min`; finite, >= 0 (> 0 if `positive`),
    at most `max_s`."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is invalid: expected seconds or a time such as 20s, 200ms, 2min")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _TIME.match(str(value).lower())
        if match is None or match.group(2) not in _TIME_UNITS:
            raise ValueError(f"{what} {value!r} is invalid: expected seconds or a time such as 20s, 200ms, 2min")
        seconds = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if not (math.isfinite(seconds) and (seconds > 0 if positive else seconds >= 0) and seconds <= max_s):
        at_most = "" if max_s == math.inf else f" and at most {max_s:g} s" + (" (a week)" if max_s == MAX_RUN_S else "")
        raise ValueError(f"{what} {value!r} is invalid: expected a time {'>' if positive else '>='} 0{at_most}")
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


def fault_from_user(entry: Any, *, run_s: float = MAX_RUN_S, run: str = "") -> Fault:
    """One entry of the user format's `faults` list, in a run of `run_s` seconds, which bounds its parameter
    (`run` names where `run_s` came from). Errors name the field, not the position."""
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
                         f"expected {value_expected(kind, run_s, run=run)}")
    if kind in VALUE_KEYS:
        check_value(kind, None if value is None else float(value), run_s, run=run)
    restart = entry.get("restart", True)
    if not isinstance(restart, bool):
        raise ValueError(f"restart {restart!r} is invalid: expected true or false")
    if "target" not in entry and kind != "syncer_crash":
        raise ValueError(f"target is missing for {kind}: expected learner-N or N")
    return Fault(at_s=parse_time_s(entry["at"], "at"), kind=kind, target=parse_target(entry.get("target"), kind),
                 duration_s=parse_time_s(entry.get("duration", 0), "duration", max_s=MAX_RUN_S), restart=restart,
                 value=None if value is None else float(value))


def _text_hint(value: Any) -> str:
    """Why text that reads as a number is not one: a plan's loader reads every unquoted number as a number (an
    exponent included), so it was quoted."""
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return " (it is text in quotes: write the number without them, such as 3 or 1.5e3)"


def _duration_given(duration_s: float) -> float:
    """A duration given instead of the plan's (`--duration`): seconds > 0, at most MAX_RUN_S."""
    if not (isinstance(duration_s, int | float) and math.isfinite(duration_s) and 0 < duration_s <= MAX_RUN_S):
        raise ValueError(f"--duration {duration_s:g} is invalid: expected seconds > 0 and at most {MAX_RUN_S:g} "
                         "(a week)")
    return float(duration_s)


def load_plan(path: str | Path, num_learners: int, *, duration_s: float | None = None) -> FaultPlan:
    """Read and validate a user plan for a run of `num_learners` learners (see the module docstring), run for
    the file's duration or, if given, `duration_s` instead (`--duration`: errors then name that flag)."""
    path = Path(path)
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the fault plan ({exc.strerror or exc})") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_PlanLoader)  # noqa: S506 (a safe loader)
        elif path.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=_json_object)
        else:
            raise ValueError(f"{name}: unknown plan format {path.suffix!r}: expected .yaml, .yml or .json")
    except _DuplicateKey as exc:
        raise ValueError(f"{name}: {exc}") from exc
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: expected a mapping with duration and faults at the top")
    _reject_unknown_keys(data, _PLAN_KEYS, where=f"{name}: ")
    if "duration" not in data:
        raise ValueError(f"{name}: duration is missing: expected how long each system runs, e.g. duration: 120s")
    try:
        file_duration_s = parse_time_s(data["duration"], "duration", positive=True, max_s=MAX_RUN_S)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    if duration_s is None:
        duration_s, run = file_duration_s, f"the plan's duration of {file_duration_s:g}s"
    else:
        duration_s = _duration_given(duration_s)
        run = f"--duration {duration_s:g}s"
    # The one range every seed of a run takes (run_config imports torch: only when a file is read).
    from ddiloco.run_config import MAX_SEED

    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name}: seed {seed!r} is invalid: expected an integer in 0..{MAX_SEED} (2**63 - 1)")
    entries = data.get("faults")
    if entries is None:  # no key, or `faults:` with nothing after it
        entries = []
    if not isinstance(entries, list):
        raise ValueError(f"{name}: faults is invalid: expected a list of faults (or none: []), not {entries!r}")
    faults = []
    for index, entry in enumerate(entries):
        where = f"{name}, fault {index}"
        try:
            fault = fault_from_user(entry, run_s=duration_s, run=run)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        check_fits(fault, num_learners, duration_s, where, run=run)
        faults.append(fault)
    try:
        return FaultPlan(duration_s=duration_s, num_learners=num_learners, faults=tuple(faults), seed=seed,
                         source=str(path))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


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


def quick_plan(num_learners: int, *, seed: int = 0, duration_s: float | None = None) -> FaultPlan:
    """The `--quick` plan: 40 s per system (or `duration_s`: `--duration`), one fault of each kind that fits,
    over by 32 s."""
    if not (isinstance(num_learners, int) and num_learners >= 2):
        raise ValueError(f"num_learners={num_learners!r} is invalid for the quick plan: expected >= 2 "
                         "(one learner must stay up while another is down)")
    faults = tuple(Fault(at_s=at, kind=kind, target=None if slot is None else slot % num_learners,
                         duration_s=duration, restart=restart, value=value)
                   for at, kind, slot, duration, restart, value in _QUICK)
    if duration_s is not None:
        duration_s = _duration_given(duration_s)
        for index, fault in enumerate(faults):
            check_fits(fault, num_learners, duration_s, f"the --quick plan, fault {index}",
                       run=f"--duration {duration_s:g}s")
    return FaultPlan(duration_s=QUICK_DURATION_S if duration_s is None else duration_s, num_learners=num_learners,
                     faults=faults, seed=seed, source="quick")


# ---- the failure model --------------------------------------------------------------------------------

DRAWN_START_AFTER_S = 10.0
"""A drawn plan (failure model, soak) injects nothing in its first seconds: start-up is set-up."""
DRAWN_MARGIN_S = 10.0
"""...nor in its last ones: the margin leaves time to see the last recovery."""
DEFAULT_VALUES = {"straggler": 3.0, "latency": 0.2, "bandwidth": 1.25e6, "drop": 0.5, "corrupt": 0.5}
"""Parameters of drawn faults other than crash: 3x slower, 200 ms, 10 Mbit/s, half the messages."""
DOWN_KINDS = ("crash", "hang")
"""Drawn kinds that stop a learner contributing; at most max_down_at_once of them overlap."""


def _check_drawn_duration(duration_s: float) -> None:
    """Before drawing: a run of 1e30 s would draw faults for ever before the plan could refuse its duration."""
    if not (isinstance(duration_s, int | float) and math.isfinite(duration_s) and 0 < duration_s <= MAX_RUN_S):
        raise invalid("duration_s", duration_s, f"seconds > 0 and at most {MAX_RUN_S:g} (a week)")


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
    _check_drawn_duration(duration_s)
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
    _check_drawn_duration(duration_s)
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
