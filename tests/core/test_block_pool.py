"""The block pool and KV cache manager keep their invariants under any sequence of operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.core.block_pool import BlockPool
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.request import Request
from tokenloom.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=64))


def test_free_queue_hands_out_least_recently_freed_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.release([b])
    pool.release([a])
    assert pool.free_block_ids() == [2, 3, b.block_id, a.block_id]
    assert [block.block_id for block in pool.allocate(4)] == [2, 3, b.block_id, a.block_id]


def test_a_pool_of_millions_of_blocks_makes_only_those_it_hands_out():
    """An accelerator's memory holds millions of a small model's blocks (the simulator sizes pools so)."""
    pool = BlockPool(50_000_000)
    assert pool.blocks == [] and pool.num_free_blocks == 50_000_000
    first = pool.allocate(3)[0]
    pool.release([first])
    assert len(pool.blocks) == 3 and pool.num_used_blocks == 2
    assert [block.block_id for block in pool.allocate(2)] == [3, 4]  # those never handed out go first
    pool.check_invariants()


def test_cached_block_is_reused_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.register_computed_blocks(first)
    first_blocks = kv.block_ids("a")
    kv.free(first)
    second = make_request("b", [*list(range(8)), 99, 98])
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == first_blocks[:2]
    # A different prefix of the same length finds nothing.
    assert kv.find_cached_prefix(make_request("c", [7] * 10)) == []


def test_hash_collision_never_serves_wrong_tokens():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, 12345, (1, 2, 3))
    assert pool.lookup(12345, (1, 2, 3)) is block
    assert pool.lookup(12345, (9, 9, 9)) is None


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(8)))
    assert kv.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    kv.register_computed_blocks(request)
    kv.free(request)
    again = make_request("b", list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1  # 8 tokens: one block from cache, the last block recomputed


def test_ref_count_cannot_go_negative():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    try:
        pool.release([block])
    except AssertionError:
        return
    raise AssertionError("double free went unnoticed")


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40)),
    st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 9)),
    st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operation, max_size=60), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 24))
def test_kv_manager_invariants_under_random_operations(ops, block_size, num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
    live: dict[str, Request] = {}
    counter = 0
    for kind, a, b in ops:
        if kind == "add":
            counter += 1
            # A few shared prefixes (a picks one) so the prefix cache gets hits.
            request = make_request(f"r{counter}", [a] * 5 + list(range(b)))
            hits = kv.find_cached_prefix(request)
            num_new = request.num_tokens - len(hits) * block_size
            if kv.allocate_slots(request, num_new, hits):
                request.num_computed_tokens = request.num_tokens
                kv.register_computed_blocks(request)
                live[request.request_id] = request
                assert len(kv.block_ids(request.request_id)) * block_size >= request.num_tokens
            else:
                kv.free(request)
        elif kind == "grow" and live:
            request = list(live.values())[a % len(live)]
            request.output_token_ids.extend([7] * b)
            if kv.allocate_slots(request, b):
                request.num_computed_tokens += b
                kv.register_computed_blocks(request)
            else:
                request.output_token_ids = request.output_token_ids[:-b]
        elif kind == "free" and live:
            request = live.pop(list(live)[a % len(live)])
            kv.free(request)
        kv.check_invariants(set(live))
        assert kv.num_used_blocks <= num_blocks
        all_blocks = [bid for rid in live for bid in kv.block_ids(rid)]
        shared = {bid for bid in all_blocks if all_blocks.count(bid) > 1}
        # Only cached (full, identical-prefix) blocks may be shared between requests.
        assert all(kv.pool.blocks[bid].block_hash is not None for bid in shared)
    for request in live.values():
        kv.free(request)
    kv.check_invariants(set())
    assert kv.num_used_blocks == 0


def test_a_block_table_handed_out_keeps_its_ids_while_the_request_grows_and_is_trimmed():
    """block_table gives the manager's own list (no copy a step): later steps only append to it, and a trim or a
    free leaves the list a reader holds as it was; a new list comes with a new epoch."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("r", list(range(6)))
    assert kv.allocate_slots(request, 6)
    ids, epoch = kv.block_table("r")
    seen = ids[:]
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 6)  # 12 tokens: a third block, appended
    grown, same_epoch = kv.block_table("r")
    assert same_epoch == epoch and grown[: len(seen)] == seen and len(grown) == 3
    kv.trim(request, 6)  # drafts rejected: back to two blocks, in a new list under a new epoch
    trimmed, new_epoch = kv.block_table("r")
    assert new_epoch != epoch and trimmed == seen and trimmed is not grown and len(grown) == 3
    kv.free(request)
    assert trimmed == seen and kv.block_table("r") == ([], -1)
