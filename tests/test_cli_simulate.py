"""``hisparse-triton simulate``: both output forms, the numbers' consistency, defaults scaled
to the preset, the cannot-miss warning, policies, bad input."""

import json
import os

import pytest
import torch

from hisparse_triton.cli import main
from hisparse_triton.link import DEFAULT_LINK_GBPS

SMALL = ["simulate", "--preset", "tiny", "--requests", "3", "--max-running", "2",
         "--prompt-len", "100",
         "--output-len", "6", "--free-block-watermark", "1"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_json(capsys, *flags):
    assert main([*SMALL, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_is_consistent(capsys):
    r = run_json(capsys)
    assert r["schema"] == "hisparse-triton/simulate" and r["schema_version"] == 1
    assert r["preset"] == "tiny" and r["device"] == "cpu" and r["verified"]
    assert r["decode_steps"] == 2 * 6 and r["resolves"] == r["decode_steps"] * 4
    assert r["resolved_rows"] == 3 * 6 * 4
    assert r["hits"] + r["misses"] + r["masked"] == r["resolved_rows"] * r["top_k"]
    assert r["misses"] > 0 and r["masked"] == 0
    assert r["rows_checked"] == (r["resolved_rows"] * r["top_k"] - r["masked"]) * 2
    assert r["h2d_bytes"] == r["misses"] * 64 * 2       # 64 B rows, leader + follower
    assert r["d2h_bytes"] == 3 * (100 + 6) * 8 * 64     # every token of 8 sparse layers
    assert r["h2d_seconds"] == pytest.approx(r["h2d_bytes"] / (r["link_gbps"] * 1e9))
    assert r["link_gbps"] == DEFAULT_LINK_GBPS and "31-37 GB/s" in r["link_source"]
    assert 0 < r["device_peak_bytes"] < r["all_gpu_peak_bytes"]
    assert r["gpu_bytes_saved"] == r["all_gpu_peak_bytes"] - r["device_peak_bytes"]
    # the documented key (it was spelled gpu_savedfraction)
    assert r["gpu_saved_fraction"] == pytest.approx(
        r["gpu_bytes_saved"] / r["all_gpu_peak_bytes"])
    assert 0 < r["hit_rate"] < 1
    assert r["warnings"] == [] and r["workload"] == "calibrated" and not r["sampled"]
    # the policies replay the same positions: LRU is the runtime's rule, Belady the optimum
    p = r["policies"]
    assert r["lru_matches_runtime"] and p["lru"]["misses"] == r["misses"]
    assert p["belady"]["misses"] <= min(p["lru"]["misses"], p["fifo"]["misses"])


def test_human_report(capsys):
    assert main([*SMALL, "--link-gbps", "25"]) == 0
    out = capsys.readouterr().out
    for text in ("hisparse-triton simulate: preset tiny", "hit rate", "at 25 GB/s",
                 "GPU memory saved", "verify: exact", "wall time", "lru", "fifo", "belady",
                 "the runtime's rule: equals its",
                 "generator calibration (the generator's own fit, not this run): LRU miss rate",
                 "published GLM-5.1", "steady state: miss rate", "from resident pages",
                 "from the hot buffer", "(miss rate"):
        assert text in out


def test_hits_split_and_the_steady_state(capsys):
    """Hits are resident-page hits plus hot-buffer hits; the steady-state miss rate leaves
    out each stream's warm-up (by default until its hot buffer is full, at most half)."""
    r = run_json(capsys, "--output-len", "12")
    assert r["resident_hits"] + r["hot_hits"] == r["hits"] and r["hot_hits"] > 0
    st = r["steady_state"]
    assert st["warmup"] == "buffer-full" and st["warmup_steps"] is None
    assert st["resolved_rows_total"] == r["resolved_rows"]
    assert r["resolved_rows"] // 2 <= st["resolved_rows"] < r["resolved_rows"]
    assert 0 < st["misses"] < r["misses"] and st["columns"] < r["hits"] + r["misses"]
    assert st["miss_rate"] == pytest.approx(st["misses"] / st["columns"])
    assert st["miss_rate"] < r["miss_rate"]  # the cold start misses most
    zero = run_json(capsys, "--output-len", "12", "--warmup-steps", "0")["steady_state"]
    assert zero["warmup"] == "steps" and zero["resolved_rows"] == r["resolved_rows"]
    assert zero["misses"] == r["misses"] and zero["miss_rate"] == pytest.approx(r["miss_rate"])
    every = run_json(capsys, "--warmup-steps", "1000")["steady_state"]
    assert every["resolved_rows"] == every["columns"] == 0
    assert main([*SMALL, "--warmup-steps", "1000"]) == 0
    assert "nothing left after the warm-up" in capsys.readouterr().out


def test_defaults_are_the_other_commands_defaults():
    from hisparse_triton.cli import build_parser
    from hisparse_triton.link import DEFAULT_LINK_GBPS
    from hisparse_triton.presets import DEFAULT_PRESET
    from hisparse_triton.simulation import SimSettings, with_defaults

    args = build_parser().parse_args(["simulate"])
    assert args.preset is None and args.device == "auto" and args.threads == 1
    assert with_defaults(SimSettings()).preset == DEFAULT_PRESET == "deepseek-v3.2-fp8"
    assert SimSettings().link_gbps == DEFAULT_LINK_GBPS
    bench = build_parser().parse_args(["bench"])
    advise = build_parser().parse_args(["advise"])
    assert bench.device == args.device  # bench's --threads: 1 on the CPU (see test_cli_bench)
    assert advise.preset == DEFAULT_PRESET


def test_pure_hisparse_and_roomy_pools_say_what_happened(capsys):
    assert main([*SMALL]) == 0   # watermark 1: pages are dropped, not kept readable
    out = capsys.readouterr().out
    assert "pages dropped from the GPU as soon as they were durable" in out
    assert "readable until their block is reused" not in out
    assert main([*SMALL[:-2], "--device-blocks", "2000"]) == 0
    out = capsys.readouterr().out
    assert "no GPU memory saved (every page stayed on the GPU)" in out
    assert "readable until their block is reused" in out
    # DeepSeek-V3.2's indexer pages take whole pool blocks: a roomy pool costs more
    assert main(["simulate", "--preset", "deepseek-v3.2-fp8", "--layers", "2", "--requests",
                 "2", "--prompt-len", "2304", "--output-len", "3", "--top-k", "256",
                 "--prefill-chunk", "1024", "--device-blocks", "400", "--policies",
                 "none"]) == 0
    out = capsys.readouterr().out
    assert "MORE GPU memory than all layers on the GPU" in out and "saved (-" not in out
    assert "the pool held every page (nothing offloaded)" in out


def test_locality_raises_the_hit_rate(capsys):
    low = run_json(capsys, "--locality", "0", "--no-verify")
    high = run_json(capsys, "--locality", "1", "--no-verify")
    assert not low["verified"] and low["rows_checked"] == 0
    assert high["hit_rate"] > low["hit_rate"]
    assert high["h2d_bytes"] < low["h2d_bytes"]


def test_progress_bar_goes_to_stderr(capsys):
    assert main([*SMALL, "--progress", "--no-verify", "--json"]) == 0
    captured = capsys.readouterr()
    assert "simulate: 100%" in captured.err and "12/12" in captured.err
    assert "<00:00" in captured.err  # elapsed<remaining: the ETA
    json.loads(captured.out)


def test_triton_backend(capsys):
    """Triton kernels inside simulate: on CUDA when present, else the interpreter on CPU."""
    device = ("cuda" if torch.cuda.is_available()
              and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    r = json.loads(_run(capsys, "simulate", "--preset", "tiny", "--layers", "4",
                        "--requests", "1",
                        "--prompt-len", "80", "--output-len", "1", "--topk", "16",
                        "--backend", "triton", "--device", device,
                        "--free-block-watermark", "1", "--json"))
    assert r["top_k"] == 16  # --topk: the hidden old spelling of --top-k
    assert r["backend"] == "triton" and r["verified"] and r["misses"] > 0
    assert r["device"].startswith(device)


def _run(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("flags,code,message", [
    (["--locality", "2"], 2, "must be in [0, 1]"),
    (["--requests", "0"], 2, "argument --requests: must be an integer in [1, "),
    # used to be a traceback from the allocator; now refused with the flag and its range
    (["--device-blocks", "99999999999999"], 2,
     "argument --device-blocks: must be an integer in [2, 2147483647]"),
    (["--device-blocks", "2000000000"], 1, "(--device-blocks): the device pool would take"),
    (["--host-blocks", "2000000000"], 1, "(--host-blocks): the host pool would take"),
    (["--seed", "-1"], 2, "argument --seed: must be an integer in [0, 4294967295]"),
    (["--seed", "4294967296"], 2, "argument --seed: must be an integer in [0, 4294967295]"),
    (["--link-gbps", "5e10"], 2, "argument --link-gbps: must be a number in [0.001, 10000] GB/s"),
    (["--top-k", "0"], 2, "argument --top-k: must be an integer in [1, 32768]"),
    (["--layers", "9"], 1, "--layers 9 exceeds the tiny preset's 8 sparse layers"),
    (["--workload", "calibrated", "--locality", "0.5"], 1, "--locality applies to"),
    (["--trace", "/nonexistent.npz"], 2, "argument --trace: '/nonexistent.npz' is not a file"),
    (["--prompt-len", "2000"], 1, "exceed the tiny preset's max context of 1024"),
    (["--device-blocks", "3"], 1, "error: cannot add request 0: its hot region needs"),
    (["--host-blocks", "8"], 1, "increase host_pool_gib"),
    # both used to end in a traceback (torch's RuntimeError) or a crash (libgomp)
    (["--device", "tpu"], 1, "error: device 'tpu' is not a torch device"),
    (["--device", "meta"], 1, "error: device 'meta': the runtime runs on a cpu or cuda"),
    (["--threads", "100000"], 1, "--threads 100000 exceeds the"),
])
def test_bad_input_one_line(capsys, flags, code, message):
    assert main([*SMALL, *flags]) == code
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_device_without_cuda(capsys):
    assert main([*SMALL, "--device", "cuda"]) == 1
    assert "CUDA is not available" in capsys.readouterr().err


def test_a_workload_that_cannot_miss_warns(capsys):
    # every history (20 + 4 tokens) is shorter than top-k (32): each step selects it all
    assert main(["simulate", "--preset", "tiny", "--requests", "2", "--prompt-len", "20",
                 "--output-len", "4",
                 "--no-verify", "--json"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert len(r["warnings"]) == 1 and "cannot miss" in r["warnings"][0]
    assert "simulate: warning: every request's history" in captured.err
    # the hot buffer (256 rows) holds every history (150 tokens): only first touches miss
    assert main(["simulate", "--preset", "tiny", "--requests", "2", "--prompt-len", "140",
                 "--output-len", "10",
                 "--device-buffer-size", "256", "--no-verify", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["warnings"]) == 1 and "holds every request's whole history" in r["warnings"][0]


def test_defaults_scale_with_the_preset():
    from hisparse_triton.simulation import SimSettings, with_defaults

    s = with_defaults(SimSettings(preset="deepseek-v3.2-fp8"))
    assert s.top_k == 2048 and s.prompt_len == 32768 and s.output_len == 64
    assert s.prompt_len > s.top_k  # misses can happen
    assert s.layers == 4 and s.sampled and s.prefill_chunk == 8192
    glm = with_defaults(SimSettings(preset="glm-5-indexshare"))
    assert glm.layers == 16 and glm.sampled  # 4 index groups of a leader and 3 followers
    tiny = with_defaults(SimSettings(preset="tiny"))
    assert tiny.layers == 8 and not tiny.sampled and tiny.prompt_len == 16 * 32
    assert tiny.prompt_len + tiny.output_len <= 1024


def test_sampled_preset_run_scales_to_the_model(capsys):
    """A big preset at small sizes: a sample of index groups, scaled to the model's count;
    the device pool is a steady state (indexer + hot region + tail), not whole histories."""
    r = json.loads(_run(capsys, "simulate", "--preset", "deepseek-v3.2-fp8", "--layers", "2",
                        "--requests", "2", "--max-running", "2", "--prompt-len", "4608",
                        "--output-len", "3", "--top-k", "256", "--prefill-chunk", "2048",
                        "--json"))
    assert r["sampled"] and r["index_groups"] == 2 and r["model_index_groups"] == 61
    assert r["misses"] > 0 and r["lru_matches_runtime"]
    assert r["h2d_bytes_per_step_model"] == pytest.approx(
        r["h2d_bytes"] / r["decode_steps"] * 61 / 2)
    assert r["device_pool_bytes"] < r["all_gpu_peak_bytes"]
    out = _run(capsys, "simulate", "--preset", "deepseek-v3.2-fp8", "--layers", "2",
               "--requests", "1", "--prompt-len", "4608", "--output-len", "2", "--top-k", "256",
               "--policies", "none")
    assert "2 of 61 sparse layers simulated" in out and "scaled to 61 index groups" in out
    assert "hot-buffer policies" not in out


def test_shared_prefix_is_reused_and_stays_exact(capsys):
    """Prompts share half their tokens: the later requests find the prefix's full pages
    cached (``add_request`` with token ids), append only the rest, and every resolved row
    still matches the dense copy (a shared position's bytes depend on the prefix only)."""
    r = run_json(capsys, "--shared-prefix", "0.5")
    assert r["shared_prefix"] == 0.5 and r["shared_prefix_tokens"] == 50
    # 50 shared tokens = 3 full pages of 16; requests 1 and 2 hit them
    assert r["prefix_hit_tokens"] == 2 * 48 and r["prefix_query_tokens"] == 3 * 100
    assert r["prefix_hit_rate"] == pytest.approx(96 / 300)
    assert r["verified"] and r["rows_checked"] > 0 and r["lru_matches_runtime"]
    assert r["d2h_bytes"] == (3 * (100 + 6) - 96) * 8 * 64   # hit tokens are not mirrored
    assert r["prefix_d2h_bytes_avoided"] == 96 * 8 * 64
    plain = run_json(capsys)
    assert plain["shared_prefix"] is None and plain["prefix_query_tokens"] == 0


def test_mtp_resolves_one_union_per_step_and_attributes_misses(capsys):
    r = run_json(capsys, "--mtp", "2")
    assert r["mtp"] == 2 and r["device_buffer_size"] == 3 * 32     # (Q + 1) x top-k
    assert r["generated_tokens"] == 3 * 6 and r["decode_steps"] == 2 * 3
    assert r["resolved_columns"] == r["resolved_rows"] * 2 * 32
    assert r["hits"] + r["misses"] + r["masked"] == r["resolved_columns"]
    assert r["misses"] > 0 and r["lru_matches_runtime"] and r["verified"]
    tokens = r["query_tokens"]
    assert [t["query"] for t in tokens] == [0, 1]
    assert sum(t["misses"] for t in tokens) == r["misses"]
    assert sum(t["columns"] for t in tokens) == r["resolved_columns"] - r["masked"]
    assert all(t["hits"] + t["misses"] == t["columns"] for t in tokens)
    assert r["misses_per_generated_token"] == pytest.approx(r["misses"] / 18)
    assert "query_tokens" not in run_json(capsys)


def test_roomy_pool_moves_nothing_and_the_chunk_limit_offloads(capsys):
    """A pool that holds everything, at the default watermark: no page leaves the GPU, no
    transfer after prefill. The engine's chunk limit makes a longer request keep only about
    one chunk pinned: it offloads, its older pages are unpinned, yet in a roomy pool no
    block is reused, so they stay readable and still nothing moves (the counterfactual
    with them dropped would have missed)."""
    roomy = ["--device-blocks", "2000", "--free-block-watermark", "0.1"]
    r = run_json(capsys, *roomy)
    assert r["device_pool_sizing"] == "given" and r["free_block_watermark"] == 0.1
    assert r["misses"] == r["h2d_bytes"] == r["unpinned_pages"] == 0
    limited = run_json(capsys, *roomy, "--max-num-batched-tokens", "32")
    assert limited["max_num_batched_tokens"] == 32 and limited["prefill_chunk"] == 32
    assert limited["unpinned_pages"] > 0 and limited["lost_pages"] == 0
    assert limited["misses"] == 0 and limited["unpinned_misses_avoided"] > 0
    assert limited["verified"] and limited["lru_matches_runtime"]
    tight = run_json(capsys, "--max-num-batched-tokens", "32")   # pure HiSparse: it misses
    assert tight["misses"] > 0 and tight["prefill_chunk"] == 32


def test_transfers_avoided_by_unpinned_pages(capsys):
    """At the default watermark in a tight pool, unpinned pages stay readable until reused;
    replaying the positions with them dropped at once misses more: the difference is what
    keeping them saved. Pure HiSparse (watermark 1) drops them: nothing is avoided."""
    flags = ["--requests", "4", "--prompt-len", "300", "--output-len", "8"]
    assert main(["simulate", "--preset", "tiny", *flags, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["unpinned_pages"] > 0 and r["unpinned_misses_avoided"] > 0
    assert r["misses_if_unpinned_dropped"] == r["misses"] + r["unpinned_misses_avoided"]
    assert r["unpinned_h2d_bytes_avoided"] == r["unpinned_misses_avoided"] * 64 * 2
    pure = run_json(capsys, "--requests", "4")
    assert pure["unpinned_pages"] > 0 and pure["unpinned_misses_avoided"] == 0


def test_human_report_of_the_serving_options(capsys):
    assert main([*SMALL, "--shared-prefix", "0.5", "--mtp", "2",
                 "--max-num-batched-tokens", "64"]) == 0
    out = capsys.readouterr().out
    for text in ("engine chunk limit 64", "a shared prefix of 50 tokens (50.0% of each prompt)",
                 "2 query tokens per decode step", "rows x (2 x 32) columns",
                 "per query token", "token 1", "misses per generated token",
                 "residency:", "pages dropped from the GPU as soon as they were durable",
                 "prefix cache: 96 of 300 prompt tokens hit"):
        assert text in out, text


@pytest.mark.parametrize("flags,code,message", [
    (["--mtp", "0"], 2, "argument --mtp: must be an integer in [1, 16]"),
    (["--shared-prefix", "1.5"], 2, "argument --shared-prefix"),
    (["--prefill-chunk", "64", "--max-num-batched-tokens", "32"], 1,
     "--prefill-chunk 64 exceeds --max-num-batched-tokens 32"),
    (["--mtp", "4", "--max-num-batched-tokens", "2"], 1, "--mtp 4 appends more tokens"),
    (["--mtp", "2", "--record", "x.npz"], 1, "cannot be combined with --trace or --record"),
])
def test_serving_options_bad_input(capsys, tmp_path, flags, code, message):
    flags = [str(tmp_path / f) if f.endswith(".npz") else f for f in flags]
    assert main([*SMALL, *flags]) == code
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_oracle_content_is_a_function_of_the_key():
    from hisparse_triton.oracle import DenseOracle, position_bytes

    pos = torch.arange(5, 9)
    a = position_bytes(3, 1, pos, 64)
    assert a.shape == (4, 64) and a.dtype == torch.uint8
    assert torch.equal(a, position_bytes(torch.full((4,), 3), 1, pos, 64))
    assert torch.equal(a[1:], position_bytes(3, 1, pos[1:], 64))
    assert not torch.equal(a, position_bytes(4, 1, pos, 64))
    assert not torch.equal(a, position_bytes(3, 2, pos, 64))

    class View:  # the two calls DenseOracle.__init__/add make
        device_layers = ["L"]
        max_num_seqs, max_model_len = 1, 8

        def device_cache(self, layer):
            return torch.zeros(2, 4, 64, dtype=torch.uint8)

        def state_row(self, request_id):
            return 0

    with pytest.raises(ValueError, match="needs a content function"):
        DenseOracle(View()).add("r", cached_tokens=4)
    oracle = DenseOracle(View(), content=lambda rid, layer, p, n: position_bytes(7, 0, p, n))
    oracle.add("r", cached_tokens=4)
    assert torch.equal(oracle.dense_rows("r", "L"), position_bytes(7, 0, torch.arange(4), 64))


def test_command_choices_match_the_library():
    from hisparse_triton import policies, workload
    from hisparse_triton.commands import simulate

    assert simulate.POLICIES == policies.POLICIES
    assert simulate.WORKLOADS == workload.WORKLOADS
