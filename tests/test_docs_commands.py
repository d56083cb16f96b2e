"""Every ``hisparse-triton`` command shown in README.md and docs/*.md is a valid command line,
the files the documented commands write are ignored by git, and the blocks marked to run
(``<!-- docs-test: run -->`` on the line before a ```bash block) run as written.

The marked blocks run in an empty temporary folder, on the CPU, one command after the other
(a later command may read what an earlier one wrote, as a reader would run them). Every other
block's commands run the same way at small size (``SMALL``: a few hundred rows, the tiny
preset, one kernel group), except those that need CUDA or a GPU result, which say so; each
must exit 0 and write the files it names. The example scripts' documented commands run in
``tests/test_tiny_dsa.py``."""

from __future__ import annotations

import json
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


needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="needs git and a git checkout")


def _ignored(path: str) -> bool:
    """Whether git ignores ``path`` (relative to the checkout; it need not exist)."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                          capture_output=True).returncode == 0


@needs_git
def test_documented_output_files_are_ignored():
    outputs = _outputs()
    assert len(outputs) >= 5
    for where, path in outputs:
        assert _ignored(path), f"{where}: `{path}`, written by a documented command, is not " \
                               f"in .gitignore"


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


# ------------------------------------------------------------ what documented commands leave


def _documented_python_outputs() -> list[tuple[str, str]]:
    """Files written by the documented ``python bench/...`` commands whose output is a
    positional argument (``bench_resolve.py OUT.json``)."""
    out = []
    for path in DOC_FILES:
        for line, commands, _ in bash_blocks(path):
            for command in commands:
                if not command.startswith("python"):
                    continue
                words = shlex.split(command)
                if len(words) > 2 and words[1] == "bench/bench_resolve.py":
                    out.append((f"{path.relative_to(ROOT)}:{line}", words[2]))
    return out


@needs_git
@pytest.mark.parametrize("path", ["hisparse_triton-0.1.0-py3-none-any.whl",
                                  "dist/hisparse_triton-0.1.0.tar.gz", "build/lib/x.py",
                                  "hisparse_triton.egg-info/PKG-INFO"])
def test_what_pip_wheel_and_build_write_is_ignored(path):
    assert _ignored(path), f"`{path}` (written by pip wheel . / python -m build) is not in " \
                           f".gitignore"


@needs_git
def test_what_documented_scripts_write_is_ignored():
    outputs = _documented_python_outputs()
    assert outputs, "the docs no longer show bench/bench_resolve.py"
    for where, path in outputs:
        assert _ignored(path), f"{where}: `{path}`, written by a documented command, is not " \
                               f"ignored"


def test_bench_resolve_reports_progress(monkeypatch, tmp_path, capsys):
    """``python bench/bench_resolve.py OUT.json`` compiles for a minute or more: it says what
    it does first and prints a line per compile (the compile itself is faked here)."""
    import json

    import bench_resolve
    from hisparse_triton.compile import report

    def compile_report(arch, groups, widths, small_host, progress=None):
        for width in widths:
            progress(f"resolve K={width}: _resolve_kernel")
        return {"arch": f"sm_{arch}", "triton": "x",
                "launches": [{"variant": f"resolve K={w}"} for w in widths]}

    monkeypatch.setattr(report, "compile_report", compile_report)
    out = tmp_path / "model.json"
    assert bench_resolve.main([str(out), "2048,4096"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("bench_resolve: compiling every resolve variant at top-k "
                               "2048, 4096 for sm_90")
    assert "compiling launch 1: resolve K=2048" in lines[1]
    assert "compiling launch 2: resolve K=4096" in lines[2]
    assert len(json.loads(out.read_text())["variants"]) == 2
    assert captured.out.startswith(f"wrote {out}: 2 variants in ")
    assert bench_resolve.main([]) == 2 and "usage:" in capsys.readouterr().err


def _commented_bash_lines(path: Path) -> list[tuple[int, str, str]]:
    """``(line, command, comment)`` of every command inside a ```bash block: ``\\``
    continuations joined, the comments of its lines kept apart."""
    out, inside, start, command, comment = [], False, 0, "", ""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = text.strip()
        if stripped.startswith("```"):
            inside = stripped.startswith("```bash") and not inside
            continue
        if not inside or not stripped or stripped.startswith("#"):
            continue
        code, _, note = text.partition(" # ")
        start = start or number
        command, comment = f"{command} {code.strip()}", f"{comment} {note.strip()}"
        if command.endswith("\\"):
            command = command[:-1]
            continue
        out.append((start, command.strip(), comment.strip()))
        start, command, comment = 0, "", ""
    return out


def test_heavy_documented_bench_commands_state_their_memory():
    """A documented ``bench`` line whose CPU sweep needs more than ``LARGE_RUN_BYTES`` of RAM
    (the command prints its estimate first) says how much in its comment."""
    import torch

    from hisparse_triton.benchmarks.settings import host_memory_estimate
    from hisparse_triton.commands import bench

    heavy = []
    for path in DOC_FILES:
        for number, command, comment in _commented_bash_lines(path):
            first = re.split(r"\||&&", command)[0].split()
            if first[:1] == [] or not first[0].endswith("hisparse-triton") \
                    or first[1:2] != ["bench"]:
                continue
            words = shlex.split(" ".join(first))
            args = build_parser().parse_args(words[1:])
            if args.decode_step:
                continue
            need = host_memory_estimate(bench.settings_from_args(args, torch.device("cpu")))
            if need["total"] >= bench.LARGE_RUN_BYTES:
                heavy.append((f"{path.relative_to(ROOT)}:{number}", " ".join(words), comment))
    assert len(heavy) >= 3
    for where, command, comment in heavy:
        assert re.search(r"\d GiB", comment), f"{where}: `{command}` needs over 1 GiB of RAM " \
                                              f"on a CPU and its line does not say so"


# ------------------------------------------------------- every documented command, run small
#: The suffix that runs a documented command of each subcommand at small size (argparse takes
#: the last value of a repeated flag, so these win over the documented ones).
SMALL = {
    "bench": ["--device", "cpu", "--rows", "256", "--warmup-ms", "1", "--rep-ms", "1"],
    "simulate": ["--preset", "tiny", "--requests", "2", "--output-len", "16"],
    "metrics": ["--preset", "tiny", "--requests", "2", "--output-len", "16"],
    "compile-report": ["--kernels", "vllm"],   # 3 launches: a few seconds
    "advise": [],
    "tune": [],
}
#: Documented commands that cannot run without CUDA: ``(words that mark it, reason)``.
NEEDS_CUDA = [
    (("bench", "--decode-step"), "times a whole decode step on a GPU"),
]
#: Documented commands that need a file no command of their block writes.
NEEDS_INPUT = [
    (("advise", "--bench-json"), "reads a GPU `bench --json` result (CPU results are refused)"),
]


def small_command(argv: str) -> tuple[list[str], str | None]:
    """The documented ``argv`` at small size, and why it cannot run here (``None``: it can).
    A trace replay keeps the recorded run's settings; ``--serve`` takes a free port and stops
    once the workload is done; ``tune`` runs only as ``--dry-run`` without CUDA."""
    import torch

    words = shlex.split(argv)
    command = words[0]
    for marks, reason in NEEDS_INPUT:
        if words[0] == marks[0] and all(mark in words for mark in marks[1:]):
            return words, reason
    if not torch.cuda.is_available():
        for marks, reason in NEEDS_CUDA:
            if words[0] == marks[0] and all(mark in words for mark in marks[1:]):
                return words, f"needs CUDA: {reason}"
        if command == "tune" and "--dry-run" not in words:
            return words, "needs CUDA: tunes launch parameters on a GPU"
    small = [] if "--trace" in words else list(SMALL[command])
    if "--serve" in words:
        words[words.index("--serve") + 1] = "0"
        small += ["--duration", "0"]
    return [*words, *small], None


def _written_by(words: list[str]) -> list[str]:
    """The files a command line says it writes (``--json PATH``, ``--plot``, ``--record``)."""
    return [words[i + 1] for i, word in enumerate(words[:-1])
            if word in OUTPUT_FLAGS and words[i + 1] != "-" and not words[i + 1].startswith("-")]


def _json_to_stdout(words: list[str]) -> bool:
    """Whether ``--json`` is bare or ``-`` (the JSON goes to stdout)."""
    if "--json" not in words:
        return False
    value = words[words.index("--json") + 1:][:1]
    return value in ([], ["-"]) or value[0].startswith("-")


#: One runner per doc block: imports once, then each command in a forked child with its
#: output in a log; ``{index: exit status}`` on stdout as JSON.
COMMAND_RUNNER = """
import json, os, signal, sys
import torch, hisparse_triton.runtime  # noqa: F401 - warm imports
from hisparse_triton.cli import main
jobs, timeout, results = json.loads(sys.argv[1]), int(sys.argv[2]), {}
for index, job in enumerate(jobs):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1); os.dup2(err, 2)
            signal.alarm(timeout)
            code = main(job["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    results[index] = os.waitstatus_to_exitcode(status)
print(json.dumps(results))
"""
COMMAND_TIMEOUT_S = 120
UNMARKED = [(f"{path.relative_to(ROOT)}:{line}", commands)
            for path in DOC_FILES for line, commands, marked in bash_blocks(path)
            if not marked and any(c.split()[0].endswith("hisparse-triton") for c in commands)]


@pytest.mark.slow
@pytest.mark.parametrize("where, commands", UNMARKED, ids=[w for w, _ in UNMARKED])
def test_documented_block_runs_at_small_size(where, commands, tmp_path):
    """Every ``hisparse-triton`` command of a ```bash block (the marked blocks run as written
    above) runs at small size on the CPU, in order in one folder, exits 0 and writes the files
    it names; bare ``--json`` prints JSON on stdout (with the key a documented ``jq`` reads)."""
    jobs, checks, skipped = [], [], []
    for command in commands:
        first, _, pipe = command.partition("|")
        if not first.split()[0].endswith("hisparse-triton"):
            continue
        words, reason = small_command(" ".join(first.split()[1:]))
        if reason:
            skipped.append(f"`{first.strip()}` ({reason})")
            continue
        index = len(jobs)
        jobs.append({"argv": words, "out": str(tmp_path / f"{index}.out"),
                     "err": str(tmp_path / f"{index}.err")})
        checks.append((first.strip(), words, pipe.strip()))
    if not jobs:
        pytest.skip("; ".join(skipped))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", COMMAND_RUNNER, json.dumps(jobs),
                           str(COMMAND_TIMEOUT_S)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60 + COMMAND_TIMEOUT_S * len(jobs))
    assert done.returncode == 0, f"the command runner failed:\n{done.stderr[-3000:]}"
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    for index, (command, words, pipe) in enumerate(checks):
        out = Path(jobs[index]["out"]).read_text(encoding="utf-8", errors="replace")
        err = Path(jobs[index]["err"]).read_text(encoding="utf-8", errors="replace")
        small = f"`{command}` (run as `hisparse-triton {shlex.join(words)}`)"
        assert statuses[str(index)] == 0, \
            f"{where}: {small} exited {statuses[str(index)]}:\n{err[-2000:]}"
        for path in _written_by(words):
            assert (tmp_path / path).is_file() and (tmp_path / path).stat().st_size > 0, \
                f"{where}: {small} did not write {path}"
            if path.endswith(".json"):
                json.loads((tmp_path / path).read_text(encoding="utf-8"))
        if _json_to_stdout(words):
            payload = json.loads(out)
            key = re.match(r"jq\s+'\.(\w+)", pipe)
            if key:
                assert key.group(1) in payload, f"{where}: {small} has no {key.group(1)!r}"
    if skipped:
        print("not run here:", "; ".join(skipped))
