"""``simulate --verdict`` agrees with ``advise`` run on the same trace.

One run of the tiny preset records its top-k positions (``--record``) and ends with the live
verdict (its runtime's counters, sampled after every decode step, fed to the advise model);
then ``advise --trace`` measures every setting's miss rate on the recorded positions with
the same model inputs. Stated tolerances: the same recommended setting; the deployment's own
setting's miss rate within 1.5 points and its throughput estimate within 2%; the recommended
setting's throughput within 5% (the verdict carries the observed rate to the other buffer
sizes along the calibrated curve's shape, advise measures them).

The workload is one wave of requests (no request starts after the verdict's warm-up: the
live counters cannot leave a late request's cold start out, advise's streams do) under pure
HiSparse residency (``--free-block-watermark 1``: only the active tail on the GPU, advise's
steady-state assumption).
"""

from __future__ import annotations

import json

import pytest

from hisparse_triton.cli import main

MODEL = ["--gpu-memory-gib", "0.01", "--host-pool-gib", "1", "--step-ms", "1:1,64:2"]
RUN = ["simulate", "--preset", "tiny", "--requests", "4", "--max-running", "4",
       "--output-len", "256", "--free-block-watermark", "1", "--no-verify", "--policies",
       "none", "--no-progress"]


@pytest.mark.parametrize("link, mode", [("0.2", "hisparse"), ("0.02", "all-gpu")])
def test_the_verdict_agrees_with_advise_on_the_same_trace(link, mode, tmp_path, capsys):
    trace, sim_json, adv_json = (tmp_path / n for n in ("run.npz", "sim.json", "adv.json"))
    assert main([*RUN, "--record", str(trace), "--verdict", *MODEL, "--link-gbps", link,
                 "--json", str(sim_json)]) == 0
    out = capsys.readouterr().out
    report = json.loads(sim_json.read_text())
    verdict = report["verdict"]
    assert verdict["text"] in out.splitlines()          # printed at the end of the report
    assert verdict["window"]["warmup_steps"] == 64      # the first quarter of 256 steps
    context = report["prompt_len"] + report["output_len"]
    assert main(["advise", "--preset", "tiny", "--trace", str(trace), "--context-len",
                 str(context), "--block-sizes", str(report["block_size"]), *MODEL,
                 "--link-gbps", link, "--no-progress", "--json", str(adv_json)]) == 0
    advice = json.loads(adv_json.read_text())
    # Same sweep, same model inputs.
    mine = verdict["advice"]
    for key in ("preset", "context_len", "top_k", "gpu_memory_gib", "host_pool_gib",
                "link_gbps", "step_model", "block_sizes"):
        assert mine[key] == advice[key], key
    assert [r["device_buffer_size"] for r in mine["settings"]] == \
        [r["device_buffer_size"] for r in advice["settings"]] == [32, 64, 128, 256]
    # The recommendation.
    rec, theirs = verdict["recommended"], advice["recommended"]
    assert rec["mode"] == theirs["mode"] == mode
    assert (rec["block_size"], rec["device_buffer_size"]) == \
        (theirs["block_size"], theirs["device_buffer_size"])
    assert rec["tokens_per_s"] == pytest.approx(theirs["tokens_per_s"], rel=0.05)
    # The deployment's own setting (block 16, buffer 64).
    own = next(r for r in advice["settings"] if r["device_buffer_size"] == 64)
    assert verdict["device_buffer_size"] == 64 and verdict["block_size"] == 16
    assert verdict["miss_rate"] == pytest.approx(own["miss_rate"], abs=0.015)
    assert verdict["tokens_per_s"] == pytest.approx(own["tokens_per_s"], rel=0.02)
    assert verdict["all_gpu_tokens_per_s"] == pytest.approx(advice["all_gpu"]["tokens_per_s"])
    assert verdict["speedup_vs_all_gpu"] == pytest.approx(
        own["tokens_per_s"] / advice["all_gpu"]["tokens_per_s"], rel=0.02)


def test_the_window_is_the_runtime_s_own_counters(tmp_path, capsys):
    """The verdict's miss rate is the runtime's counters over the steps after the warm-up:
    with no warm-up, the whole run's (the report's own hits and misses)."""
    path = tmp_path / "sim.json"
    assert main(["simulate", "--preset", "tiny", "--requests", "2", "--output-len", "16",
                 "--no-verify", "--policies", "none", "--no-progress", "--verdict",
                 "--warmup-steps", "0", *MODEL, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    window = report["verdict"]["window"]
    assert window["since_start"] and window["warmup_steps"] == 0
    assert (window["observed_hits"], window["observed_misses"]) == (report["hits"],
                                                                     report["misses"])
    assert report["verdict"]["miss_rate"] == pytest.approx(report["miss_rate"])
    capsys.readouterr()


def test_verdict_flags_need_the_verdict(capsys):
    assert main(["simulate", "--preset", "tiny", "--step-ms", "5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("hisparse-triton simulate: error: --step-ms set the live verdict's model: "
                   "add --verdict.")


def test_without_the_flag_there_is_no_verdict(tmp_path, capsys):
    path = tmp_path / "sim.json"
    assert main(["simulate", "--preset", "tiny", "--requests", "1", "--output-len", "2",
                 "--no-verify", "--no-progress", "--json", str(path)]) == 0
    assert "verdict" not in json.loads(path.read_text())
    assert "HiSparse verdict" not in capsys.readouterr().out


def test_a_sampled_run_is_judged_with_advise_s_budgets():
    """A large preset is simulated on a few index groups: their pools do not describe the
    model, so the verdict takes advise's budgets unless given (the preset is the run's)."""
    from hisparse_triton.metrics import VerdictSettings
    from hisparse_triton.simulation import SimSettings, _whole_model_verdict, with_defaults

    sampled = with_defaults(SimSettings(preset="deepseek-v3.2-fp8"))
    assert sampled.sampled
    v = _whole_model_verdict(VerdictSettings(preset=None), sampled)
    assert (v.preset, v.gpu_memory_gib, v.host_pool_gib) == ("deepseek-v3.2-fp8", 80.0, 256.0)
    given = _whole_model_verdict(VerdictSettings(preset=None, gpu_memory_gib=40.0), sampled)
    assert (given.gpu_memory_gib, given.host_pool_gib) == (40.0, 256.0)
    whole = _whole_model_verdict(VerdictSettings(preset=None),
                                 with_defaults(SimSettings(preset="tiny")))
    assert (whole.preset, whole.gpu_memory_gib, whole.host_pool_gib) == ("tiny", None, None)
