"""The pool of KV cache blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block is in exactly one of two states: *owned* (ref_cnt > 0, held by one or more requests) or *free*
(ref_cnt == 0, in the free queue). A free block may still carry the hash of the tokens it holds: until the
pool hands it out again, a later request with the same prefix can take it back (a prefix-cache hit). Blocks
are handed out from the head of the free queue, so the least recently freed cached blocks go first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

BlockHash = int


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the tokens a cached block holds, to confirm a hash hit
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks: O(1) pop from the head, append at the tail, removal anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None, "block already queued"
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"block {block.block_id} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        assert first is not None and first is not self._tail, "no free blocks"
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """A block's hash covers its own tokens and, through the parent's hash, every token before it."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """The blocks, made as they are first handed out: a pool sized from an accelerator's memory for a small model
    holds millions, which would take seconds to make and memory to keep. Until then they wait, in id order, ahead
    of the free queue, as they would at the head of a queue that held all of them from the start (blocks freed
    later go to its tail), so the order blocks are handed out in is the same."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self._num_blocks = num_blocks
        self.blocks: list[KVBlock] = []  # those handed out at least once; blocks[i].block_id == i
        self.free_queue = FreeBlockQueue(())
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def _num_unmade(self) -> int:
        return self._num_blocks - len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self._num_unmade

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Hands out n blocks from the head of the free queue, evicting any cached content they held."""
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        new_blocks = []
        for _ in range(n):
            block = self._next_free()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _next_free(self) -> KVBlock:
        if self._num_unmade:
            block = KVBlock(len(self.blocks))
            self.blocks.append(block)
            return block
        return self.free_queue.popleft()

    def free_block_ids(self) -> list[int]:
        """The free blocks' ids in the order they will be handed out (for tests: it lists every one)."""
        return [*range(len(self.blocks), self._num_blocks), *(block.block_id for block in self.free_queue)]

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        """A cached block holding exactly these tokens after this prefix, or None."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None  # a hash collision must never serve another prefix's KV
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on cache-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; a block nobody holds goes to the tail of the free queue."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} ref count went negative"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds these tokens; keep the first one
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()

    def check_invariants(self) -> None:
        """Every block is either free (ref 0, queued) or owned (ref > 0, not queued); the index is consistent."""
        queued = {b.block_id for b in self.free_queue}
        assert len(queued) == self.free_queue.num_free
        for i, block in enumerate(self.blocks):
            assert block.block_id == i
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in queued), f"block {block.block_id} is lost"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash
