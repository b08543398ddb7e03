"""`dflash` command line: one subcommand per module in dflash/commands.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is imported only
when its command runs, so `dflash stats` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
import typing

from dflash.commands import CliError
from dflash.train.config import ConfigError
from dflash.train.versions import check_installed

# name -> (module under dflash.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a DFlash drafter (pipelined, instrumented)"),
    "eval": ("eval", "speculative decoding with a drafter: tau, acceptance, lossless check"),
    "export": ("export", "export a checkpoint in the reference (z-lab) drafter format"),
    "tune": ("tune", "short measured trials of the throughput settings, each chosen by the last one's verdict"),
    "stats": ("stats", "print the per-category summary of a telemetry.jsonl recording"),
    "data": ("data", "dataset tools: regenerate responses with the target, build the demo set"),
    "target": ("target", "target tools: build the built-in tiny target"),
}


# Commands that never import torch or transformers: no version check, no import cost.
TORCH_FREE = {"stats"}


class CommandParser(argparse.ArgumentParser):
    """A command's parser whose errors are one line naming `--help`: `dflash train`'s usage is some
    30 lines, which buried the one that said what was wrong."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists every flag)\n")


def unknown_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """`unknown flag --max-stesp; did you mean --max-steps?`: the closest flag the command has."""
    flag = next((a for a in unknown if a.startswith("-")), None)
    if flag is None:
        return f"unexpected argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}"
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, [o for o in parser._option_string_actions if o.startswith("--")], n=1)
    return f"unknown flag {name}" + (f"; did you mean {close[0]}?" if close else "")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    # Only the chosen command's module is imported (and its arguments registered).
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in COMMANDS:
        sub.choices[first] = p = CommandParser(prog=f"dflash {first}", description=COMMANDS[first][1])
        importlib.import_module(f"dflash.commands.{COMMANDS[first][0]}").add_arguments(p)
    parser.commands = sub.choices  # type: ignore[attr-defined]  # each command's parser, for its usage
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # the command's own flags, not the top level's: that is where the flag was expected
        command = parser.commands.get(args.command) or parser
        command.error(unknown_message(command, unknown))
    args.argv = list(argv)  # the command line as given, for commands that re-launch themselves
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(f"dflash.commands.{COMMANDS[args.command][0]}")
    try:
        if args.command not in TORCH_FREE:
            check_installed()
        return int(module.run(args) or 0)
    except (CliError, ConfigError) as e:
        print(f"dflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
