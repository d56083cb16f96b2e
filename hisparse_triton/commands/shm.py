"""``hisparse-triton shm``: list and remove shared host pools (no torch import).

A shared host pool is a file ``hisparse-NAME`` in ``/dev/shm`` (else the system temp dir)
that tp_rank 0 creates and unlinks when it closes. A rank 0 that was killed (``SIGKILL``, an
OOM kill, a crashed node agent) cannot unlink it, and the file keeps its RAM until someone
removes it. This command finds such *stale* pools (their creator process is gone):

- ``shm list``: every pool with its size, owner and mode (a pool is created 0600, or 0640 for
  a group; attaching ranks refuse any other), creator pid and state (``alive``, ``stale``, or
  ``unknown`` when its header cannot be read or it was created in another pid namespace);
- ``shm clean``: remove every stale pool (alive and unknown ones are left alone);
- ``shm clean --name NAME``: remove that pool; a live or unknown one only with ``--force``
  (processes that still map it keep their memory until they exit).

``--dir`` looks in another folder; ``--json PATH|-`` writes the result as JSON (schema
``hisparse-triton/shm``). Refusals and unknown names exit 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional

from hisparse_triton.commands.output import add_json_flag, json_document, report_stream, write_json

SCHEMA_VERSION = 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``shm list`` and ``shm clean``."""
    parser = subparsers.add_parser(
        "shm", help="list or remove shared host pools (stale ones left by a killed rank 0)",
        description="List the shared host pools of this node and remove stale ones (left "
                    "behind by a creating rank that was killed).")
    actions = parser.add_subparsers(dest="shm_action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="list pools: size, owner and mode, creator pid, "
                                              "alive or stale")
    clean = actions.add_parser("clean", help="remove stale pools, or one pool with --name")
    clean.add_argument("--name", default=None,
                       help="remove only this pool (the host_pool_name it was created with; "
                            "default: every stale pool)")
    clean.add_argument("--force", action="store_true",
                       help="with --name: remove the pool even if its creator is alive or "
                            "its state is unknown")
    for sub in (listing, clean):
        sub.add_argument("--dir", default=None, metavar="DIR",
                         help="folder of the pool files (default /dev/shm, else the temp dir)")
        add_json_flag(sub, "the pools")
    return parser


def _age(created_ns: int, now_ns: int) -> str:
    seconds = max(0, (now_ns - created_ns) // 1_000_000_000)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} B"


def _record(info: Any) -> dict[str, Any]:
    header = info.header
    return {"name": info.name, "path": info.path, "state": info.state,
            "file_bytes": info.file_bytes, "owner": info.owner,
            "owner_uid": info.owner_uid if info.owner_uid >= 0 else None,
            "group": info.group, "mode": f"{info.mode:04o}",
            "pool_bytes": header.data_bytes if header else None,
            "creator_pid": header.creator_pid if header else None,
            "created_unix": header.created_ns / 1e9 if header else None,
            "fingerprint": header.fingerprint if header else None,
            "error": info.error or None}


def _table(pools: list[Any]) -> list[str]:
    now = time.time_ns()
    rows = [("NAME", "POOL SIZE", "OWNER", "MODE", "CREATOR PID", "STATE", "AGE",
             "FINGERPRINT")]
    for info in pools:
        header = info.header
        rows.append((info.name, _size(header.data_bytes if header else info.file_bytes),
                     f"{info.owner}:{info.group}", f"{info.mode:04o}",
                     str(header.creator_pid) if header else "-", info.state,
                     _age(header.created_ns, now) if header else "-",
                     (header.fingerprint or "-") if header else info.error))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
            for row in rows]


def run(args: argparse.Namespace) -> int:
    """List or clean the pools; returns the exit status."""
    from hisparse_triton.worker import shared_pool
    from hisparse_triton.errors import SharedHostPoolError

    folder: str = args.dir if args.dir is not None else shared_pool.pool_dir()
    out = report_stream(args.json)
    removed: list[Any] = []
    try:
        if args.shm_action == "clean" and args.name is not None:
            removed.append(shared_pool.remove_pool(args.name, force=args.force, folder=folder))
        elif args.shm_action == "clean":
            if args.force:
                raise ValueError("--force removes one named pool: pass --name NAME too.")
            for info in shared_pool.list_pools(folder):
                if info.state == "stale":
                    removed.append(shared_pool.remove_pool(info.name, folder=folder))
        pools = shared_pool.list_pools(folder)
    except (SharedHostPoolError, FileNotFoundError, NotADirectoryError) as exc:
        raise ValueError(str(exc)) from None
    if args.shm_action == "list":
        if pools:
            print(f"shared host pools in {folder}:", file=out)
            for line in _table(pools):
                print(line, file=out)
        else:
            print(f"no shared host pools in {folder}", file=out)
    else:
        for info in removed:
            pid = info.header.creator_pid if info.header else "?"
            print(f"removed {info.name} ({info.state}, creator pid {pid}, "
                  f"{_size(info.file_bytes)}): {info.path}", file=out)
        if not removed:
            print(f"no stale shared host pools in {folder}", file=out)
        left = [info for info in pools if info.state != "alive"]
        for info in left:
            print(f"left {info.name}: state {info.state} ({info.error}); remove it with "
                  f"`hisparse-triton shm clean --name {info.name} --force`", file=out)
    if args.json is not None:
        payload: dict[str, Optional[Any]] = {"action": args.shm_action, "dir": folder,
                                             "pools": [_record(info) for info in pools]}
        if args.shm_action == "clean":
            payload["removed"] = [_record(info) for info in removed]
        write_json(json_document("shm", SCHEMA_VERSION, payload), args.json)
    sys.stdout.flush()
    return 0
