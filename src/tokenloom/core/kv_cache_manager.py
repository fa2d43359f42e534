"""Which KV blocks each request holds, and the prefix cache over full blocks of tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import count

from tokenloom.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from tokenloom.core.request import PLACEHOLDER_TOKEN, Request
from tokenloom.utils import cdiv


class KVCacheManager:
    """Gives requests the blocks their tokens need, and shares full blocks of identical prefixes between them.

    A block becomes shareable once every token in it is computed; its hash is chained from its parent's, so one
    lookup per block walks the longest cached prefix of a new request.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # Each request's blocks, by id (the pool's blocks[id] is the block): a step reads them for every request.
        self._block_ids: dict[str, list[int]] = {}
        # Each request's list of ids only grows by appending under one epoch; a new list (after it was freed) or a
        # trimmed one takes a new epoch, so a reader that kept the ids it saw need only add the tail (block_table).
        self._epochs: dict[str, int] = {}
        self._next_epoch = count()
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # how many leading blocks of a request are in the cache index
        self.prefix_cache_queries = 0  # in tokens, as vLLM counts them
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in order (a copy of ints: no walk over its blocks)."""
        return self._block_ids.get(request_id, [])[:]

    def block_table(self, request_id: str) -> tuple[list[int], int]:
        """The request's list of block ids itself (not a copy: a step reads it for every request, and a copy cost
        the context's length each step) and its epoch. Under one epoch the list only grows by appending, so the ids
        it holds now stay where they are; a reader keeps its length now and reads no further."""
        return self._block_ids.get(request_id, []), self._epochs.get(request_id, -1)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that starts the request's tokens.

        The last token is always left to compute, because the step must produce its logits. A request that asks
        for prompt logprobs needs every prompt token's logits, so it computes its whole prompt (as in vLLM).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self._full_block_hashes(request)
        hits: list[KVBlock] = []
        for i in range(min(len(hashes), (request.num_tokens - 1) // self.block_size)):
            block = self.pool.lookup(hashes[i], self._block_tokens(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[KVBlock] = ()) -> bool:
        """Makes room for num_new_tokens more tokens after the computed (and cache-hit) ones; False if it can't."""
        num_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return self._allocate(request, num_tokens, cached_blocks)

    def allocate_for_swap_in(self, request: Request, num_new_tokens: int) -> int | None:
        """Blocks for a swapped-out request's computed tokens and num_new_tokens more; None if there is no room.

        Its leading blocks that are still in the prefix cache are taken from there; returns how many, since
        their KV need not be copied back from the host.
        """
        hits = self.find_cached_prefix(request)[: request.num_computed_tokens // self.block_size]
        if not self._allocate(request, request.num_computed_tokens + num_new_tokens, hits):
            return None
        return len(hits)

    def _allocate(self, request: Request, num_tokens: int, cached_blocks: Sequence[KVBlock]) -> bool:
        ids = self._block_ids.get(request.request_id)
        if ids is None:
            ids = self._block_ids[request.request_id] = []
            self._epochs[request.request_id] = next(self._next_epoch)
        num_needed = cdiv(num_tokens, self.block_size) - len(ids) - len(cached_blocks)
        if num_needed <= 0 and not cached_blocks:  # most decode steps: the last block has room
            return True
        # Cache hits that sit in the free queue stop being free once we take them.
        num_available = self.pool.num_free_blocks - sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_needed > num_available:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            ids.extend(block.block_id for block in cached_blocks)
            self._num_registered[request.request_id] = len(ids)
        if num_needed > 0:
            ids.extend(block.block_id for block in self.pool.allocate(num_needed))
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Makes the request's newly completed blocks findable by later requests with the same prefix (up to the
        first that holds a placeholder: the rest wait for its token, and a later call registers them)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes, ids = self._full_block_hashes(request), self._block_ids[request.request_id]
        num_full = min(num_full, len(hashes))
        for i in range(start, num_full):
            self.pool.cache_full_block(self.pool.blocks[ids[i]], hashes[i], self._block_tokens(request, i))
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks beyond the first num_tokens tokens (slots taken for drafts it rejected).

        Those blocks hold no computed token, so none is in the prefix cache index."""
        ids = self._block_ids.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        assert keep >= self._num_registered.get(request.request_id, 0), "a registered block would be given back"
        if len(ids) > keep:
            self.pool.release(self._blocks(reversed(ids[keep:])))
            self._block_ids[request.request_id] = ids[:keep]  # a new list: a reader of the old one keeps its ids
            self._epochs[request.request_id] = next(self._next_epoch)

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Computed tokens in the request's leading blocks that other requests hold too."""
        num_shared = 0
        for block in self._blocks(self._block_ids.get(request.request_id, [])):
            if block.ref_cnt < 2:
                break
            num_shared += 1
        return min(num_shared * self.block_size, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Gives back every block the request holds; the last blocks go first to eviction, its shared prefix last."""
        ids = self._block_ids.pop(request.request_id, [])
        self._epochs.pop(request.request_id, None)
        self.pool.release(self._blocks(reversed(ids)))
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def _blocks(self, ids: Iterable[int]) -> list[KVBlock]:
        return [self.pool.blocks[block_id] for block_id in ids]

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        """The tokens of the request's block `index` (read alone: a request's whole token list is not copied)."""
        return tuple(request.token_ids_slice(index * self.block_size, (index + 1) * self.block_size))

    def _full_block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks, up to the first that holds a placeholder (a token still
        on the device: its block is hashed once the token is known), chained from the request's root."""
        hashes = self._hashes.setdefault(request.request_id, [])
        root = _chain_root(request) if not hashes else None
        for i in range(len(hashes), request.num_tokens // self.block_size):
            block_tokens = self._block_tokens(request, i)
            if PLACEHOLDER_TOKEN in block_tokens:
                break
            hashes.append(hash_block_tokens(hashes[-1] if hashes else root, block_tokens))
        return hashes

    def check_invariants(self, live_request_ids: set[str]) -> None:
        self.pool.check_invariants()
        assert set(self._block_ids) <= live_request_ids, "blocks held by a request that is gone"
        assert self._epochs.keys() == self._block_ids.keys(), "a list of block ids without its epoch, or the reverse"
        holders: dict[int, int] = {}
        for ids in self._block_ids.values():
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id} ref count is off"


def _chain_root(request: Request) -> BlockHash | None:
    """What a request's first block hash starts from. Under a LoRA adapter, its name and path: the same tokens have
    other K and V under another adapter (or under a name that came to stand for another path). With a cache salt,
    the salt: a client (or tenant) that salts its requests shares no block with anyone else, so no one can tell from
    a faster first token that it sent a prompt."""
    lora, salt = request.lora_request, request.cache_salt
    root = None if lora is None else hash(("lora", lora.lora_name, lora.lora_path))
    return root if salt is None else hash(("salt", salt, root))
