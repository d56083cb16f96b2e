"""``hisparse-triton plan``: human and JSON output, bad input, and a torch-free fast start."""

import json
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
    (["plan", "--tp", "0"], 2, "argument --tp: must be an integer >= 1, got '0'"),
    (["plan", "--gpu-memory-gib", "-3"], 2, "argument --gpu-memory-gib: must be a finite number"),
    (["plan", "--host-pool-gib", "lots"], 2, "argument --host-pool-gib: expected a number"),
    (["plan", "--preset", "llama"], 2, "argument --preset: invalid choice: 'llama'"),
    (["plan", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["plan", "--host-pool-gib", "1"], 1,
     "host pool has 419 blocks but one request at max_model_len=163840 needs 2562"),
    (["plan", "--device-buffer-size", "100"], 1,
     "device_buffer_size=100 is smaller than max_decode_query_len * index_topk = 2048"),
    (["plan", "--device-buffer-size", "40000"], 1, "exceeds the maximum of 32768"),
    (["plan", "--gpu-memory-gib", "0.0001"], 1, "it needs at least 2"),
    # finite GiB whose byte count overflows a float: was an OverflowError traceback
    (["plan", "--gpu-memory-gib", "1e300"], 1, "gpu_memory_gib must be a finite number > 0"),
    (["plan", "--host-pool-gib", "1e300"], 1, "host_pool_gib must be a finite number > 0"),
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
