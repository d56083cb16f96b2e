"""vLLM 0.33.0's HiSparse stack on a CPU, driven step by step, with every attention row checked.

Scheduler side (all vLLM's own): the HiSparse planner (``vllm.v1.hisparse.layout``) -> vLLM's
``Scheduler`` with its ``KVCacheManager`` (source / resident / hot managers) ->
``HiSparseCoordinator`` -> ``HiSparseConnector`` (scheduler role), which emits each step's
``HiSparseConnectorMetadata``.

Worker side (vLLM's own): ``SparseMLAIndexGroupBuilder`` / ``HiSparseMLAIndexGroup`` create one
``HiSparseRuntime`` per sparse layer (leaders and followers), ``init_hisparse_kv_cache`` allocates
and binds the host pool and the device slab, ``HiSparseConnector`` (worker role) /
``HiSparseConnectorWorker`` run the step (residency updates, state rows, mirrors, spills,
invalidation). The ops they call are whatever ``torch.ops._C_cache_ops`` holds: here ours,
registered by vLLM's plugin loader from this project's entry point.

What this module plays itself is vLLM's model runner and model, as little as it can: request
state rows and per-batch-row block tables / slot mappings (``FakeBlockTables``, the
``InputBatch`` fields the connector reads), the attention metadata fields HiSparse reads, the
KV rows a model would write (a pure function of layer, position and the token prefix, so a
recomputed or prefix-shared row is the same bytes), the indexer's top-k choices, and the
attention layer's calls into the index group, in the order ``MLAAttention`` and the sparse
MLA backends make them. Every row an attention kernel would read (decode rows through the
resolve op, resident prefill rows, staged prefill rows, the FP8 up-converted workspace) is
compared with the row the model wrote there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

ROW_BYTES = 656  # fp8_ds_mla: 512 fp8 e4m3 + 4 fp32 scales + 64 bf16 rope
UPCONVERTED_WIDTH = 576  # bf16: 512 dequantised + 64 rope
VOCAB = 50_000


@dataclass(frozen=True)
class StackShape:
    """A small DeepSeek-V3.2-like geometry (fp8_ds_mla rows) and serving limits."""

    num_layers: int = 4
    #: layers that own an indexer (the rest follow the previous leader)
    leaders: tuple[int, ...] = (0, 2)
    block_size: int = 16
    index_topk: int = 128  # vLLM's index conversion kernel tiles the top-k by 128
    max_model_len: int = 1024
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 192
    num_gpu_blocks: int = 96
    host_blocks: int = 400
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class StackCounts:
    """What a run exercised (every field counts checked rows or events)."""

    steps: int = 0
    idle_steps: int = 0
    decode_batches: int = 0
    mixed_batches: int = 0
    staged_batches: int = 0
    resident_prefill_batches: int = 0
    preemptions: int = 0
    finished: int = 0
    prefix_hit_tokens: int = 0
    decode_rows: int = 0
    padding_rows: int = 0
    resident_prefill_rows: int = 0
    staged_prefill_rows: int = 0
    fp8_workspace_rows: int = 0
    checked_columns: int = 0
    hits: int = 0  # the resolve op's swap_stats, summed over index groups
    misses: int = 0
    dma_copies: int = 0
    host_copies: int = 0
    residency_updates: int = 0
    paths: set[str] = field(default_factory=set)


def make_vllm_config(shape: StackShape) -> SimpleNamespace:
    """A ``VllmConfig`` stand-in: vLLM's own sub-configs (scheduler, cache, parallel,
    attention with ``HiSparseConfig``, KV transfer with ``HiSparseConnector``) plus the few
    model facts HiSparse reads. ``VllmConfig`` itself refuses HiSparse off CUDA."""
    from pydantic.fields import FieldInfo
    from vllm.config import (CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.config.attention import AttentionConfig, HiSparseConfig

    cache = CacheConfig(block_size=shape.block_size, num_gpu_blocks_override=shape.num_gpu_blocks,
                        enable_prefix_caching=shape.enable_prefix_caching)
    cache.kv_cache_layout = "BLHNC"  # HiSparseConnector.get_required_kvcache_layout
    host_gib = shape.host_blocks * shape.block_size * ROW_BYTES * shape.num_layers / 2**30
    config = SimpleNamespace(
        scheduler_config=SchedulerConfig(
            max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len, enable_chunked_prefill=True,
            is_encoder_decoder=False),
        cache_config=cache,
        parallel_config=ParallelConfig(),
        attention_config=AttentionConfig(hisparse_config=HiSparseConfig()),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiSparseConnector", kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": host_gib}),
        model_config=SimpleNamespace(
            max_model_len=shape.max_model_len,
            hf_config=SimpleNamespace(index_topk=shape.index_topk),
            uses_mrope=False, is_encoder_decoder=False, runner_type="generate",
            is_diffusion=False, supports_multimodal_inputs=False,
            return_sampling_mask=False, skip_tokenizer_init=True),
        speculative_config=None,
        # VllmConfig properties, at their values without speculative decoding or PP.
        max_in_flight_tokens=shape.max_num_batched_tokens,
        max_concurrent_batches=1,
        num_speculative_tokens=0, num_lookahead_tokens=0,
        num_prefill_lookahead_tokens=0, num_hash_lookahead_tokens=0,
        use_v2_model_runner=True, is_mm_encoder_only=False,
    )
    for config_field in dataclasses.fields(VllmConfig):
        if hasattr(config, config_field.name):
            continue
        default = config_field.default
        try:
            if config_field.default_factory is not dataclasses.MISSING:
                default = config_field.default_factory()
            elif isinstance(default, FieldInfo):
                default = default.get_default(call_default_factory=True)
            elif default is dataclasses.MISSING:
                continue
        except RuntimeError:  # DeviceConfig cannot infer a device on a CPU machine
            continue
        setattr(config, config_field.name, default)
    return config


def make_kv_cache_spec(shape: StackShape) -> dict[str, Any]:
    """DeepSeek-V3.2's per-layer specs: a sparse-MLA fp8_ds_mla cache per layer, an indexer
    cache per leader (132 B rows)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs: dict[str, Any] = {}
    for layer in range(shape.num_layers):
        specs[layer_name(layer)] = MLAAttentionSpec(
            block_size=shape.block_size, num_kv_heads=1, head_size=ROW_BYTES, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", cache_role=SparseCacheRole.SPARSE,
            is_index_group_leader=layer in shape.leaders, topk_buffer_width=shape.index_topk)
        if layer in shape.leaders:
            specs[f"model.layers.{layer}.indexer"] = MLAAttentionSpec(
                block_size=shape.block_size, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER)
    return specs


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.attn"


# ----------------------------------------------------------------------------------------
# The model's rows (the dense truth) and the indexer's choices
# ----------------------------------------------------------------------------------------

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def prefix_hashes(tokens: list[int], state: int = 0) -> np.ndarray:
    """uint64 [len(tokens)]: hash of each prefix, continuing from ``state`` (the hash of the
    tokens before these; 0 at a sequence's start). A row's content depends on its prefix."""
    out = np.empty(len(tokens), dtype=np.uint64)
    value = np.uint64(state)
    with np.errstate(over="ignore"):
        for p, token in enumerate(tokens):
            value = _mix(np.array([value * np.uint64(1_000_003) + np.uint64(token)]))[0]
            out[p] = value
    return out


def model_rows(layer: int, hashes: np.ndarray) -> torch.Tensor:
    """uint8 [n, 656]: the fp8_ds_mla row layer ``layer`` writes for each prefix hash.

    fp8 bytes avoid the e4m3 NaN codes (0x7F, 0xFF), scales are powers of two and rope values
    small multiples of 1/8, so the up-converted row is exact and comparable bit for bit.
    """
    n = hashes.shape[0]
    with np.errstate(over="ignore"):
        key = _mix(hashes.astype(np.uint64) * np.uint64(0x100000001B3) + np.uint64(layer + 1))
        lanes = _mix(key[:, None] + np.arange(512, dtype=np.uint64)[None, :]
                     * np.uint64(0xD1B54A32D192ED03))
    fp8 = (lanes % np.uint64(126)).astype(np.uint8) | ((lanes >> np.uint64(8)) % 2 * 128
                                                       ).astype(np.uint8)
    rows = torch.empty((n, ROW_BYTES), dtype=torch.uint8)
    rows[:, :512] = torch.from_numpy(fp8)
    exponents = ((key[:, None] >> np.uint64(16)) + np.arange(4, dtype=np.uint64)) % np.uint64(5)
    scales = torch.from_numpy(np.exp2(exponents.astype(np.float64) - 2.0).astype(np.float32))
    rows[:, 512:528] = scales.view(torch.uint8).reshape(n, 16)
    rope_ints = ((key[:, None] >> np.uint64(24)) + np.arange(64, dtype=np.uint64) * np.uint64(7)
                 ) % np.uint64(97)
    rope = torch.from_numpy(rope_ints.astype(np.float32) / 8.0 - 6.0).to(torch.bfloat16)
    rows[:, 528:] = rope.view(torch.uint8).reshape(n, 128)
    return rows


def upconvert(rows: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 576] from fp8_ds_mla rows: 512 e4m3 values x their 128-column fp32 scale,
    then the 64 bf16 rope values."""
    n = rows.shape[0]
    values = rows[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = rows[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    out = torch.empty((n, UPCONVERTED_WIDTH), dtype=torch.bfloat16)
    out[:, :512] = (values * scales).to(torch.bfloat16)
    out[:, 512:] = rows[:, 528:].contiguous().view(torch.bfloat16)
    return out


def choose_topk(request_key: int, query_positions: np.ndarray, top_k: int,
                step: int) -> np.ndarray:
    """int32 [n, top_k]: the indexer's picks for query rows at ``query_positions`` (each row
    picks positions <= its own). Long contexts keep a stable favourite set (hot-buffer hits)
    plus a few fresh picks per step (misses). As vLLM's indexer does, -1 columns (fewer
    picks than ``top_k``) come last; some rows pick fewer on purpose."""
    out = np.full((len(query_positions), top_k), -1, dtype=np.int32)
    for row, position in enumerate(query_positions.tolist()):
        rng = np.random.default_rng((request_key, position, step))
        count = position + 1
        if count <= top_k:
            picks = rng.permutation(count)
        else:
            candidates = np.arange(count, dtype=np.uint64)
            favourite = np.argsort(_mix(candidates + np.uint64(request_key) * np.uint64(7919)))
            stable = favourite[: top_k - 16]
            rest = np.setdiff1d(np.arange(count), stable, assume_unique=False)
            fresh = rng.choice(rest, size=16, replace=False)
            picks = rng.permutation(np.concatenate([stable, fresh]))
        if rng.random() < 0.25:
            picks = picks[: max(1, picks.shape[0] - int(rng.integers(1, 8)))]
        out[row, : picks.shape[0]] = picks
    return out


# ----------------------------------------------------------------------------------------
# The model runner's per-batch-row tables
# ----------------------------------------------------------------------------------------


class FakeBlockTables:
    """The two fields of the model runner's ``BlockTables`` that HiSparse binds:
    ``input_block_tables[group]`` (int32 [max_num_seqs, pages], by input-batch row) and
    ``slot_mappings[group]`` (int64 [max_num_batched_tokens], -1 past the batch)."""

    def __init__(self, pages_per_group: list[int], max_num_seqs: int, max_tokens: int) -> None:
        self.input_block_tables = [torch.zeros((max_num_seqs, pages), dtype=torch.int32)
                                   for pages in pages_per_group]
        self.slot_mappings = [torch.full((max_tokens,), -1, dtype=torch.int64)
                              for _ in pages_per_group]

    def fill(self, block_ids: list[tuple[list[int], ...]], positions: np.ndarray,
             batch_rows: np.ndarray, block_size: int) -> None:
        """Rows of this batch (``block_ids[row][group]``) and each token's slot per group."""
        for group, table in enumerate(self.input_block_tables):
            table.zero_()
            slots = self.slot_mappings[group]
            slots.fill_(-1)
            for row, groups in enumerate(block_ids):
                ids = groups[group][: table.shape[1]]
                table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            page_table = table.numpy()
            pages = positions // block_size
            valid = pages < table.shape[1]
            blocks = np.where(valid, page_table[batch_rows, np.minimum(pages, table.shape[1] - 1)],
                              -1).astype(np.int64)
            token_slots = np.where(valid & (blocks >= 0), blocks * block_size
                                   + positions % block_size, -1)
            slots[: len(positions)] = torch.from_numpy(token_slots)


@dataclass
class _WorkerRequest:
    state_row: int
    block_ids: list[list[int]]


class HiSparseStack:
    """One engine: vLLM's scheduler and HiSparse worker halves with a minimal model runner."""

    def __init__(self, shape: StackShape, dma: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
            HiSparseConnector)
        from vllm.v1.attention.backends.mla.index_group import (
            SparseMLAIndexGroupBuilder, get_sparse_mla_index_group_max_rows)
        from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                                 get_request_block_hasher, init_none_hash)
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.hisparse.binding import init_hisparse_kv_cache
        from vllm.v1.hisparse.layout import (get_hisparse_kv_cache_config,
                                             get_hisparse_kv_cache_groups)
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        self.shape = shape
        self.dma = dma
        self.counts = StackCounts()
        B = shape.block_size
        config = make_vllm_config(shape)
        self.config = config
        register_all_kvcache_specs(config)

        # ---- planner (as the engine core runs it) ----
        groups = get_hisparse_kv_cache_groups(config, make_kv_cache_spec(shape))
        assert groups is not None
        host_budget = int(config.kv_transfer_config.kv_connector_extra_config["host_pool_gib"]
                          * 2**30)
        self.kv_cache_config = get_hisparse_kv_cache_config(
            config, groups, available_memory=1 << 40, host_budget=host_budget)
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config([self.kv_cache_config])
        config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks

        # ---- scheduler side ----
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(B, sha256)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=scheduler_kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=B)

        # ---- worker side ----
        kv_groups = self.kv_cache_config.kv_cache_groups
        self.source_group = next(i for i, g in enumerate(kv_groups) if g.host_resident)
        max_rows = get_sparse_mla_index_group_max_rows(config)
        builder = SparseMLAIndexGroupBuilder(
            torch.full((shape.max_num_batched_tokens, shape.index_topk), -1, dtype=torch.int32),
            max_decode_rows=max_rows)
        self.layers: list[tuple[Any, int]] = []
        forward_context: dict[str, Any] = {}
        for layer in range(shape.num_layers):
            group, index = builder.register_layer(layer in shape.leaders, config, head_size=576,
                                                  kv_cache_dtype="fp8_ds_mla")
            self.layers.append((group, index))
            forward_context[layer_name(layer)] = SimpleNamespace(
                hisparse_cache=group.cache(index), is_draft_layer=False)
        config.compilation_config.static_forward_context = forward_context
        pages = [spec_pages(g.kv_cache_spec, shape) for g in kv_groups]
        self.block_tables = FakeBlockTables(pages, shape.max_num_seqs,
                                            shape.max_num_batched_tokens)
        self.kv_caches = init_hisparse_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                                [B] * len(kv_groups), config, forward_context,
                                                self.block_tables)
        self.connector = HiSparseConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.connector.register_kv_caches(self.kv_caches)
        # The attention layers' own view of their (host) cache: [blocks, B, row].
        self.source_caches = [self.kv_caches[layer_name(layer)].view(-1, B, ROW_BYTES)
                              for layer in range(shape.num_layers)]

        self.requests: dict[str, _WorkerRequest] = {}
        # A new request takes the highest free state row, so state rows and batch rows differ
        # (the ops must index by the right one).
        self.free_state_rows = list(range(shape.max_num_seqs))
        self.hashes: dict[str, np.ndarray] = {}
        self.request_keys: dict[str, int] = {}

    # ---- requests ----

    def add_request(self, spec: RequestSpec) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.request_keys[spec.request_id] = len(self.request_keys) + 1
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(spec.request_id, list(spec.prompt), params, None,
                                           block_hasher=self.block_hasher))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _hashes(self, request_id: str, tokens: list[int], upto: int) -> np.ndarray:
        known = self.hashes.get(request_id, np.empty(0, dtype=np.uint64))
        if known.shape[0] < upto:
            state = int(known[-1]) if known.shape[0] else 0
            known = np.concatenate([known, prefix_hashes(tokens[known.shape[0]:upto], state)])
            self.hashes[request_id] = known
        return known[:upto]

    # ---- one engine step ----

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        self.counts.steps += 1
        self.counts.preemptions += len(output.preempted_req_ids or ())
        metadata = output.kv_connector_metadata
        self.counts.residency_updates += len(metadata.residency_updates)
        self.counts.host_copies += len(metadata.host_block_copies)
        for request_id in (output.finished_req_ids | set(output.preempted_req_ids or ())):
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.free_state_rows.append(state.state_row)
        for new in output.scheduled_new_reqs:
            self.counts.prefix_hit_tokens += new.num_computed_tokens
            self.free_state_rows.sort()
            self.requests[new.req_id] = _WorkerRequest(
                self.free_state_rows.pop(), [list(ids) for ids in new.block_ids])
        cached = output.scheduled_cached_reqs
        for request_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is not None:
                state = self.requests[request_id]
                for group, ids in enumerate(new_ids):
                    state.block_ids[group].extend(ids)

        connector = self.connector
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        scheduled = output.num_scheduled_tokens
        if not scheduled:
            self.counts.idle_steps += 1
            connector.start_load_kv(None)
            connector.finish_forward()
            sampled: dict[str, list[int]] = {}
        else:
            sampled = self._forward(output)
            connector.finish_forward()
        self.dma.drain()
        connector.wait_for_save()
        connector.get_kv_connector_stats()
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        request_ids = list(sampled)
        result = ModelRunnerOutput(
            req_ids=request_ids, req_id_to_index={r: i for i, r in enumerate(request_ids)},
            sampled_token_ids=[sampled[r] for r in request_ids],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta))
        before = len(self.scheduler.requests)
        self.scheduler.update_from_output(output, result)
        self.counts.finished += before - len(self.scheduler.requests)
        self.counts.dma_copies = self.dma.copies
        self.counts.hits, self.counts.misses = self.hot_stats()

    def _forward(self, output: Any) -> dict[str, list[int]]:
        from vllm.forward_context import create_forward_context, override_forward_context
        from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

        shape = self.shape
        B = shape.block_size
        scheduled = output.num_scheduled_tokens
        # Decodes first (query length 1, vLLM's reorder threshold), then prefills.
        order = sorted(scheduled, key=lambda r: (scheduled[r] != 1,))
        num_decodes = sum(1 for r in order if scheduled[r] == 1)
        computed = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        computed.update(zip(output.scheduled_cached_reqs.req_ids,
                            output.scheduled_cached_reqs.num_computed_tokens))
        positions, batch_rows, hashes = [], [], []
        for row, request_id in enumerate(order):
            start, count = computed[request_id], scheduled[request_id]
            request = self.scheduler.requests[request_id]
            all_hashes = self._hashes(request_id, list(request.all_token_ids), start + count)
            positions.append(np.arange(start, start + count))
            batch_rows.append(np.full(count, row))
            hashes.append(all_hashes[start:start + count])
        positions_np = np.concatenate(positions)
        rows_np = np.concatenate(batch_rows)
        hashes_np = np.concatenate(hashes)
        num_tokens = int(positions_np.shape[0])
        num_reqs = len(order)
        seq_lens = np.array([computed[r] + scheduled[r] for r in order], dtype=np.int32)
        decode_only = num_decodes == num_reqs
        # CUDA-graph padding of decode batches: rows past the batch map to request 0.
        padded = shape.max_num_seqs if decode_only else num_tokens
        self.counts.padding_rows += padded - num_tokens

        self.block_tables.fill([self.requests[r].block_ids for r in order], positions_np,
                               rows_np, B)
        idx_mapping = torch.tensor([self.requests[r].state_row for r in order], dtype=torch.int32)
        req_id_per_token = torch.zeros(padded, dtype=torch.int32)
        req_id_per_token[:num_tokens] = torch.from_numpy(rows_np.astype(np.int32))
        query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.from_numpy(np.cumsum([scheduled[r] for r in order]))
        source_table = self.block_tables.input_block_tables[self.source_group]
        prefill = None
        if not decode_only:
            from vllm.v1.hisparse.runtime import build_hisparse_prefill_staging_plan
            prefill_lens = seq_lens[num_decodes:]
            plan = build_hisparse_prefill_staging_plan(
                source_table[num_decodes:num_reqs], torch.from_numpy(prefill_lens), B,
                int(((prefill_lens + B - 1) // B).sum()))
            prefill = SimpleNamespace(host_staging_plan=plan)
        metadata = SimpleNamespace(
            num_actual_tokens=num_tokens, num_decode_tokens=num_decodes, num_decodes=num_decodes,
            num_prefills=num_reqs - num_decodes, num_reqs=num_reqs,
            max_query_len=int(max(scheduled.values())), req_id_per_token=req_id_per_token,
            block_table=source_table[:num_reqs], block_size=B, query_start_loc=query_start_loc,
            seq_lens=torch.from_numpy(seq_lens), prefill=prefill)
        attn_metadata = {layer_name(layer): metadata for layer in range(shape.num_layers)}

        self.connector.start_load_kv(None, scheduler_output=output,
                                     request_state_indices=idx_mapping, request_ids=order,
                                     num_tokens=num_tokens, attn_metadata=attn_metadata)

        probes = self._probe_rows(order, scheduled, num_decodes)
        topk = torch.full((padded, shape.index_topk), -1, dtype=torch.int32)
        query_keys = [self.request_keys[order[row]] for row in rows_np.tolist()]
        with override_forward_context(create_forward_context(attn_metadata, self.config)):
            for layer in range(shape.num_layers):
                group, index = self.layers[layer]
                assert isinstance(group, HiSparseMLAIndexGroup)
                handle = group.cache(index)
                if layer in shape.leaders:
                    # The indexer: one top-k per query row for the whole index group.
                    for key in sorted(set(query_keys)):
                        mask = np.array(query_keys) == key
                        topk[:num_tokens][torch.from_numpy(mask)] = torch.from_numpy(choose_topk(
                            key, positions_np[mask], shape.index_topk, self.counts.steps))
                    if decode_only:  # padding rows repeat a real row, as stale buffers do
                        topk[num_tokens:] = topk[0]
                    handle.prepare_group_for_batch(metadata)
                self._write_layer(handle, layer, hashes_np, padded)
                handle.finish_kv_update()
                self._attend(group, index, layer, metadata, topk[:padded], probes, rows_np,
                             order, num_decodes, seq_lens, decode_only)
        return {request_id: self._sample(request_id, computed[request_id]
                                         + scheduled[request_id])
                for request_id in order}

    def _probe_rows(self, order: list[str], scheduled: dict[str, int],
                    num_decodes: int) -> np.ndarray:
        """Token rows whose attention reads are checked: every decode row; of each prefill
        chunk its first and last rows and two more (vLLM's index conversion runs one Triton
        program per row, and the interpreter makes that the slow part of a step)."""
        rng = np.random.default_rng((self.counts.steps, 17))
        probes = list(range(num_decodes))
        start = num_decodes
        for request_id in order[num_decodes:]:
            count = scheduled[request_id]
            picks = {0, count - 1, *rng.integers(0, count, size=2).tolist()}
            probes.extend(start + p for p in sorted(picks))
            start += count
        return np.array(probes, dtype=np.int64)

    def _sample(self, request_id: str, end: int) -> list[int]:
        request = self.scheduler.requests[request_id]
        if end < request.num_tokens:  # a prefill chunk short of the prompt's end
            return []
        seed = _mix(np.array([self.request_keys[request_id] * 100_003 + end], dtype=np.uint64))
        return [int(seed[0] % np.uint64(VOCAB))]

    def _write_layer(self, handle: Any, layer: int, hashes: np.ndarray, padded: int) -> None:
        """The model's KV write (``MLAAttention.update_kv_cache``): rows go to
        ``write_target``'s slots in the resident cache."""
        rows = model_rows(layer, hashes)
        cache, slots, num_rows = handle.write_target(rows.shape[0], padded)
        slots = slots[:num_rows].to(torch.int64)
        valid = slots >= 0
        B = self.shape.block_size
        cache[slots[valid] // B, slots[valid] % B] = rows[:num_rows][valid]

    # ---- attention reads, checked ----

    def _attend(self, group: Any, index: int, layer: int, metadata: Any, topk: torch.Tensor,
                probes: np.ndarray, rows: np.ndarray, order: list[str], num_decodes: int,
                seq_lens: np.ndarray, decode_only: bool) -> None:
        """The sparse MLA backend's reads (``SparseMLAAttentionImpl.forward_mqa`` and the FP8
        FlashMLA path), each checked against the rows the model wrote."""
        handle = group.cache(index)
        hot = group.physical_kv_cache(index).view(-1, ROW_BYTES)
        counts = self.counts
        leader = layer in self.shape.leaders
        if decode_only:
            physical, valid = group.convert_logical_to_physical_topk(
                index, topk, metadata, block_stride_rows=None, return_valid_counts=True)
            num_tokens = rows.shape[0]
            counts.paths.add("decode")
            counts.decode_batches += leader
            assert bool((physical[num_tokens:] == -1).all()), "a padding row resolved rows"
            assert bool((valid[num_tokens:] == 0).all()), "a padding row counted rows"
            counts.decode_rows += num_tokens
            self._check_rows("decode", layer, hot, physical[:num_tokens], valid[:num_tokens],
                             topk[:num_tokens], rows, order)
            return
        if handle.all_context_pages_resident:
            # Only the probed query rows go through the conversion (see _probe_rows).
            probe = torch.from_numpy(probes)
            probed = SimpleNamespace(**vars(metadata))
            probed.req_id_per_token = metadata.req_id_per_token[probe]
            physical, valid = group.convert_logical_to_physical_topk(
                index, topk[probe], probed, block_stride_rows=None, return_valid_counts=True)
            counts.paths.add("resident-prefill")
            counts.resident_prefill_batches += leader
            counts.resident_prefill_rows += probes.shape[0]
            self._check_rows("resident-prefill", layer, hot, physical, valid, topk[probe],
                             rows[probes], order)
            return

        counts.mixed_batches += leader and num_decodes > 0
        counts.staged_batches += leader
        if num_decodes:
            physical, valid = group.convert_logical_to_physical_topk(
                index, topk[:num_decodes], metadata, block_stride_rows=None,
                return_valid_counts=True)
            counts.paths.add("mixed-decode")
            counts.decode_rows += num_decodes
            self._check_rows("mixed-decode", layer, hot, physical, valid, topk[:num_decodes],
                             rows[:num_decodes], order)
        self._check_staged_prefill(group, index, layer, metadata, topk, probes, rows, order,
                                   num_decodes)
        self._check_fp8_prefill(group, index, layer, metadata, order, num_decodes, seq_lens)

    def _check_staged_prefill(self, group: Any, index: int, layer: int, metadata: Any,
                              topk: torch.Tensor, probes: np.ndarray, rows: np.ndarray,
                              order: list[str], num_decodes: int) -> None:
        """The bf16 sparse path: ``stage_prefill_rows`` (-> ``hisparse_gather_plan``) stages
        the prefill requests' pages, then vLLM's conversion maps the probed rows into it."""
        from vllm.v1.attention.backends.mla.sparse_utils import (
            triton_convert_req_index_to_global_index)

        staged, block_table, req_ids = group.stage_prefill_rows(
            index, self.source_caches[layer], metadata)
        probes = probes[probes >= num_decodes]
        probe = torch.from_numpy(probes)
        prefill_topk = topk[probe].contiguous()
        physical, valid = triton_convert_req_index_to_global_index(
            req_ids[probe - num_decodes].contiguous(), block_table, prefill_topk,
            BLOCK_SIZE=self.shape.block_size, NUM_TOPK_TOKENS=prefill_topk.shape[1],
            return_valid_counts=True)
        self.counts.paths.add("staged-prefill")
        self.counts.staged_prefill_rows += probes.shape[0]
        self._check_rows("staged-prefill", layer, staged.reshape(-1, ROW_BYTES), physical,
                         valid, prefill_topk, rows[probes], order)

    def _check_fp8_prefill(self, group: Any, index: int, layer: int, metadata: Any,
                           order: list[str], num_decodes: int, seq_lens: np.ndarray) -> None:
        """FlashMLA's FP8 path: every prefill request's whole context up-converted into one
        bf16 workspace (``gather_fp8_prefill`` -> ``cp_gather_and_upconvert_fp8_kv_cache``
        with host rows)."""
        prefill_lens = seq_lens[num_decodes:]
        starts = np.concatenate([[0], np.cumsum(prefill_lens)[:-1]]).astype(np.int32)
        total = int(prefill_lens.sum())
        workspace = torch.full((total, UPCONVERTED_WIDTH), float("nan"), dtype=torch.bfloat16)
        plan = metadata.prefill.host_staging_plan
        group.gather_fp8_prefill(index, self.source_caches[layer], workspace, plan.block_table,
                                 torch.from_numpy(starts), len(prefill_lens), metadata, 0)
        expected = []
        for offset, length in enumerate(prefill_lens.tolist()):
            request_id = order[num_decodes + offset]
            hashes = self._hashes(request_id, list(self.scheduler.requests[request_id]
                                                   .all_token_ids), length)
            expected.append(upconvert(model_rows(layer, hashes)))
        want = torch.cat(expected)
        bad = (workspace.view(torch.int16) != want.view(torch.int16)).any(dim=1)
        if bad.any():
            first = int(torch.nonzero(bad)[0])
            raise AssertionError(f"fp8 prefill workspace: layer {layer}, {int(bad.sum())} of "
                                 f"{total} rows differ (first: workspace row {first})")
        self.counts.paths.add("fp8-prefill")
        self.counts.fp8_workspace_rows += total

    def _check_rows(self, path: str, layer: int, cache_rows: torch.Tensor,
                    physical: torch.Tensor, valid: torch.Tensor, topk: torch.Tensor,
                    rows: np.ndarray, order: list[str]) -> None:
        """The readable columns of each row (vLLM's convert kernel packs them to the front, the
        resolve op keeps them in place; both keep column order) must read, in order, the rows
        the model wrote for the selected positions; ``valid`` counts them and an attention
        kernel reading the first ``valid`` columns finds no -1 there."""
        physical = physical.to(torch.int64)
        logical = topk.to(torch.int64)
        assert physical.shape == logical.shape, (path, physical.shape, logical.shape)
        selected = logical >= 0
        readable = physical >= 0
        counted = selected.sum(dim=1)
        assert torch.equal(readable.sum(dim=1), counted), (
            f"{path}: layer {layer}: readable columns {readable.sum(dim=1).tolist()} != "
            f"selected {counted.tolist()}")
        assert torch.equal(valid.reshape(-1)[: counted.shape[0]].to(torch.int64), counted), (
            f"{path}: layer {layer}: valid counts {valid.tolist()} != {counted.tolist()}")
        columns = torch.arange(logical.shape[1])
        assert bool(readable[columns[None, :] < counted[:, None]].all()), (
            f"{path}: layer {layer}: a -1 column before the last valid one")
        row_of, _ = torch.nonzero(selected, as_tuple=True)
        positions = logical[selected].numpy()
        hashes = np.empty(positions.shape[0], dtype=np.uint64)
        requests = rows[row_of.numpy()]
        for batch_row in np.unique(requests).tolist():
            request_id = order[batch_row]
            mine = requests == batch_row
            known = self._hashes(request_id, list(self.scheduler.requests[request_id]
                                                  .all_token_ids), int(positions[mine].max()) + 1)
            hashes[mine] = known[positions[mine]]
        want = model_rows(layer, hashes)
        got = cache_rows[physical[readable]]
        wrong = (got != want).any(dim=1)
        if bool(wrong.any()):
            first = int(torch.nonzero(wrong)[0])
            row = int(row_of[first])
            raise AssertionError(
                f"{path}: layer {layer}: request {order[int(rows[row])]} query row {row}: "
                f"position {int(positions[first])} read a row the model did not write there "
                f"({int(wrong.sum())} of {positions.shape[0]} selected rows wrong)")
        self.counts.checked_columns += int(positions.shape[0])

    def hot_stats(self) -> tuple[int, int]:
        """Hits and misses the resolve op counted, summed over the index groups."""
        hits = misses = 0
        for group, index in self.layers:
            runtime = group.cache(index).runtime
            if runtime.is_group_leader:
                h, m = runtime.index_group.swap_stats.to(torch.int64).tolist()
                hits, misses = hits + h, misses + m
        return hits, misses

    def run(self, requests: list[RequestSpec], *, max_steps: int,
            arrivals: dict[int, list[RequestSpec]] | None = None) -> StackCounts:
        """Serve ``requests`` (plus ``arrivals[step]`` when that step starts) to completion."""
        for spec in requests:
            self.add_request(spec)
        arrivals = dict(arrivals or {})
        while self.has_unfinished() or arrivals:
            for spec in arrivals.pop(self.counts.steps, []):
                self.add_request(spec)
            if self.counts.steps >= max_steps:
                raise AssertionError(f"not done after {max_steps} steps: {self.counts}")
            self.step()
        return self.counts

    def close(self) -> None:
        self.connector.shutdown()


def spec_pages(spec: Any, shape: StackShape) -> int:
    """Block-table width of a group: the hot group's per-request blocks, else a full
    ``max_model_len`` request."""
    from vllm.v1.kv_cache_interface import HiSparseHotSpec

    if isinstance(spec, HiSparseHotSpec):
        return spec.blocks_per_request
    return math.ceil(shape.max_model_len / shape.block_size)


def random_requests(count: int, seed: int, *, prompt_lens: tuple[int, int],
                    max_tokens: tuple[int, int], shared_prefix: int = 0) -> list[RequestSpec]:
    """``count`` requests with random prompts (the first ``shared_prefix`` tokens common to
    all, for prefix-cache hits) and output lengths."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, size=shared_prefix).tolist()
    specs = []
    for i in range(count):
        length = int(rng.integers(*prompt_lens))
        prompt = prefix + rng.integers(0, VOCAB, size=max(length - shared_prefix, 1)).tolist()
        specs.append(RequestSpec(f"req-{i}", tuple(prompt), int(rng.integers(*max_tokens))))
    return specs
