"""``examples/tiny_dsa.py``: a DeepSeek-V3.2-shaped model decoding through the runtime is
bit-identical (tokens and logits) to the same model with every KV row kept dense.

The default run: 4 layers (2 index groups of leader + follower), 4 requests of 128-320
prompt tokens (top-k 32), 3 decoded at a time, prefill in chunks of 32 with a commit after
every step, a device pool smaller than the requests' histories (misses). The check is shown
not to be vacuous: one corrupted byte of a resolved row, or one wrong row id, changes the
logits.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_dsa.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("tiny_dsa_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


tiny_dsa = _load_example()

SPEC = tiny_dsa.RunSpec(max_running=3)  # 4 requests, 3 at a time: a freed state row is reused
HAS_TRITON_BACKEND = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


class ResolveLog:
    """Wraps ``runtime.resolve`` (and ``commit``) to record calls and optionally tamper with
    one call's result: ``tamper(runtime, request_ids, topk, rows)`` returns the rows the
    store sees, or None to keep them."""

    def __init__(self, runtime, tamper=None, at_call: int = -1) -> None:
        self.calls: list[tuple[int, str, list, int]] = []  # (step, leader, ids, width)
        self.step = 0
        self.tampered = False
        resolve, commit = runtime.resolve, runtime.commit

        def logged_resolve(leader, request_ids, topk):
            rows = resolve(leader, request_ids, topk)
            self.calls.append((self.step, leader, list(request_ids), topk.shape[1]))
            if tamper is not None and len(self.calls) - 1 == at_call:
                changed = tamper(runtime, leader, request_ids, topk, rows)
                if changed is not None:
                    self.tampered = True
                    rows = changed
            return rows

        def counted_commit():
            commit()
            self.step += 1

        runtime.resolve, runtime.commit = logged_resolve, counted_commit


def run_hisparse(spec, tamper=None, at_call: int = -1):
    with tiny_dsa.build_runtime(spec) as runtime:
        log = ResolveLog(runtime, tamper, at_call)
        result = tiny_dsa.run(spec, tiny_dsa.HiSparseStore(runtime))
        stats = runtime.stats()
        pool = runtime.device_block_pool.capacity
        all_gpu = tiny_dsa.all_gpu_blocks(runtime, spec)
    return result, stats, log, pool, all_gpu


@pytest.fixture(scope="module")
def dense():
    return tiny_dsa.run_dense(SPEC)


def test_bit_identical_to_dense_under_memory_pressure(dense):
    workload = SPEC.workload()
    topk = SPEC.model_config().topk
    assert len(set(workload.prompt_lens)) == SPEC.num_requests
    assert min(workload.prompt_lens) > 2 * SPEC.chunk_size > topk   # chunked, real top-k
    result, stats, log, pool, all_gpu = run_hisparse(SPEC)

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
    # Every step resolves every index group over the batch; some prefill steps needed more
    # than one resolve (a chunk's union wider than the hot buffer), with padding rows.
    leaders = [SPEC.model_config().sparse_layer(i) for i in range(0, SPEC.num_layers, 2)]
    per_step = {}
    for step, leader, _, _ in log.calls:
        per_step[(step, leader)] = per_step.get((step, leader), 0) + 1
    assert {key[1] for key in per_step} == set(leaders)
    assert len(per_step) == result.steps * len(leaders)
    assert max(per_step.values()) > 1
    assert any(None in ids for _, _, ids, _ in log.calls)


def test_shared_prefix_and_one_request_at_a_time_stay_exact():
    spec = tiny_dsa.RunSpec(num_requests=2, prompt_len_range=(70, 110), max_new_tokens=4,
                            shared_prefix_len=48, max_running=1, chunk_size=24,
                            offload_threshold_pages=1)
    prompts = [r.prompt for r in spec.workload().requests(spec.model_config().vocab_size)]
    assert prompts[0][:48] == prompts[1][:48] and prompts[0][48:] != prompts[1][48:]
    result, stats, *_ = run_hisparse(spec)
    assert tiny_dsa.compare(tiny_dsa.run_dense(spec), result) == []
    assert stats.misses > 0


def _committed_column(runtime, request_ids, topk):
    """(row, column) of a selected position whose rows were committed before this step."""
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
        row = int(rows[r, c])
        cache[row // cache.shape[1], row % cache.shape[1], 3] ^= 0x40  # a float's exponent
        return rows
    return tamper


def _wrong_row(runtime, leader, request_ids, topk, rows):
    found = _committed_column(runtime, request_ids, topk)
    if found is None:
        return None
    r, c = found
    other = next(int(v) for v in rows[r] if v >= 0 and v != rows[r, c])
    rows = rows.clone()
    rows[r, c] = other
    return rows


@pytest.mark.parametrize("tamper", [_corrupt_byte(0), _corrupt_byte(1), _wrong_row],
                         ids=["corrupt-leader-byte", "corrupt-follower-byte", "wrong-row-id"])
def test_the_check_is_not_vacuous(dense, tamper):
    result, _, log, *_ = run_hisparse(SPEC, tamper, at_call=12)
    assert log.tampered
    problems = tiny_dsa.compare(dense, result)
    assert any("logits differ" in p for p in problems), problems


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_bit_identical_small():
    spec = tiny_dsa.RunSpec(num_requests=2, num_layers=2, prompt_len_range=(70, 100),
                            max_new_tokens=2, offload_threshold_pages=1,
                            free_block_watermark=1.0, backend="triton")
    result, stats, log, *_ = run_hisparse(spec)
    assert tiny_dsa.compare(tiny_dsa.run_dense(spec), result) == []
    assert stats.misses > 0
    assert any(None in ids for _, _, ids, _ in log.calls)


def _slow_selected(config) -> bool:
    markexpr = config.getoption("markexpr") or ""
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_backend_bit_identical_full(dense, request):
    if not torch.cuda.is_available() and not _slow_selected(request.config):
        pytest.skip("about a minute in the Triton interpreter; select it with -m slow")
    spec = tiny_dsa.RunSpec(max_running=SPEC.max_running, backend="triton")
    result, stats, *_ = run_hisparse(spec)
    assert tiny_dsa.compare(dense, result) == []
    assert stats.misses > 0


def test_cli_check(capsys):
    assert tiny_dsa.main(["--requests", "2", "--layers", "2", "--max-new-tokens", "3",
                          "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: tokens and logits bit-identical" in out and " misses" in out


def test_cli_rejects_a_workload_that_does_not_fit(capsys):
    assert tiny_dsa.main(["--prompt-len", "1000", "1100"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_hooks_refuse_what_is_not_enabled():
    with pytest.raises(NotImplementedError, match="spec_tokens=2"):
        tiny_dsa.run_dense(tiny_dsa.RunSpec(num_requests=1, spec_tokens=2))
    with pytest.raises(ValueError, match="256 B"):
        tiny_dsa.TinyDSAConfig.for_preset("tiny", kv_lora_rank=60)

    class CachedEverything(tiny_dsa.DenseStore):
        def add(self, request, prompt_len, max_new_tokens):
            super().add(request, prompt_len, max_new_tokens)
            return prompt_len

    spec = tiny_dsa.RunSpec(num_requests=1)
    store = CachedEverything(tiny_dsa.dense_store_for(spec.model_config()).row_dims)
    with pytest.raises(ValueError, match="cached tokens"):
        tiny_dsa.run(spec, store)
