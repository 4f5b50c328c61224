"""The `ddiloco` command: argument parsing, logging setup and dispatch to each layer's commands.

The only module that reads `sys.argv` or configures logging. Each layer owns its subcommands in a
`commands` module exposing `add_parser(subparsers)` and `run(args) -> int`; argument errors and
invalid configs end with one clear line on stderr and exit code 2, never a traceback, and so does a
Ctrl-C at any point from the first import of a command on (exit code 130).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ddiloco import interrupts
from ddiloco.exit_status import EXIT_USAGE

COMMAND_MODULES = (
    "ddiloco.plan.commands",
    "ddiloco.runtime.run_commands",
    "ddiloco.runtime.process_commands",
    "ddiloco.sim.commands",
    "ddiloco.chaos.commands",
    "ddiloco.transport.commands",
)
"""Each registers its subcommands; imports inside them stay lazy so `ddiloco --help` is quick."""



class _Version(argparse.Action):
    """`ddiloco --version`: the package's version and the wire schema its processes speak, which every process of one
    run must share (a process of another schema is refused as `bad_schema`). The schema is read when asked for: its
    module imports torch."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show the version and the wire schema, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from ddiloco.build_info import build_id
        from ddiloco.messages import SCHEMA_VERSION

        print(f"ddiloco {build_id()} (wire schema {SCHEMA_VERSION})")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: resilient, low-communication distributed pre-training.")
    parser.add_argument("--version", action=_Version)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        known = set(subparsers.choices)
        module.add_parser(subparsers)
        for command in set(subparsers.choices) - known:
            subparsers.choices[command].set_defaults(handler=module.run)
    _name_own_parsers(parser)
    return parser


def _name_own_parsers(parser: argparse.ArgumentParser) -> None:
    """Give each (sub)command's parser to what it parses as `command_parser`, the innermost one winning, so that an
    unknown flag is reported with that command's usage line, not the top-level one."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _name_own_parsers(sub)


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        stream=sys.stderr)


SCRIPT_COMMANDS = ("run",)
"""Commands that take a learner script after `--` (`ddiloco run [flags] -- python train.py ARGS`)."""


def main(argv: list[str] | None = None) -> int:
    with interrupts.watched():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    command = "ddiloco"
    try:
        # Building the parser imports every command's flags, torch among them: seconds in which a Ctrl-C
        # must end the command as quietly as one during the run.
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        script: list[str] | None = None
        if "--" in argv:
            cut = argv.index("--")
            argv, script = argv[:cut], argv[cut + 1:]
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        command = f"ddiloco {args.command}"
        if script is not None and args.command not in SCRIPT_COMMANDS:
            parser.error(f"`ddiloco {args.command}` takes no script after --")
        if script == []:
            parser.error("nothing after --: give the learner command, e.g. -- python train.py")
        args.script = script or []
        _configure_logging(args.verbose)
        if interrupts.received():  # a Ctrl-C during the imports that one of them swallowed (`ddiloco.interrupts`)
            raise KeyboardInterrupt
        try:
            return int(args.handler(args) or 0)
        except ValueError as exc:
            # Config validation names the field and the value; that line is the whole message.
            print(f"{command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or a SIGTERM or SIGHUP inside `interrupts.stop_signals_raise()`
        print(f"{command}: interrupted", file=sys.stderr)
        return interrupts.exit_code(interrupt)


if __name__ == "__main__":
    sys.exit(main())
