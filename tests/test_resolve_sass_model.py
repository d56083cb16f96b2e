"""The SASS issue-cycle model (hisparse_triton/compile/sass_model.py) on small hand-written SASS, and once on
a compiled resolve kernel (skipped without ptxas)."""

from __future__ import annotations

import shutil

import pytest

from hisparse_triton.compile import sass_model as sm

# cuobjdump -sass style: absolute branch targets, no line info.
STRAIGHT = """
        Function : k
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   IADD3 R2, R0, 0x1, RZ ;
        /*0030*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E R6, desc[UR4][R4.64] ;
        /*0050*/                   FADD R7, R6, R6 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   SHFL.BFLY PT, R8, R7, 0x1, 0x1f ;
        /*0080*/                   STS.64 [R0], R8 ;
        /*0090*/                   STG.E desc[UR4][R2.64], R8 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
        /*00c0*/                   NOP;
"""

# nvdisasm -gi style: labels and source lines; a loop (line 7) around two ALU instructions,
# and a cold block after the first unconditional EXIT.
LOOP = """
	//## File "k.py", line 5
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
	//## File "k.py", line 8
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
	//## File "k.py", line 7
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/               @P0 EXIT ;
        /*0050*/                   EXIT ;
.L_x_1:
        /*0060*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0070*/                   BRA `(.L_x_1) ;
"""


def test_classify():
    assert sm.classify("LDG.E.64") == "global"
    assert sm.classify("REDG.E.ADD.STRONG.GPU") == "global"
    assert sm.classify("LDS.128") == "shared"
    assert sm.classify("SHFL.BFLY") == "shuffle"
    assert sm.classify("ISETP.GE.AND") == "alu"
    assert sm.classify("IMAD.MOV.U32") == "alu"
    assert sm.classify("FFMA") == "fp"
    assert sm.classify("ULDC.64") == "uniform"
    assert sm.classify("BAR.SYNC.DEFER_BLOCKING") == "barrier"
    assert sm.classify("BSSY") == "branch"
    assert sm.classify("S2R") == "other"


def test_parse_targets_and_lines():
    instrs = sm.parse_sass(LOOP)
    assert [i.addr for i in instrs] == [0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    bra = instrs[3]
    assert bra.base == "BRA" and bra.target == 0x10 and bra.line == 7 and bra.pred == "@!P0"
    assert sm.parse_sass(STRAIGHT)[-1].target == 0xb0  # NOP dropped, hex target parsed


def test_straight_line_counts_and_cycles():
    m = sm.model_sass(STRAIGHT, num_warps=8)
    c = m.counts
    assert (c["alu"], c["fp"], c["global"], c["shared"], c["shuffle"], c["barrier"]) == \
        (1, 1, 3, 1, 1, 1)
    assert c["branch"] == 1 and c["other"] == 2  # EXIT; LDC, S2R (the BRA after EXIT: cold)
    assert m.barriers == 1 and m.segments == 2
    # Segment 1: 6 instructions, two chained loads (the second's address is the first's
    # result): depth 2 -> latency bound. Segment 2: SHFL + STS.64 + STG + EXIT.
    assert m.mem_depth == 2
    wps = 8 / 4
    seg1_pipe = max(6 * wps, 1 * wps * sm.ALU_CYCLES, 2 * wps * 4)
    assert 2 * sm.MEM_LATENCY > seg1_pipe
    seg2 = max(4 * wps, 0, (1 + 2 + 1) * wps * 4)
    assert m.pipe_cycles == seg2
    assert m.latency_cycles == 2 * sm.MEM_LATENCY + sm.BAR_CYCLES
    assert m.cycles_per_row == seg2 + 2 * sm.MEM_LATENCY + sm.BAR_CYCLES
    assert m.us_per_call(64) == pytest.approx(m.cycles_per_row / sm.CLOCK_HZ * 1e6)
    assert m.us_per_call(sm.SMS + 1) == pytest.approx(2 * m.us_per_call(1))  # two waves


# Triton 3.9's line info for an inlined @triton.jit call (the loop of helper h.py, called at
# k.py line 3): the innermost line, then each call site on a line of its own.
INLINED = """
	//## File "k.py", line 2
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
	//## File "h.py", line 9 inlined at "k.py", line 3
	//## File "k.py", line 3
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
	//## File "h.py", line 8 inlined at "k.py", line 3
	//## File "k.py", line 3
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
	//## File "k.py", line 4
	//## File "k.py", line 3
        /*0040*/                   EXIT ;
"""


def test_an_inlined_line_is_the_innermost_frame():
    instrs = sm.parse_sass(INLINED)
    assert [(i.file, i.line) for i in instrs] == [
        ("k.py", 2), ("h.py", 9), ("h.py", 8), ("h.py", 8), ("k.py", 3)]
    model = sm.model_sass(INLINED, num_warps=4, loop_trips={"h.py:8": 16})
    assert model.unmapped_loops == [] and model.counts["alu"] == 1 + 2 * 16


def test_loop_trips_by_source_line():
    once = sm.model_sass(LOOP, num_warps=4)
    assert once.unmapped_loops == [{"addr": "0x30", "line": 7, "trips": None}]
    assert once.counts["alu"] == 3  # MOV + the body once; the cold block is not counted
    many = sm.model_sass(LOOP, num_warps=4, loop_trips={7: 16})
    assert many.unmapped_loops == []
    assert many.counts["alu"] == 1 + 2 * 16 and many.counts["branch"] == 16 + 2  # BRA x16, @P0 EXIT, EXIT
    assert many.alu_cycles == many.counts["alu"] * 1 * sm.ALU_CYCLES


def test_early_exit_ends_the_path_at_a_predicated_exit():
    """``early_exit``: a program that returns at once (``@P0 EXIT``) costs the instructions
    before it, not the loop after it."""
    full = sm.model_sass(LOOP, num_warps=4, loop_trips={7: 16})
    early = sm.model_sass(LOOP, num_warps=4, loop_trips={7: 16}, early_exit=True)
    assert full.counts["alu"] == 1 + 2 * 16
    early_exit = """
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0010*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0020*/              @!P0 EXIT ;
        /*0030*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   EXIT ;
"""
    short = sm.model_sass(early_exit, num_warps=4, early_exit=True)
    long = sm.model_sass(early_exit, num_warps=4)
    assert short.counts["alu"] == 1 and short.barriers == 0 and short.mem_depth == 1
    assert long.counts["alu"] == 2 and long.barriers == 1
    # LOOP's first EXIT (``@P0 EXIT``) is after its loop: the same work, one EXIT fewer
    assert early.counts["alu"] == full.counts["alu"]
    assert early.counts["branch"] == full.counts["branch"] - 1


def test_loop_lines_maps_for_statements():
    src = ["def k(x):\n", "    for i in range(0, K, S):\n", "        pass\n",
           "    for j in range(0, H, B):\n"]
    assert sm.loop_lines(src, 10, {"for i in range(0, K, S)": 4, "range(0, H, B)": 2}) == \
        {11: 4, 13: 2}


def test_bad_input():
    with pytest.raises(ValueError, match="num_warps"):
        sm.model_sass(STRAIGHT, num_warps=0)
    with pytest.raises(ValueError, match="no SASS"):
        sm.model_sass("nothing here", num_warps=4)


def _ptxas() -> bool:
    try:
        from triton import knobs

        return bool(knobs.nvidia.ptxas.path) and shutil.which(knobs.nvidia.cuobjdump.path) \
            is not None
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas(), reason="needs Triton's ptxas / cuobjdump")
def test_compiled_resolve_has_a_model():
    from hisparse_triton.compile.report import report_in_subprocess

    doc = report_in_subprocess(90, groups=("resolve",), widths=(2048,), small_host=False)
    errors = [(r["variant"], r["error"]) for r in doc["launches"] if r["error"]]
    assert not errors  # every launch compiles (every size 1 included: Python-int bounds)
    rows = [r for r in doc["launches"] if r["variant"] == "resolve K=2048 H=4096 R=64"]
    assert rows and not rows[0]["error"]
    model = rows[0]["model"]
    assert model["cycles_per_row"] > 0 and set(model["us_per_call"]) == {"1", "8", "64", "132"}
    assert "unmapped_loops" not in model  # every runtime loop of the kernel has its trips
    assert rows[0]["kernel"] == "_resolve_hash_kernel" and "unflagged row" in model["path"]
    # The fallback launch: costed on the early return every unflagged row takes, the full
    # sorted path beside it (what the launch costs when a row is flagged).
    fallback = [r for r in doc["launches"]
                if r["variant"] == "resolve K=2048 H=4096 R=64 fallback"]
    assert fallback and fallback[0]["kernel"] == "_resolve_kernel"
    assert fallback[0]["call"] == rows[0]["call"] == "resolve K=2048 H=4096 R=64"
    fb = fallback[0]["model"]
    assert "early return" in fb["path"] and fb["barriers"] == 0
    assert fb["cycles_per_row"] < fb["if_a_row_takes_the_full_path"]["cycles_per_row"]


def test_bench_resolve_sums_the_launches_of_a_call():
    """``bench_resolve.per_call``: a call's launches (the records sharing ``call``; the
    second is ``"<variant> fallback"``) summed at their own grid; a flagged row costs the
    fallback's full path."""
    from bench_resolve import per_call

    hash_model = {"us_per_call_this_grid": 9.4, "path": "p"}
    fallback = {"us_per_call_this_grid": 0.25, "path": "early",
                "if_a_row_takes_the_full_path": {"us_per_call_this_grid": 25.0}}
    launches = [
        {"variant": "resolve K=2048 R=64", "call": "resolve K=2048 R=64", "kernel": "h",
         "model": hash_model},
        {"variant": "resolve K=2048 R=64 fallback", "call": "resolve K=2048 R=64",
         "kernel": "s", "model": fallback},
        {"variant": "resolve K=8192 R=64", "call": "resolve K=8192 R=64", "kernel": "s",
         "model": {"us_per_call_this_grid": 100.0}},
        {"variant": "broken", "call": "broken", "kernel": "s", "model": None},
    ]
    calls = per_call(launches)
    assert set(calls) == {"resolve K=2048 R=64", "resolve K=8192 R=64"}
    two = calls["resolve K=2048 R=64"]
    assert two["us"] == 9.65 and two["if_a_row_is_flagged_us"] == 34.4
    assert [launch["kernel"] for launch in two["launches"]] == ["h", "s"]
    assert calls["resolve K=8192 R=64"]["us"] == 100.0
