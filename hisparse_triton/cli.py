"""The ``hisparse-triton`` command line (also ``python -m hisparse_triton``).

Each subcommand is a module under ``hisparse_triton.commands`` exposing
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``; add one by
appending its module name to ``COMMAND_MODULES``. Command modules must not import torch at
module level (``plan`` has to start fast): import heavy dependencies inside ``run``.

Bad flags (argparse errors) exit 2, and a ``ValueError`` raised by a command (invalid
configuration, a plan that does not fit) exits 1; both print ONE line on stderr and no
traceback. ``hisparse-triton`` without a command prints the help and exits 0.

Conventions every command follows: ``--top-k`` (``--topk`` is a hidden alias), ``--json
PATH|-`` (``commands.output``: a bare ``--json`` or ``-`` writes to stdout, every document
carries ``schema`` and ``schema_version``), ``--seed`` in ``[0, 2**32 - 1]``, numbers out of
their plausible range rejected with the flag and the range named (``commands.argtypes``),
``--progress/--no-progress`` for one tqdm bar style with an ETA
(``benchmarks.progress``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn, Optional, Sequence

PROG = "hisparse-triton"

#: Subcommand modules, in ``--help`` order. Adding a command is one line here.
COMMAND_MODULES: tuple[str, ...] = (
    "hisparse_triton.commands.plan",
    "hisparse_triton.commands.simulate",
    "hisparse_triton.commands.bench",
    "hisparse_triton.commands.tune",
    "hisparse_triton.commands.shm",
    "hisparse_triton.commands.advise",
    "hisparse_triton.commands.metrics",
    "hisparse_triton.commands.compile_report",
)


class UsageError(Exception):
    """A bad command line (raised instead of argparse's print-usage-and-exit)."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, raised as ``UsageError``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, one subparser per module of ``COMMAND_MODULES``."""
    from hisparse_triton import __version__

    parser = _Parser(prog=PROG, description="Hierarchical sparse-attention KV offload "
                     "(HiSparse) on Triton: plan, run and measure.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=False,
                                       parser_class=_Parser)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(_one_line(exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:  # bare `hisparse-triton`: the help, not an error
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:
        print(f"{PROG} {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `hisparse-triton plan | head`: not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # keep the interpreter's final flush quiet
        return 0
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
