"""Subcommands of the ``hisparse-triton`` CLI, one module each.

A command module exposes:

- ``add_parser(subparsers) -> argparse.ArgumentParser``: add its subparser (with ``help=``)
  and flags, return the subparser;
- ``run(args: argparse.Namespace) -> int``: do the work, return the exit status; raise
  ``ValueError`` with one clear sentence for bad input (the CLI prints it as one line).

Register it in ``hisparse_triton.cli.COMMAND_MODULES``. Keep module-level imports light (no
torch / triton): every command module is imported to build the parser, and ``plan`` must
start fast. Import heavy dependencies inside ``run``.
"""
