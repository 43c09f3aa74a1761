"""Paged KV memory: `BlockPool`, fixed-size blocks of keys and values for all layers, and `PagedKVCache`, a drop-in
for `KVCache` (kv_cache.py) whose rows hold blocks of a pool instead of a capacity reserved at admission.

Index convention: pool `k[layer, block, kv_head, slot, dim]`; position p of row b lives in block
`table[b][p // block_size]`, slot `p % block_size`. A (block, kv_head) pair is block_size x head_dim contiguous
values, so `keys_values` is one `index_select` of those chunks over the pool, and its result, viewed as
[rows, kv_heads, positions, head_dim], has the strides of the contiguous cache's view (attention reads both alike).

Positions and lengths follow `KVCache`: a write of T positions lands at lengths[b] .. lengths[b] + T - 1 and does
not change `lengths`; `advance` then marks how many of them are valid.

Blocks per row: before a write, row b is given blocks up to ceil((lengths[b] + T) / block_size), for all rows at
once, or the write raises `OutOfBlocksError` having changed nothing (the caller may preempt a row and retry).
`reserve(num_new)` instead gives row b the blocks of its num_new[b] real positions only (a ragged pass: a decoding
row feeds 1 token beside another row's prompt chunk of T), and the next write sends each row's padded positions
past num_new[b] to the pool's *sink* block (one block beyond `num_blocks`, never handed out or read): a padded pass
costs no blocks, and a runtime can check, before the pass, that its blocks fit (runtime/offload/pipeline.py).
After `advance`, `truncate`, `reset_rows` and `select_rows` every row holds exactly ceil(lengths[b] / block_size)
blocks (`assign_rows`: every assigned row): the blocks of right-padded positions and rejected drafts go back to
the pool at the next of those calls. A scratch view (`scratch_view`) allocates in its owner's tables and frees
nothing. Several caches (the two interleaved batches of a worker) may share one pool.

`capacity` is a per-row limit on positions, as in `KVCache` (growable or not); no memory is reserved for it.
"""

from __future__ import annotations

import threading

import torch

from .kv_cache import CacheCapacityError, KVCache

Tensor = torch.Tensor


class OutOfBlocksError(CacheCapacityError):
    """A write or assignment needs more blocks than the pool has free; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"{needed} KV blocks needed, {free} free in the pool")
        self.needed, self.free = needed, free


class BlockPool:
    """`num_blocks` blocks of `block_size` positions of K and V for every layer, and their free list. Allocation
    and freeing are thread-safe: a drafter on another thread may draft into one batch's cache (a scratch view)
    while the attention worker writes the other's.

    The storage is allocated empty and a block is zeroed when it is first handed out (fresh blocks go out in id
    order, so they are the ids from `touched` up): host memory is committed as blocks come into use, not for the
    whole pool at start. Block 0, which pads block tables, is zeroed at once. Block `num_blocks` (the storage holds
    one more) is the sink that padded positions of a reserved write go to (`PagedKVCache.reserve`); it is never
    handed out and never gathered. Every block a cache reads thus holds
    finite values (zeros or keys written earlier), which masked attention weighs by exactly 0.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.sink = num_blocks  # the block padded positions of a reserved write land in (class docstring)
        shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=self.device)  # [layers, blocks, kv_heads, block_size, dim]
        self.v = torch.empty(shape, dtype=dtype, device=self.device)  # [layers, blocks, kv_heads, block_size, dim]
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: freed blocks on top, fresh ones in id order
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self.touched = 0  # blocks 0..touched-1 have been zeroed; the others were never handed out
        self._zero_upto(1)

    @classmethod
    def for_bytes(cls, nbytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> BlockPool:
        """The largest pool of `block_size`-position blocks within `nbytes` bytes (at least one block)."""
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        return cls(num_layers, max(1, nbytes // per_block), block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self._used)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (keys and values, every layer)."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions: ceil(tokens / block_size)."""
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` free block ids, or `OutOfBlocksError` (nothing allocated) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocksError(n, len(self._free))
            blocks = [self._free.pop() for _ in range(n)]
            self._used.update(blocks)
            self._zero_upto(max(blocks, default=-1) + 1)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool; a block that is not in use (a double free) raises ValueError."""
        with self._lock:
            if len(set(blocks)) != len(blocks) or not self._used.issuperset(blocks):
                raise ValueError(f"freeing blocks that are not in use: {sorted(set(blocks) - self._used)[:8]}")
            self._used.difference_update(blocks)
            self._free.extend(reversed(blocks))

    def nbytes(self) -> int:
        """Bytes of the pool's storage (keys and values), the sink block included."""
        return (self.num_blocks + 1) * self.block_nbytes

    def _zero_upto(self, top: int) -> None:
        """Zero the never handed out blocks touched..top-1."""
        if top > self.touched:
            with torch.inference_mode():
                self.k[:, self.touched:top].zero_()
                self.v[:, self.touched:top].zero_()
            self.touched = top


class PagedKVCache:
    """Batched KV cache over a `BlockPool`, with one block table per row. See the module docstring."""

    def __init__(self, pool: BlockPool, batch_size: int, capacity: int, growable: bool = True) -> None:
        self.pool = pool
        self.num_layers, self.num_kv_heads, self.head_dim = pool.num_layers, pool.num_kv_heads, pool.head_dim
        self.dtype, self.device = pool.dtype, pool.device
        self.batch_size = batch_size
        self.growable = growable
        self._capacity = capacity
        self._blocks: list[list[int]] = [[] for _ in range(batch_size)]  # per row: its block ids, position order
        self._home = self  # whose block tables these are (a scratch view: its owner's)
        self._version = 0  # bumped when a block table changes (on the home cache)
        self._gather: tuple[int, int, Tensor] | None = None  # (version, blocks per row, index) of keys_values
        self._slots: tuple[int, int, Tensor] | None = None  # (version, T, pool row per written value) of write
        self._out: tuple[Tensor, Tensor] | None = None  # keys_values' K and V buffers, [chunks, block_size * dim]
        self._lengths = torch.zeros(batch_size, dtype=torch.long)  # [batch], CPU
        self._device_lengths: Tensor | None = None
        self._pending: Tensor | None = None  # [batch] real positions of the next write (`reserve`), else None

    # ---- the KVCache interface ---------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def lengths(self) -> Tensor:
        """Valid positions per row, LongTensor [batch] on the CPU. Read-only: mutate via the methods."""
        return self._lengths

    def device_lengths(self) -> Tensor:
        """`lengths` on the cache's device (memoised until the lengths change)."""
        if self._device_lengths is None:
            self._device_lengths = self._lengths.to(self.device)
        return self._device_lengths

    def write(self, layer: int, k_new: Tensor, v_new: Tensor) -> None:
        """Store k_new, v_new [batch, kv_heads, T, head_dim] at positions lengths[b] + t, t in 0..T-1 (allocating
        the blocks they need first, or raising OutOfBlocksError with nothing changed)."""
        batch, _, steps, _ = k_new.shape
        if batch != self.batch_size or k_new.shape != v_new.shape:
            raise ValueError(f"k/v of shapes {tuple(k_new.shape)}, {tuple(v_new.shape)} for batch {self.batch_size}")
        slots = self._write_slots(steps)  # [batch * kv_heads * T]
        with torch.inference_mode():
            for store, new in ((self.pool.k, k_new), (self.pool.v, v_new)):
                flat = store[layer].view(-1, self.head_dim)  # [blocks * kv_heads * block_size, dim]
                flat.index_copy_(0, slots, new.reshape(-1, self.head_dim).to(self.dtype))  # [batch * kv * T, dim]

    def keys_values(self, layer: int, upto: int) -> tuple[Tensor, Tensor]:
        """Positions 0..upto-1 of every row, gathered from the pool: ([batch, kv_heads, upto, head_dim],) * 2.
        Positions past a row's blocks read an arbitrary block (they are past its length: never valid data).

        The results are views of two buffers this cache reuses (no allocation per layer): they hold until its
        next `keys_values` call."""
        per_row = self.pool.blocks_for(upto)
        index = self._gather_index(per_row)  # [batch * kv_heads * per_row]
        out_k, out_v = self._buffers(len(index))  # [batch * kv_heads * per_row, block_size * dim] each
        shape = (self.batch_size, self.num_kv_heads, per_row * self.pool.block_size, self.head_dim)
        with torch.inference_mode():
            chunk = self.pool.block_size * self.head_dim
            k = torch.index_select(self.pool.k[layer].view(-1, chunk), 0, index, out=out_k).view(shape)
            v = torch.index_select(self.pool.v[layer].view(-1, chunk), 0, index, out=out_v).view(shape)
        return k[:, :, :upto], v[:, :, :upto]  # [batch, kv_heads, upto, dim]

    def advance(self, num_new: Tensor | int) -> None:
        """Mark `num_new[b]` more positions of each row valid (they must have been written); frees the blocks
        past the new lengths (padded positions)."""
        num_new = self._per_row(num_new)
        if bool((num_new < 0).any()):
            raise ValueError(f"advance by negative counts {num_new.tolist()}")
        new_lengths = self._lengths + num_new
        if self.batch_size and int(new_lengths.max()) > self.capacity:
            raise CacheCapacityError(f"advance to lengths {new_lengths.tolist()} past capacity {self.capacity}")
        held = [len(blocks) * self.pool.block_size for blocks in self._home._blocks]
        if any(n > h for n, h in zip(new_lengths.tolist(), held)):
            raise ValueError(f"advance to lengths {new_lengths.tolist()} past the positions the rows' blocks hold "
                             f"{held}: they were not written")
        self._set_lengths(new_lengths)
        self._trim()

    def truncate(self, new_lengths: Tensor) -> None:
        """Shorten rows to `new_lengths[b]` <= lengths[b] (e.g. drop rejected speculative tokens); frees the blocks
        no longer needed."""
        new_lengths = self._per_row(new_lengths)
        if bool((new_lengths > self._lengths).any()) or bool((new_lengths < 0).any()):
            raise ValueError(f"truncate to {new_lengths.tolist()} from lengths {self._lengths.tolist()}")
        self._set_lengths(new_lengths)
        self._trim()

    def reset_rows(self, rows: Tensor | list[int]) -> None:
        """Empty the given rows (length 0, their blocks freed), e.g. to put a new request in a finished one's slot."""
        index = torch.as_tensor(rows, dtype=torch.long)
        new_lengths = self._lengths.clone()
        new_lengths[index] = 0
        self._set_lengths(new_lengths)
        self._trim()

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (the batch shrinks to len(rows)); the other rows' blocks are freed and
        no KV data moves. A row may be kept once only (its blocks have one owner)."""
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"select_rows: rows {rows} repeat a row; a paged row's blocks cannot be shared")
        if self._owns():
            kept = set(rows)
            dropped = [n for n in range(self.batch_size) if n not in kept]
            self.pool.free([b for n in dropped for b in self._blocks[n]])
            self._blocks = [self._blocks[n] for n in rows]
            self._changed()
        self.batch_size = len(rows)
        self._set_lengths(self._lengths[torch.as_tensor(rows, dtype=torch.long)])

    def assign_rows(self, rows: list[int], source: KVCache | PagedKVCache) -> None:
        """Copy row i of `source` (contents and length) into row rows[i] of this cache, e.g. after a prefill; the
        rows' old blocks are freed first. OutOfBlocksError (nothing changed) when the pool cannot hold them."""
        self._require_owner("assign_rows")
        if (source.num_layers, source.num_kv_heads, source.head_dim) != (
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError("assign_rows: caches of different layer/head geometry")
        if source.batch_size != len(rows):
            raise ValueError(f"assign_rows: {len(rows)} rows but the source cache has {source.batch_size}")
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"assign_rows: rows {rows} repeat a row")
        src_lengths = source.lengths.clone()  # [n]
        used = int(src_lengths.max()) if rows else 0
        if not self.growable:
            self.ensure_capacity(used)  # raises, changing nothing, past a fixed capacity
        needed = sum(self.pool.blocks_for(int(n)) for n in src_lengths.tolist())
        releasing = sum(len(self._blocks[r]) for r in rows)
        if needed > self.pool.free_blocks + releasing:
            raise OutOfBlocksError(needed, self.pool.free_blocks + releasing)
        self.ensure_capacity(used)
        keys, values = _all_positions(source, used)  # [layers, n, kv_heads, used, dim] each
        self.pool.free([b for r in rows for b in self._blocks[r]])
        for r, n in zip(rows, src_lengths.tolist()):
            self._blocks[r] = self.pool.allocate(self.pool.blocks_for(int(n)))
        self._changed()
        valid = torch.arange(used)[None, None, :] < src_lengths[:, None, None]  # [n, 1, used]
        valid = valid.expand(-1, self.num_kv_heads, -1)  # [n, kv_heads, used]
        slots = self._slot_index(torch.as_tensor(rows, dtype=torch.long), torch.arange(used))[valid]  # [m]
        slots = slots.to(self.device)
        with torch.inference_mode():
            for store, data in ((self.pool.k, keys), (self.pool.v, values)):
                flat = store.view(self.num_layers, -1, self.head_dim)  # [layers, blocks * kv * block_size, dim]
                flat.index_copy_(1, slots, data[:, valid.to(data.device)].to(self.device, self.dtype))  # [L, m, dim]
        new_lengths = self._lengths.clone()
        new_lengths[torch.as_tensor(rows, dtype=torch.long)] = src_lengths
        self._set_lengths(new_lengths)

    def reserve(self, num_new: Tensor | list[int]) -> None:
        """Give row b the blocks of positions lengths[b] .. lengths[b] + num_new[b] - 1 (all rows or none:
        `OutOfBlocksError`, nothing changed), for the next write: its positions past num_new[b] (right padding) go
        to the pool's sink block instead of taking blocks. Lasts until the lengths change (advance, truncate...)."""
        self._require_owner("reserve")
        num_new = self._per_row(torch.as_tensor(num_new, dtype=torch.long))  # [batch]
        if bool((num_new < 0).any()):
            raise ValueError(f"reserve negative counts {num_new.tolist()}")
        extents = self._lengths + num_new  # [batch]
        if not self.growable:
            self.ensure_capacity(int(extents.max()) if self.batch_size else 0)
        self._reserve(extents.tolist())
        self.ensure_capacity(int(extents.max()) if self.batch_size else 0)
        self._pending = num_new
        self._slots = None

    def blocks_needed(self, num_new: Tensor | list[int]) -> int:
        """Blocks `reserve(num_new)` would take from the pool now."""
        extents = (self._lengths + self._per_row(torch.as_tensor(num_new, dtype=torch.long))).tolist()
        return sum(max(0, self.pool.blocks_for(e) - len(t)) for e, t in zip(extents, self._home._blocks))

    def ensure_capacity(self, needed: int) -> None:
        """Raise the per-row limit to `needed` positions (or raise CacheCapacityError if not growable). Allocates
        nothing: blocks come with writes."""
        if needed <= self._capacity:
            return
        if not self.growable:
            raise CacheCapacityError(f"{needed} positions needed; the KV cache holds {self._capacity}")
        self._capacity = needed

    def scratch_view(self) -> PagedKVCache:
        """A cache over the same block tables with its own copy of `lengths` (a drafter drafting into the target's
        cache, runtime/offload/drafters/resident_experts.py). Its writes past this cache's valid positions allocate
        the blocks they need in this cache's tables (freed by this cache's next advance or truncate), so it grows
        as this cache does (capacity is a per-row limit here, not storage: blocks come from the pool); the view
        itself never frees a block, and its select_rows / reset_rows change only its own lengths."""
        view = PagedKVCache.__new__(PagedKVCache)
        view.__dict__.update(self.__dict__)
        view._gather = view._slots = view._out = None
        view._set_lengths(self._lengths)
        return view

    def nbytes(self) -> int:
        """Bytes of the blocks this cache's rows hold (keys and values)."""
        return sum(len(blocks) for blocks in self._home._blocks) * self.pool.block_nbytes

    def used_bytes(self) -> int:
        """Bytes of valid positions (keys and values)."""
        per_position = self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return 2 * per_position * int(self._lengths.sum())

    # ---- paged only -----------------------------------------------------------------------------------------------
    def add_rows(self, n: int) -> None:
        """Append `n` empty rows (length 0, no blocks) to the batch; nothing is copied."""
        self._require_owner("add_rows")
        if n < 0:
            raise ValueError(f"add_rows: n = {n} < 0")
        self._blocks.extend([] for _ in range(n))
        self.batch_size += n
        self._changed()
        self._set_lengths(torch.cat([self._lengths, torch.zeros(n, dtype=torch.long)]))

    def release(self) -> None:
        """Return every row's blocks to the pool (rows become empty); a scratch view releases nothing."""
        if self._owns():
            self.reset_rows(list(range(self.batch_size)))
        self._out = None

    def blocks_held(self) -> list[int]:
        """Blocks each row holds now (from the home tables)."""
        return [len(blocks) for blocks in self._home._blocks]

    # ---- internals ------------------------------------------------------------------------------------------------
    def _owns(self) -> bool:
        return self._home is self

    def _require_owner(self, what: str) -> None:
        if not self._owns():
            raise RuntimeError(f"{what} on a scratch view: only the cache that owns the blocks may do that")

    def _changed(self) -> None:
        self._version += 1

    def _reserve(self, extents: list[int]) -> None:
        """Make row b hold at least blocks_for(extents[b]) blocks (in the home tables): all rows or none."""
        tables = self._home._blocks
        need = [max(0, self.pool.blocks_for(e) - len(t)) for e, t in zip(extents, tables)]
        fresh = self.pool.allocate(sum(need))  # OutOfBlocksError here leaves everything unchanged
        if not fresh:
            return
        start = 0
        for table, n in zip(tables, need):
            table.extend(fresh[start:start + n])
            start += n
        self._home._changed()

    def _trim(self) -> None:
        """Free every block past ceil(lengths[b] / block_size) (the owner only; a view's lengths free nothing)."""
        if not self._owns():
            return
        freed: list[int] = []
        for table, n in zip(self._blocks, self._lengths.tolist()):
            keep = self.pool.blocks_for(n)
            if len(table) > keep:
                freed += table[keep:]
                del table[keep:]
        if freed:
            self.pool.free(freed)
            self._changed()

    def _write_slots(self, steps: int) -> Tensor:
        """Pool rows (`_slot_index`) of the T positions each row writes next, [batch * kv_heads * T], on the
        device; reserves their blocks first. Memoised across the layers of one pass."""
        memo = self._slots
        if memo is not None and memo[0] == self._home._version and memo[1] == steps:
            return memo[2]
        pending = self._pending
        if pending is not None and (len(pending) != self.batch_size or bool((pending > steps).any())):
            pending = None  # (a write other than the reserved one: reserve for every position, as without it)
        needed = int(self._lengths.max()) + steps if self.batch_size else 0
        if pending is None:
            if not self.growable:
                self.ensure_capacity(needed)  # raises, changing nothing, past a fixed capacity
            self._reserve((self._lengths + steps).tolist())
            self.ensure_capacity(needed)
        positions = self._lengths[:, None] + torch.arange(steps)  # [batch, T]
        padded = None if pending is None else torch.arange(steps)[None, :] >= pending[:, None]  # [batch, T]
        if padded is not None:
            positions = torch.where(padded, self._lengths[:, None], positions)  # (any real position: remapped below)
        slots = self._slot_index(torch.arange(self.batch_size), positions)  # [batch, kv_heads, T]
        if padded is not None and bool(padded.any()):
            heads = torch.arange(self.num_kv_heads)[None, :, None]  # [1, kv_heads, 1]
            sink = (self.pool.sink * self.num_kv_heads + heads) * self.pool.block_size  # [1, kv_heads, 1]
            sink = sink + (torch.arange(steps) % self.pool.block_size)[None, None, :]  # [1, kv_heads, T]
            slots = torch.where(padded[:, None, :], sink, slots)
        slots = slots.reshape(-1).to(self.device)
        self._slots = (self._home._version, steps, slots)
        return slots

    def _slot_index(self, rows: Tensor, positions: Tensor) -> Tensor:
        """Rows of a layer's pool viewed as [blocks * kv_heads * block_size, head_dim] that hold `positions`
        ([n, T] or [T], CPU) of rows `rows` [n], for each kv head: [n, kv_heads, T]."""
        bs, heads = self.pool.block_size, self.num_kv_heads
        positions = positions.expand(len(rows), -1) if positions.dim() == 1 else positions  # [n, T]
        width = max(1, self.pool.blocks_for(int(positions.max()) + 1) if positions.numel() else 1)
        blocks = self._table(width)[rows].gather(1, positions // bs)  # [n, T]
        head = torch.arange(heads)[None, :, None]  # [1, kv_heads, 1]
        return (blocks[:, None, :] * heads + head) * bs + (positions % bs)[:, None, :]

    def _gather_index(self, per_row: int) -> Tensor:
        """Chunks (block * kv_heads + head) of each row's first `per_row` blocks, per kv head, in a layer's pool
        viewed as [blocks * kv_heads, block_size * head_dim]: [batch * kv_heads * per_row] on the device
        (memoised)."""
        memo = self._gather
        if memo is not None and memo[0] == self._home._version and memo[1] == per_row:
            return memo[2]
        blocks = self._table(per_row)[: self.batch_size, :per_row]  # [batch, per_row]
        heads = torch.arange(self.num_kv_heads)[None, :, None]  # [1, kv_heads, 1]
        index = (blocks[:, None, :] * self.num_kv_heads + heads).reshape(-1).to(self.device)
        self._gather = (self._home._version, per_row, index)
        return index

    def _buffers(self, chunks: int) -> tuple[Tensor, Tensor]:
        """keys_values' K and V buffers, their first `chunks` rows (grown by at least 1.5x when too small)."""
        if self._out is None or self._out[0].shape[0] < chunks:
            size = max(chunks, 3 * self._out[0].shape[0] // 2 if self._out is not None else 0)
            shape = (size, self.pool.block_size * self.head_dim)
            with torch.inference_mode():
                self._out = (torch.empty(shape, dtype=self.dtype, device=self.device),
                             torch.empty(shape, dtype=self.dtype, device=self.device))
        return self._out[0][:chunks], self._out[1][:chunks]

    def _table(self, width: int) -> Tensor:
        """The home block tables as a LongTensor [rows, width] on the CPU, padded with block 0."""
        tables = self._home._blocks
        out = torch.zeros(len(tables), width, dtype=torch.long)
        for n, blocks in enumerate(tables):
            row = blocks[:width]
            if row:
                out[n, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def _per_row(self, value: Tensor | int) -> Tensor:
        return torch.as_tensor(value, dtype=torch.long).cpu().expand(self.batch_size).clone()  # [batch]

    def _set_lengths(self, new_lengths: Tensor) -> None:
        self._lengths = new_lengths.to(dtype=torch.long, device="cpu").clone()
        self._device_lengths = None
        self._slots = None
        self._pending = None


def _all_positions(cache: KVCache | PagedKVCache, upto: int) -> tuple[Tensor, Tensor]:
    """Positions 0..upto-1 of every row of every layer: ([layers, rows, kv_heads, upto, head_dim],) * 2."""
    if isinstance(cache, PagedKVCache):
        per_row = cache.pool.blocks_for(upto)
        index = cache._gather_index(per_row)  # [rows * kv_heads * per_row]
        chunk = cache.pool.block_size * cache.head_dim
        shape = (cache.num_layers, cache.batch_size, cache.num_kv_heads, per_row * cache.pool.block_size,
                 cache.head_dim)
        k = cache.pool.k.view(cache.num_layers, -1, chunk).index_select(1, index).view(shape)[:, :, :, :upto]
        v = cache.pool.v.view(cache.num_layers, -1, chunk).index_select(1, index).view(shape)[:, :, :, :upto]
        return k, v
    return cache.k[:, :, :, :upto], cache.v[:, :, :, :upto]
