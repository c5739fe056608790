"""The `memfit` command. Each subcommand lives in its own module here with two functions:
`add_parser(subparsers)` and `run(args) -> int`.

Errors that are the user's (memfit.core.errors.MemfitError) print as one line and exit with code 2;
a run stopped by a signal exits with the shell's code for it (130 Ctrl-C, 143 SIGTERM).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys

from memfit.core.errors import MemfitError

# Commands that only print (and write the profile cache, closed when written): see main's end.
_PRINT_ONLY = {"estimate", "plan"}
# Subcommands in the order `memfit --help` lists them. A module that is not there yet is skipped.
SUBCOMMANDS = ["estimate", "plan", "profile", "train", "track", "export"]


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (what was wrong, where to look), exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit", description="Make PyTorch training fit in memory: explain, save, plan, prove."
    )
    from memfit import __version__

    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"memfit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"memfit.cli.{name}":
                continue
            raise
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


SILENT_EXIT_DELAY_S = 3.0
"""How long a rank that stays silent about a shared error waits before exiting (rank 0 prints it)."""


def _speaks(exc: MemfitError) -> bool:
    """Under torchrun every rank meets the same config error: rank 0 alone prints it. Other errors
    may be one rank's own: every rank prints those."""
    import os

    from memfit.core.errors import ConfigError

    if not isinstance(exc, ConfigError):
        return True
    return os.environ.get("RANK", "0") == "0"


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Under torchrun every rank meets the same usage error: rank 0 alone prints it (as _speaks)."""
    import contextlib
    import io
    import os

    if os.environ.get("RANK", "0") == "0":
        return parser.parse_args(argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        _let_rank_0_speak()
        raise


def _let_rank_0_speak() -> None:
    """A silent rank that exits first makes torchrun stop the others, rank 0 perhaps before it has
    printed the error they share: such a rank waits a moment before it exits."""
    import time

    time.sleep(SILENT_EXIT_DELAY_S)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own: under torchrun, it dies with torchrun's agent
        from memfit.distributed.lifeline import bind_to_launcher

        bind_to_launcher()
    try:
        parser = build_parser()  # imports torch: seconds, in which a Ctrl-C is one line too
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help, --version, or an argparse error (already printed as one line)
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    args._own_process = argv is None  # the `memfit` command: this process ends when the command does
    try:
        code = int(args._run(args) or 0)
    except MemfitError as exc:
        if _speaks(exc):
            print(f"memfit {args.command}: error: {exc}", file=sys.stderr)
        else:
            _let_rank_0_speak()
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C before training began, or the launcher before its ranks started
        print("memfit: interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)
    if argv is None and args.command in _PRINT_ONLY:
        # The process ends next. Its heap (torch, torch._dynamo, the traces) is moved out of the
        # collector's reach, so the interpreter's final collection does not walk it (most of a second).
        gc.freeze()
    return code
