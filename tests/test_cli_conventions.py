"""Conventions every command of the CLI follows (simulate, bench, tune, advise, metrics):
bare command prints help, ``--json PATH|-`` with a schema name and version, ``--top-k`` with
the hidden ``--topk`` alias, bounded seeds and numbers, normal file permissions, one progress
bar."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from hisparse_triton import tuning_cache
from hisparse_triton.cli import build_parser, main


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "cache") + "/")
    tuning_cache.invalidate()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    tuning_cache.invalidate()


#: A fast invocation of every command this suite checks (bare ``--json`` = stdout).
COMMANDS = {
    "simulate": ["simulate", "--preset", "tiny", "--requests", "1", "--prompt-len", "48",
                 "--output-len", "2",
                 "--no-verify"],
    "bench": ["bench", "--rows", "64", "--row-bytes", "32", "--layers", "1", "--ops", "gather",
              "--methods", "torch", "--top-k", "16", "--warmup-ms", "0.5", "--rep-ms", "1",
              "--device", "cpu"],
    "tune": ["tune", "--dry-run", "--kernel", "gather", "--layers", "1", "--quick"],
    "advise": ["advise", "--preset", "tiny", "--buffers", "32", "--block-sizes", "16",
               "--steps", "8", "--streams", "1"],
    "metrics": ["metrics", "--requests", "1", "--prompt-len", "48", "--output-len", "2",
                "--no-verify"],
}


def test_bare_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hisparse-triton")
    for command in ("plan", "simulate", "bench", "tune", "advise", "metrics"):
        assert f"    {command} " in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_bare_json_is_stdout_with_schema_and_version(command, capsys):
    assert main([*COMMANDS[command], "--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # nothing else on stdout
    assert doc["schema"] == f"hisparse-triton/{command}"
    assert isinstance(doc["schema_version"], int) and doc["schema_version"] >= 1
    assert list(doc)[:2] == ["schema", "schema_version"]
    assert captured.err.strip()  # the human report went to stderr


@pytest.mark.parametrize("command", ["simulate", "advise"])
def test_json_file_has_normal_permissions(command, tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main([*COMMANDS[command], "--json", str(path)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert json.loads(path.read_text())["schema"] == f"hisparse-triton/{command}"
    assert capsys.readouterr().out.strip()  # the report on stdout


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_top_k_flag_and_hidden_alias(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    help_text = sub.format_help()
    assert "--top-k" in help_text and "--topk" not in help_text
    base = COMMANDS[command][:1]
    assert parser.parse_args([*base, "--topk", "64"]).top_k == 64
    assert parser.parse_args([*base, "--top-k", "64"]).top_k == 64


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("seed, ok", [("0", True), ("4294967295", True), ("-1", False),
                                      ("4294967296", False)])
def test_seed_range(command, seed, ok, capsys):
    parser = build_parser()
    if ok:
        assert parser.parse_args([command, "--seed", seed]).seed == int(seed)
        return
    assert main([command, "--seed", seed]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"argument --seed: must be an integer in [0, 4294967295], got "
                        f"'{seed}'") and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, flag", [
    (["simulate", "--device-blocks", "99999999999999"], "--device-blocks"),
    (["simulate", "--link-gbps", "1e12"], "--link-gbps"),
    (["bench", "--rows", "99999999999"], "--rows"),
    (["bench", "--hot-slots", "100000"], "--hot-slots"),
    (["tune", "--rows", "0"], "--rows"),
    (["tune", "--rep-ms", "1e9"], "--rep-ms"),
    (["advise", "--step-ms", "0"], "--step-ms"),
    (["advise", "--block-sizes", "0"], "--block-sizes"),
])
def test_out_of_range_names_the_flag_and_range(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"argument {flag}: must be" in err and " in [" in err


@pytest.mark.parametrize("command", ["simulate", "bench", "advise", "metrics"])
def test_one_progress_bar_with_an_eta(command, capsys):
    argv = [a for a in COMMANDS[command]]
    assert main([*argv, "--progress"]) == 0
    err = capsys.readouterr().err
    label = command + ": 100%|"
    assert label in err, err[-500:]
    line = err[err.rindex(label):].splitlines()[0]
    assert "<00:00" in line and "/s]" in line  # elapsed<remaining (the ETA), a rate


def _options(parser, name: str = ""):
    """``(command, action)`` of every option of every (sub)command of ``parser``."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _options(sub, f"{name} {sub_name}".strip())
        elif action.option_strings and action.help != argparse.SUPPRESS \
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


def test_every_flag_that_takes_a_value_shows_its_default():
    missing = [f"{command} {action.option_strings[0]}"
               for command, action in _options(build_parser())
               if action.nargs != 0 and "default" not in (action.help or "").lower()]
    assert missing == [], f"--help shows no default for: {', '.join(missing)}"


def test_device_takes_the_same_values_in_every_command(capsys):
    devices = {command: action for command, action in _options(build_parser())
               if "--device" in action.option_strings}
    assert set(devices) >= {"simulate", "bench", "metrics"}
    assert len({(a.metavar, a.default, a.help.split(": ", 1)[1])
                for a in devices.values()}) == 1
    assert all(a.help.endswith("cpu, cuda or cuda:N") for a in devices.values())
    for command in devices:
        parser = build_parser()
        assert parser.parse_args([command, "--device", "cuda:1"]).device == "cuda:1"
    if not torch.cuda.is_available():   # the value is accepted, the machine has no CUDA
        for command in ("bench", "simulate"):
            assert main([command, "--device", "cuda:1"]) == 1
            err = capsys.readouterr().err
            assert "--device cuda:1: CUDA is not available" in err, err
