"""The promises a chaos run checks after the fact, from the files the processes left behind.

Each check returns `(ok, detail)`; the detail carries counts and, on failure, the first few cases
that break the promise, so a report can say what went wrong without a debugger. The checks read a
system directory of a chaos run (a normal `ddiloco run` directory plus `chaos/`; formats in
`ddiloco.chaos.analysis`) and never trust one log alone: the round log, the syncer's events, the
learners' work ledgers and the syncer's final state must tell one story.

- no_committed_round_lost_or_repeated: rounds 0..N-1 once each, every fragment's versions 1, 2, ...,
  commit events that match the log, and a final syncer state holding all N rounds.
- global_equals_replay: the final global parameters equal, bit for bit, the replay of the whole
  round log from the seed's initial model (`ddiloco.syncer.replay_rounds`).
- every_update_merged_or_rejected_with_reason: every publish reaches a verdict (or died with its
  learner), every accepted update is merged exactly once (or discarded at a clean stop, or died with
  its syncer), every rejection has a reason.
- no_fresh_learner_became_global_source: the global model comes from the seed once and from the
  syncer's durable state afterwards; learners publish only on top of a Welcome; no round merges an
  update based on a version newer than the one it replaces.
- no_process_left_behind: every process the chaos runner started was gone after the stop.
- rounds_kept_committing: the run did not fail (the syncer gave up, or the soak's watchdog saw no round
  commit for its limit); the detail gives the longest gap between commits.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from ddiloco.chaos.analysis import DATA_PARALLEL
from ddiloco.checkpoint import load_latest_state, read_json, read_jsonl
from ddiloco.round_log import RoundLog
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import STATE_DIR, replay_genesis

EXAMPLES = 3
"""How many unexplained cases a detail names (the counts say how many there were)."""
RUNTIME_CHECKS = ("no_committed_round_lost_or_repeated", "global_equals_replay",
                  "every_update_merged_or_rejected_with_reason", "no_fresh_learner_became_global_source",
                  "no_process_left_behind", "rounds_kept_committing")
DATA_PARALLEL_CHECKS = ("no_process_left_behind",)

Result = tuple[bool, str]


def _examples(cases: list[str]) -> str:
    return "; ".join(cases[:EXAMPLES]) + (f"; ... {len(cases) - EXAMPLES} more" if len(cases) > EXAMPLES else "")


def _syncer_incarnations(system_dir: Path) -> list[list[dict[str, Any]]]:
    """The syncer's events cut at each "start"; an incarnation without "stopped" was killed hard."""
    incarnations: list[list[dict[str, Any]]] = []
    for event in read_jsonl(system_dir / "syncer" / "metrics.jsonl"):
        if "event" not in event:
            continue
        if event["event"] == "start" or not incarnations:
            incarnations.append([])
        incarnations[-1].append(event)
    return incarnations


def _killed(incarnation: list[dict[str, Any]]) -> bool:
    return not any(e.get("event") in ("stopped", "end") for e in incarnation)


def _learner_incarnations(system_dir: Path) -> dict[int, list[list[dict[str, Any]]]]:
    out: dict[int, list[list[dict[str, Any]]]] = {}
    learners = system_dir / "learners"
    for learner_dir in sorted(learners.iterdir()) if learners.is_dir() else []:
        if not learner_dir.name.isdigit():
            continue
        incarnations: list[list[dict[str, Any]]] = []
        for event in read_jsonl(learner_dir / "work.jsonl"):
            if event.get("event") == "start" or not incarnations:
                incarnations.append([])
            incarnations[-1].append(event)
        out[int(learner_dir.name)] = incarnations
    return out


def _publish_key(event: dict[str, Any]) -> tuple[int, int, int]:
    return int(event.get("fragment", -1)), int(event.get("base_version", -1)), int(event.get("inner_step", -1))


def no_committed_round_lost_or_repeated(system_dir: str | Path) -> Result:
    system_dir = Path(system_dir)
    rounds = RoundLog(system_dir).lines()
    problems = []
    numbers = [int(r["round"]) for r in rounds]
    if numbers != list(range(len(rounds))):
        repeated = sorted(n for n, c in Counter(numbers).items() if c > 1)
        missing = sorted(set(range(max(numbers, default=-1) + 1)) - set(numbers))
        problems.append(f"round numbers not 0..{len(rounds) - 1} once each (repeated {repeated[:EXAMPLES]}, "
                        f"missing {missing[:EXAMPLES]})")
    versions: dict[int, list[int]] = defaultdict(list)
    for r in rounds:
        versions[int(r["fragment"])].append(int(r["version"]))
    for fragment, seen in sorted(versions.items()):
        if seen != list(range(1, len(seen) + 1)):
            problems.append(f"fragment {fragment} versions {seen[:8]} do not rise by one per round")
    logged = {int(r["round"]): (int(r["fragment"]), int(r["version"])) for r in rounds}
    incarnations = _syncer_incarnations(system_dir)
    commits = [e for inc in incarnations for e in inc if e.get("event") == "commit"]
    event_rounds = Counter(int(e["round"]) for e in commits)
    mismatched = [f"commit event of round {e['round']} (fragment {e['fragment']}, version {e['version']})"
                  for e in commits if logged.get(int(e["round"])) != (int(e["fragment"]), int(e["version"]))]
    repeated_events = sorted(n for n, c in event_rounds.items() if c > 1)
    if mismatched:
        problems.append(f"{len(mismatched)} commit events not in rounds.jsonl: {_examples(mismatched)}")
    if repeated_events:
        problems.append(f"rounds committed twice by events: {repeated_events[:EXAMPLES]}")
    # A syncer killed between making a round durable and logging its event leaves one round without
    # an event; more than one per hard kill is a lost event.
    silent = sorted(set(logged) - set(event_rounds))
    kills = sum(1 for inc in incarnations if _killed(inc))
    if len(silent) > kills:
        problems.append(f"{len(silent)} rounds without a commit event but only {kills} syncer kills: "
                        f"{silent[:EXAMPLES]}")
    latest = load_latest_state(system_dir / STATE_DIR)
    state_rounds = None if latest is None else latest[2]
    if state_rounds != len(rounds):
        problems.append(f"the final syncer state holds {state_rounds} rounds, the log {len(rounds)}")
    detail = (f"{len(rounds)} rounds, {len(versions)} fragments, {len(commits)} commit events, "
              f"{len(silent)} rounds without an event, {kills} syncer kills, final state at {state_rounds}")
    return not problems, detail + ("" if not problems else ": " + "; ".join(problems))


def global_equals_replay(system_dir: str | Path) -> Result:
    system_dir = Path(system_dir)
    try:
        records = list(RoundLog(system_dir).records())
    except (ValueError, OSError) as exc:
        return False, f"the round log cannot be replayed: {exc}"
    latest = load_latest_state(system_dir / STATE_DIR)
    if latest is None:
        return False, f"no syncer state in {system_dir / STATE_DIR}"
    state, _, serial = latest
    if serial != len(records):
        return False, f"the final state is at round {serial}, the log holds {len(records)}: not comparable"
    config = RunConfig.load(system_dir / "config.json")
    replayed = replay_genesis(system_dir, config.diloco, records)
    final = state["global"]
    if set(final) != set(replayed):
        return False, f"parameter names differ: {sorted(set(final) ^ set(replayed))[:EXAMPLES]}"
    differing = [name for name, tensor in replayed.items() if not torch.equal(final[name], tensor)]
    if differing:
        return False, f"{len(differing)} of {len(replayed)} tensors differ from the replay of {len(records)} " \
                      f"rounds: {_examples(differing)}"
    return True, f"{len(replayed)} tensors equal bit for bit after replaying {len(records)} rounds"


def every_update_merged_or_rejected_with_reason(system_dir: str | Path) -> Result:
    """Counted, not matched one to one: a learner restarted from its checkpoint publishes the same
    (fragment, base version, inner step) again, and a syncer incarnation can only merge what it
    accepted itself, so updates are counted per key within each syncer incarnation."""
    system_dir = Path(system_dir)
    counts: Counter[str] = Counter()
    unexplained: list[str] = []
    syncer_incarnations = _syncer_incarnations(system_dir)
    accepted: Counter[tuple[int, tuple[int, int, int, int]]] = Counter()
    discarded: Counter[tuple[int, tuple[int, int, int, int]]] = Counter()
    accepted_keys: set[tuple[int, int, int, int]] = set()
    committed_by: dict[int, int] = {}
    for number, inc in enumerate(syncer_incarnations):
        for e in inc:
            kind = e.get("event")
            if kind in ("update", "discarded") and (kind == "discarded" or e.get("accepted")):
                key = (int(e["learner_id"]), int(e["fragment"]), int(e.get("base_version", -1)),
                       int(e["inner_step"]))
                (accepted if kind == "update" else discarded)[(number, key)] += 1
                accepted_keys.add(key)
            elif kind == "commit":
                committed_by[int(e["round"])] = number
            if kind == "rejection" or (kind == "update" and not e.get("accepted")):
                counts["syncer_rejections"] += 1
            elif kind == "rejections_suppressed":  # refused calls summed up per period (never an update's fate)
                counts["syncer_rejections"] += int(e.get("count", 0))
                if not e.get("reason"):
                    unexplained.append(f"syncer {kind} of learner {e.get('learner_id')} without a reason")

    for learner_id, incarnations in _learner_incarnations(system_dir).items():
        for number, events in enumerate(incarnations):
            killed = not any(e.get("event") == "end" for e in events)
            published = Counter(_publish_key(e) for e in events if e.get("event") == "publish")
            fated = Counter(_publish_key(e) for e in events if e.get("event") == "fate")
            counts["published"] += sum(published.values())
            for key, count in (published - fated).items():
                if killed:
                    counts["lost_with_learner"] += count
                else:
                    unexplained.append(f"learner {learner_id} (incarnation {number}) publish of fragment {key[0]} "
                                       f"at inner step {key[2]} has no fate")
            for key in fated - published:
                unexplained.append(f"learner {learner_id} (incarnation {number}) fate of fragment {key[0]} at "
                                   f"inner step {key[2]} without a publish")
            for fate in (e for e in events if e.get("event") == "fate"):
                key, outcome = _publish_key(fate), fate.get("fate")
                counts[f"fate_{outcome}"] += 1
                if outcome in ("rejected", "dropped") and not fate.get("reason"):
                    unexplained.append(f"learner {learner_id} {outcome} fate of fragment {key[0]} at inner step "
                                       f"{key[2]} without a reason")
                if outcome == "accepted" and (learner_id, key[0], key[1], key[2]) not in accepted_keys:
                    unexplained.append(f"learner {learner_id} update of fragment {key[0]} at inner step {key[2]} "
                                       "accepted by its fate but by no syncer update event")

    merged: Counter[tuple[int, tuple[int, int, int, int]]] = Counter()
    last_round: dict[int, set[tuple[int, int, int, int]]] = {}
    incarnation = 0
    for r in RoundLog(system_dir).lines():
        # A round whose commit event is missing (a kill between the fsync and the event line) was
        # committed by the incarnation that committed the round before it.
        incarnation = committed_by.get(int(r["round"]), incarnation)
        last_round[incarnation] = set()
        for p in r["participants"]:
            # A participant also names the learner's earlier updates it includes (Participant.folded).
            for base, step in [(p["base_version"], p.get("inner_step", -1)), *p.get("folded", ())]:
                key = (int(p["learner_id"]), int(r["fragment"]), int(base), int(step))
                merged[(incarnation, key)] += 1
                last_round[incarnation].add(key)
    # The update that closed an incarnation's last round may lack its "update" line when a kill came between the
    # round's fsync and that line (`SyncerService.commit` writes it right after): once per killed incarnation.
    unlogged_closer = {number: keys for number, keys in last_round.items() if _killed(syncer_incarnations[number])}
    for number, key in sorted(set(accepted) | set(merged) | set(discarded)):
        a, m, d = accepted[(number, key)], merged[(number, key)], discarded[(number, key)]
        counts["merged"] += min(m, a)
        counts["discarded"] += min(d, max(a - m, 0))
        lost = a - m - d
        described = f"learner {key[0]} update of fragment {key[1]} at inner step {key[3]}"
        if lost == -1 and key in unlogged_closer.get(number, ()):
            unlogged_closer.pop(number)
            counts["merged"] += 1
            counts["merged_as_the_syncer_was_killed"] += 1
        elif lost < 0:
            unexplained.append(f"{described}: accepted {a} time(s) by syncer incarnation {number} but merged {m} "
                               f"and discarded {d} time(s)")
        elif lost > 0 and _killed(syncer_incarnations[number]):
            counts["lost_with_syncer"] += lost
        elif lost > 0:
            unexplained.append(f"{described} accepted but neither merged, discarded, nor lost with a killed syncer")
    detail = ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "no updates"
    if unexplained:
        return False, f"{detail}; {len(unexplained)} unexplained: {_examples(unexplained)}"
    return True, detail


def no_fresh_learner_became_global_source(system_dir: str | Path) -> Result:
    system_dir = Path(system_dir)
    problems: list[str] = []
    committed = 0
    starts = 0
    for number, inc in enumerate(_syncer_incarnations(system_dir)):
        for e in inc:
            if e.get("event") == "start":
                starts += 1
                source, rounds = e.get("source"), int(e.get("rounds_committed", 0))
                expected = "init" if number == 0 else "checkpoint"
                if source is not None and source != expected:
                    problems.append(f"syncer start {number} from {source!r}, expected {expected!r}")
                if number == 0 and rounds != 0:
                    problems.append(f"the first syncer start already holds {rounds} rounds")
                if rounds < committed:
                    problems.append(f"syncer start {number} holds {rounds} rounds but {committed} were committed")
            elif e.get("event") == "commit":
                committed = max(committed, int(e["round"]) + 1)

    publishes = 0
    for learner_id, incarnations in _learner_incarnations(system_dir).items():
        for number, events in enumerate(incarnations):
            welcome: dict[str, Any] | None = None
            for e in events:
                if e.get("event") == "welcome":
                    welcome = e
                elif e.get("event") == "publish":
                    publishes += 1
                    fragment, base = int(e["fragment"]), int(e["base_version"])
                    if welcome is None:
                        problems.append(f"learner {learner_id} (incarnation {number}) published fragment "
                                        f"{fragment} at inner step {e.get('inner_step')} before any Welcome")
                    elif base < int(welcome["versions"][fragment]):
                        problems.append(f"learner {learner_id} (incarnation {number}) published fragment "
                                        f"{fragment} on base {base}, older than its Welcome's "
                                        f"{welcome['versions'][fragment]}")

    participants = 0
    for r in RoundLog(system_dir).lines():
        before = int(r["version"]) - 1
        for p in r["participants"]:
            participants += 1
            if int(p["base_version"]) > before:
                problems.append(f"round {r['round']} merged learner {p['learner_id']}'s update on base "
                                f"{p['base_version']} of fragment {r['fragment']}, which was at version {before}")
    detail = f"{starts} syncer starts, {publishes} publishes, {participants} round participants"
    if problems:
        return False, f"{detail}; {len(problems)} violations: {_examples(problems)}"
    return True, detail


def no_process_left_behind(system_dir: str | Path) -> Result:
    info = read_json(Path(system_dir) / "chaos" / "run.json")
    if not isinstance(info, dict):
        return False, f"{Path(system_dir) / 'chaos' / 'run.json'} is missing: nothing says the processes stopped"
    started, left = info.get("pids") or [], info.get("left_behind") or []
    if left:
        return False, f"{len(left)} of {len(started)} processes still alive after the stop: {left[:EXAMPLES * 3]}"
    return True, f"all {len(started)} processes gone after the stop"


def rounds_kept_committing(system_dir: str | Path) -> Result:
    info = read_json(Path(system_dir) / "chaos" / "run.json")
    if not isinstance(info, dict):
        return False, f"{Path(system_dir) / 'chaos' / 'run.json'} is missing"
    gap = info.get("longest_commit_gap_s")
    longest = f"longest gap between commits {gap:.1f} s" if isinstance(gap, int | float) else "gap not measured"
    if info.get("failure"):
        return False, f"the run failed: {info['failure']} ({longest})"
    return True, longest


CHECKS = {
    "rounds_kept_committing": rounds_kept_committing,
    "no_committed_round_lost_or_repeated": no_committed_round_lost_or_repeated,
    "global_equals_replay": global_equals_replay,
    "every_update_merged_or_rejected_with_reason": every_update_merged_or_rejected_with_reason,
    "no_fresh_learner_became_global_source": no_fresh_learner_became_global_source,
    "no_process_left_behind": no_process_left_behind,
}


def check_invariants(system_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{name: {"ok", "detail"}} of every check that applies to the system (data-parallel: processes only)."""
    system_dir = Path(system_dir)
    info = read_json(system_dir / "chaos" / "run.json") or {}
    is_dp = info.get("system", system_dir.name) == DATA_PARALLEL
    names = DATA_PARALLEL_CHECKS if is_dp else RUNTIME_CHECKS
    out = {}
    for name in names:
        ok, detail = CHECKS[name](system_dir)
        out[name] = {"ok": ok, "detail": detail}
    return out
