"""Every ``hisparse-triton`` command shown in README.md and docs/*.md is a valid command line,
the files the documented commands write are ignored by git, and the blocks marked to run
(``<!-- docs-test: run -->`` on the line before a ```bash block) run as written.

The marked blocks run in an empty temporary folder, on the CPU, one command after the other
(a later command may read what an earlier one wrote, as a reader would run them)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hisparse_triton.cli import UsageError, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- docs-test: run -->"
#: Flags whose value is a file the command writes.
OUTPUT_FLAGS = ("--json", "--plot", "--record")


def bash_blocks(path: Path) -> list[tuple[int, list[str], bool]]:
    """``(line, commands, marked)`` of every ```bash block: its commands (comments dropped,
    ``\\`` continuations joined) and whether the run mark precedes it."""
    out, block, start, marked, previous = [], None, 0, False, ""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = text.strip()
        if block is None:
            if stripped.startswith("```bash"):
                block, start, marked = [], number, previous.strip() == RUN_MARK
        elif stripped.startswith("```"):
            out.append((start, _join_continuations(block), marked))
            block = None
        else:
            block.append(text)
        previous = text if stripped else previous
    return out


def _join_continuations(lines: list[str]) -> list[str]:
    commands, current = [], ""
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        current += " " + line.strip()
        if current.endswith("\\"):
            current = current[:-1]
            continue
        commands.append(current.strip())
        current = ""
    return commands


def cli_commands() -> list[tuple[str, str]]:
    """``(where, argv text)`` of every ``hisparse-triton ...`` command of the docs (also after
    ``&&`` or a pipe, or called as ``.venv/bin/hisparse-triton``)."""
    found = []
    for path in DOC_FILES:
        for line, commands, _ in bash_blocks(path):
            for command in commands:
                for part in re.split(r"&&|\|", command):
                    words = part.split()
                    if words and words[0].endswith("hisparse-triton"):
                        found.append((f"{path.relative_to(ROOT)}:{line}",
                                      " ".join(words[1:])))
    return found


COMMANDS = cli_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 25
    assert {argv.split()[0] for _, argv in COMMANDS} >= {"simulate", "advise", "bench", "tune"}


#: Flags whose value must be an existing file when the flags are parsed.
INPUT_FLAGS = ("--trace",)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[f"{w} {a}"[:90] for w, a in COMMANDS])
def test_documented_command_parses(where, argv, tmp_path, monkeypatch):
    words = shlex.split(argv)
    monkeypatch.chdir(tmp_path)   # inputs an earlier documented command would have written
    for flag in INPUT_FLAGS:
        if flag in words[:-1]:
            (tmp_path / words[words.index(flag) + 1]).write_bytes(b"")
    try:
        build_parser().parse_args(words)
    except UsageError as exc:
        pytest.fail(f"{where}: `hisparse-triton {argv}` is not a valid command: {exc}",
                    pytrace=False)
    except SystemExit:  # --help / --version
        pass


def _outputs() -> list[tuple[str, str]]:
    out = []
    for where, argv in COMMANDS:
        words = shlex.split(argv)
        for flag in OUTPUT_FLAGS:
            if flag in words[:-1]:
                value = words[words.index(flag) + 1]
                if value != "-" and not value.startswith(("-", "/", "$")):
                    out.append((where, value))
    return out


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout")
def test_documented_output_files_are_ignored():
    outputs = _outputs()
    assert len(outputs) >= 5
    for where, path in outputs:
        rc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                            capture_output=True).returncode
        assert rc == 0, f"{where}: `{path}`, written by a documented command, is not in " \
                        f".gitignore"


MARKED = [(f"{path.relative_to(ROOT)}:{line}", commands)
          for path in DOC_FILES for line, commands, marked in bash_blocks(path) if marked]


def test_some_blocks_are_marked_to_run():
    assert len(MARKED) >= 1


@pytest.mark.parametrize("where, commands", MARKED, ids=[w for w, _ in MARKED])
def test_marked_block_runs(where, commands, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for command in commands:
        words = shlex.split(command)
        assert words[0].endswith("hisparse-triton"), f"{where}: only CLI commands run here"
        done = subprocess.run([sys.executable, "-m", "hisparse_triton", *words[1:]],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (f"{where}: `{command}` exited {done.returncode}:\n"
                                      f"{done.stderr[-2000:]}")
