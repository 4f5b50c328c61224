"""Checks that a run directory can be used, made before any process starts, and the launcher's own records there.

Every process of a run writes there (config.json, logs, checkpoints, status files, the round log), so a
path that is a file, cannot be created or cannot be written is a user's mistake to report in one line at
once, not a traceback from whichever process writes first. So is a `--resume` of a run that is still going:
a second launcher would overwrite the first one's records and start a syncer that the first one's lock turns away.
What the files in it are is `run_paths.RunPaths`.

The launcher holds an exclusive flock on the directory itself for as long as it runs it (`claim_run_dir`), and
records two things for later commands: who runs the directory now (`launcher/processes.json`: its pid and the
kernel's start time of that pid, so a pid reused after the run ended is not taken for it), and the learner command
the run was last started with and how each learner was started (`launcher/command.json`: its ranks and devices,
`LAUNCH_SHAPE`, and whether it has an evaluator), which a `--resume` without `-- COMMAND` or those flags runs again.

A start that fails before any process of the run ran (Ray could not be started or joined, the syncer's command could
not be executed) puts the directory back as it found it (`before_start`, `undo_start`): a new run's directory was
refused by the same command again ("already exists and is not empty"), a `--resume` kept a config it never ran.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.checkpoint import atomic_write_bytes, atomic_write_json, read_json_object
from ddiloco.launcher_watch import process_start_time
from ddiloco.runtime.process_lock import DirectoryLock
from ddiloco.runtime.run_paths import RunPaths
from ddiloco.runtime.syncer_standby import SyncerLock
from ddiloco.runtime.syncer_state import GENESIS_FILE

if TYPE_CHECKING:
    from ddiloco.run_config import RunConfig

BUILT_IN_LEARNER = "the built-in TinyGPT learner"
"""How a run without a learner command is named in messages."""

PROBE_PREFIX = ".ddiloco-write-test-"
"""Name of the empty file written (and removed at once) to prove a directory can be written: permissions
alone do not say (root ignores them, a read-only mount does not show in them)."""


RUNS_DIR = Path("runs")
"""Where a command writes when it is not given a directory: `runs/<kind>-<timestamp>` (`fresh_dir`)."""


def fresh_dir(kind: str, *, flag: str) -> tuple[Path, Path]:
    """A new directory of this command's own under RUNS_DIR, created: `runs/KIND-<timestamp>`, or that name with `-2`,
    `-3`, ... where it is taken. `mkdir` refuses a name that exists, so commands started in the same second (a sweep
    started in a loop with `&`) each get their own: given one name, all but one `ddiloco run` would be refused ("choose
    another --run-dir", which they had not chosen) and two `ddiloco chaos` or `ddiloco experiment` would write into the
    same folder. Returns it and the outermost folder created (it, or RUNS_DIR too) for `before_start`. ValueError naming
    `flag` where it cannot be created."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    require_directory(RUNS_DIR, flag=flag)
    outermost = None if RUNS_DIR.is_dir() else RUNS_DIR
    for name in itertools.chain([f"{kind}-{stamp}"], (f"{kind}-{stamp}-{n}" for n in itertools.count(2))):
        path = RUNS_DIR / name
        try:
            path.mkdir(parents=True)
            return path, outermost or path
        except FileExistsError:
            continue
        except OSError as exc:
            raise ValueError(f"run directory {path} cannot be created ({exc.strerror or exc}): give a {flag}") from None
    raise AssertionError("itertools.count never ends")


def new_output_dir(given: Path | None, kind: str, *, flag: str) -> Path:
    """The folder a command that writes a new run of its own (`ddiloco chaos`, `ddiloco experiment`) writes to, made
    and proven writable: `given` when it is empty or missing, else `fresh_dir(kind)`. ValueError naming `flag`."""
    if given is None:  # a name no other command has, however many start in this second
        path = fresh_dir(kind, flag=flag)[0]
    else:
        path = given
        require_directory(path, flag=flag)
        require_empty(path, flag=flag)
    prepare_run_dir(path, flag=flag)
    return path


def require_empty(path: Path, *, flag: str, hint: str = "") -> None:
    """ValueError if the directory `path` holds anything: a new run's files would mix with another's. `hint` goes
    before the advice to choose another `flag`."""
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"run directory {path} already exists and is not empty: {hint}choose another {flag}")


def require_directory(path: Path, *, flag: str) -> None:
    """ValueError if `path` exists and is not a directory."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory: give a directory for the run (it is created "
                         f"if missing)")


def prepare_run_dir(path: Path, *, flag: str) -> None:
    """Create `path` if needed and prove it can be written; ValueError naming the directory otherwise."""
    require_directory(path, flag=flag)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"run directory {path} cannot be created ({exc.strerror or exc}): choose another "
                         f"{flag}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=path)
    except OSError as exc:
        raise ValueError(f"run directory {path} is not writable ({exc.strerror or exc}): every process of a run "
                         f"writes its logs, checkpoints and status there; make it writable or choose another "
                         f"{flag}") from None
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(probe)


# ---- a start that failed ----------------------------------------------------------------------------------------

REWRITTEN_AT_START = ("config.json", "launcher/command.json", "launcher/processes.json")
"""The files a start rewrites before any process runs: a failed start puts their bytes back."""
APPENDED_AT_START = ("launcher/metrics.jsonl", "logs")
"""The files (or every file in the folders) a start appends to before any process runs (its `run_started` event, the
line that opens a child's log): a failed start cuts them back to their length."""


@dataclass(frozen=True)
class RunDirBefore:
    """What a run directory held before this `ddiloco run` wrote to it (`before_start`)."""

    root: Path
    outermost_created: Path | None
    """The outermost folder the start creates (the run directory or one of its parents); None: the run directory was
    there."""
    paths: frozenset[Path]
    """Every path under the run directory."""
    rewritten: Mapping[Path, bytes]
    """The REWRITTEN_AT_START files there were, by path: their bytes."""
    lengths: Mapping[Path, int]
    """The APPENDED_AT_START files there were, by path: their length in bytes."""


def _put_back(before: RunDirBefore, paths: list[Path]) -> tuple[list[Path], list[str]]:
    """Write back each of `paths` whose bytes `before` holds (REWRITTEN_AT_START) and which differs now: those put
    back, and a line for each that could not be."""
    restored, left = [], []
    for path in paths:
        data = before.rewritten.get(path)
        try:
            if data is not None and (not path.is_file() or path.read_bytes() != data):
                atomic_write_bytes(path, data)
                restored.append(path)
        except OSError as exc:
            left.append(f"{path} ({exc.strerror or exc})")
    return restored, left


RUN_RECORDS = ("config.json", "launcher/command.json")
"""The records a start rewrites that say what the run is and how its processes start (`--resume` reads them)."""


def restore_run_records(before: RunDirBefore) -> str | None:
    """After a start whose syncer never served (it refused the run directory, so no learner ran): put RUN_RECORDS back
    as they were before it. Left rewritten with today's fields and flags by a refused upgrade, they are refused as
    unknown by the version that wrote the run: a run neither version opens (an upgrade probe). Returns the console's
    line; None when nothing was rewritten."""
    restored, left = _put_back(before, [before.root / name for name in RUN_RECORDS])
    if left:
        return f"the syncer never served, and what this start rewrote could not all be put back: {'; '.join(left)}"
    if not restored:
        return None
    names = [str(path.relative_to(before.root)) for path in restored]
    return (f"the syncer never served, so no learner ran: {' and '.join(names)} "
            f"{'is as it was' if len(restored) == 1 else 'are as they were'} before this start")


def before_start(run_dir: Path) -> RunDirBefore:
    """What `run_dir` holds now, before this start writes to it, for `undo_start`. Paths only, besides the few
    launcher records of REWRITTEN_AT_START: a resumed run's checkpoints are not read."""
    root = run_dir.absolute()
    outermost, folder = None, root
    while not folder.exists() and folder != folder.parent:
        outermost, folder = folder, folder.parent
    paths = frozenset(_tree(root)) if root.is_dir() else frozenset()
    rewritten = {root / name: (root / name).read_bytes() for name in REWRITTEN_AT_START if (root / name).is_file()}
    lengths = {path: path.stat().st_size for path in paths if path.is_file() and not path.is_symlink()
               and any(path == root / name or (root / name) in path.parents for name in APPENDED_AT_START)}
    return RunDirBefore(root, outermost, paths, rewritten, lengths)


def _tree(root: Path) -> list[Path]:
    """Every path under `root`, without following a link."""
    found = []
    for folder, dirs, files in os.walk(root):
        found += [Path(folder, name) for name in (*dirs, *files)]
    return found


def undo_start(before: RunDirBefore) -> list[str]:
    """Put the run directory back as `before` found it: remove every path this start created (the run directory and
    its parents too, where the start created them), put back the files it rewrote and cut back those it appended to.
    Nothing that was there is removed. Call it only while this launcher holds the directory (`claim_run_dir`): another
    `ddiloco run` in it could have created what it removes. Returns a line per path it could not put back."""
    left = []
    if before.root.is_dir():
        for folder, dirs, files in os.walk(before.root, topdown=False):
            for name in (*files, *dirs):
                path = Path(folder, name)
                if path in before.paths:
                    continue
                try:
                    if path.is_dir() and not path.is_symlink():
                        path.rmdir()
                    else:
                        path.unlink()
                except OSError as exc:
                    left.append(f"{path} ({exc.strerror or exc})")
    left += _put_back(before, list(before.rewritten))[1]
    for path, length in before.lengths.items():
        try:
            if path.stat().st_size > length:
                os.truncate(path, length)
        except OSError as exc:
            left.append(f"{path} ({exc.strerror or exc})")
    if before.outermost_created is not None and not left:
        try:
            before.root.rmdir()
        except OSError as exc:
            return [f"{before.root} ({exc.strerror or exc})"]
        for folder in before.root.parents:  # those the start created, while nothing else came into them
            if folder == before.outermost_created.parent:
                break
            try:
                folder.rmdir()
            except OSError:
                break
    return left


# ---- who runs the directory now ---------------------------------------------------------------------------------

def record_processes(paths: RunPaths, children: Mapping[str, list[int]]) -> None:
    """Write `launcher/processes.json`: this launcher (pid and start time) and every child pid it started so far."""
    pid = os.getpid()
    atomic_write_json(paths.processes, {"launcher_pid": pid, "launcher_started": process_start_time(pid),
                                        "children": dict(children)})


def claim_run_dir(run_dir: Path, *, resume: bool) -> DirectoryLock:
    """This launcher's hold on `run_dir`, until it releases it or exits: an exclusive flock on the directory itself,
    taken before `require_not_running` (for a `resume`), so that the check and the claim are one step. Two launchers
    started in the same instant both passed `require_not_running` before either had recorded its processes, and both
    ran. ValueError naming the launcher that holds it (or what `require_not_running` finds); nothing is written."""
    lock = DirectoryLock(run_dir)
    if not lock.try_acquire():
        launcher = _live_launcher(RunPaths(run_dir))
        if not resume:
            raise ValueError(f"run directory {run_dir} is in use: another ddiloco run"
                             f"{f' (pid {launcher})' if launcher else ''} started in it at the same time; choose "
                             "another --run-dir")
        # Its records name it once it has written them: a launcher that won the same instant may not have yet.
        raise ValueError(_still_going(run_dir, f"its launcher, ddiloco run pid {launcher}, is alive" if launcher else
                                      "another ddiloco run started on it in the same instant and holds it"))
    if resume:
        try:
            # A syncer serving it without a launcher. Not the launcher processes.json names: every launcher holds this
            # lock for its whole life, so one alive now runs another directory (this one a copy of its run's).
            require_not_running(run_dir, launcher=False)
        except ValueError:
            lock.release()
            raise
    return lock


def _live_launcher(paths: RunPaths) -> int | None:
    """The pid of the launcher `launcher/processes.json` records, while that process lives (the same pid and start
    time; not this process, which asks); else None."""
    processes = read_json_object(paths.processes) or {}
    pid, started = processes.get("launcher_pid"), processes.get("launcher_started")
    if isinstance(pid, int) and pid != os.getpid() and started is not None and process_start_time(pid) == started:
        return pid
    return None


def require_not_running(run_dir: Path, *, launcher: bool = True) -> None:
    """ValueError naming the live process when the run in `run_dir` is still going: its launcher (`ddiloco run`,
    from `launcher/processes.json`; not with `launcher=False`, for a caller that holds the directory's lock) or a
    syncer serving it (one holds `syncer.lock` for as long as it lives, however it was started). Files left by a run
    that ended, `kill -9` included, do not count: the recorded launcher pid must still name the same process (and not
    this one: a process that asks is not running a run, `ddiloco run` called again from Python), and the kernel releases
    a dead syncer's lock. A copy of a live run's directory names that run's launcher, which holds the original's lock,
    not the copy's: counted, it would keep the copy from being resumed while the original runs."""
    if launcher and (pid := _live_launcher(RunPaths(run_dir))) is not None:
        live = f"its launcher, ddiloco run pid {pid}, is alive"
    elif (lock := SyncerLock(run_dir)).held():
        live = f"its syncer, pid {lock.holder()}, holds {lock.path}"
    else:
        return
    raise ValueError(_still_going(run_dir, live))


def _still_going(run_dir: Path, live: str) -> str:
    return (f"--resume {run_dir}: the run is still going ({live}): stop it first (Ctrl-C where it runs, or kill it) "
            "and resume once it has ended")


# ---- the learner command ------------------------------------------------------------------------------------------

def _describe(script: Sequence[str]) -> str:
    """A learner command as a user typed it after `--`, or the built-in learner's name."""
    return shlex.join(script) if script else BUILT_IN_LEARNER


LAUNCH_SHAPE = {"nproc_per_learner": "--nproc-per-learner", "device": "--device", "threads": "--threads",
                "evaluate": "--evaluate", "round_files": "--round-files", "full_state_every": "--full-state-every",
                "checkpoint_every_s": "--checkpoint-every-s"}
"""The `ddiloco run` settings (`RunSettings` fields, by flag) that say how each learner is started, whether an
evaluator runs beside them and what the syncer and the learners keep: recorded beside its command, so that a
`--resume` without the flag starts the run's processes as it last ran them. A learner of 2 ranks resumed as one
process crash-looped in `init_process_group`, without RANK; a script run started with `--evaluate` resumed without its
evaluator; a run started with `--round-files all` would lose its early rounds' files at a plain `--resume`, one
started with `--full-state-every 10` went back to 100 (ten times the rounds' files kept on disk), and one with
`--threads 4` to the default (null in the record: the default, cores // learners, on the machine that resumes it)."""


def _shown(name: str, value: Any) -> str:
    """A LAUNCH_SHAPE setting as its flag: `--device cuda:0`, `--evaluate`, `--no-evaluate`."""
    flag = LAUNCH_SHAPE[name]
    if isinstance(value, bool):
        return flag if value else f"--no-{flag.removeprefix('--')}"
    return f"{flag} {value}"


def record_learner_command(paths: RunPaths, script: Sequence[str], shape: Mapping[str, Any]) -> dict[str, Any] | None:
    """Write `launcher/command.json`: the learner command the run starts with (empty: the built-in learner), the
    directory it was given in, where its relative paths mean what the user meant, and `shape`, the LAUNCH_SHAPE
    settings it starts with. Returns the record it replaced where that named another command or shape (None
    otherwise), for `restore_learner_command`."""
    before = read_json_object(paths.learner_command)
    record = {"command": list(script), "cwd": os.getcwd(), **{name: shape[name] for name in LAUNCH_SHAPE}}
    atomic_write_json(paths.learner_command, record)
    # The directory too: a resume from elsewhere whose relative paths then failed took the record of where they worked.
    if before is None or all(before.get(key) == record[key] for key in ("command", "cwd", *LAUNCH_SHAPE)):
        return None
    return before


def restore_learner_command(paths: RunPaths, replaced: Mapping[str, Any], script: Sequence[str]) -> str:
    """Put back the record `record_learner_command` replaced, when no learner ran with `script` (every one of the
    launch failed or was refused): a mistyped `-- COMMAND` on a `--resume` would otherwise be what the next `--resume`
    runs. Returns the line for the console."""
    atomic_write_json(paths.learner_command, dict(replaced))
    before = tuple(str(word) for word in replaced.get("command") or ())
    where = f" as given in {replaced['cwd']}" if replaced.get("cwd") not in (None, os.getcwd()) else ""
    return (f"no learner ran with {_describe(script)} (every one failed or was refused): the run keeps the command it "
            f"ran with before, {_describe(before)}{where}, for its next --resume")


def _recorded_launch(run_dir: Path) -> dict[str, Any] | None:
    """`launcher/command.json` (`record_learner_command`), or None for a run from before it was written. ValueError
    when it is there but damaged: a command that was a string ran as its letters, and a record that was not a JSON
    object was dropped without a word, with the run's --round-files all and evaluator."""
    path = RunPaths(run_dir).learner_command
    if not path.exists():
        return None
    record = read_json_object(path)
    command = record.get("command") if record is not None else None
    if not isinstance(command, list) or not all(isinstance(word, str) for word in command):
        problem = "not a JSON object" if record is None else "its command is not a list of strings"
        raise ValueError(f"--resume {run_dir}: {path} is damaged ({problem}): restore it from a backup, or remove it "
                         f"and give the learner command (-- python train.py) and its flags (--evaluate, --round-files, "
                         "...) again")
    return record


def resumed_launch_shape(run_dir: Path, given: Mapping[str, Any],
                         defaults: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The LAUNCH_SHAPE settings a `--resume` of `run_dir` takes from the run's record, and lines for the console:
    each one not `given` (a flag left out) is the run's recorded value, said when it is not the default; one given
    that differs from the record is used, and that is said. A run recorded before the shape was (or none recorded)
    takes the flags given and the defaults, but for its rounds' files: one that kept every round's file (round 0's is
    there) keeps them (`--round-files all`), as the version that started it did; the default removed them."""
    record = _recorded_launch(run_dir) or {}
    kept = {name: record[name] for name in LAUNCH_SHAPE if name not in given and name in record}
    notes = []
    if shown := [_shown(name, value) for name, value in kept.items() if value != defaults[name]]:
        notes.append(f"resuming with the run's {' '.join(shown)}")
    differ = [name for name, value in given.items() if name in record and record[name] != value]
    if differ:
        notes.append(f"resuming with {' '.join(_shown(name, given[name]) for name in differ)}, which "
                     f"differs from what the run last ran with: "
                     f"{' '.join(_shown(name, record[name]) for name in differ)}")
    if "round_files" not in record and "round_files" not in given and _kept_every_round(run_dir):
        kept["round_files"] = "all"
        notes.append("resuming with --round-files all: this run was started before ddiloco recorded its launch "
                     "settings, and it kept every round's file (give --round-files recent to keep only what a restart "
                     "needs)")
    return kept, tuple(notes)


def _kept_every_round(run_dir: Path) -> bool:
    """Whether the run's round log is not empty and round 0's file is still there."""
    from ddiloco.round_log import RoundLog

    log = RoundLog(run_dir)
    try:
        return log.path.stat().st_size > 0 and log.tensors_path(0).exists()
    except OSError:
        return False


def pruned_rounds_note(run_dir: Path) -> str | None:
    """A line for the console when a `--round-files all` resume cannot keep every round's file: the run ran with the
    default before, which removed the early ones (the round log is not empty, round 0's file is gone), so a replay from
    the genesis stays impossible; None otherwise. It said nothing, and the run recorded "all"."""
    from ddiloco.round_log import RoundLog

    log = RoundLog(run_dir)
    try:
        if log.path.stat().st_size == 0 or log.tensors_path(0).exists():
            return None
        kept = sorted(path.name for path in log.tensor_dir.glob("round_*.safetensors"))
    except OSError:
        return None
    since = f"from {kept[0].removesuffix('.safetensors')} on" if kept else "none"
    return (f"--round-files all keeps every round's file from now on, but this run ran with --round-files recent "
            f"before and removed the early ones (it holds {since}): a replay from the genesis is not possible")


def nothing_to_train_note(run_dir: Path, config: RunConfig) -> str | None:
    """A line for the console when a `--resume` has nothing to train: every learner's status says it is done at the
    run's budget or past it (the resume starts everything, and each learner is done at once); None otherwise."""
    from ddiloco.runtime.run_paths import RunPaths

    paths = RunPaths(run_dir)
    statuses = [read_json_object(paths.learner_status(i)) or {} for i in range(config.num_learners)]
    if not all(s.get("state") == "done" and isinstance(s.get("inner_step"), int) and
               s["inner_step"] >= config.inner_steps for s in statuses):
        return None
    return (f"every learner of this run is done at --inner-steps {config.inner_steps} or past it: this resume trains "
            "nothing (give a larger --inner-steps to train on)")


def resumed_learner_command(run_dir: Path, config: RunConfig, given: Sequence[str], *,
                            built_in: bool = False) -> tuple[tuple[str, ...], str | None]:
    """The learner command a `--resume` of `run_dir` runs, and a line for the console when it is not simply the one
    given: without `-- COMMAND` (or `built_in`, `--built-in-learner`: the built-in learner, given), the run's recorded
    command; with one that differs, the one given. A run written before commands were recorded keeps the one given,
    but one whose genesis shows a script's model is refused without `-- COMMAND` (it would otherwise start the
    built-in TinyGPT learner against the script's model)."""
    given = tuple(given)
    record = _recorded_launch(run_dir)
    if record is None:
        if not given and not built_in and _genesis_is_a_script_model(run_dir, config):
            raise ValueError(f"--resume {run_dir}: this run's model is not the built-in TinyGPT, so it was started "
                             f"with a learner command, which its directory does not record: give it again after --, "
                             f"e.g. ddiloco run --resume {run_dir} -- python train.py")
        return given, None
    recorded = tuple(str(word) for word in record.get("command") or ())
    if not given and not built_in:
        if not recorded:
            return (), None
        note = f"resuming with the run's command: {_describe(recorded)}"
        given_in = record.get("cwd")
        if given_in is not None and given_in != os.getcwd():
            note += f" (as given in {given_in}: its relative paths now start from {os.getcwd()})"
        return recorded, note
    if given != recorded:
        return given, (f"resuming with {_describe(given)}, which differs from the command the run last ran with: "
                       f"{_describe(recorded)}")
    return given, None


def _genesis_is_a_script_model(run_dir: Path, config: RunConfig) -> bool:
    """True when the run's genesis holds a parameter the built-in TinyGPT of `config` does not have. False without a
    readable genesis: then nothing tells (a damaged one is the syncer's to report)."""
    import torch
    from safetensors import SafetensorError, safe_open

    from ddiloco.model import build_model

    try:
        with safe_open(str(run_dir / GENESIS_FILE), "pt") as genesis:
            names = set(genesis.keys())
    except (OSError, SafetensorError):
        return False
    with torch.device("meta"):  # names only: no memory, no initialisation
        tinygpt = build_model(config.model)
    return not names <= set(tinygpt.state_dict())
