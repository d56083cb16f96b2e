"""JSON output shared by every subcommand (no torch import).

Every JSON document the CLI writes has the same envelope: ``"schema"`` (``hisparse-triton/
<command>``) and ``"schema_version"`` (an int, raised when a key changes meaning or goes
away; new keys do not raise it) come first, then the command's own keys. Every command takes
``--json PATH|-`` with one meaning: ``-`` (or a bare ``--json``) writes the document to stdout (the human report,
if any, then goes to stderr), a PATH is written atomically with normal file permissions
(``0644`` under the usual umask).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Mapping

from hisparse_triton.commands.argtypes import output_path_or_stdout
from hisparse_triton.fileio import write_atomically

#: Prefix of every schema name.
SCHEMA_PREFIX = "hisparse-triton/"


def json_document(command: str, version: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` under the common envelope: ``{"schema": "hisparse-triton/<command>",
    "schema_version": version, **payload}``."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"schema_version must be an int >= 1, got {version!r}.")
    return {"schema": SCHEMA_PREFIX + command, "schema_version": version, **payload}


def add_json_flag(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    """``--json PATH|-``: the flag every subcommand spells the same way."""
    parser.add_argument("--json", metavar="PATH|-", nargs="?", const="-", default=None,
                        type=output_path_or_stdout,
                        help=f"write {what} as JSON to PATH, or to stdout with '-' or no "
                             f"value (the human report then goes to stderr; default: no JSON)")


def report_stream(json_target: str | None):
    """Where the human-readable report goes: stderr when JSON takes stdout."""
    return sys.stderr if json_target == "-" else sys.stdout


def write_json(document: Mapping[str, Any], target: str) -> None:
    """Write ``document`` to ``target``: ``-`` for stdout, else a path replaced atomically.

    The file gets ``0666 & ~umask`` permissions (what ``open()`` would give), not the
    private ``0600`` of a temporary file.
    """
    text = json.dumps(document, indent=2, allow_nan=True) + "\n"
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_atomically(target, text, suffix=".json")


__all__ = ["SCHEMA_PREFIX", "add_json_flag", "json_document", "report_stream", "write_json"]
