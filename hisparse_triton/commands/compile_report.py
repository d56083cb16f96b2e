"""``hisparse-triton compile-report``: compile every kernel launch the runtime can make for
an NVIDIA (``sm_90``) or AMD (``gfx942``) architecture, on any machine (no GPU), and print
registers, spills, shared memory / LDS, instruction count and occupancy per launch
(``hisparse_triton.compile.report`` explains every column). Also
``python -m hisparse_triton.compile.report``."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Any, Optional, Sequence

from hisparse_triton.commands.output import (
    add_json_flag,
    json_document,
    report_stream,
    write_json,
)

def _arch(text: str) -> int | str:
    """``sm_90`` -> 90; an AMD target (``gfx942``, optionally with target-ID features such as
    ``gfx942:sramecc+``) stays a string."""
    text = text.strip()
    if re.fullmatch(r"gfx[0-9a-f]+(:[\w+-]+)*", text):
        return text
    m = re.fullmatch(r"sm_?(\d+)a?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--arch must look like sm_90 or gfx942, got {text!r}")
    return int(m.group(1))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``compile-report`` and its flags."""
    parser = subparsers.add_parser(
        "compile-report", help="compile every kernel launch for a GPU architecture (no GPU "
                               "needed): registers, spills, shared memory, occupancy",
        description="Compile every kernel launch of the runtime for an NVIDIA or AMD "
                    "architecture (no GPU needed) and report registers, spills, shared memory "
                    "/ LDS, instruction count and occupancy.")
    parser.add_argument("--arch", type=_arch, default=90,
                        help="target: sm_80 / sm_90 (default) / sm_100, or AMD gfx90a / gfx942 "
                             "/ gfx950")
    parser.add_argument("--kernels", default="resolve,copy,vllm,sglang",
                        help="comma-separated groups: resolve, copy, vllm (the vLLM plugin's "
                             "FP8 up-convert), sglang (the SGLang plugin's swap-in and copy); "
                             "default all")
    parser.add_argument("--widths", type=_ints, default=None,
                        help="resolve top-k widths (default 2048..32768, every width the config accepts)")
    parser.add_argument("--no-small-host", dest="small_host", action="store_false",
                        help="skip the resolve variants with a small host pool (int32 keys)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a launch fails to compile or spills to memory (CI)")
    add_json_flag(parser, "the report")
    return parser


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton compile-report``."""
    groups = [g for g in args.kernels.split(",") if g]
    from hisparse_triton.compile.report import GROUPS

    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ValueError(f"--kernels: unknown group(s) {bad}; expected {', '.join(GROUPS)}")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter hides the compiled kernels
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "hisparse_triton", "compile-report",
                                *_flags(args)], env=env)
    from hisparse_triton.compile.report import (
        RESOLVE_WIDTHS,
        compile_report,
        format_report,
    )

    stream = report_stream(args.json)
    widths = args.widths if args.widths is not None else list(RESOLVE_WIDTHS)
    payload = compile_report(args.arch, groups=groups, widths=widths,
                             small_host=args.small_host,
                             progress=lambda what: print(f"compiling {what}", file=sys.stderr))
    print(format_report(payload), file=stream)
    if args.json is not None:
        write_json(json_document("compile-report", 1, payload), args.json)
    status = _check(payload) if args.check else 0
    failed, line = verdict(payload)
    if (failed or not payload["launches"]) and not args.check:
        line += " (--check would exit 1)"
    print(line, file=stream)
    return status


def _check(payload: dict[str, Any]) -> int:
    """``--check``: 1 (with the failing launches on stderr) when a launch did not compile or
    spills to memory (``verdict``), or when no launch was recorded."""
    failed, _ = verdict(payload)
    for launch in failed:
        print(f"compile-report --check: {launch}", file=sys.stderr)
    return 1 if failed or not payload["launches"] else 0


def verdict(payload: dict[str, Any]) -> tuple[list[str], str]:
    """``(failing launches, the one-line verdict)`` of a report: a launch fails when it did
    not compile or spills to memory (NVIDIA stack / local bytes; AMD scratch or VGPR spills;
    SGPRs spilled into VGPR lanes cost no memory and do not fail)."""
    launches = payload["launches"]
    errors = [r for r in launches if r.get("error")]
    spills = [r for r in launches if not r.get("error") and r.get("spills")]
    failed = [f"{r['variant']}: {r['kernel']}: " + (r.get("error") or "spills to memory")
              for r in errors + spills]
    arch = payload.get("arch")
    if not launches:
        return failed, f"check: FAIL, no launch was recorded for {arch}"
    count = f"{len(launches)} launch{'es' if len(launches) != 1 else ''}"
    if not failed:
        return failed, f"check: PASS, {count} compiled for {arch}, no spills to memory"
    parts = [f"{len(errors)} did not compile" if errors else "",
             f"{len(spills)} spill to memory" if spills else ""]
    first = failed[0] + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
    return failed, (f"check: FAIL, {len(failed)} of {count} for {arch}: "
                    f"{', '.join(p for p in parts if p)}; first: {first}")


def _flags(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces ``args`` (for the run outside the interpreter)."""
    flags = ["--arch", args.arch if isinstance(args.arch, str) else f"sm_{args.arch}",
             "--kernels", args.kernels]
    if args.widths is not None:
        flags += ["--widths", ",".join(map(str, args.widths))]
    if not args.small_host:
        flags.append("--no-small-host")
    if args.check:
        flags.append("--check")
    if args.json is not None:
        flags += ["--json", args.json]
    return flags


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hisparse_triton.compile.report ...``: the same command."""
    from hisparse_triton.cli import main as cli_main

    return cli_main(["compile-report", *(sys.argv[1:] if argv is None else argv)])


