"""Which KV-cache blocks each request holds, and prefix-cache lookups over the block pool.

A full block is identified by a chained hash: sha256(parent block's hash, its token ids, extra
keys). The chain makes a hit on block i imply hits on blocks 0..i-1, so a lookup walks from the
first block and stops at the first miss. Extra keys (a cache salt, the LoRA adapter's id: one
adapter's KV is not another's, nor the base model's) go into the first block only;
the chain carries them to every later block. sha256 rather than Python's hash(): a crafted
collision would hand one request another's KV.
"""

from __future__ import annotations

import hashlib
from array import array

from scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.core.request import Request

_ROOT_HASH = b"\0" * 32


def hash_block(parent: bytes, token_ids: list[int], extra: str | None = None,
               lora_id: int = 0) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("i", token_ids).tobytes())
    if extra is not None:
        h.update(b"\1salt:" + extra.encode())
    if lora_id:  # a separate tag: no salt string can pose as an adapter
        h.update(b"\2lora:" + lora_id.to_bytes(4, "little"))
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each request already cached

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (cached free blocks count as free)."""
        return 1 - self.pool.num_free_blocks / (self.pool.num_blocks - 1)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks a new (or resumed) request can reuse, and the tokens they hold.

        The hit stops one token short of the whole sequence: the last token must be computed to
        produce the logits of the next one.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Gives the request room for `num_new_tokens` more tokens after its computed ones
        (and after any prefix-cache hits). Returns the newly allocated blocks, or None when the
        pool is short, in which case nothing changed."""
        req_id = request.wire_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is not None and not new_computed_blocks and not num_new_computed_tokens:
            # The common decode step: the new tokens fit the request's last block, and no block
            # became full (a full one must be cached below).
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size and (
                    not self.enable_prefix_caching
                    or min(total, len(request.all_token_ids)) // self.block_size
                    <= self._num_cached.get(req_id, 0)):
                return []
        hits = new_computed_blocks or []
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new = -(-total // self.block_size) - len(blocks) - len(hits)
        if num_new > 0 or hits:
            # Touching a free cached hit takes it out of the free queue, so it counts against it.
            num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
            if max(num_new, 0) + num_free_hits > self.pool.num_free_blocks:
                if not blocks:
                    del self.req_to_blocks[req_id]
                return None
            if hits:
                self.pool.touch(hits)
                blocks.extend(hits)
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        # Blocks become findable as soon as they are scheduled: a request admitted later in this
        # same step reads them after the worker has written them in the same forward pass.
        num_full = min(total, len(request.all_token_ids)) // self.block_size
        if self.enable_prefix_caching and num_full > self._num_cached.get(req_id, 0):
            self._cache_full_blocks(request, blocks, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last block first: tails are the least likely to be
        shared, so they should be evicted before the prefixes they hang from."""
        blocks = self.req_to_blocks.pop(request.wire_id, None)
        self._num_cached.pop(request.wire_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def forget_cached(self, request: Request, first_block: int = 0) -> None:
        """Takes the request's blocks from `first_block` on out of the prefix cache: their KV was
        never written (the worker refused the step that was to write it)."""
        for block in self.req_to_blocks.get(request.wire_id, [])[first_block:]:
            self.pool.uncache(block)
        self._num_cached[request.wire_id] = min(self._num_cached.get(request.wire_id, 0),
                                                first_block)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_full: int) -> None:
        start = self._num_cached.get(request.wire_id, 0)
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.wire_id] = num_full

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        """Hashes the request's full blocks up to `num_blocks` (its tokens there are final)."""
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for i in range(len(hashes), min(num_blocks, len(tokens) // size)):
            parent = hashes[i - 1] if i else _ROOT_HASH
            first = i == 0
            hashes.append(hash_block(
                parent, tokens[i * size:(i + 1) * size], request.cache_salt if first else None,
                request.lora.lora_int_id if first and request.lora is not None else 0))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        idle = not any(self.req_to_blocks.values())
        self.pool.check_invariants(idle=idle)
        held = sum(len(b) for b in self.req_to_blocks.values())
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert held == refs, f"requests hold {held} block references, the pool counts {refs}"
