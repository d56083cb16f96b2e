"""``hisparse_triton.integrations.sglang``: the signatures it replaces with, its version and
signature guard, the delegation of what stays SGLang's, and (with SGLang installed) SGLang's
plugin loader finding the entry point and honouring ``SGLANG_PLUGINS``.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from hisparse_triton.integrations import sglang as plugin


def test_replacements_have_sglangs_exact_signatures():
    """Our functions take exactly SGLang 0.5.23's parameters (names, order, kinds,
    defaults), which ``register()`` also requires of the functions it replaces."""
    for name, expected in plugin.REPLACED.items():
        assert plugin._parameters(getattr(plugin, name)) == expected, name
    swap_in = inspect.signature(plugin.load_cache_to_device_buffer_mla).parameters
    assert list(swap_in)[:3] == ["top_k_tokens", "device_buffer_tokens", "host_cache_locs"]
    assert swap_in["skip_io"].default is False


def test_importing_the_plugin_imports_no_sglang():
    import subprocess
    import sys

    code = ("import sys, hisparse_triton.integrations.sglang as p; "
            "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_a_missing_sglang_is_refused(monkeypatch, caplog):
    """No SGLang distribution: ``register()`` logs why, returns False, registers nothing."""
    import importlib.metadata as metadata

    def no_sglang(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", no_sglang)
    monkeypatch.setattr(plugin, "_REGISTERED", [])
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is False
    assert "SGLang is not installed" in caplog.text
    assert plugin.providers()["load_cache_to_device_buffer_mla"] is None


def test_dsv4_replay_and_wide_top_k_run_sglangs_own(monkeypatch):
    """``copy_cache_planned_mla(is_dsv4_layout=True)`` and, on the Triton backend, a swap-in
    over ``MAX_TOP_K`` call SGLang's original functions with the caller's arguments."""
    calls = []
    monkeypatch.setitem(plugin._ORIGINALS, "copy_cache_planned_mla",
                        lambda **kw: calls.append(("copy", kw)))
    monkeypatch.setitem(plugin._ORIGINALS, "load_cache_to_device_buffer_mla",
                        lambda *args: calls.append(("swap", args)))
    i32 = torch.zeros(1, 1, dtype=torch.int32)
    plugin.copy_cache_planned_mla(
        miss_src=torch.zeros(1, 1, dtype=torch.int64), miss_dst=i32, miss_count=i32[0],
        num_real_reqs=i32[0], host_cache=torch.zeros(1), device_buffer=torch.zeros(1),
        item_size_bytes=4, is_dsv4_layout=True)
    assert calls[0][0] == "copy" and calls[0][1]["is_dsv4_layout"] is True
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "triton")
    top_k = torch.zeros(1, plugin.MAX_TOP_K + 1, dtype=torch.int32)
    plugin.load_cache_to_device_buffer_mla(top_k, *([None] * 10), plugin.MAX_TOP_K + 1, 4096)
    assert calls[1][0] == "swap" and calls[1][1][11] == plugin.MAX_TOP_K + 1


# ----------------------------------------------------------------- with SGLang installed


@pytest.mark.needs_sglang
def test_sglang_0_5_23_is_accepted():
    assert plugin.refusal() is None


@pytest.fixture
def fresh_registry(monkeypatch):
    """A registry as before any plugin ran (restored afterwards), and an unregistered
    plugin."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    monkeypatch.setattr(plugin, "_REGISTERED", [])
    HookRegistry._hooks.clear()
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(saved)


@pytest.mark.needs_sglang
def test_register_registers_two_replace_hooks_once(fresh_registry):
    from sglang.srt.plugins.hook_registry import HookType

    assert plugin.register() is True
    assert plugin.register() is True
    targets = {t: [(k, f) for k, f, _ in hooks] for t, hooks in fresh_registry._hooks.items()}
    assert targets == {f"{plugin.TARGET_MODULE}.{name}": [(HookType.REPLACE,
                                                           getattr(plugin, name))]
                       for name in plugin.REPLACED}


@pytest.mark.needs_sglang
def test_another_sglang_version_is_refused(fresh_registry, monkeypatch, caplog):
    import importlib.metadata as metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version",
                        lambda name: "0.5.24" if name == "sglang" else real(name))
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is False
    assert "SGLang 0.5.24 is installed" in caplog.text
    assert not fresh_registry._hooks


@pytest.mark.needs_sglang
@pytest.mark.parametrize("name", sorted(plugin.REPLACED))
def test_a_changed_signature_is_refused(fresh_registry, monkeypatch, caplog, name):
    """A replaced function whose parameters differ from 0.5.23's (here: one more keyword)
    makes ``register()`` refuse the whole plugin, naming the function."""
    import sglang.kernels.ops.kvcache.hisparse as kernels

    original = inspect.unwrap(getattr(kernels, name))

    def changed(*args, extra=None, **kwargs):
        return original(*args, **kwargs)

    changed.__signature__ = inspect.signature(original).replace(parameters=[
        *inspect.signature(original).parameters.values(),
        inspect.Parameter("extra", inspect.Parameter.KEYWORD_ONLY, default=None)])
    monkeypatch.setattr(kernels, name, changed)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is False
    assert f"{plugin.TARGET_MODULE}.{name} has parameters" in caplog.text
    assert not fresh_registry._hooks


@pytest.mark.needs_sglang
def test_sglang_plugins_allow_list_is_honoured(monkeypatch):
    """SGLang's loader finds the installed entry point, and skips it when ``SGLANG_PLUGINS``
    names other plugins only."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "hisparse_triton")
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert found["hisparse_triton"][0] is plugin.register
    assert found["hisparse_triton"][1] == "hisparse-triton"
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert "hisparse_triton" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
