"""The scheduler package as a whole: no torch when imported (the static import rules are
``test_import_rules.py``'s), one group-kind vocabulary, its public surface kept."""

import subprocess
import sys

from hisparse_triton.groups import DEVICE_KINDS, GroupKind, HotGroup, IndexerGroup
from hisparse_triton.layout import GROUP_KINDS, group_kind
from hisparse_triton.specs import GroupKind as SpecsGroupKind
from scheduler_plans import make_plan, make_scheduler


def test_importing_the_scheduler_package_imports_no_torch():
    code = ("import sys\n"
            "import hisparse_triton.scheduler\n"
            "from hisparse_triton.scheduler import (block_pool, capacity, coordinator,\n"
            "    invariants, journal, managers, plan_builder, prefix_cache, requests,\n"
            "    residency, scheduler, stats)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_one_group_kind_vocabulary():
    assert GroupKind is SpecsGroupKind
    assert GROUP_KINDS == ("source", "indexer", "resident", "hot", "regular")
    assert set(DEVICE_KINDS) == set(GroupKind) - {GroupKind.SOURCE}
    plan = make_plan(full=True, window=True)
    kvc = plan.kv_cache_config
    topology = kvc.hisparse_topology
    for index, group in enumerate(kvc.kv_cache_groups):
        kind = group_kind(group)
        assert kind is topology.kind_of(index) and kind == kind.value
        assert f"{kind}" == str(kind) == kind.value                 # prints as before
    s = make_scheduler(full=True, window=True)
    for group, m in zip(s.groups.groups, s.devices.managers):
        assert group.kind is group_kind(group.spec) and m.group is group
    assert IndexerGroup.kind == "indexer" and HotGroup.kind == "hot"


def test_public_surface_is_kept():
    from hisparse_triton import scheduler as package

    assert set(package.__all__) >= {"HiSparseScheduler", "SchedulerStats",
                                    "DEFAULT_FREE_BLOCK_WATERMARK", "check_id_list",
                                    "check_request_id"}
    s = make_scheduler()
    for name in ("add_request", "append_slots", "append_group_rows", "append_decode",
                 "free_request", "step", "stats", "reset_stats", "state_rows", "block_table",
                 "host_block_table", "reset_prefix_cache", "can_admit", "can_append",
                 "check_invariants", "close", "_debug_snapshot"):
        assert callable(getattr(s, name)), name
    for name in ("journal", "device_block_pool", "host_block_pool", "layout", "leaders",
                 "row_layer_names", "available_device_blocks", "truly_free_device_blocks",
                 "has_pending_changes", "step_count"):
        getattr(s, name)
