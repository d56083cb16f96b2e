"""An issue-cycle model of one CTA from its sm_90 SASS: a CPU-only estimate, not a timing.

``model_sass(text, num_warps=..., loop_trips=...)`` reads the disassembly of a cubin
(``cuobjdump -sass`` or, with source lines, ``nvdisasm -gi``) and estimates the cycles one CTA
(= one resolve row: one program per row, one row per SM) spends on an H200 SM. The model:

1. **Path.** The instructions from the entry to the first unconditional ``EXIT``. Code that
   ptxas places after it (cold paths reached only by a branch: the padding row of resolve) is
   not counted. Every forward branch before it is assumed to run both sides (conservative:
   an ``if`` costs its body). A launch whose programs all take an early return in a
   realistic batch (``loop_trips.EARLY_EXITS``: the hash resolve's fallback launch, no row
   flagged) is costed to its first ``EXIT``, predicated or not, with the full path beside
   it; every launch model says which path it counts (``path``).
2. **Loops.** A branch to an address at or before its own is a back edge; the instructions of
   ``[target, branch]`` run ``trips`` times. ``loop_trips`` maps the *source line* (``"path:line"``, or the line
   number alone) of the back-edge branch (``nvdisasm -gi`` line info; of an inlined ``@triton.jit``
   call, the innermost line, which Triton 3.9 follows with its call sites; ``loop_lines`` finds
   the line of a ``for`` statement in a kernel's source) to its trip count; a loop it does not name runs once and is
   listed in ``unmapped_loops``. Static SASS counts a loop body once; the dynamic trace this
   builds (loop bodies repeated) is what every figure below counts. Kernels whose hot loops
   are ``tl.static_range`` (unrolled: static = dynamic) need no trips.
3. **Classes** of each instruction (``classify``): ``alu`` (INT32 and IMAD: half rate on sm_90,
   16 lanes per SMSP, 2 cycles a warp instruction), ``fp`` (full rate), ``uniform`` (``U*``,
   ``S2UR``, ``R2UR``, ``ULDC``: the uniform datapath, one issue slot), ``shared`` (``LDS``,
   ``STS``, ``ATOMS``, ``LDSM``), ``shuffle`` (``SHFL``), ``global`` (``LDG``, ``STG``, ``ATOMG``,
   ``RED``, ...), ``barrier`` (``BAR``), ``branch`` (``BRA``, ``BSSY``, ``BSYNC``, ``EXIT``...),
   ``other`` (``S2R``, ``LDC``, ``VOTE``, ``REDUX``...). ``NOP`` is not counted.
4. **Throughput** of a barrier segment (the instructions between two ``BAR``), with the
   CTA's ``num_warps`` spread evenly over the SM's 4 SMSPs (``warps_per_smsp = num_warps / 4``):
   ``issue = instructions x warps_per_smsp`` (one issue per SMSP per cycle),
   ``alu = alu instructions x warps_per_smsp x 2``, ``mio = (shared + shuffle + global)
   instructions x num_warps x width`` (the SM's one shared/LSU path: one 32-bit warp access per
   cycle, 64-bit 2, 128-bit 4; scattered global accesses cost more in reality: not modelled).
   ``pipe = max(issue, alu, mio)``.
5. **Latency** of a segment: ``depth x MEM_LATENCY`` where ``depth`` is the longest chain of
   dependent global loads / value-returning atomics in the segment (register data flow over
   the trace: a load's result feeding the address of the next load adds one), plus
   ``BAR_CYCLES`` per ``bar.sync``. A segment costs ``max(pipe, depth x MEM_LATENCY)`` (warps
   hide latency behind other warps' issue, not behind their own dependent loads).
6. **Time.** ``cycles_per_row = sum over segments + barriers x BAR_CYCLES``; per call,
   ``waves x cycles_per_row / CLOCK_HZ`` with ``waves = ceil(R / (SMS x ctas_per_sm))``.
   Launch latency (a few us on a GPU, paid once per launch) is not included.

Constants (stated assumptions, H200 SXM): ``CLOCK_HZ`` = 1.98 GHz (the SM boost clock),
``SMS`` = 132, ``MEM_LATENCY`` = 500 cycles (between an L2 hit, ~270, and HBM, ~600: the
workspace tables are L2-resident, the state tensors often not), ``BAR_CYCLES`` = 24.
The model ranks variants of one kernel by the same number on any machine; it is not a
measurement (``bench/gpu_check.py`` times the variants on a GPU).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from hisparse_triton.compile.loop_trips import EARLY_EXITS, LOOP_TRIPS, MODEL_PATHS

__all__ = ["BAR_CYCLES", "CLOCK_HZ", "Instr", "MEM_LATENCY", "SMS", "classify", "loop_lines",
           "launch_model", "model_sass", "parse_sass", "sass_of_cubin"]

CLOCK_HZ = 1.98e9
SMS = 132
SMSPS = 4
MEM_LATENCY = 500
BAR_CYCLES = 24
ALU_CYCLES = 2  # INT32 / IMAD: 16 lanes per SMSP on sm_90

_ALU = frozenset("""IADD3 IADD IADD32I LOP3 LOP LOP32I SHF SHL SHR ISETP ICMP SEL LEA IMNMX VIMNMX
VIMNMX3 VIADD VIADDMNMX IABS FLO POPC BREV BMSK SGXT PRMT PLOP3 P2R R2P IMAD IMAD32I IMUL
IMUL32I XMAD MOV MOV32I IDP BFE BFI ISCADD LEA_HI I2I I2IP ISAD IMNMX3""".split())
_FP = frozenset("""FFMA FADD FMUL FMNMX FSEL FSETP FSET HFMA2 HADD2 HMUL2 DADD DMUL DFMA F2F
I2F F2I FRND MUFU FCHK FSWZADD""".split())
_SHARED = frozenset("LDS STS ATOMS LDSM STSM".split())
_SHUFFLE = frozenset(["SHFL"])
_GLOBAL = frozenset("LDG STG ATOMG ATOM RED REDG LD ST LDGSTS ATOMG LDL STL".split())
_RETURNS = frozenset("LDG ATOMG ATOM LD LDL".split())  # global accesses that return a value
_BRANCH = frozenset("BRA BRX JMP JMX CALL RET EXIT BSSY BSYNC WARPSYNC YIELD BREAK KILL".split())
_BARRIER = frozenset(["BAR"])
CLASSES = ("alu", "fp", "uniform", "shared", "shuffle", "global", "barrier", "branch", "other")

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FILE_LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
_INLINED_AT = re.compile(r'inlined at "([^"]*)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_REG = re.compile(r"\b(U?R\d+|U?P\d)\b(\.64|\.128)?")


@dataclass
class Instr:
    """One SASS instruction: address, opcode with modifiers, predicate, operands, branch
    target address (branches), source line (``nvdisasm -gi``), class."""

    addr: int
    opcode: str
    pred: str
    operands: list[str]
    target: Optional[int] = None
    line: Optional[int] = None
    cls: str = "other"
    file: Optional[str] = None

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def classify(opcode: str) -> str:
    """The class (see the module docstring) of a SASS opcode such as ``LDG.E.64``."""
    base = opcode.split(".")[0]
    if base in _BARRIER:
        return "barrier"
    if base in _BRANCH:
        return "branch"
    if base in _SHARED:
        return "shared"
    if base in _SHUFFLE:
        return "shuffle"
    if base in _GLOBAL:
        return "global"
    if base.startswith("U") or base in ("S2UR", "R2UR", "ULDC"):
        return "uniform"
    if base in _ALU:
        return "alu"
    if base in _FP:
        return "fp"
    return "other"


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_sass(text: str) -> list[Instr]:
    """The instructions of the first function in ``cuobjdump -sass`` / ``nvdisasm [-gi]`` text
    (``NOP`` dropped). Branch targets (hex addresses or ``.L_x_N`` labels) become addresses."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    line: Optional[int] = None
    file: Optional[str] = None
    caller: Optional[tuple[str, int]] = None  # the call site of the last inlined line read
    for raw in text.splitlines():
        m = _FILE_LINE.search(raw)
        if m:
            here = (m.group(1), int(m.group(2)))
            if here != caller:  # not the outer frame of an inlined line (Triton 3.9+)
                file, line = here
            at = _INLINED_AT.search(raw)
            caller = (at.group(1), int(at.group(2))) if at else None
            continue
        m = _LABEL.match(raw.strip())
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _LINE.match(raw)
        if not m:
            if instrs and "Function :" in raw:
                break  # a second function: stop
            continue
        addr, body = int(m.group(1), 16), m.group(2)
        caller = None
        for label in pending_labels:
            labels[label] = addr
        pending_labels = []
        pred = ""
        if body.startswith("@"):
            pred, _, body = body.partition(" ")
            body = body.strip()
        opcode, _, rest = body.partition(" ")
        if opcode == "NOP":
            continue
        instrs.append(Instr(addr, opcode, pred, _split_operands(rest), line=line,
                            cls=classify(opcode), file=file))
    for ins in instrs:
        if ins.base in ("BRA", "BSSY", "CALL", "JMP", "BRX"):
            for op in ins.operands:
                hexm = re.fullmatch(r"0x([0-9a-f]+)", op.strip())
                lab = re.search(r"(\.L_x_\d+)", op)
                if hexm:
                    ins.target = int(hexm.group(1), 16)
                elif lab and lab.group(1) in labels:
                    ins.target = labels[lab.group(1)]
    return instrs


def loop_lines(source_lines: Sequence[str], first_line: int,
               trips: Mapping[str, int]) -> dict[int, int]:
    """``{source line: trips}`` for a kernel whose source starts at line ``first_line``
    (``inspect.getsourcelines``): each key of ``trips`` is text of a ``for`` statement
    (e.g. ``"for c0 in range(0, K, SORT)"``); every line holding it gets its trip count."""
    out: dict[int, int] = {}
    for i, text in enumerate(source_lines):
        for pattern, n in trips.items():
            if pattern in text:
                out[first_line + i] = n
    return out


def _trace(instrs: list[Instr], loop_trips: Mapping[Any, int], early_exit: bool = False
           ) -> tuple[list[int], list]:
    """Indices of the dynamic trace (loops expanded) and the loops ``(addr, line, trips)``;
    with ``early_exit`` the path ends at the first ``EXIT``, predicated or not."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    end = len(instrs)
    for i, ins in enumerate(instrs):
        if ins.base == "EXIT" and (early_exit or not ins.pred):
            end = i + 1
            break
    loops, trips_at = [], {}
    for i, ins in enumerate(instrs[:end]):
        if ins.base == "BRA" and ins.target is not None and ins.target <= ins.addr \
                and ins.target in index:
            n = None
            if ins.line is not None:
                n = loop_trips.get(f"{ins.file}:{ins.line}", loop_trips.get(ins.line))
            loops.append((ins.addr, ins.line, n))
            trips_at[i] = max(1, n if n is not None else 1)
    trace: list[int] = []
    count: dict[int, int] = {}
    pc = 0
    while pc < end:
        trace.append(pc)
        if pc in trips_at:
            done = count.get(pc, 0) + 1
            if done < trips_at[pc]:
                count[pc] = done
                pc = index[instrs[pc].target]
                continue
            count[pc] = 0
        pc += 1
        if len(trace) > 20_000_000:
            raise ValueError("sass_model: trace over 20M instructions (check loop_trips)")
    return trace, loops


def _regs(operand: str) -> list[str]:
    regs = []
    for name, width in _REG.findall(operand):
        if name in ("RZ", "URZ", "PT", "UPT"):
            continue
        regs.append(name)
        if width and name[0] in "RU" and not name.startswith("UP"):
            base = re.match(r"(U?R)(\d+)", name)
            n = {".64": 2, ".128": 4}[width]
            regs += [f"{base.group(1)}{int(base.group(2)) + k}" for k in range(1, n)]
    return regs


def _width(opcode: str) -> int:
    if ".128" in opcode:
        return 4
    if ".64" in opcode:
        return 2
    return 1


_PRED_OPERAND = re.compile(r"^!?U?P(\d|T)$")


def _n_dest_operands(ins: Instr) -> int:
    """How many leading operands an instruction writes: none for stores, branches and
    barriers; else the first, plus the predicate outputs right after it (a carry ``P`` of
    ``LEA`` / ``IADD3``: up to 2; the second result of ``ISETP`` / ``PLOP3``: 1)."""
    if ins.cls in ("branch", "barrier") or ins.base in ("STG", "STS", "ST", "STL", "RED",
                                                         "REDG", "STSM"):
        return 0
    if not ins.operands or not _regs(ins.operands[0]) and ins.operands[0] not in ("PT",
                                                                                 "UPT"):
        return 0
    limit = 1 if ins.base.endswith("SETP") or ins.base.endswith("PLOP3") else 2
    n = 1
    while n <= limit and n < len(ins.operands) and _PRED_OPERAND.match(ins.operands[n]):
        n += 1
    return n


def _dests(ins: Instr) -> list[str]:
    """Registers an instruction writes (its leading result operands; a load writes as many
    consecutive registers as its width)."""
    n = _n_dest_operands(ins)
    regs = [r for op in ins.operands[:n] for r in _regs(op)]
    if regs and ins.cls in ("global", "shared"):
        m = re.match(r"(U?R)(\d+)$", regs[0])
        if m:
            regs = [f"{m.group(1)}{int(m.group(2)) + k}" for k in range(_width(ins.opcode))
                    ] + regs[1:]
    return regs


def _sources(ins: Instr) -> list[str]:
    """Registers an instruction reads (every operand after its results, and its guard)."""
    srcs = [r for op in ins.operands[_n_dest_operands(ins):] for r in _regs(op)]
    if ins.pred:
        srcs += _regs(ins.pred.lstrip("@!"))
    return srcs


@dataclass
class Model:
    """What ``model_sass`` returns (``as_dict`` for JSON)."""

    num_warps: int
    counts: dict[str, int] = field(default_factory=dict)         # dynamic, per warp
    static_counts: dict[str, int] = field(default_factory=dict)  # in the cubin path
    barriers: int = 0
    segments: int = 0
    mem_depth: int = 0            # sum over segments of the dependent-load chain length
    issue_cycles: float = 0.0     # per SMSP
    alu_cycles: float = 0.0
    mio_cycles: float = 0.0
    pipe_cycles: float = 0.0      # segments bound by issue / ALU / MIO throughput
    latency_cycles: float = 0.0   # segments bound by their load chain, and barriers
    cycles_per_row: float = 0.0
    loops: list = field(default_factory=list)
    unmapped_loops: list = field(default_factory=list)

    def us_per_call(self, rows: int, ctas_per_sm: int = 1) -> float:
        waves = max(1, math.ceil(rows / (SMS * max(1, ctas_per_sm))))
        return waves * self.cycles_per_row / CLOCK_HZ * 1e6

    def as_dict(self, rows: Optional[Iterable[int]] = None, ctas_per_sm: int = 1
                ) -> dict[str, Any]:
        out = {
            "model": "sass-issue v1", "clock_ghz": CLOCK_HZ / 1e9, "sms": SMS,
            "mem_latency_cycles": MEM_LATENCY, "bar_cycles": BAR_CYCLES,
            "num_warps": self.num_warps, "instructions_per_warp": self.counts,
            "barriers": self.barriers, "mem_depth": self.mem_depth,
            "issue_cycles_per_row": round(self.issue_cycles),
            "alu_cycles_per_row": round(self.alu_cycles),
            "mio_cycles_per_row": round(self.mio_cycles),
            "pipe_bound_cycles_per_row": round(self.pipe_cycles),
            "latency_bound_cycles_per_row": round(self.latency_cycles),
            "cycles_per_row": round(self.cycles_per_row),
            "us_per_row": round(self.cycles_per_row / CLOCK_HZ * 1e6, 2),
        }
        if rows is not None:
            out["us_per_call"] = {str(r): round(self.us_per_call(r, ctas_per_sm), 2)
                                  for r in rows}
        if self.unmapped_loops:
            out["unmapped_loops"] = self.unmapped_loops
        return out


def model_sass(text: str, *, num_warps: int, loop_trips: Optional[Mapping[Any, int]] = None,
               early_exit: bool = False) -> Model:
    """The issue-cycle model of one CTA (see the module docstring) of the kernel in ``text``.
    ``loop_trips``: ``{"path:line" or line of a back edge: trips}``. ``early_exit``: the path
    ends at the first ``EXIT``, predicated or not (a program that takes its early return:
    the hash resolve's fallback launch on a row the hash launch did not flag)."""
    if num_warps < 1:
        raise ValueError(f"sass_model: num_warps must be >= 1, got {num_warps}")
    instrs = parse_sass(text)
    if not instrs:
        raise ValueError("sass_model: no SASS instructions in the text")
    trace, loops = _trace(instrs, loop_trips or {}, early_exit)
    model = Model(num_warps=num_warps)
    model.loops = [{"addr": hex(a), "line": line, "trips": n} for a, line, n in loops]
    model.unmapped_loops = [x for x in model.loops if x["trips"] is None]
    model.counts = {c: 0 for c in CLASSES}
    model.static_counts = {c: 0 for c in CLASSES}
    for i in sorted(set(trace)):
        model.static_counts[instrs[i].cls] += 1
    wps = num_warps / SMSPS
    seg = _Segment()
    depth: dict[str, int] = {}
    for i in trace:
        ins = instrs[i]
        model.counts[ins.cls] += 1
        if ins.cls == "barrier":
            model.barriers += 1
            _close(model, seg, wps)
            seg = _Segment()
            depth = {}
            continue
        seg.issue += 1
        if ins.cls == "alu":
            seg.alu += 1
        elif ins.cls in ("shared", "shuffle", "global"):
            seg.mio += _width(ins.opcode)
        d = max((depth.get(r, 0) for r in _sources(ins)), default=0)
        if ins.base in _RETURNS:
            d += 1
        seg.depth = max(seg.depth, d)
        for r in _dests(ins):
            depth[r] = d
    _close(model, seg, wps)
    model.latency_cycles += model.barriers * BAR_CYCLES
    model.cycles_per_row = model.pipe_cycles + model.latency_cycles
    return model


@dataclass
class _Segment:
    issue: int = 0
    alu: int = 0
    mio: int = 0
    depth: int = 0


def _close(model: Model, seg: _Segment, wps: float) -> None:
    """Add one barrier segment's cycles to the model."""
    model.segments += 1
    issue, alu, mio = seg.issue * wps, seg.alu * wps * ALU_CYCLES, seg.mio * wps * SMSPS
    model.issue_cycles += issue
    model.alu_cycles += alu
    model.mio_cycles += mio
    model.mem_depth += seg.depth
    pipe = max(issue, alu, mio)
    lat = seg.depth * MEM_LATENCY
    if lat > pipe:
        model.latency_cycles += lat
    else:
        model.pipe_cycles += pipe


def sass_of_cubin(cubin: bytes, line_info: bool = True) -> str:
    """Disassembly of a cubin: ``nvdisasm -gi`` (with source lines) when Triton ships it,
    else ``cuobjdump -sass``."""
    import os
    import subprocess
    import tempfile

    from triton import knobs

    cuobjdump = knobs.nvidia.cuobjdump.path
    nvdisasm = os.path.join(os.path.dirname(cuobjdump), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        if line_info and os.path.exists(nvdisasm):
            proc = subprocess.run([nvdisasm, "-gi", "-c", f.name], capture_output=True,
                                  text=True)
            if proc.returncode == 0 and proc.stdout.strip():
                return proc.stdout
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


#: Batch sizes every model entry reports ``us_per_call`` for.
MODEL_ROWS = (1, 8, 64, 132)
#: The ``path`` of a launch model (which path of the kernel the figures count).
FULL_PATH = "every branch taken (the slowest program's path), loop trips as stated"
EARLY_EXIT_PATH = ("the early return (to the first EXIT): every program of a batch takes it "
                   "(the hash resolve's fallback launch, no row flagged); "
                   "if_a_row_takes_the_full_path: the launch when one row is flagged")


def _module_of(kernel: Any) -> Any:
    import sys

    fn = getattr(kernel, "fn", kernel)
    return sys.modules.get(getattr(fn, "__module__", ""), None)


def _name_of(kernel: Any) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", "")


def launch_model(kernel: Any, sass: str, args: tuple, kwargs: dict, grid: Sequence[int],
                 num_warps: int, ctas_per_sm: int) -> dict[str, Any]:
    """The compile report's ``model`` field of one launch: the model of ``sass`` with the loop
    trips ``loop_trips.LOOP_TRIPS`` states for the kernel and these launch arguments
    (``{for-statement text: trips}``, when it has an entry, matched against the lines of
    every source file the SASS line info names), ``us_per_call`` at ``MODEL_ROWS`` and at
    the launch's own grid."""
    trips_of = LOOP_TRIPS.get(_name_of(kernel))
    lines: dict = {}
    if trips_of is not None:  # every source file the SASS names: the jit helpers' loops too
        trips = trips_of(kernel, args, kwargs, grid)
        here = os.path.dirname(getattr(_module_of(kernel), "__file__", "") or ".")
        for path in sorted({i.file for i in parse_sass(sass) if i.file}):
            # The kernel's own directory first: a cubin from Triton's cache names the file it
            # was first compiled from (the same source, maybe another checkout).
            local = os.path.join(here, os.path.basename(path))
            try:
                with open(local if os.path.exists(local) else path) as f:
                    source = f.readlines()
            except OSError:
                continue
            for line, n in loop_lines(source, 1, trips).items():
                lines[f"{path}:{line}"] = n
    rows = int(grid[0]) if grid else 1
    model = model_sass(sass, num_warps=num_warps, loop_trips=lines)
    name = _name_of(kernel)
    path = MODEL_PATHS.get(name)
    early = EARLY_EXITS.get(name)
    if early is not None and early(kwargs):  # most programs return at once: model that path
        full = model.as_dict(MODEL_ROWS, ctas_per_sm)
        full["us_per_call_this_grid"] = round(model.us_per_call(rows, ctas_per_sm), 2)
        model = model_sass(sass, num_warps=num_warps, loop_trips=lines, early_exit=True)
        out = model.as_dict(MODEL_ROWS, ctas_per_sm)
        out["path"] = EARLY_EXIT_PATH
        out["if_a_row_takes_the_full_path"] = {  # the launch then waits for that row
            k: full[k] for k in ("cycles_per_row", "us_per_row", "us_per_call",
                                 "us_per_call_this_grid", "barriers", "mem_depth")}
    else:
        out = model.as_dict(MODEL_ROWS, ctas_per_sm)
        out["path"] = path(kwargs) if path is not None else FULL_PATH
    out["us_per_call_this_grid"] = round(model.us_per_call(rows, ctas_per_sm), 2)
    return out
