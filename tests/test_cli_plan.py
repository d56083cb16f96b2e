"""``hisparse-triton plan``: human and JSON output, bad input, and a torch-free fast start."""

import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

from hisparse_triton import cli
from hisparse_triton.config import GIB


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", "--json", *argv)
    assert code == 0 and err == ""
    return json.loads(out)


def test_json_default_is_the_worked_example(capsys):
    report = plan_json(capsys, "--host-pool-gib", "64")
    assert report["preset"] == "deepseek-v3.2-fp8"
    assert report["max_model_len"] == 163_840
    assert report["host_block_stride"] == 2_561_024
    assert report["host_num_blocks"] == 26_832
    assert report["shared_host_pool"] is False
    assert report["bytes_per_block"] == 515_328
    assert report["num_gpu_blocks"] == 80 * GIB // 515_328
    assert report["host_bytes_per_token"] == 40_016
    assert report["device_bytes_per_token"] == 8052
    roles = [g["role"] for g in report["groups"]]
    assert roles == ["source", "indexer"] + ["resident"] * 6 + ["hot"] * 6
    source = report["groups"][0]
    assert source["layers"] == 61 and source["host_resident"] is True
    assert source["page_size_bytes"] == 2_561_024 and source["group_role"] == "hisparse_source"
    assert [g["layers"] for g in report["groups"][2:8]] == [12] * 5 + [1]
    assert all(set(g) >= {"role", "layers", "page_size_bytes", "host_resident"}
               for g in report["groups"])
    assert report["steady_state_concurrency"] == pytest.approx(
        min(report["gpu_concurrency"], report["host_concurrency"]))
    assert report["host_concurrency"] == pytest.approx(26_832 / 2560)
    assert report["baseline_concurrency"] == pytest.approx(80 * GIB / (2560 * 64 * 48_068))
    assert report["concurrency_gain"] == pytest.approx(
        report["steady_state_concurrency"] / report["baseline_concurrency"])


def test_json_flags_change_the_plan(capsys):
    report = plan_json(capsys, "--tp", "8")
    assert report["shared_host_pool"] is True and report["host_block_stride"] == 2_564_096
    report = plan_json(capsys, "--tp", "8", "--no-shared-host-pool")
    assert report["shared_host_pool"] is False and report["host_block_stride"] == 2_561_024
    report = plan_json(capsys, "--shared-host-pool")
    assert report["shared_host_pool"] is True
    report = plan_json(capsys, "--device-buffer-size", "8192", "--max-model-len", "65536",
                       "--gpu-memory-gib", "40")
    hot = [g for g in report["groups"] if g["role"] == "hot"]
    assert all(g["blocks_per_request"] == 128 for g in hot)
    assert report["max_model_len"] == 65_536 and report["gpu_memory_bytes"] == 40 * GIB
    small = plan_json(capsys, "--gpu-memory-gib", "20")["steady_state_concurrency"]
    large = plan_json(capsys, "--gpu-memory-gib", "200")["steady_state_concurrency"]
    assert small < large


@pytest.mark.parametrize("preset", ["deepseek-v3.2-bf16", "glm-5", "glm-5-indexshare", "tiny"])
def test_every_preset_plans(capsys, preset):
    report = plan_json(capsys, "--preset", preset)
    assert report["preset"] == preset and report["steady_state_concurrency"] > 0


def test_human_output(capsys):
    code, out, err = run_cli(capsys, "plan")
    assert code == 0 and err == ""
    assert "HiSparse plan: deepseek-v3.2-fp8" in out
    assert "source" in out and "host (pinned)" in out and "indexer" in out
    assert out.count(" resident ") == 6 and out.count(" hot ") == 6
    assert "2,561,024" in out and "515,328" in out
    assert "host 40,016 B" in out and "device 8,052 B" in out
    assert "all-GPU baseline" in out
    assert re.search(r"gain +\d+\.\d\dx$", out.rstrip())


def test_human_output_shared_pool(capsys):
    code, out, _ = run_cli(capsys, "plan", "--tp", "4")
    assert code == 0 and "shared by 4 TP ranks" in out and "2,564,096" in out


@pytest.mark.parametrize("argv, code, needle", [
    (["plan", "--tp", "0"], 2, "argument --tp: must be an integer in [1, 1024], got '0'"),
    (["plan", "--gpu-memory-gib", "-3"], 2,
     "argument --gpu-memory-gib: must be a number in [1e-06, 4096] GiB, got '-3'"),
    (["plan", "--host-pool-gib", "lots"], 2, "argument --host-pool-gib: expected a number"),
    (["plan", "--preset", "llama"], 2, "argument --preset: invalid choice: 'llama'"),
    (["plan", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["plan", "--host-pool-gib", "1"], 1,
     "host pool has 419 blocks but one request at max_model_len=163840 needs 2562"),
    (["plan", "--device-buffer-size", "100"], 1,
     "device_buffer_size=100 is smaller than max_decode_query_len * index_topk = 2048"),
    (["plan", "--device-buffer-size", "40000"], 2,
     "argument --device-buffer-size: must be an integer in [1, 32768] rows, got '40000'"),
    (["plan", "--gpu-memory-gib", "0.0001"], 1, "it needs at least 2"),
    # implausibly large amounts (bytes given as GiB) are refused while parsing the flags
    (["plan", "--gpu-memory-gib", "1e300"], 2, "argument --gpu-memory-gib: must be a number in"),
    (["plan", "--gpu-memory-gib", "80e9"], 2,
     "argument --gpu-memory-gib: must be a number in [1e-06, 4096] GiB, got '80e9' (a value "
     "this large is surely bytes; the flag takes GiB)"),
    (["plan", "--host-pool-gib", "1e290"], 2,
     "argument --host-pool-gib: must be a number in [1e-06, 65536] GiB, got '1e290'"),
    (["plan", "--host-pool-gib", "nan"], 2, "argument --host-pool-gib: must be a number in"),
    (["plan", "--max-num-batched-tokens", "0"], 2,
     "argument --max-num-batched-tokens: must be an integer in [1, 16777216] tokens"),
    (["plan", "--top-k", "0"], 2, "argument --top-k: must be an integer in [1, 32768]"),
    (["plan", "--pp", "0"], 2, "argument --pp: must be an integer in [1, 1024], got '0'"),
    (["plan", "--nodes", "100000"], 2, "argument --nodes: must be an integer in [1, 4096]"),
    (["plan", "--tp", "8", "--nodes", "2", "--shared-host-pool"], 1,
     "shared_host_pool=True needs every rank on one node and no pipeline parallelism"),
    (["plan", "--tp", "8", "--pp", "2", "--shared-host-pool"], 1,
     "but num_nodes=1 and pipeline_parallel_size=2"),
    (["plan", "--max-model-len", "300000"], 1,
     "max_model_len 300,000 exceeds the deepseek-v3.2-fp8 preset's max context of 163,840"),
])
def test_bad_input_is_one_line_on_stderr(capsys, argv, code, needle):
    got, out, err = run_cli(capsys, *argv)
    assert got == code
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert needle in err and err.startswith("hisparse-triton")
    assert "Traceback" not in err


def test_help_exits_zero(capsys):
    code, out, _ = run_cli(capsys, "plan", "--help")
    assert code == 0 and "--gpu-memory-gib" in out and "--no-shared-host-pool" in out
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "plan" in out


def test_console_script_entry_point():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("hisparse-triton") == "hisparse_triton.cli:main"


def test_commands_are_registered_by_module():
    assert "hisparse_triton.commands.plan" in cli.COMMAND_MODULES


NO_TORCH = """
import sys
from hisparse_triton.cli import main
code = main(["plan", "--json"])
heavy = sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
raise SystemExit(code)
"""


def test_plan_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "HEAVY=", proc.stderr
    assert json.loads(proc.stdout)["host_block_stride"] == 2_561_024


def test_python_m_subprocess_output_and_errors():
    ok = subprocess.run([sys.executable, "-m", "hisparse_triton", "plan", "--preset", "tiny"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "HiSparse plan: tiny" in ok.stdout and ok.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "hisparse_triton", "plan", "--tp", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "argument --tp: expected an integer, got 'x'" in bad.stderr


def test_json_row_aligned_and_in_flight_keys(capsys):
    report = plan_json(capsys, "--row-aligned-blocks", "--max-num-batched-tokens", "8192")
    assert report["schema"] == "hisparse-triton/plan" and report["schema_version"] == 1
    assert list(report)[:2] == ["schema", "schema_version"]
    assert report["row_aligned_blocks"] is True and report["max_num_batched_tokens"] == 8192
    assert (report["bytes_per_block"], report["num_gpu_blocks"]) == (545_792, 157_384)
    alignment = report["row_alignment"]
    assert alignment["unaligned_bytes_per_block"] == 515_328
    assert alignment["unaligned_num_gpu_blocks"] == 166_688
    assert alignment["blocks_lost"] == 166_688 - 157_384
    assert alignment["padding_bytes_per_block"] == 545_792 - 515_328
    assert alignment["rows_per_block"] == [{"row_bytes": 656, "rows_per_block": 832}]
    resident = [g for g in report["groups"] if g["role"] == "resident"]
    assert all(g["blocks_per_request"] == 128 for g in resident)
    assert report["admission_blocks_per_request"] == 2560 + 6 * 128 + 6 * 64
    topology = report["topology"]
    assert topology["resident_groups"] == [2, 3, 4, 5, 6, 7]
    assert topology["hot_groups"] == [8, 9, 10, 11, 12, 13]
    assert [g["paired_group"] for g in report["groups"][2:4]] == [8, 9]
    assert report["groups"][0]["paired_group"] is None
    assert len(topology["index_groups"]) == 61
    assert topology["index_groups"][13] == {
        "leader": "model.layers.13.self_attn.attn", "layers": ["model.layers.13.self_attn.attn"],
        "resident_group": 3, "hot_group": 9}
    assert report["warnings"] == []


def test_max_concurrent_batches_widens_the_admission_window(capsys):
    one = plan_json(capsys, "--max-num-batched-tokens", "8192")
    assert (one["max_concurrent_batches"], one["in_flight_tokens"]) == (1, 8192)
    two = plan_json(capsys, "--max-num-batched-tokens", "8192", "--max-concurrent-batches", "2")
    assert (two["max_concurrent_batches"], two["in_flight_tokens"]) == (2, 16_384)
    assert two["schema_version"] == 1
    resident = [g for g in two["groups"] if g["role"] == "resident"]
    assert all(g["blocks_per_request"] == 256 for g in resident)
    assert two["admission_blocks_per_request"] == one["admission_blocks_per_request"] + 6 * 128
    assert two["gpu_concurrency"] < one["gpu_concurrency"]
    _, out, _ = run_cli(capsys, "plan", "--max-num-batched-tokens", "8192",
                        "--max-concurrent-batches", "2")
    assert "max_num_batched_tokens 8,192 x 2 batches in flight = 16,384 tokens" in out
    unset = plan_json(capsys, "--max-concurrent-batches", "2")
    assert unset["in_flight_tokens"] == unset["max_model_len"]
    code, _, err = run_cli(capsys, "plan", "--max-concurrent-batches", "0")
    assert code == 2 and "argument --max-concurrent-batches: must be an integer in [1, " in err


def test_json_glm5_index_share_row_aligned(capsys):
    report = plan_json(capsys, "--preset", "glm-5-indexshare", "--row-aligned-blocks")
    assert (report["bytes_per_block"], report["num_gpu_blocks"]) == (209_920, 409_200)
    groups = report["topology"]["index_groups"]
    assert len(groups) == 20 and groups[0]["layers"][-1] == "model.layers.3.self_attn.attn"


def test_row_alignment_cost_is_shown_either_way(capsys):
    code, out, _ = run_cli(capsys, "plan")
    assert code == 0
    assert "row-aligned  off; --row-aligned-blocks: 515,328 -> 545,792 B per block" in out
    assert "9,304 fewer blocks (5.6%)" in out
    code, out, _ = run_cli(capsys, "plan", "--row-aligned-blocks")
    assert "row-aligned  on: 515,328 -> 545,792 B per block (832 rows of 656 B)" in out
    assert "device pool  157,384 blocks x 545,792 B" in out


def test_human_output_explains_the_gain(capsys):
    _, out, _ = run_cli(capsys, "plan", "--max-num-batched-tokens", "8192")
    assert "the sparse-MLA history lives in pinned host memory" in out
    assert "only the indexer cache, its newest 2 pages (resident tail)" in out
    assert "max_num_batched_tokens 8,192" in out


def test_device_buffer_warning_line_and_json(capsys):
    code, out, err = run_cli(capsys, "plan", "--device-buffer-size", "4100")
    assert code == 0 and err == ""
    assert "  warning: device_buffer_size=4100 is not a multiple of block_size=64" in out
    report = plan_json(capsys, "--device-buffer-size", "4100")
    assert len(report["warnings"]) == 1 and "60 of them are never used" in report["warnings"][0]


def test_parallel_flags_and_shared_pool_auto_rule(capsys):
    assert plan_json(capsys, "--tp", "8")["shared_host_pool"] is True
    across = plan_json(capsys, "--tp", "8", "--nodes", "2")
    assert across["shared_host_pool"] is False and across["num_nodes"] == 2
    staged = plan_json(capsys, "--tp", "8", "--pp", "2")
    assert staged["shared_host_pool"] is False and staged["pipeline_parallel_size"] == 2


def test_top_k_flag_and_hidden_alias(capsys):
    assert plan_json(capsys, "--top-k", "1024")["device_buffer_size"] == 2048
    assert plan_json(capsys, "--topk", "512")["index_topk"] == 512
    code, out, _ = run_cli(capsys, "plan", "--help")
    assert "--top-k" in out and "--topk" not in out
    assert "--row-aligned-blocks" in out and "--max-num-batched-tokens" in out


def test_json_to_a_file_prints_the_report(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "plan", "--json", str(target), "--preset", "tiny")
    assert code == 0 and err == "" and "HiSparse plan: tiny" in out
    document = json.loads(target.read_text())
    assert document["schema"] == "hisparse-triton/plan" and document["preset"] == "tiny"
    code, out, _ = run_cli(capsys, "plan", "--json", "-", "--preset", "tiny")
    assert json.loads(out)["preset"] == "tiny"


def test_console_script_prints_the_new_keys():
    script = os.path.join(os.path.dirname(sys.executable), "hisparse-triton")
    if not os.path.exists(script):
        pytest.skip("the hisparse-triton console script is not installed next to this Python")
    proc = subprocess.run([script, "plan", "--row-aligned-blocks", "--max-num-batched-tokens",
                           "8192", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    report = json.loads(proc.stdout)
    assert report["row_aligned_blocks"] is True and report["max_num_batched_tokens"] == 8192
    assert report["row_alignment"]["blocks_lost"] == 9304 and "topology" in report


def test_prefill_staging_memory_is_shown(capsys):
    """DeepSeek-V3.2 at 163,840 tokens: a chunk of one request stages at most 163,840 rows
    (2,560 blocks, 1.23 GiB of the pool, lent for its step by default); a call writes only its
    index group's 656 B rows of them (102.5 MiB). A reserved region is shown as such."""
    report = plan_json(capsys, "--max-num-batched-tokens", "8192", "--host-pool-gib", "64")
    p = report["prefill_staging"]
    assert p["mode"] == "lent" and p["reserved_blocks"] == 0 and p["reserved_bytes"] == 0
    assert p["chunk_rows"] == 163_840 and p["chunk_blocks"] == 2560
    assert p["chunk_bytes"] == 2560 * 515_328
    assert p["group_row_bytes"] == 656 and p["chunk_written_bytes"] == 163_840 * 656
    assert p["workspace_bytes"] == 4 * 26_832 * 64 + 8 * 163_840
    small = plan_json(capsys, "--max-num-batched-tokens", "16")["prefill_staging"]
    assert small["chunk_rows"] == 16 * 2048                 # T x top-k below the history
    reserved = plan_json(capsys, "--prefill-staging-rows", "1000")["prefill_staging"]
    assert reserved["mode"] == "reserved" and reserved["reserved_blocks"] == 16
    assert reserved["reserved_bytes"] == 16 * 515_328
    code, out, err = run_cli(capsys, "plan", "--max-num-batched-tokens", "8192")
    assert code == 0 and "staging rows lent per step" in out
    assert "163,840 rows: 2,560 blocks = 1.23 GiB" in out and "102.50 MiB" in out
    glm = plan_json(capsys, "--preset", "glm-5-indexshare")["prefill_staging"]
    assert glm["group_row_bytes"] == 4 * 656                # four layers share an indexer
