import pytest
import torch

from draftsmith.runtime.kv_cache import KVCache
from draftsmith.serve.engine import prefix_cache
from draftsmith.serve.engine.prefix_cache import PrefixCache

BS = 4  # block size used throughout
BLOCK_BYTES = BS * 2 * 2 * 2 * 4 * 4  # tokens * (k, v) * layers * kv_heads * head_dim * fp32


def cache(layers: int = 2, filled: bool = True) -> KVCache:
    c = KVCache.allocate(layers=layers, kv_heads=2, head_dim=4, max_len=64, dtype=torch.float32, device="cpu")
    if filled:
        for t in (*c.k, *c.v):
            t.copy_(torch.randn_like(t))
    return c


def same(a: KVCache, b: KVCache, start: int, end: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.read(start, end), b.read(start, end), strict=True))


def zero(c: KVCache, start: int, end: int) -> bool:
    return all(not t.any() for t in c.read(start, end))


def test_full_hit_restores_target_and_drafter():
    target, drafter = cache(), cache(layers=1)
    tokens = list(range(13))  # 3 full blocks + 1
    pc = PrefixCache(block_size=BS)
    pc.insert(tokens, "s", [target, drafter])
    assert len(pc) == 3

    t2, d2 = cache(filled=False), cache(layers=1, filled=False)
    assert pc.lookup(tokens, "s", [t2, d2]) == 12
    assert same(t2, target, 0, 12) and same(d2, drafter, 0, 12)
    assert zero(t2, 12, 64) and zero(d2, 12, 64)


def test_partial_hit_shares_first_block_only():
    target = cache()
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(12)), "s", [target])
    other = [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11, 12]  # diverges inside block 1
    fresh = cache(filled=False)
    assert pc.lookup(other, "s", [fresh]) == 4
    assert same(fresh, target, 0, 4) and zero(fresh, 4, 64)
    assert pc.lookup([7, 1, 2, 3, 4, 5], "s", [cache(filled=False)]) == 0  # first block differs


def test_last_token_must_be_left_to_prefill():
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(8)), "s", [cache()])
    assert len(pc) == 2
    assert pc.lookup(list(range(8)), "s", [cache(filled=False)]) == 4
    assert pc.lookup(list(range(9)), "s", [cache(filled=False)]) == 8
    assert pc.lookup(list(range(4)), "s", [cache(filled=False)]) == 0


def test_insert_upto_stores_only_full_blocks_before_it():
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(12)), "s", [cache()], upto=7)
    assert len(pc) == 1
    assert pc.lookup(list(range(12)), "s", [cache(filled=False)]) == 4


def test_other_salt_or_cache_set_is_a_miss():
    pc = PrefixCache(block_size=BS)
    tokens = list(range(9))
    pc.insert(tokens, "target-a|fp32|drafter-x", [cache(), cache(layers=1)])
    fresh = cache(filled=False)
    assert pc.lookup(tokens, "target-a|fp32|drafter-y", [fresh, cache(layers=1, filled=False)]) == 0
    assert zero(fresh, 0, 64)
    assert pc.lookup(tokens, "target-a|fp32|drafter-x", [fresh]) == 0  # stored with a drafter, asked without
    assert zero(fresh, 0, 64)
    assert pc.lookup(tokens, "target-a|fp32|drafter-x", [fresh, cache(layers=1, filled=False)]) == 8


def test_same_tokens_under_two_salts_are_kept_apart():
    pc = PrefixCache(block_size=BS)
    tokens = list(range(9))
    a, b = cache(), cache()
    pc.insert(tokens, "a", [a])
    pc.insert(tokens, "b", [b])
    assert len(pc) == 4
    for salt, src in (("a", a), ("b", b)):
        fresh = cache(filled=False)
        assert pc.lookup(tokens, salt, [fresh]) == 8
        assert same(fresh, src, 0, 8)


def test_lru_eviction_under_byte_budget():
    pc = PrefixCache(block_size=BS, max_bytes=5 * BLOCK_BYTES)
    a, b, c = [1] * 9, [2] * 9, [3] * 9  # 2 full blocks each (the 9th token is never stored)
    pc.insert(a, "s", [cache()])
    pc.insert(b, "s", [cache()])
    assert pc.nbytes == 4 * BLOCK_BYTES
    assert pc.lookup(a, "s", [cache(filled=False)]) == 8  # a is now more recent than b
    pc.insert(c, "s", [cache()])  # 6 blocks > 5: one goes, b's leaf (least recently used)
    assert len(pc) == 5 and pc.nbytes == 5 * BLOCK_BYTES
    assert pc.lookup(a, "s", [cache(filled=False)]) == 8
    assert pc.lookup(c, "s", [cache(filled=False)]) == 8
    assert pc.lookup(b, "s", [cache(filled=False)]) == 4  # root kept, leaf evicted

    pc.max_bytes = 2 * BLOCK_BYTES
    pc.insert(c, "s", [cache()])  # nothing new; touching c makes a and b the oldest
    assert len(pc) == 2 and pc.nbytes == 2 * BLOCK_BYTES
    assert pc.lookup(c, "s", [cache(filled=False)]) == 8
    assert pc.lookup(a, "s", [cache(filled=False)]) == 0
    assert pc.nbytes == sum(t.nbytes for blk in pc.blocks.values() for kv in blk.kv for t in kv)


def test_evicting_a_parent_evicts_its_descendants():
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(13)), "s", [cache(), cache(layers=1)])
    pc.insert([9] * 5, "s", [cache(), cache(layers=1)])
    assert len(pc) == 4
    root = next(k for k, blk in pc.blocks.items() if blk.parent is None and blk.tokens == (0, 1, 2, 3))
    pc._remove(root)
    assert len(pc) == 1
    assert pc.nbytes == BLOCK_BYTES + BLOCK_BYTES // 2  # the [9]*4 block: target + 1-layer drafter
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0


def test_counters():
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(9)), "s", [cache()])
    pc.lookup(list(range(9)), "s", [cache(filled=False)])  # 8 of 9
    pc.lookup(list(range(6)), "s", [cache(filled=False)])  # 4 of 6
    pc.lookup(list(range(9)), "t", [cache(filled=False)])  # 0 of 9
    assert (pc.queried_tokens, pc.hit_tokens) == (24, 12)


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens, salt: 0)  # every key collides
    target = cache()
    pc = PrefixCache(block_size=BS)
    pc.insert(list(range(9)), "s", [target])
    assert len(pc) == 1  # the second block collides with the first and is not stored
    fresh = cache(filled=False)
    assert pc.lookup([5, 6, 7, 8, 9], "s", [fresh]) == 0
    assert zero(fresh, 0, 64)
    pc.insert([5, 6, 7, 8, 9], "s", [cache()])  # must not overwrite the stored block
    assert pc.lookup(list(range(9)), "s", [fresh]) == 4
    assert same(fresh, target, 0, 4)
