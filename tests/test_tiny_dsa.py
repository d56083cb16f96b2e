"""``examples/tiny_dsa.py``: a DeepSeek-V3.2-shaped model decoding through HiSparse is
bit-identical (tokens and logits) to the same model with every KV row kept dense.

The default run: 4 layers (2 index groups of leader + follower), 4 requests of 128-320
prompt tokens (top-k 32), prefill in chunks of 32, a device pool smaller than the requests'
histories (misses). Driven through the scheduler + worker pair (the serving-stack protocol),
through the in-process facade, and on two tensor-parallel processes sharing one host pool;
under memory pressure (default watermark, and 1.0), with the engine's chunk limit, a shared
prefix reused from the prefix cache (the dense run computes it) and two query tokens per
decode step (the dense run decodes one at a time). The check is shown not to be vacuous: one
corrupted byte of a resolved row, or one wrong row id, changes the logits. Every command the
example's docstring, README.md and docs/*.md give for it is accepted and runs as written.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hisparse_triton.errors import UncommittedTokensError
from test_docs_commands import DOC_FILES, ROOT, _join_continuations, bash_blocks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_dsa.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("tiny_dsa_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


tiny_dsa = _load_example()

SPEC = tiny_dsa.RunSpec(max_running=3)  # 4 requests, 3 at a time: a freed state row is reused
#: Two at a time, the later two share a 64-token prefix (4 pages) with the first two.
SERVING = tiny_dsa.RunSpec(num_requests=4, max_running=2, prompt_len_range=(96, 200),
                           max_new_tokens=6, shared_prefix_len=64)
HAS_TRITON_BACKEND = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


class ResolveLog:
    """Wraps ``runtime.resolve`` and ``runtime.resolve_prefill`` (and ``commit``) to record
    calls and optionally tamper with one call's result: the ``at_call``-th call of the kind
    ``tamper_prefill`` names; ``tamper(runtime, leader, request_ids, topk, rows)`` returns the
    rows the store sees, or None to keep them."""

    def __init__(self, runtime, tamper=None, at_call: int = -1,
                 tamper_prefill: bool = False) -> None:
        self.calls: list[tuple[int, str, list, tuple]] = []  # (step, leader, ids, topk shape)
        self.prefill_calls: list[tuple[int, str, list, tuple]] = []  # the same, per token
        self.step = 0
        self.tampered = False
        resolve, resolve_prefill, commit = (runtime.resolve, runtime.resolve_prefill,
                                            runtime.commit)

        def logged(call, log, prefill):
            def wrapper(leader, request_ids, topk):
                rows = call(leader, request_ids, topk)
                log.append((self.step, leader, list(request_ids), tuple(topk.shape)))
                if tamper is not None and prefill == tamper_prefill \
                        and len(log) - 1 == at_call:
                    changed = tamper(runtime, leader, request_ids, topk, rows)
                    if changed is not None:
                        self.tampered = True
                        rows = changed
                return rows
            return wrapper

        def counted_commit():
            commit()
            self.step += 1

        runtime.resolve = logged(resolve, self.calls, False)
        runtime.resolve_prefill = logged(resolve_prefill, self.prefill_calls, True)
        runtime.commit = counted_commit


def run_facade(spec, tamper=None, at_call: int = -1, tamper_prefill: bool = False):
    with tiny_dsa.build_runtime(spec) as runtime:
        log = ResolveLog(runtime, tamper, at_call, tamper_prefill)
        result = tiny_dsa.run(spec, tiny_dsa.HiSparseStore(runtime))
        stats = runtime.stats()
        pool = runtime.device_block_pool.capacity
        all_gpu = tiny_dsa.all_gpu_blocks(runtime.kv_cache_config, spec)
    return result, stats, log, pool, all_gpu


def run_split(spec, drafts=None):
    """Decode through a scheduler + worker pair; returns the result, the store and both
    halves' stats."""
    scheduler, worker = tiny_dsa.build_split(spec)
    with worker:
        store = tiny_dsa.SplitStore(worker, scheduler)
        result = tiny_dsa.run(spec, store, drafts)
        return result, store, scheduler.stats(), worker.stats()


@pytest.fixture(scope="module")
def dense():
    return tiny_dsa.run_dense(SPEC)


@pytest.fixture(scope="module")
def serving_dense():
    return tiny_dsa.run_dense(SERVING)


def test_bit_identical_to_dense_under_memory_pressure(dense):
    workload = SPEC.workload()
    topk = SPEC.model_config().topk
    assert len(set(workload.prompt_lens)) == SPEC.num_requests
    assert min(workload.prompt_lens) > 2 * SPEC.chunk_size > topk   # chunked, real top-k
    result, stats, log, pool, all_gpu = run_facade(SPEC)

    assert tiny_dsa.compare(dense, result) == []
    assert set(result.tokens) == {f"req-{i}" for i in range(SPEC.num_requests)}
    for request, tokens in result.tokens.items():
        assert len(tokens) == SPEC.max_new_tokens
        assert result.logits[request].shape == (SPEC.max_new_tokens,
                                                SPEC.model_config().vocab_size)
    # The pool cannot hold the histories: rows were gathered from the host.
    assert pool < all_gpu
    assert stats.misses > 0 and stats.h2d_bytes > 0 and stats.d2h_bytes > 0
    assert stats.num_requests == 0 and stats.device_blocks == 0 and stats.host_blocks == 0
    # Every step selects for every index group: decoding requests through their hot
    # buffers (resolve), prefill chunks through prefill staging (resolve_prefill, one id per
    # query token); a mixed step does both, its resolve with padding rows for the requests
    # that prefill.
    leaders = [SPEC.model_config().sparse_layer(i) for i in range(0, SPEC.num_layers, 2)]
    per_step: dict[tuple[int, str], set[str]] = {}
    for kind, calls in (("decode", log.calls), ("prefill", log.prefill_calls)):
        for step, leader, _, _ in calls:
            per_step.setdefault((step, leader), set()).add(kind)
    assert {key[1] for key in per_step} == set(leaders)
    assert len(per_step) == result.steps * len(leaders)
    assert {"decode", "prefill"} in per_step.values()
    assert any(None in ids for _, _, ids, _ in log.calls)
    topk = SPEC.model_config().topk
    assert all(len(ids) == shape[0] and shape[1] == topk
               for _, _, ids, shape in log.prefill_calls)
    assert max(len(set(ids)) for _, _, ids, _ in log.prefill_calls) > 1   # batched chunks


@pytest.mark.parametrize("watermark", [None, 1.0], ids=["default-watermark", "pure-hisparse"])
def test_scheduler_worker_pair_is_exact_under_memory_pressure(dense, watermark):
    """The serving-stack protocol (scheduling calls, step(), apply, forward, mirror) with a
    tight pool: at the default watermark pages are unpinned and some lost to other requests,
    at 1.0 every committed page outside the tail is read through the hot buffer."""
    spec = dataclasses.replace(SPEC, free_block_watermark=watermark)
    result, store, sched, work = run_split(spec)
    assert tiny_dsa.compare(dense, result) == []
    assert work.plans == result.steps                     # one plan per model step
    assert work.misses > 0 and work.h2d_bytes > 0 and work.d2h_bytes > 0
    assert sched.unpinned_pages > 0 and sched.num_requests == 0
    if watermark is None:
        assert sched.lost_pages > 0                       # blocks went to other owners
    else:
        assert sched.lost_pages == 0                      # dropped at once, never lost
    # decode steps resolved [R, 1, K] at once; prefill chunks went through prefill staging,
    # one [tokens, K] call per index group and step
    topk = SPEC.model_config().topk
    assert (SPEC.running, 1, topk) in {shape for _, shape in store.resolve_shapes}
    assert store.prefill_shapes and all(k == topk for _, (_, k) in store.prefill_shapes)


def test_the_model_is_batch_invariant(serving_dense):
    """What prefix reuse and speculative decoding are compared on: a request's tokens and
    logits do not depend on what it is batched with (one request at a time, all at once)."""
    alone = tiny_dsa.run_dense(dataclasses.replace(SERVING, max_running=1))
    together = tiny_dsa.run_dense(dataclasses.replace(SERVING, max_running=4))
    assert alone.steps != together.steps != serving_dense.steps
    assert tiny_dsa.compare(serving_dense, alone) == []
    assert tiny_dsa.compare(serving_dense, together) == []


def test_chunked_prefill_under_the_engine_limit(dense):
    spec = dataclasses.replace(SPEC, max_num_batched_tokens=SPEC.chunk_size)
    result, _, sched, work = run_split(spec)
    assert tiny_dsa.compare(dense, result) == []
    # a request longer than one chunk outgrows its admission window: it offloads
    assert work.misses > 0 and sched.unpinned_pages > 0
    # the runtime refuses a larger uncommitted append, and changes nothing
    scheduler, worker = tiny_dsa.build_split(spec)
    with worker:
        store = tiny_dsa.SplitStore(worker, scheduler)
        store.add("r", 100, 4)
        before = scheduler._debug_snapshot()
        with pytest.raises(UncommittedTokensError, match="max_num_batched_tokens=32"):
            store.append("r", spec.chunk_size + 1)
        assert scheduler._debug_snapshot() == before
        store.append("r", spec.chunk_size)
        with pytest.raises(UncommittedTokensError):
            store.append("r", 1)                 # the chunk is not committed yet
    with pytest.raises(ValueError, match="below the prefill chunk"):
        tiny_dsa.plan_for_spec(dataclasses.replace(SPEC, max_num_batched_tokens=16))


@pytest.mark.parametrize("kind", ["split", "facade"])
def test_shared_prefix_is_reused_not_recomputed(serving_dense, kind):
    """The later requests find the first ones' 64-token prefix in the prefix cache: they
    compute only the rest (the dense run computes everything) and stay bit-identical."""
    prompts = [r.prompt for r in SERVING.workload().requests(SERVING.model_config().vocab_size)]
    assert all(p[:64] == prompts[0][:64] for p in prompts)
    if kind == "split":
        result, _, sched, _ = run_split(SERVING)
        hits, query = sched.prefix_hit_tokens, sched.prefix_query_tokens
    else:
        result, stats, *_ = run_facade(SERVING)
        hits, query = stats.prefix_hit_tokens, stats.prefix_query_tokens
    assert tiny_dsa.compare(serving_dense, result) == []
    assert result.cached_tokens == hits == 2 * 64          # requests 2 and 3
    assert query == sum(SERVING.workload().prompt_lens)
    assert result.computed_tokens == serving_dense.computed_tokens - result.cached_tokens


def test_speculative_decoding_two_query_tokens(serving_dense):
    """Q = 2: each decode step feeds the last token and one draft (the dense greedy
    continuation), resolves their top-k as ONE [R, 2, K] union per index group, appends 2
    tokens; every draft is accepted and the result equals one-token-at-a-time decoding."""
    spec = dataclasses.replace(SERVING, spec_tokens=2, free_block_watermark=1.0)
    result, store, sched, work = run_split(spec, drafts=serving_dense.tokens)
    assert tiny_dsa.compare(serving_dense, result) == []
    assert result.steps < serving_dense.steps
    topk = spec.model_config().topk
    assert work.misses > 0
    unions = [shape for _, shape in store.resolve_shapes if len(shape) == 3 and shape[1] == 2]
    assert unions and all(shape[2] == topk for shape in unions)
    assert store.buffer_size == 3 * topk                  # (Q + 1) x top-k by default
    assert sched.prefix_hit_tokens > 0


def test_a_wrong_draft_is_rejected(serving_dense):
    spec = dataclasses.replace(SERVING, num_requests=1, spec_tokens=2)
    drafts = {rid: [(t + 1) % 96 for t in tokens] for rid, tokens in serving_dense.tokens.items()}
    with pytest.raises(tiny_dsa.DraftRejectedError, match="was rejected"):
        run_split(spec, drafts=drafts)


@pytest.mark.parametrize("store", ["split", "facade"])
def test_mtp_with_random_acceptance_rolls_back_and_is_bit_identical(serving_dense, store):
    """``--mtp 3``: 3 drafts per step from a drafter wrong at random, 0..3 accepted per
    step, the rejected ones rolled back (``truncate``) before the step commits, under pure
    HiSparse (every committed page read through the hot buffer) with a shared prefix:
    tokens and logits identical to the dense one-token-at-a-time run."""
    spec = dataclasses.replace(SERVING, spec_tokens=4, draft_error=0.35,
                               free_block_watermark=1.0)
    if store == "split":
        result, _, sched, work = run_split(spec, drafts=serving_dense.tokens)
        misses = work.misses
    else:
        with tiny_dsa.build_runtime(spec) as runtime:
            result = tiny_dsa.run(spec, tiny_dsa.HiSparseStore(runtime), serving_dense.tokens)
            sched = runtime.stats()
            misses = sched.misses
    assert tiny_dsa.compare(serving_dense, result) == []
    assert result.rejected_tokens > 0 and result.steps < serving_dense.steps
    assert misses > 0 and sched.prefix_hit_tokens > 0


def test_two_tensor_parallel_ranks_share_one_host_pool(serving_dense):
    """``--tp 2``: two processes (gloo); rank 0 schedules and broadcasts every plan and the
    step's rows; both compute the same tokens over one host pool in /dev/shm, under pressure,
    with the chunk limit, a reused prefix and two query tokens per step."""
    spec = dataclasses.replace(SERVING, spec_tokens=2, max_num_batched_tokens=32)
    ranks = tiny_dsa.run_tp(spec, 2, drafts=serving_dense.tokens)
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        assert tiny_dsa.compare(serving_dense, r.result) == [], r.rank
    zero, one = ranks
    assert zero.worker["misses"] == one.worker["misses"] > 0
    assert zero.worker["plans"] == one.worker["plans"] == zero.result.steps
    assert zero.worker["d2h_bytes"] > 0 and one.worker["d2h_bytes"] == 0  # rank 0 mirrors
    assert zero.scheduler["prefix_hit_tokens"] == 128 and one.scheduler is None
    leftover = [f for f in os.listdir("/dev/shm") if f.startswith("hisparse-tiny-dsa-")] \
        if os.path.isdir("/dev/shm") else []
    assert not leftover, leftover


def test_a_failing_rank_ends_the_tensor_parallel_run():
    """Rank 0 cannot admit (a pool too small): it shares the refusal, every rank stops and
    the caller gets the error, not a hang."""
    spec = dataclasses.replace(SERVING, num_requests=1, device_blocks=5)
    with pytest.raises(RuntimeError, match="hot region needs"):
        tiny_dsa.run_tp(spec, 2, timeout_s=120)


def _committed_column(runtime, request_ids, topk):
    """(row, column) of a selected position whose rows were committed before this step."""
    topk = topk.reshape(topk.shape[0], -1)
    for r, request in enumerate(request_ids):
        if request is None:
            continue
        committed = runtime.seq_len(request) - SPEC.chunk_size
        for c in range(topk.shape[1]):
            if 0 <= int(topk[r, c]) < committed:
                return r, c
    return None


def _corrupt_byte(layer_index):
    def tamper(runtime, leader, request_ids, topk, rows):
        found = _committed_column(runtime, request_ids, topk)
        if found is None:
            return None
        r, c = found
        layer = runtime.index_group(leader)[layer_index]
        cache = runtime.device_cache(layer)
        row = int(rows.reshape(rows.shape[0], -1)[r, c])
        cache[row // cache.shape[1], row % cache.shape[1], 3] ^= 0x40  # a float's exponent
        return rows
    return tamper


def _wrong_row(runtime, leader, request_ids, topk, rows):
    found = _committed_column(runtime, request_ids, topk)
    if found is None:
        return None
    r, c = found
    flat = rows.reshape(rows.shape[0], -1).clone()
    other = next(int(v) for v in flat[r] if v >= 0 and v != flat[r, c])
    flat[r, c] = other
    return flat.view(rows.shape)


@pytest.mark.parametrize("tamper", [_corrupt_byte(0), _corrupt_byte(1), _wrong_row],
                         ids=["corrupt-leader-byte", "corrupt-follower-byte", "wrong-row-id"])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_the_check_is_not_vacuous(dense, tamper, prefill):
    result, _, log, *_ = run_facade(SPEC, tamper, at_call=12, tamper_prefill=prefill)
    assert log.tampered
    problems = tiny_dsa.compare(dense, result)
    assert any("logits differ" in p for p in problems), problems


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_bit_identical_small():
    spec = tiny_dsa.RunSpec(num_requests=2, num_layers=2, prompt_len_range=(70, 100),
                            max_new_tokens=2, offload_threshold_pages=1,
                            free_block_watermark=1.0, backend="triton")
    result, stats, log, *_ = run_facade(spec)
    assert tiny_dsa.compare(tiny_dsa.run_dense(spec), result) == []
    assert stats.misses > 0
    assert any(None in ids for _, _, ids, _ in log.calls)


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_split_prefix_and_two_query_tokens_small():
    spec = tiny_dsa.RunSpec(num_requests=2, num_layers=2, prompt_len_range=(70, 90),
                            max_new_tokens=3, max_running=1, shared_prefix_len=48,
                            spec_tokens=2, free_block_watermark=1.0, backend="triton")
    dense = tiny_dsa.run_dense(spec)
    result, store, sched, work = run_split(spec, drafts=dense.tokens)
    assert tiny_dsa.compare(dense, result) == []
    assert work.misses > 0 and sched.prefix_hit_tokens == 48
    assert any(len(shape) == 3 and shape[1] == 2 for _, shape in store.resolve_shapes)


#: One 2K-token prompt prefilled in 16 chunks of 128 over a pool of 180 blocks (keeping its
#: rows on the GPU would take 258 per index group pair): most of every chunk's history lives
#: only in the host pool.
LONG = tiny_dsa.RunSpec(num_requests=1, prompt_len_range=(2048, 2048), max_new_tokens=4,
                        chunk_size=128, max_num_batched_tokens=128, max_model_len=2052,
                        device_blocks=180)


def _run_long(spec):
    scheduler, worker = tiny_dsa.build_split(spec)
    with worker:
        store = tiny_dsa.SplitStore(worker, scheduler)
        result = tiny_dsa.run(spec, store)
        return result, store, scheduler, worker.stats()


def test_a_2k_token_prompt_prefills_through_staging_over_an_offloading_pool():
    dense = tiny_dsa.run_dense(LONG)
    result, store, scheduler, work = _run_long(LONG)
    assert tiny_dsa.compare(dense, result) == []
    plan = tiny_dsa.plan_for_spec(LONG)
    assert scheduler.device_block_pool.capacity < tiny_dsa.all_gpu_blocks(
        plan.kv_cache_config, LONG)
    assert scheduler.prefill_staging.capacity_rows >= 2048    # the whole history fits
    assert scheduler.stats().unpinned_pages > 100             # the history left the GPU
    leaders = [LONG.model_config().sparse_layer(i) for i in range(0, LONG.num_layers, 2)]
    # every chunk: one [128 tokens, 32] prefill staging call per index group
    assert store.prefill_shapes == [(leader, (128, 32)) for _ in range(16) for leader in leaders]
    assert work.misses > 0                                    # decode steps gather


def test_cli_max_model_len_lifts_the_presets_context(capsys):
    argv = ["--requests", "1", "--layers", "2", "--prompt-len", "1100", "1100",
            "--max-new-tokens", "2", "--chunk-size", "128", "--max-num-batched-tokens", "128",
            "--device-blocks", "120", "--check"]
    assert tiny_dsa.main(argv) == 2
    assert "exceeds max_model_len 1024" in capsys.readouterr().err
    assert tiny_dsa.main([*argv, "--max-model-len", "1102"]) == 0
    assert "check: tokens and logits bit-identical" in capsys.readouterr().out


def _slow_selected(config) -> bool:
    markexpr = config.getoption("markexpr") or ""
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_bit_identical_full(dense, request):
    if not torch.cuda.is_available() and not _slow_selected(request.config):
        pytest.skip("about a minute in the Triton interpreter; select it with -m slow")
    spec = tiny_dsa.RunSpec(max_running=SPEC.max_running, backend="triton")
    result, _, _, work = run_split(spec)
    assert tiny_dsa.compare(dense, result) == []
    assert work.misses > 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_2k_token_prompt(request):
    if not torch.cuda.is_available() and not _slow_selected(request.config):
        pytest.skip("about 15 s in the Triton interpreter; select it with -m slow")
    spec = dataclasses.replace(LONG, num_layers=2, backend="triton")
    result, store, _, work = _run_long(spec)
    assert tiny_dsa.compare(tiny_dsa.run_dense(spec), result) == []
    assert len(store.prefill_shapes) == 16 and work.misses > 0


@pytest.mark.parametrize("store", ["split", "facade"])
def test_cli_check(capsys, store):
    assert tiny_dsa.main(["--requests", "2", "--layers", "2", "--max-new-tokens", "3",
                          "--shared-prefix-len", "32", "--max-running", "1",
                          "--spec-tokens", "2", "--store", store, "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: tokens and logits bit-identical" in out and " misses" in out
    assert "32 prompt tokens reused from the prefix cache" in out


@pytest.mark.parametrize("argv,message", [
    (["--prompt-len", "1000", "1100"], "max_model_len"),
    (["--tp", "2", "--store", "facade"], "--store split"),
    (["--max-num-batched-tokens", "8"], "below the prefill chunk"),
])
def test_cli_rejects_what_does_not_fit(capsys, argv, message):
    assert tiny_dsa.main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="256 B"):
        tiny_dsa.TinyDSAConfig.for_preset("tiny", kv_lora_rank=60)
    with pytest.raises(ValueError, match="needs drafts"):
        tiny_dsa.greedy_decode(tiny_dsa.TinyDSA(SPEC.model_config()),
                               tiny_dsa.dense_store_for(SPEC.model_config()), SPEC.workload(),
                               spec_tokens=2)
    with pytest.raises(ValueError, match="scheduler lives on rank 0"):
        scheduler, worker = tiny_dsa.build_split(SPEC)
        with worker:
            tiny_dsa.SplitStore(worker, None)

    class CachedEverything(tiny_dsa.DenseStore):
        def add(self, request, prompt_len, max_new_tokens, token_ids=None):
            super().add(request, prompt_len, max_new_tokens)
            return prompt_len

    spec = tiny_dsa.RunSpec(num_requests=1)
    store = CachedEverything(tiny_dsa.dense_store_for(spec.model_config()).row_dims)
    with pytest.raises(ValueError, match="cached tokens"):
        tiny_dsa.run(spec, store)


# ------------------------------------------------------------------ the documented commands
#: Documented commands that need a GPU: run only with CUDA (their arguments are checked
#: everywhere).
NEEDS_CUDA_FLAGS = ("--device cuda", "--cuda-graph")
#: Documented commands too slow for the normal suite: ``{argv text: reason}`` (none today;
#: each takes 1-5 s on the CPU).
SLOW_COMMANDS: dict[str, str] = {}


def example_commands() -> list[tuple[str, str]]:
    """``(where, argv text)`` of every ``python examples/<name>.py ...`` command written in an
    example's module docstring, and of the example commands README.md and docs/*.md show
    (inline code spans and ```bash blocks), deduplicated."""
    found: dict[str, str] = {}

    def add(where: str, command: str) -> None:
        command = " ".join(command.split())
        if command.startswith("python examples/"):
            found.setdefault(command[len("python "):], where)

    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        # (a ``\\`` continuation in a docstring already joined the lines; join any others)
        for command in _join_continuations(doc.splitlines()):
            add(f"{path.relative_to(ROOT)} docstring", command)
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"`(python examples/[^`]+)`", text):
            line = text.count("\n", 0, match.start()) + 1
            add(f"{path.relative_to(ROOT)}:{line}", match.group(1))
        for line, commands, _ in bash_blocks(path):
            for command in commands:
                add(f"{path.relative_to(ROOT)}:{line}", command)
    return [(where, argv) for argv, where in found.items()]


EXAMPLE_COMMANDS = example_commands()
_IDS = [argv[:80] for _, argv in EXAMPLE_COMMANDS]


def test_the_docstring_commands_are_found():
    docstring = [argv for where, argv in EXAMPLE_COMMANDS if "docstring" in where]
    assert len(docstring) >= 4 and any("--prompt-len 2048 2048" in a for a in docstring)
    assert any(where.startswith("README.md") for where, _ in EXAMPLE_COMMANDS)


class _Stopped(Exception):
    """Raised in place of the run once ``main`` accepted the arguments."""


@pytest.mark.parametrize("where, argv", EXAMPLE_COMMANDS, ids=_IDS)
def test_documented_example_command_is_accepted(where, argv, monkeypatch):
    """Every documented command parses and its run fits the plan (``main`` would exit 2
    otherwise: e.g. a prompt + new tokens past ``--max-model-len``); the run is stopped."""
    words = shlex.split(argv)
    assert words[0] == "examples/tiny_dsa.py", f"{where}: a new example needs its own check"

    def stop(*args, **kwargs):
        raise _Stopped

    monkeypatch.setattr(tiny_dsa, "run_dense", stop)
    monkeypatch.setattr(tiny_dsa, "_decode", stop)
    try:
        code = tiny_dsa.main(words[1:])
    except _Stopped:
        return
    except SystemExit as exc:  # argparse refused a flag
        code = exc.code
    pytest.fail(f"{where}: `python {argv}` exits {code} before it runs", pytrace=False)


@pytest.mark.parametrize("where, argv", EXAMPLE_COMMANDS, ids=_IDS)
def test_documented_example_command_runs(where, argv, request):
    """Every documented command runs as written (``python`` = this interpreter, from the
    repository root) and exits 0; with ``--check`` it reports bit-identical results."""
    if any(flag in argv for flag in NEEDS_CUDA_FLAGS) and not torch.cuda.is_available():
        pytest.skip(f"{where}: the command needs a CUDA device")
    if argv in SLOW_COMMANDS and not _slow_selected(request.config):
        pytest.skip(f"{SLOW_COMMANDS[argv]}; select it with -m slow")
    done = subprocess.run([sys.executable, *shlex.split(argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (f"{where}: `python {argv}` exited {done.returncode}:\n"
                                  f"{done.stdout[-1000:]}\n{done.stderr[-2000:]}")
    if "--check" in argv.split():
        assert "check: tokens and logits bit-identical" in done.stdout, done.stdout[-1000:]
    for problem in claim_problems(argv, done.stdout):
        pytest.fail(f"{where}: `python {argv}`: {problem}", pytrace=False)


#: What the docs say a documented command shows, beyond running: ``{argv text: [text the
#: output must contain]}`` (README: "a device pool smaller than ...").
DOCUMENTED_CLAIMS: dict[str, list[str]] = {
    "examples/tiny_dsa.py --check": ["the pool is smaller"],
}


def claim_problems(argv: str, out: str) -> list[str]:
    """What a documented command's output fails to show: its ``DOCUMENTED_CLAIMS``, and
    with ``--shared-prefix-len N`` (prefix reuse) a non-zero count of reused prompt tokens."""
    problems = [f"the output does not say {text!r}"
                for text in DOCUMENTED_CLAIMS.get(argv, []) if text not in out]
    words = argv.split()
    if "--shared-prefix-len" in words and int(words[words.index("--shared-prefix-len") + 1]):
        reused = re.search(r"(\d+) prompt tokens reused from the prefix cache", out)
        if not reused or int(reused.group(1)) == 0:
            problems.append("it shows prefix reuse, but no prompt token was reused")
    return problems


def test_claims_are_checked():
    assert claim_problems("examples/tiny_dsa.py --shared-prefix-len 64",
                          "0 prompt tokens reused from the prefix cache") != []
    assert claim_problems("examples/tiny_dsa.py --shared-prefix-len 64",
                          "128 prompt tokens reused from the prefix cache") == []
    assert claim_problems("examples/tiny_dsa.py --check", "the pool is not smaller") != []
    assert set(DOCUMENTED_CLAIMS) <= {argv for _, argv in EXAMPLE_COMMANDS}


def test_the_pool_is_compared_like_with_like():
    """The report's two pool figures count the same things: blocks for the same running
    requests at the same length, the null block in both; the pool's split adds up."""
    plan = tiny_dsa.plan_for_spec(SPEC)
    kv = plan.kv_cache_config
    longest = SPEC.workload().max_len
    pages = -(-longest // plan.block_size)
    # all-GPU: the indexer and both MLA (resident) groups' whole histories, per request
    assert tiny_dsa.all_gpu_blocks(kv, SPEC) == 1 + SPEC.running * 3 * pages
    staging = tiny_dsa.staging_blocks(plan)
    assert staging == -(-plan.config.hisparse.prefill_staging_rows // plan.block_size)
    line = tiny_dsa.pool_line(SPEC, plan)
    assert line.startswith(f"device pool {kv.num_blocks} blocks ({kv.num_blocks - staging} "
                           f"for {SPEC.running} running requests")
    assert f"{staging} of prefill staging" in line and f"of {longest} tokens each" in line
    assert f"would take {tiny_dsa.all_gpu_blocks(kv, SPEC)}: the pool is" in line


# ------------------------------------------------------------------ decode under CUDA graphs
def test_fixed_shape_decode_steps_are_bit_identical_with_padding(dense):
    """``--cuda-graph`` on CPU: every decode step runs the step the graph would replay
    (fixed batch of ``max_running`` rows; fewer running requests padded), bit-identical."""
    spec = dataclasses.replace(SPEC, cuda_graph=True)
    result, store, _, work = run_split(spec)
    assert tiny_dsa.compare(dense, result) == []
    graph = store.graph
    assert graph.eager_steps > 0 and graph.padding_rows > 0 and graph.captures == 0
    assert work.misses > 0


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fixed_shape_decode_steps_on_the_triton_backend_small():
    spec = tiny_dsa.RunSpec(num_requests=3, max_running=2, num_layers=2,
                            prompt_len_range=(70, 100), max_new_tokens=3,
                            free_block_watermark=1.0, backend="triton", cuda_graph=True)
    result, store, _, work = run_split(spec)
    assert tiny_dsa.compare(tiny_dsa.run_dense(spec), result) == []
    assert store.graph.padding_rows > 0 and work.misses > 0


def test_graph_inputs_pad_a_smaller_batch_and_padding_changes_nothing():
    spec = tiny_dsa.RunSpec(num_requests=2, max_running=3, num_layers=2,
                            prompt_len_range=(40, 60), free_block_watermark=1.0)
    scheduler, worker = tiny_dsa.build_split(spec)
    with worker:
        store = tiny_dsa.SplitStore(worker, scheduler)
        model = tiny_dsa.TinyDSA(spec.model_config())
        for rid in ("x", "y"):
            store.add(rid, 40, 4)
            store.append(rid, 40)
        store.begin()
        store.commit()
        for rid in ("x", "y"):
            store.append(rid, 1)
        store.begin()
        graph = tiny_dsa.GraphDecode(model, store, 3)
        inputs = graph.step_inputs(["y", "x"], [[5], [7]], [40, 40])
        rows = store._step_rows
        assert inputs["tokens"].tolist() == [5, 7, 0]
        assert inputs["positions"].view(-1).tolist() == [40, 40, -1]
        assert inputs["state_rows"].tolist() == [rows["rows"]["y"], rows["rows"]["x"], -1]
        assert inputs["valid"].view(-1).tolist() == [True, True, False]
        for layer, slots in inputs["slots"].items():
            assert slots.tolist() == [int(rows["slots"]["y"][layer][0]),
                                      int(rows["slots"]["x"][layer][0]), 0]
        # a step of padding rows only (the warm-up before a capture): rows -1, nothing moved
        seen = []
        resolve_rows = worker.resolve_rows

        def recorded(leader, state_rows, topk, **kwargs):
            out = resolve_rows(leader, state_rows, topk, **kwargs)
            seen.append(out.clone())
            return out

        worker.resolve_rows = recorded
        before = (worker._debug_snapshot(), worker.device_pool.tensor.clone(), worker.stats())
        graph._fill(graph.padding_inputs())
        graph.forward()
        assert seen and all(bool((rows == -1).all()) for rows in seen)
        assert before[0] == worker._debug_snapshot() and before[2] == worker.stats()
        assert torch.equal(before[1], worker.device_pool.tensor)
        store.commit()


@pytest.mark.parametrize("argv", [["--cuda-graph", "--tp", "2"],
                                  ["--cuda-graph", "--store", "facade"],
                                  ["--cuda-graph", "--spec-tokens", "2"]])
def test_cli_cuda_graph_needs_one_rank_of_the_split_store(capsys, argv):
    assert tiny_dsa.main(argv) == 2
    assert "--cuda-graph" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CUDA graph capture)")
def test_cli_cuda_graph_captures_once_and_replays_bit_identical(capsys):
    assert tiny_dsa.main(["--device", "cuda", "--backend", "triton", "--cuda-graph",
                          "--requests", "4", "--max-running", "3", "--check"]) == 0
    out = capsys.readouterr().out
    assert "captured 1 time(s), replayed" in out and "bit-identical" in out
    assert " 0 padding rows" not in out
