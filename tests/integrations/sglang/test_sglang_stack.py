"""SGLang 0.5.23's own ``HiSparseCoordinator`` runs its swap-in on this project's ops, loaded
by SGLang's ``load_plugins()`` from the installed entry point: requests admitted both ways,
decode steps with misses, CUDA-graph padding rows and a follower layer; every returned row
exact, SGLang's state equal to a walk of its own CUDA kernel, ``naive_load_topk`` in
agreement (``sglang_stack``). Deliberate breakages of the swap-in are caught.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.needs_sglang

BACKEND_ENV = "HISPARSE_TRITON_BACKEND"


@pytest.fixture
def sglang_process(monkeypatch):
    from sglang_stack import setup_process

    setup_process(monkeypatch)
    return monkeypatch


def test_load_plugins_replaces_the_coordinators_swap_in(sglang_process):
    """After ``load_plugins()`` the coordinator's own names for the swap-in and the replay
    are SGLang's REPLACE wrappers around ours; the functions left to SGLang are untouched."""
    import sglang.kernels.ops.kvcache.hisparse as kernels
    import sglang.srt.managers.hisparse_coordinator as coordinator
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from hisparse_triton.integrations import sglang as plugin

    for name in plugin.REPLACED:
        target = f"{plugin.TARGET_MODULE}.{name}"
        assert target in HookRegistry._patched
        hooks = [(kind, fn) for kind, fn, _ in HookRegistry._hooks[target]]
        assert (HookType.REPLACE, getattr(plugin, name)) in hooks
        assert getattr(coordinator, name) is getattr(kernels, name)
        assert getattr(kernels, name) is not plugin._ORIGINALS[name]
    for name in plugin.NOT_REPLACED:
        assert f"{plugin.TARGET_MODULE}.{name}" not in HookRegistry._hooks
    assert plugin.providers()["load_cache_to_device_buffer_mla"] == "hisparse_triton"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_coordinator_rows_exact_on_both_backends(sglang_process, backend, fmt):
    """Eight decode steps of four requests through SGLang's coordinator on the chosen
    backend (the Triton kernels run in the interpreter here), bf16 576-element and fp8
    656-byte rows: every check of ``sglang_stack`` holds, with misses, hits and padding."""
    from sglang_stack import run_scenario

    sglang_process.setenv(BACKEND_ENV, backend)
    stats = run_scenario(sglang_process, fmt=fmt, steps=8)
    assert stats["steps"] == 8 and stats["walked"] == 16 and stats["naive"] == 16
    assert stats["misses"] > 0 and stats["padded_rows"] == 8
    assert stats["columns"] == 8 * 4 * 3 * 64


# ------------------------------------------------------------------ deliberate breakages


# Each fault gets the swap-in's arguments (SGLang's order) after the call, and the slot
# table as it was before it.


def _break_lru(args, saved):
    """LRU <-> MRU swapped for every long row (a wrong LRU update)."""
    lru, rpi, lens, hot = args[9], args[7], args[8], args[12]
    for b in range(int(args[15][0])):
        if int(lens[b]) > hot:
            lru[int(rpi[b])] = lru[int(rpi[b])].flip(0)


def _break_slots(args, saved):
    """The slot table keeps its old positions (misses not recorded)."""
    args[1].copy_(saved)


def _break_newest(args, saved):
    """The newest position's columns point one slot too low."""
    top_k, dbl, out, rpi, lens, K, H = args[0], args[3], args[6], args[7], args[8], args[11], \
        args[12]
    for b in range(int(args[15][0])):
        newest = top_k[b, :K] == int(lens[b]) - 1
        if int(lens[b]) > H and newest.any():
            out[b, :K][newest] = dbl[int(rpi[b]), H - 1]


def _break_plan(args, saved):
    """The recorded miss counts say nothing was missed."""
    if args[18] is not None:
        args[18].zero_()


BREAKAGES = {"lru": _break_lru, "slot-table": _break_slots, "newest": _break_newest,
             "plan": _break_plan, "replay": None}
#: The check that must catch each fault first.
CAUGHT_BY = {"lru": "layer 0: LRU differs from SGLang's kernel",
             "slot-table": "layer 0: slot table differs from SGLang's kernel",
             "newest": "layer 0 request .* wrong KV row", "plan": "layer 0: miss counts",
             "replay": "layer 1 request .* wrong KV row"}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_deliberate_breakages_are_caught(sglang_process, breakage):
    """The swap-in (or the follower replay) is wrapped with one deliberate fault; the same
    scenario must then fail its checks."""
    from sglang_stack import run_scenario

    from hisparse_triton.integrations import sglang as plugin
    from hisparse_triton.integrations import sglang_reference

    sglang_process.setenv(BACKEND_ENV, "torch")
    fault = BREAKAGES[breakage]

    def swap_in(*args):
        saved = args[1].clone()
        sglang_reference.load_cache_to_device_buffer_mla(*args)
        if fault is not None:
            fault(args, saved)

    def replay(**kwargs):
        if breakage != "replay":
            sglang_reference.copy_cache_planned_mla(**kwargs)

    sglang_process.setattr(plugin, "sglang_reference", types.SimpleNamespace(
        load_cache_to_device_buffer_mla=swap_in, copy_cache_planned_mla=replay))
    with pytest.raises(AssertionError, match=CAUGHT_BY[breakage]):
        run_scenario(sglang_process, steps=6, naive=False)


def test_scenario_passes_with_the_wrapper_and_no_fault(sglang_process):
    """The breakage wrapper itself changes nothing: without a fault the scenario passes."""
    from sglang_stack import run_scenario

    from hisparse_triton.integrations import sglang as plugin
    from hisparse_triton.integrations import sglang_reference

    sglang_process.setenv(BACKEND_ENV, "torch")
    sglang_process.setattr(plugin, "sglang_reference", types.SimpleNamespace(
        load_cache_to_device_buffer_mla=sglang_reference.load_cache_to_device_buffer_mla,
        copy_cache_planned_mla=sglang_reference.copy_cache_planned_mla))
    assert run_scenario(sglang_process, steps=6, naive=False)["walked"] == 12


def test_coordinator_keeps_its_spec_and_dsv4_paths():
    """The functions left to SGLang are SGLang's own objects in the coordinator."""
    import sglang.kernels.ops.kvcache.hisparse as kernels
    import sglang.srt.managers.hisparse_coordinator as coordinator

    for name in ("load_cache_to_device_buffer_spec_mla", "load_cache_to_device_buffer_dsv4_mla"):
        assert getattr(coordinator, name) is getattr(kernels, name)
        assert not hasattr(getattr(kernels, name), "__wrapped__")
