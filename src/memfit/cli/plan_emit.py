"""`memfit plan ... --emit torchtitan|accelerate|lightning|deepspeed [--emit-to PATH]`: the chosen plan
as that framework's own config, and what of the plan the config cannot say.

    memfit plan MODEL --budget 8GiB --gpus 4 --emit deepspeed --emit-to ds_config.json
    memfit plan --from-plan PLAN.json --emit torchtitan          # a plan written by --json, no search

Without --emit-to the config goes to stdout (redirect it to a file) and the notes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memfit.core.errors import ConfigError
from memfit.integrations.emit_plan import TARGETS


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plans other frameworks carry out (docs/integrations.md, 'Plans as framework configs')")
    g.add_argument("--emit", choices=TARGETS, metavar="FRAMEWORK",
                   help=f"write the chosen plan as that framework's config: {', '.join(TARGETS)}; prints what of "
                   "the plan the config cannot express")
    g.add_argument("--emit-to", metavar="PATH", help="with --emit: the file to write (default: stdout)")
    g.add_argument("--from-plan", metavar="PLAN.json", help="with --emit: a plan written by `memfit plan --json` "
                   "(no search; no model or budget needed)")


def check_flags(args: argparse.Namespace) -> None:
    if (args.emit_to or args.from_plan) and not args.emit:
        raise ConfigError("--emit-to and --from-plan go with --emit FRAMEWORK (" + ", ".join(TARGETS) + ")")
    if args.emit and args.json:
        raise ConfigError("--emit writes a framework's config; --json the plan itself: give one")


def read_plan(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--from-plan {path}: no such file; write one with `memfit plan ... --json > {path}`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--from-plan {path} is not a plan JSON ({type(exc).__name__}: {exc}); write one with "
                          "`memfit plan ... --json`") from None


def emit_doc(doc: dict, args: argparse.Namespace, where: str = "the plan") -> int:
    """Write the framework's config of `doc` ({"plan": ..., "cluster": ...}) and name what it leaves out."""
    from memfit.integrations.emit_plan import emit, plan_view

    out = emit(plan_view(doc, where), args.emit)
    notes = [f"{args.emit} cannot express: {line}" for line in out.unexpressed] + out.extra
    if args.emit_to:
        path = Path(args.emit_to)
        if path.is_dir():
            raise ConfigError(f"--emit-to {path} is a folder; give a file name (e.g. {path}/config{out.suffix})")
        try:
            path.write_text(out.text)
        except OSError as exc:
            raise ConfigError(f"--emit-to {path}: cannot write it ({exc.strerror or exc})") from None
        print(f"wrote {args.emit} config: {path}")
        print("\n".join(f"  {n}" for n in notes) if notes else f"  {args.emit} expresses the whole plan")
        return 0
    sys.stdout.write(out.text)
    if notes:
        print("\n".join(notes), file=sys.stderr)
    return 0
