"""One form per setting: every command's flags are generated from the dataclasses that hold its settings, each
subcommand shows only the ones it uses, and a child process reads the settings `ddiloco run` gave it from the JSON
file the launcher wrote, unchanged. Bad values end in one line and exit code 2, before anything is written."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddiloco import cli
from ddiloco.chaos.runner import ChaosSettings
from ddiloco.flags import add_config_flags, config_from_args, field_docs, field_types, flag_fields, setting
from ddiloco.plan.commands import BANDWIDTH_CONFIGS, GOODPUT_CONFIGS
from ddiloco.run_config import RUN_FIELDS, SECTIONS, RunConfig, run_config_from_args
from ddiloco.runtime.launcher import Launcher
from ddiloco.runtime.process_settings import (
    EvaluatorSettings,
    LearnerSettings,
    SyncerSettings,
    save_settings,
    settings_argv,
    settings_from_args,
)
from ddiloco.runtime.run_commands import launch_config, run_settings_from_args
from ddiloco.runtime.run_settings import RunSettings

HELP = {"-h", "--help"}
LEARNER_SECTIONS = ("diloco", "learner", "inner", "model", "data")
EVALUATOR_SECTIONS = ("diloco", "model", "data")


def flags_of(cls: type, *, prefix: str = "", skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> set:
    """The flags a dataclass's fields make: one per field, and its --no- form for a bool."""
    flags = set()
    for flag, field in flag_fields(cls, prefix=prefix, skip=skip, only=only).items():
        flags.add(flag)
        if field_types(cls)[field.name][0] is bool:
            flags.add("--no-" + flag[2:])
    return flags


def run_config_flags(sections: tuple[str, ...] = tuple(SECTIONS), run_fields: tuple[str, ...] = RUN_FIELDS) -> set:
    flags = flags_of(RunConfig, only=run_fields) if run_fields else set()
    for name in sections:
        cls, prefix = SECTIONS[name]
        flags |= flags_of(cls, prefix=prefix)
    return flags


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser, by its words after `ddiloco`."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested:
            found[words] = parser
            return
        for name, child in nested[0].choices.items():
            walk(child, f"{words} {name}".strip())

    walk(cli.build_parser(), "")
    return found


EXPECTED = {
    "syncer": {"--settings"} | flags_of(SyncerSettings) | run_config_flags(),
    "learner": {"--settings"} | flags_of(LearnerSettings) | run_config_flags(LEARNER_SECTIONS),
    "evaluator": {"--settings"} | flags_of(EvaluatorSettings) | run_config_flags(EVALUATOR_SECTIONS, ()),
    "run": ({"--run-dir", "--resume", "--config", "--no-progress", "--json", "--ray", "--cpus-per-learner",
             "--gpus-per-learner"} | flags_of(RunSettings) | run_config_flags()),
    "chaos": ({"--plan", "--quick", "--soak", "--mtbi-per-chip", "--chips-per-learner", "--recovery-scale-s",
               "--crash-recovery", "--duration", "--plan-seed", "--kill-every-s", "--systems", "--run-dir", "--config",
               "--uptime-bin-s", "--cold-restarts", "--json"}
              | flags_of(ChaosSettings, skip=("warm_restarts",)) | run_config_flags()),
    "plan goodput": ({"--systems", "--sweep-chips", "--paper-grid", "--json", "--out", "--no-plot"}
                     | set().union(*(flags_of(cls, prefix=prefix) for cls, prefix, _ in GOODPUT_CONFIGS))),
    "plan bandwidth": ({"--json", "--out", "--no-plot"}
                       | set().union(*(flags_of(cls, prefix=prefix) for cls, prefix, _ in BANDWIDTH_CONFIGS))),
    "export": {"--out", "--dtype", "--from-learners"},
    "experiment": {"--quick", "--json", "--out", "--seed"},
    "token": {"--token-file", "--learner"},
}
"""Each command's flags: its dataclasses' fields, plus the few that are no dataclass's setting (paths, output)."""


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_each_command_has_the_flags_of_the_dataclasses_it_uses_and_no_other(command):
    parser = subcommands()[command]
    flags = {option for action in parser._actions for option in action.option_strings}
    assert flags - HELP == EXPECTED[command], (sorted(flags - HELP - EXPECTED[command]),
                                              sorted(EXPECTED[command] - flags))


def test_every_command_is_covered():
    assert set(subcommands()) == set(EXPECTED)


def test_a_learner_shows_no_syncer_only_setting_and_run_shows_the_algorithm():
    commands = subcommands()
    assert "--min-quorum" not in commands["learner"].format_help()
    assert "--grace" not in commands["learner"].format_help()
    assert "--min-quorum" not in commands["evaluator"].format_help()
    for command in ("run", "syncer", "chaos"):
        text = commands[command].format_help()
        assert "--min-quorum" in text and "--num-fragments" in text and "--inner-lr" in text


def test_each_process_says_which_token_its_token_file_holds():
    # The evaluator's help said "(a learner's own token, for a learner)": an evaluator takes the run token.
    helps = {command: next(a.help for a in subcommands()[command]._actions if a.dest == "token_file")
             for command in ("syncer", "learner", "evaluator")}
    assert "learner's own" not in helps["evaluator"] and "run token" in helps["evaluator"]
    assert "this learner's own token" in helps["learner"] and "run token" in helps["syncer"]


@pytest.mark.parametrize("cls", [SyncerSettings, LearnerSettings, EvaluatorSettings, RunSettings])
def test_every_setting_is_documented_where_it_is_declared_and_its_help_says_so(cls):
    # Fields inherited from ProcessSettings (--run-dir, --token-file, ...) keep their base class's docstrings.
    docs = field_docs(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)} and all(docs.values())
    parser = argparse.ArgumentParser()
    add_config_flags(parser, cls)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert all(helps[name].startswith(doc.replace("%", "%%")) for name, doc in docs.items())


# ---- ddiloco run -> settings file -> child ----------------------------------------------------------------

COMMAND = ("python", "-m", "ddiloco.cli")


def parsed(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def child_settings(argv: list[str], cls: type):
    """What the child started with `argv` reads: its own parser, its own settings_from_args."""
    assert argv[:len(COMMAND)] == list(COMMAND)
    return settings_from_args(cls, parsed(*argv[len(COMMAND):]))


def test_a_setting_given_to_ddiloco_run_reaches_each_child_unchanged(tmp_path):
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"x")
    args = parsed("run", "--learners", "2", "--threads", "3", "--checkpoint-every-s", "2.5", "--eval-every-s", "7",
                  "--link", "1gbit,5ms", "--device", "cuda:1,cpu", "--bind", "127.0.0.1:0", "--init", str(init),
                  "--min-quorum", "2")
    settings = run_settings_from_args(args)
    config = run_config_from_args(args)
    run_dir = tmp_path / "run"
    launcher = Launcher(launch_config(settings, config, run_dir, script=(), ray_options=None, command=COMMAND))
    address = "127.0.0.1:9"

    learner = child_settings(launcher.learner_argv(1, address), LearnerSettings)
    assert learner == launcher.learner_settings(1, address)
    assert (learner.threads, learner.checkpoint_every_s, learner.link, learner.device) == (3, 2.5, "1gbit,5ms", "cpu")
    assert (learner.syncer, learner.learner_id, learner.run_dir) == (address, 1, str(run_dir))
    assert learner.token_file == str(run_dir / "learners" / "1" / "token")  # its own token, not the run's
    assert child_settings(launcher.learner_argv(0, address), LearnerSettings).device == "cuda:1"

    evaluator = child_settings(launcher.evaluator_argv(address), EvaluatorSettings)
    assert (evaluator.every_s, evaluator.threads, evaluator.token_file) == (7.0, 3, str(run_dir / "token"))

    syncer = child_settings(launcher.syncer_argv("127.0.0.1:4000"), SyncerSettings)
    assert (syncer.bind, syncer.init, syncer.standby) == ("127.0.0.1:4000", str(init.resolve()), False)
    assert child_settings(launcher.syncer_argv("127.0.0.1:4000", standby=True), SyncerSettings).standby
    # The algorithm goes by the run's config.json, which every child is pointed at.
    assert {learner.config, evaluator.config, syncer.config} == {str(run_dir / "config.json")}


def test_the_manual_form_gives_the_same_settings_as_the_file_and_flags_override_the_file(tmp_path):
    settings = LearnerSettings(run_dir=str(tmp_path), syncer="h:1,h:2", learner_id=3, threads=2, device="cuda:0",
                               link="2.5gbit,40ms", checkpoint_every_s=0.5, status_every_s=0.25,
                               chaos_control=str(tmp_path / "chaos.json"), token_env="TOKEN")
    assert settings_from_args(LearnerSettings, parsed("learner", *settings_argv(settings))) == settings
    path = save_settings(tmp_path / "learner.json", settings)
    assert settings_from_args(LearnerSettings, parsed("learner", "--settings", str(path))) == settings
    overridden = settings_from_args(LearnerSettings, parsed("learner", "--settings", str(path), "--threads", "5",
                                                            "--device", "cpu"))
    assert overridden == dataclasses.replace(settings, threads=5, device="cpu")
    syncer = SyncerSettings(run_dir=str(tmp_path), allow_no_token=True, full_state_every=7)
    assert settings_from_args(SyncerSettings, parsed("syncer", *settings_argv(syncer))) == syncer


# ---- bad values -------------------------------------------------------------------------------------------

def write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("argv", "needle"), [
    (("learner", "--run-dir", "{run}", "--learner-id", "0"),
     "ddiloco learner: error: the following arguments are required: --syncer (or --settings FILE)"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "-1"),
     "ddiloco learner: error: --learner-id=-1 is invalid: expected an integer >= 0"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--checkpoint-every-s", "0"),
     "ddiloco learner: error: --checkpoint-every-s=0.0 is invalid: expected a finite number > 0 (seconds)"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--token-file", "t",
      "--token-env", "T"), "ddiloco learner: error: --token-env='T' is invalid"),
    (("evaluator", "--run-dir", "{run}", "--syncer", "h:1", "--every-s", "-1"),
     "ddiloco evaluator: error: --every-s=-1.0 is invalid: expected a finite number >= 0 (seconds)"),
    (("syncer", "--run-dir", "{run}", "--threads", "0"),
     "ddiloco syncer: error: --threads=0 is invalid: expected an integer >= 1"),
    (("syncer", "--settings", "{file:threads=0}"), "--settings {file}: threads=0 is invalid: expected an integer >= 1"),
    (("learner", "--settings", "{file:learner_id=\"1\"}"),
     '--settings {file}: learner_id = "1" is invalid: expected an integer (write it without quotes)'),
    (("learner", "--settings", "{file:min_quorum=2}"), "--settings {file}: unknown setting(s) min_quorum"),
    (("learner", "--settings", "{missing}"), "--settings {missing}: no such file"),
    (("run", "--run-dir", "{run}", "--checkpoint-every-s", "0"),
     "ddiloco run: error: --checkpoint-every-s=0.0 is invalid: expected a finite number > 0 (seconds)"),
    (("run", "--run-dir", "{run}", "--device", ","), "ddiloco run: error: --device=',' is invalid"),
    (("chaos", "--quick", "--run-dir", "{run}", "--dp-hang-timeout-s", "0"),
     "ddiloco chaos: error: --dp-hang-timeout-s=0.0 is invalid"),
    # An empty token flag (`--token-file "$TOKEN"` with TOKEN unset) served without authentication.
    (("syncer", "--run-dir", "{run}", "--token-file", ""),
     "ddiloco syncer: error: --token-file='' is invalid: expected the path of a file holding the token"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--token-env", " "),
     "ddiloco learner: error: --token-env=' ' is invalid: expected the name of an environment variable"),
    (("syncer", "--run-dir", "{run}", "--bind", "127.0.0.1:99999"),
     "ddiloco syncer: error: --bind='127.0.0.1:99999' is invalid: port 99999 outside 0..65535"),
    (("run", "--run-dir", "{run}", "--bind", "127.0.0.1:99999"),
     "ddiloco run: error: --bind='127.0.0.1:99999' is invalid: port 99999 outside 0..65535"),
    (("learner", "--run-dir", "{run}", "--syncer", "127.0.0.1:0", "--learner-id", "0"),
     "ddiloco learner: error: --syncer='127.0.0.1:0' is invalid: port 0 is where the syncer is told to pick a port"),
    (("evaluator", "--run-dir", "{run}", "--syncer", "garbage"),
     "ddiloco evaluator: error: --syncer='garbage' is invalid: expected HOST:PORT"),
    # An IPv6 address without brackets: retried as a host name ("Misformatted domain name") for 120 s, then exit 4.
    (("learner", "--run-dir", "{run}", "--syncer", "::1:51781", "--learner-id", "0"),
     "ddiloco learner: error: --syncer='::1:51781' is invalid: an IPv6 address goes in brackets, [::1]:51781"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--device", "bogus"),
     "ddiloco learner: error: --device='bogus' is invalid: expected a torch device"),
    (("run", "--run-dir", "{run}", "--device", "cpu,bogus"),
     "ddiloco run: error: --device='cpu,bogus' is invalid: expected a torch device"),
    # Accepted and without effect: a quorum no run of 2 learners reaches (the syncer caps it at the learners alive),
    # a fixed window for a run whose window is adaptive.
    (("run", "--run-dir", "{run}", "--learners", "2", "--min-quorum", "5"),
     "ddiloco run: error: --min-quorum 5 is more than the run's 2 learners"),
    (("syncer", "--run-dir", "{run}", "--grace-s", "5"),
     "ddiloco syncer: error: --grace-s 5.0 applies only with --grace fixed (this run's window is adaptive)"),
    # A mistyped directory started a new run there, with a warning in the log only (`ddiloco run --resume` refuses).
    (("syncer", "--run-dir", "{run}", "--resume"),
     "ddiloco syncer: error: --resume {run}: no run there (no config.json): check the path, or leave --resume out"),
    # The built-in learner's model is known: each learner failed at its start, and the run left a directory that
    # neither --resume (another --num-fragments) nor a new run (not empty) would take.
    (("run", "--run-dir", "{run}", "--num-fragments", "300"),
     "ddiloco run: error: the built-in model cannot be cut so: num_fragments=300 exceeds the 29 tensors of the "
     "model: every fragment needs at least one whole tensor (use --num-fragments 29 or fewer"),
    # The run directory is made once the flags are known to be good: it was made (with its parents) first.
    (("syncer", "--run-dir", "{run}", "--learners", "0"),
     "ddiloco syncer: error: --learners=0 is invalid"),
    (("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--inner-lr", "-1"),
     "ddiloco learner: error: --inner-lr=-1.0 is invalid"),
])
def test_a_bad_setting_is_one_line_and_exit_code_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    run_dir, missing = tmp_path / "run", tmp_path / "missing.json"
    file = tmp_path / "settings.json"
    base = {"run_dir": str(run_dir), **({"syncer": "h:1", "learner_id": 0} if argv[0] == "learner" else {})}
    words = []
    for word in argv:
        if word.startswith("{file:"):
            key, _, value = word[len("{file:"):-1].partition("=")
            word = str(write(file, {**base, key: json.loads(value)}))
        words.append(word.format(run=run_dir, missing=missing))
    code = cli.main(words)
    err = capsys.readouterr().err
    assert code == 2
    assert needle.format(file=file, missing=missing, run=run_dir) in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()


# ---- flags.py ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Example:
    name: str = setting(metavar="NAME")
    """required: no default"""
    count: int | None = None
    """optional int"""
    mode: str = setting("a", choices=("a", "b"))
    """one of two"""
    fast: bool = False
    """a switch"""
    size: int = setting(3, flag="--n")
    """its own flag name"""


def example_parser(**options) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Example, **options)
    return parser


def test_generated_flags_type_require_and_choose_from_the_dataclass():
    parser = example_parser()
    args = parser.parse_args(["--name", "x", "--count", "4", "--mode", "b", "--fast", "--n", "9"])
    assert config_from_args(Example, args) == Example(name="x", count=4, mode="b", fast=True, size=9)
    assert config_from_args(Example, parser.parse_args(["--name", "x"])) == Example(name="x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--count", "4"])  # --name is required
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x", "--mode", "c"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x", "--count", "four"])
    assert example_parser(enforce_required=False).parse_args([]).name is None  # a settings file may give it
    assert example_parser(keep_defaults=True).parse_args(["--name", "x"]).mode == "a"
    assert "NAME" in parser.format_help() and "(required)" in parser.format_help()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [
    ("run", "--run-dir", "{run}", "--device", "cuda"),
    ("learner", "--run-dir", "{run}", "--syncer", "h:1", "--learner-id", "0", "--device", "cuda:1"),
    ("evaluator", "--run-dir", "{run}", "--syncer", "h:1", "--device", "cuda"),
])
def test_a_gpu_this_machine_lacks_is_refused_before_anything_starts(tmp_path, capsys, argv):
    # It started, and each learner failed at its model's `.to("cuda")` (`ddiloco run`: a crash loop after 16 s,
    # leaving a run directory; by hand: a traceback).
    run_dir = tmp_path / "run"
    code = cli.main([word.format(run=run_dir) for word in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"ddiloco {argv[0]}: error: --device cuda" in err and "this machine has no CUDA device" in err, err
    assert not run_dir.exists()


def test_an_init_file_given_to_the_resume_of_a_run_that_has_its_genesis_is_refused(tmp_path, capsys):
    # The syncer ignored it, saying so in its log only: the run went on from its own genesis.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig().save(run_dir / "config.json")
    (run_dir / "genesis.safetensors").write_bytes(b"not read")
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"not read")
    before = sorted(p.name for p in run_dir.iterdir())
    assert cli.main(["run", "--resume", str(run_dir), "--init", str(init), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"ddiloco run: error: --init {init}: the run in {run_dir} has its initial parameters already "
            "(genesis.safetensors); --init starts a new run: leave it out of a --resume") in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.parametrize("command", ["run", "learner", "syncer", "evaluator", "export RUN --out m.safetensors",
                                     "plan goodput"])
def test_an_unknown_flag_gets_its_commands_usage_line(command, capsys):
    # `ddiloco run --bogus` printed the top-level `usage: ddiloco [-h] [--version] [-v] COMMAND ...`, which does not
    # say which flags `run` takes.
    argv = [*command.split(), "--bogus", "1"]
    command = " ".join(word for word in command.split() if word.isalpha() and word.islower())
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ddiloco {command} "), err
    assert err.endswith(f"ddiloco {command}: error: unrecognized arguments: --bogus 1\n"), err
