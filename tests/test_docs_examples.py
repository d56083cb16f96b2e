"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs on its own in a separate process, on the CPU, in an empty temporary folder,
without ``TRITON_INTERPRET`` (as a reader would paste it), with a timeout; a failure names
the file and the line of the block and shows the end of its output. To keep this fast, one
runner process imports torch and hisparse_triton once and forks a fresh child per block (a
block sees no other block's state). Signatures, shell commands and partial snippets belong
in ```text / ```bash / ```pycon blocks, which are not run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 180   # per block
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")

#: Blocks known not to run yet, by the SHA-256 of their text: each one is an expected
#: failure (strict: it fails the suite once it runs). When the owner of that file fixes or
#: re-fences the block, its text changes, the entry stops matching anything and the block is
#: an ordinary test again; drop the entry then.
KNOWN_BROKEN: dict[str, str] = {
    "85ac8da2c1e0131b6012afda51e0179bc62d286824f08bd2988873fe17eb9c4e":
        "docs/kernels.md 'Choosing the backend': a partial snippet (undefined tables)",
    "0cf24b64ace1d5751024ebe4c8287e769339900d335a802ac36c512259758c50":
        "docs/kernels.md: the copy_rows / copy_pages signatures fenced as python",
    "1b773e7efe579998af43eba6ba95a5c27e931d5c1822c0a6ec0a14b5e7f6d0c9":
        "docs/resolve.md: a resolve() call on undefined inputs",
}


@dataclass(frozen=True)
class Block:
    """One ```python block: ``line`` is the 1-based line of its first code line."""

    path: Path
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode("utf-8")).hexdigest()


def python_blocks(path: Path) -> list[Block]:
    """The ```python (or ```py) blocks of a Markdown file, in order."""
    blocks, fence, lang, start, lines = [], None, "", 0, []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(text.strip())
        if fence is None:
            if match:
                fence, lang, start, lines = match.group(1), match.group(2).lower(), number, []
        elif text.strip().startswith(fence) and text.strip().strip(fence[0]) == "":
            if lang in ("python", "py"):
                blocks.append(Block(path, start + 1, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(text)
    assert fence is None, f"{path.relative_to(ROOT)}:{start}: a code fence is never closed"
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in python_blocks(path)]


def _param(block: Block):
    marks = []
    if block.digest in KNOWN_BROKEN:
        marks.append(pytest.mark.xfail(reason=KNOWN_BROKEN[block.digest], strict=True))
    return pytest.param(block, id=block.where, marks=marks)


def test_the_readme_has_runnable_examples():
    readme = [block for block in ALL_BLOCKS if block.path.name == "README.md"]
    assert len(readme) >= 2 and any("HiSparseRuntime(" in block.code for block in readme)


def test_blocks_are_found_with_their_lines(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\na = 1\n```\n```bash\nls\n```\n````py\nb = 2\n```\n"
                   "````\n```text\nno\n```\n", encoding="utf-8")
    blocks = python_blocks(doc)
    assert [(b.line, b.code) for b in blocks] == [(3, "a = 1\n"), (9, "b = 2\n```\n")]


#: The runner: import the heavy modules once, then run each block in a forked child with its
#: own folder, output files and an alarm; write ``{where: exit status}`` as JSON.
RUNNER = """
import json, os, runpy, signal, sys, traceback
import torch, hisparse_triton.runtime, hisparse_triton.ops  # noqa: F401 - warm imports
jobs, timeout, results = json.loads(sys.argv[1]), int(sys.argv[2]), {}
for job in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            out = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1); os.dup2(out, 2)
            signal.alarm(timeout)
            runpy.run_path(job["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    results[job["where"]] = os.waitstatus_to_exitcode(status)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    """``{where: (exit status, output)}`` of every block, run once per test session."""
    base = tmp_path_factory.mktemp("doc-examples")
    jobs = []
    for index, block in enumerate(ALL_BLOCKS):
        folder = base / f"block{index}"
        folder.mkdir()
        # Pad with blank lines so that a traceback's line numbers are the doc file's.
        script = folder / f"{block.path.stem}_line{block.line}.py"
        script.write_text("\n" * (block.line - 1) + block.code, encoding="utf-8")
        jobs.append({"where": block.where, "script": str(script), "cwd": str(folder),
                     "log": str(base / f"block{index}.log")})
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs), str(TIMEOUT_S)],
                          cwd=base, env=env, capture_output=True, text=True,
                          timeout=60 + TIMEOUT_S * len(jobs))
    assert done.returncode == 0, f"the doc example runner failed:\n{done.stderr[-3000:]}"
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    return {job["where"]: (statuses[job["where"]],
                           Path(job["log"]).read_text(encoding="utf-8", errors="replace"))
            for job in jobs}


@pytest.mark.parametrize("block", [_param(block) for block in ALL_BLOCKS])
def test_doc_example_runs(block: Block, doc_runs):
    status, output = doc_runs[block.where]
    if status == -14:  # SIGALRM
        pytest.fail(f"{block.where}: the ```python block ran past {TIMEOUT_S} s", pytrace=False)
    if status != 0:
        pytest.fail(f"{block.where}: the ```python block exited {status} (line numbers below "
                    f"are {block.path.name}'s):\n{output[-3000:]}", pytrace=False)
