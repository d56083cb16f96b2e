"""SGLang 0.5.23's own HiSparse classes on a CPU, driven like its decode loop drives them.

``Stack`` builds SGLang's real ``ReqToTokenPool``, ``HiSparseDSATokenToKVPool``,
``HiSparseTokenToKVPoolAllocator`` and ``HiSparseCoordinator`` (page size 64, one follower
layer that shares its leader's top-k), admits requests both ways SGLang does
(``admit_request_into_staging`` + ``collect_ready_reqs``, and ``admit_request_direct`` after a
transport wrote the host rows), and runs decode steps: allocate the new token, map it to its
reserved slot (``map_last_loc_to_buffer``, which backs up the previous token), write every
layer's KV row for it, then per layer ``swap_in_selected_pages`` with an indexer-like top-k.
Each swap-in is checked three ways:

- every returned column points at a device row holding exactly the KV row written for that
  (request, layer, position); padding rows are -1;
- for leader layers, SGLang's state after the call (slot tables, LRU, output, recorded miss
  plan, device pool) equals a thread-by-thread walk of SGLang's CUDA kernel run on the state
  before it (``sglang_op_cases.cuda_walk``);
- SGLang's own ``naive_load_topk`` gives the same rows (run on a copy of the device pool).

What the CPU run stands in for (fixtures here, nothing in the product): the gloo process group
of one rank, plain CPU memory for the pinned host pool (``pool_host.common.ALLOC_MEMORY_FUNCS``)
and for the coordinator's one ``pin_memory=True`` tensor, SGLang's CUDA bulk copies between
the pools (``transfer_kv_per_layer_mla`` / ``transfer_kv_all_layer_mla``: row copies by
tensor indexing), CUDA streams and events (SGLang's CPU ones run in program order), the model
(a KV row is a function of request, layer and position) and its indexer (random top-k with
locality, the newest position now and then).
"""

from __future__ import annotations

import types
import torch

from sglang_op_cases import SwapInCase, cuda_walk, row_bytes

LAYERS = 3
FOLLOWERS = [False, True, False]       # layer 1 reuses layer 0's top-k (and its miss plan)
PAGE = 64
FORMATS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 656)}


def setup_process(monkeypatch) -> None:
    """Process-wide stand-ins SGLang's HiSparse needs on a CPU (see the module docstring),
    then SGLang's own ``load_plugins()`` (once per process: SGLang guards it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import sglang.srt.mem_cache.pool_host.common as common

    def plain_memory(dims, dtype, device, pin_memory, allocator=None, **_):
        return torch.zeros(dims, dtype=dtype, device=device)

    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", plain_memory)
    import sglang.srt.managers.hisparse_coordinator as coordinator_module

    class _TorchWithoutPinning(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*args, pin_memory=False, **kwargs):
            return torch.tensor(*args, **kwargs)

    monkeypatch.setattr(coordinator_module, "torch", _TorchWithoutPinning("torch"))
    from sglang.srt.plugins import load_plugins

    load_plugins()


def kv_row(request: int, layer: int, position: int, nbytes: int) -> torch.Tensor:
    """The KV row the model writes for (request pool row, layer, position)."""
    g = torch.Generator().manual_seed(request * 1_000_003 + layer * 10_007 + position)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class RequestStandIn:
    """The attributes of SGLang's ``Req`` the coordinator reads and writes."""

    def __init__(self, name: str, length: int) -> None:
        self.rid = name
        self.kv = types.SimpleNamespace(req_pool_idx=None, kv_allocated_len=0, holds_kv=False)
        self.extend_end = length
        self.hisparse_staging = False


class Stack:
    """SGLang's HiSparse objects for ``LAYERS`` layers, plus the checks of the module
    docstring. ``stats`` counts what was checked."""

    def __init__(self, monkeypatch, *, fmt: str = "bf16", top_k: int = 64, hot: int = 128,
                 requests: int = 6, context: int = 1024, seed: int = 0) -> None:
        from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
        from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        dtype, dim = FORMATS[fmt]
        size = 2048
        self.top_k, self.hot = top_k, hot
        self.req_to_token_pool = ReqToTokenPool(size=requests, max_context_len=context,
                                                device="cpu", enable_memory_saver=False)
        self.device_pool = HiSparseDSATokenToKVPool(
            size=size, page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=dim, host_to_device_ratio=2)
        self.allocator = HiSparseTokenToKVPoolAllocator(
            size=size, page_size=PAGE, dtype=dtype, device="cpu", kvcache=self.device_pool,
            need_sort=False)
        self.coordinator = HiSparseCoordinator(
            self.req_to_token_pool, self.allocator, top_k=top_k, device_buffer_size=hot,
            device="cpu", tp_group=None, shared_index_layers=list(FOLLOWERS))
        self.host_pool = self.coordinator.mem_pool_host
        self.item = self.coordinator.item_size_bytes
        self._bulk_copies(monkeypatch)
        self.requests: list[RequestStandIn] = []
        self.seq_lens: dict[int, int] = {}
        self.last_top_k: dict[int, list[int]] = {}
        self.g = torch.Generator().manual_seed(seed)
        self.stats = dict(steps=0, columns=0, misses=0, walked=0, naive=0, padded_rows=0)

    # ------------------------------------------------------------------ stand-ins

    def _bulk_copies(self, monkeypatch) -> None:
        """SGLang's CUDA host <-> device row copies, as tensor indexing (the layer tables
        SGLang passes hold the pools' addresses; they are mapped back to the pools)."""
        import sglang.srt.mem_cache.pool_host.mla as mla

        by_address = {t.data_ptr(): t for t in
                      list(self.device_pool.kv_buffer) + list(self.host_pool.data_refs)}

        def per_layer(src, dst, src_indices, dst_indices, item_size):
            self.rows(dst)[dst_indices.long()] = self.rows(src)[src_indices.long()]

        def all_layers(src_layers, dst_layers, src_indices, dst_indices, item_size,
                       num_layers):
            for layer in range(num_layers):
                per_layer(by_address[int(src_layers[layer])],
                          by_address[int(dst_layers[layer])], src_indices, dst_indices,
                          item_size)

        monkeypatch.setattr(mla, "transfer_kv_per_layer_mla", per_layer, raising=False)
        monkeypatch.setattr(mla, "transfer_kv_all_layer_mla", all_layers, raising=False)

    def rows(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.reshape(-1).view(torch.uint8).view(-1, self.item)

    def kv(self, request: int, layer: int, position: int) -> torch.Tensor:
        return kv_row(request, layer, position, self.item)

    # ------------------------------------------------------------------ admission

    def admit(self, length: int, *, direct: bool) -> int:
        """Prefill a request of ``length`` tokens and hand it to the coordinator: through
        staging (KV written to the device pool, backed up by SGLang) or directly (KV written
        into host rows SGLang allocated, as a prefill/decode transport does)."""
        req = RequestStandIn(f"r{len(self.requests)}", length)
        row = self.req_to_token_pool.alloc_rows(1)[0]
        req.kv.req_pool_idx = row
        zero, n = torch.zeros(1, dtype=torch.int64), torch.tensor([length])
        allocate = self.allocator.alloc_logical_only if direct else self.allocator.alloc_extend
        logical = allocate(zero, zero, n, n, torch.tensor([-1]), length)
        self.req_to_token_pool.req_to_token[row, :length] = logical.to(torch.int32)
        req.kv.kv_allocated_len = length
        c = self.coordinator
        if direct:
            host_rows = self.host_pool.alloc_paged_token_slots(
                c.req_to_host_pool, c.req_to_host_pool_allocated_len, row, 0, length)
            for layer in range(LAYERS):
                pool = self.rows(self.host_pool.kv_buffer[layer])
                for p in range(length):
                    pool[int(host_rows[p])] = self.kv(row, layer, p)
            c.admit_request_direct(req)
        else:
            device_rows = self.allocator.full_to_hisparse_device_index_mapping[logical]
            for layer in range(LAYERS):
                pool = self.rows(self.device_pool.kv_buffer[layer])
                for p in range(length):
                    pool[int(device_rows[p])] = self.kv(row, layer, p)
            c.admit_request_into_staging(req)
            assert c.collect_ready_reqs() == [req]
        self.requests.append(req)
        self.seq_lens[row] = length
        return row

    # ------------------------------------------------------------------ decode

    def _top_k(self, row: int, seq_len: int) -> torch.Tensor:
        """Distinct positions of ``[0, seq_len)`` (padded with -1), half of them near the
        request's previous selection, the newest position every other step."""
        K = self.top_k
        if seq_len <= K:
            picked = torch.randperm(seq_len, generator=self.g).tolist()
        else:
            near = [p for p in self.last_top_k.get(row, []) if p < seq_len]
            order = torch.randperm(len(near), generator=self.g).tolist()
            picked = [near[j] for j in order[: K // 2]]
            if self.stats["steps"] % 2 == 0 and seq_len - 1 not in picked:
                picked.append(seq_len - 1)
            chosen = set(picked)
            for p in torch.randperm(seq_len, generator=self.g).tolist():
                if len(picked) == K:
                    break
                if p not in chosen:
                    picked.append(p)
                    chosen.add(p)
        self.last_top_k[row] = picked
        return torch.tensor(picked + [-1] * (K - len(picked)), dtype=torch.int32)

    def step(self, *, padding: int = 0, naive: bool = True) -> None:
        """One decode step of every admitted request (plus ``padding`` CUDA-graph padding
        rows), with the checks of the module docstring on every layer."""
        c = self.coordinator
        rows = [r.kv.req_pool_idx for r in self.requests]
        rpi = torch.tensor(rows, dtype=torch.int64)
        old = torch.tensor([self.seq_lens[r] for r in rows])
        new = old + 1
        last_loc = self.req_to_token_pool.req_to_token[rpi, old - 1].long()
        out_loc = self.allocator.alloc_decode(new, new, last_loc)
        self.req_to_token_pool.req_to_token[rpi, old] = out_loc.to(torch.int32)
        for r in self.requests:
            r.kv.kv_allocated_len += 1
        c.map_last_loc_to_buffer(new, out_loc, rpi, new, rpi)
        device_rows = self.device_pool.translate_loc_to_hisparse_device(out_loc)
        for layer in range(LAYERS):
            pool = self.rows(self.device_pool.kv_buffer[layer])
            for b, row in enumerate(rows):
                pool[int(device_rows[b])] = self.kv(row, layer, int(old[b]))
        for row in rows:
            self.seq_lens[row] += 1
        real = len(rows)
        c.num_real_reqs.fill_(real)
        batch_rpi = torch.cat([rpi, torch.zeros(padding, dtype=torch.int64)])
        batch_lens = torch.cat([new, torch.ones(padding, dtype=torch.int64)])
        top_k = None
        for layer in range(LAYERS):
            if not FOLLOWERS[layer]:
                top_k = torch.stack([self._top_k(row, int(n)) for row, n in zip(rows, new)]
                                    + [torch.full((self.top_k,), -1, dtype=torch.int32)]
                                    * padding)
            before = None if FOLLOWERS[layer] else self._snapshot(layer)
            out = c.swap_in_selected_pages(batch_rpi, batch_lens, top_k, layer).clone()
            self._check_rows(layer, rows, batch_lens, top_k, out, real)
            if before is not None:
                self._check_walk(layer, before, batch_rpi, batch_lens, top_k, out, real)
                if naive:
                    self._check_naive(layer, rpi, new, top_k[:real], out[:real])
        self.stats["steps"] += 1
        self.stats["padded_rows"] += padding

    # ------------------------------------------------------------------ checks

    def _snapshot(self, layer: int) -> SwapInCase:
        c = self.coordinator
        return SwapInCase(
            device_buffer_tokens=c.req_device_buffer_tokens[layer].clone(),
            device_buffer_locs=c.req_device_buffer_token_locs[layer].clone(),
            lru_slots=c.lru_slots[layer].clone(), host_cache_locs=c.req_to_host_pool.clone(),
            host_cache=self.host_pool.kv_buffer[layer], device_buffer=self.device_pool.kv_buffer[
                layer].clone(), top_k_tokens=torch.empty(0, dtype=torch.int32),
            req_pool_indices=torch.empty(0), seq_lens=torch.empty(0), top_k=self.top_k,
            hot=self.hot)

    def _check_rows(self, layer: int, rows: list, lens: torch.Tensor, top_k: torch.Tensor,
                    out: torch.Tensor, real: int) -> None:
        pool = self.rows(self.device_pool.kv_buffer[layer])
        assert (out[real:] == -1).all(), "padding rows must be -1"
        for b, row in enumerate(rows):
            for i, t in enumerate(top_k[b].tolist()):
                if t < 0:
                    assert int(out[b, i]) == -1, (layer, b, i)
                    continue
                loc = int(out[b, i])
                assert 0 <= loc < pool.shape[0], (layer, b, i, loc)
                assert torch.equal(pool[loc], self.kv(row, layer, t)), \
                    f"layer {layer} request {row} position {t}: wrong KV row {loc}"
                self.stats["columns"] += 1

    def _check_walk(self, layer: int, before: SwapInCase, rpi, lens, top_k, out,
                    real: int) -> None:
        c = self.coordinator
        before.top_k_tokens, before.req_pool_indices, before.seq_lens = top_k, rpi, lens
        before.num_real = real
        want = cuda_walk(before)
        assert torch.equal(out, want.out), f"layer {layer}: outputs differ from SGLang's kernel"
        assert torch.equal(c.lru_slots[layer], want.state["lru_slots"]), \
            f"layer {layer}: LRU differs from SGLang's kernel"
        assert torch.equal(c.req_device_buffer_tokens[layer],
                           want.state["device_buffer_tokens"]), \
            f"layer {layer}: slot table differs from SGLang's kernel"
        assert torch.equal(row_bytes(self.device_pool.kv_buffer[layer]),
                           row_bytes(want.state["device_buffer"])), \
            f"layer {layer}: device pool differs from SGLang's kernel"
        if c.enable_prefetch and layer in c._prefetch_groups:
            counts = c._miss_count[:real]
            assert torch.equal(counts, want.plan[2][:real]), f"layer {layer}: miss counts"
            for b in range(real):
                n = int(counts[b])
                assert torch.equal(c._miss_src[b, :n], want.plan[0][b, :n])
                assert torch.equal(c._miss_dst[b, :n], want.plan[1][b, :n])
            self.stats["misses"] += int(counts.sum())
        self.stats["walked"] += 1

    def _check_naive(self, layer: int, rpi, lens, top_k, out) -> None:
        """SGLang's ``naive_load_topk`` (which loads into the buffer's first slots) on a
        copy of the device pool: the rows it returns equal the ones ours returned."""
        pool = self.device_pool.kv_buffer[layer]
        saved = pool.clone()
        ours = self.rows(pool)[out.clamp(min=0).long()].clone()
        theirs_locs = self.coordinator.naive_load_topk(rpi, lens, top_k, layer)
        theirs = self.rows(pool)[theirs_locs.clamp(min=0).long()]
        pool.copy_(saved)
        valid = top_k >= 0
        assert torch.equal((theirs_locs >= 0), valid)
        assert torch.equal(theirs[valid], ours[valid]), f"layer {layer}: naive_load_topk differs"
        self.stats["naive"] += 1


def run_scenario(monkeypatch, *, fmt: str = "bf16", steps: int = 8, naive: bool = True,
                 seed: int = 0) -> dict:
    """Four requests, admitted both ways, long and short, one crossing from short to long
    during the run; ``steps`` decode steps, every other one with CUDA-graph padding rows.
    Returns the stack's ``stats``."""
    stack = Stack(monkeypatch, fmt=fmt, seed=seed)
    stack.admit(300, direct=False)             # long, staged
    stack.admit(200, direct=True)              # long, direct: every slot starts empty
    stack.admit(100, direct=True)              # short, direct: preloaded slots
    stack.admit(stack.hot - 3, direct=False)   # short, staged: turns long at step 3
    for step in range(steps):
        stack.step(padding=2 if step % 2 else 0, naive=naive)
    return stack.stats

