"""The pool of KV-cache blocks: reference counts, a free queue in LRU order, and the prefix cache.

A block is in exactly one of three states: in use (ref_cnt > 0), free and cached (ref_cnt == 0,
has a hash, still findable by prefix lookups), or free and empty. Free blocks of both kinds wait in
one queue; allocation takes from its head, so a cached block is evicted only once it is the least
recently freed. Block 0 is the null block: never handed out, it pads block tables on the worker.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and cached
        # Links of the free queue; None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """A doubly linked list through the blocks themselves: O(1) removal from the middle, which
    a prefix hit on a free cached block needs, and no allocation per operation."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels, so no operation special-cases an end
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and at least one more, "
                             f"got num_blocks={num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}  # block hash -> the block holding it

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones and evictable cached ones."""
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits; a hit that was free leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the queue's tail in the order given,
        so the first given is the first evicted among them."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Makes a full block findable by its hash. A second block with the same contents (two
        requests computed it at the same time) stays uncached: one copy is enough."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """No longer findable by its hash (a no-op for a block that is not cached)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is in use."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self, idle: bool = False) -> None:
        """Raises AssertionError if the pool's books do not balance. `idle`: no request holds
        a block, so every block but the null block must be free with no reference."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free, "free queue length mismatch"
        assert self.null_block not in in_queue and self.null_block.ref_cnt == 0, "null block used"
        assert all(b.ref_cnt == 0 for b in in_queue), "a referenced block is in the free queue"
        num_used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert num_used + len(in_queue) == self.num_blocks - 1, (
            f"leak: {num_used} used + {len(in_queue)} free != {self.num_blocks - 1}")
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} cached under a stale hash"
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self.cached)
        if idle:
            assert num_used == 0, f"{num_used} blocks still referenced while idle"
