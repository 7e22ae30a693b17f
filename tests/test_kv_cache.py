"""KVCache: allocation, keep (compaction of the accepted path), read/write round trip."""

from __future__ import annotations

import torch

from draftsmith.runtime.kv_cache import KVCache

LAYERS, HEADS, DIM, LEN = 2, 2, 3, 16


def labelled() -> KVCache:
    """Every element encodes (tensor, head, slot, dim), so a moved slot is recognisable."""
    c = KVCache.allocate(LAYERS, HEADS, DIM, LEN, torch.float32, "cpu")
    for t_i, t in enumerate((*c.k, *c.v)):
        h = torch.arange(HEADS).view(1, HEADS, 1, 1)
        s = torch.arange(LEN).view(1, 1, LEN, 1)
        d = torch.arange(DIM).view(1, 1, 1, DIM)
        t.copy_(t_i * 10000 + h * 1000 + s * 10 + d)
    return c


def slot_values(c: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in (*c.k, *c.v)]


def expected_after_keep(before: list[torch.Tensor], start: int, slots: list[int]) -> list[torch.Tensor]:
    out = [t.clone() for t in before]
    for t, b in zip(out, before, strict=True):
        for i, s in enumerate(slots):
            t[:, :, start + i] = b[:, :, s]
    return out


def test_allocate():
    c = KVCache.allocate(3, 2, 4, 10, torch.float16, "cpu")
    assert len(c.k) == len(c.v) == 3
    assert all(t.shape == (1, 2, 10, 4) and t.dtype == torch.float16 and not t.any() for t in (*c.k, *c.v))
    assert c.max_len == 10
    assert c.nbytes_per_token == 2 * 3 * 2 * 4 * 2
    assert len({t.data_ptr() for t in (*c.k, *c.v)}) == 6  # no aliasing between layers or k/v


def test_keep_moves_tree_branch_to_contiguous_slots():
    c = labelled()
    before = slot_values(c)
    c.keep(4, torch.tensor([5, 7, 9]))  # nodes 1, 3, 5 of a tree written at slots 4..
    after = slot_values(c)
    for a, e in zip(after, expected_after_keep(before, 4, [5, 7, 9]), strict=True):
        assert torch.equal(a, e)
    assert torch.equal(c.k[1][0, 1, 5], before[1][0, 1, 7])  # spot check: slot 5 holds old slot 7
    assert torch.equal(c.v[0][:, :, :4], before[2][:, :, :4])  # the prefix is untouched
    assert torch.equal(c.v[0][:, :, 7:], before[2][:, :, 7:])  # past the path: left alone


def test_keep_contiguous_path_is_a_no_op():
    c = labelled()
    before = slot_values(c)
    c.keep(4, torch.tensor([4, 5, 6]))
    assert all(torch.equal(a, b) for a, b in zip(slot_values(c), before, strict=True))
    c.keep(4, torch.tensor([], dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(slot_values(c), before, strict=True))


def test_keep_overlapping_source_and_destination():
    for start, slots in [(4, [5, 6, 7]), (3, [4, 6, 7, 9]), (2, [2, 4, 5]), (0, [1, 2, 3, 4, 5, 6, 7, 8])]:
        c = labelled()
        before = slot_values(c)
        c.keep(start, torch.tensor(slots))
        for a, e in zip(slot_values(c), expected_after_keep(before, start, slots), strict=True):
            assert torch.equal(a, e), (start, slots)


def test_read_write_round_trip():
    c = labelled()
    saved = c.read(3, 7)
    assert len(saved) == 2 * LAYERS and all(s.shape == (1, HEADS, 4, DIM) for s in saved)
    for s, t in zip(saved, (*c.k, *c.v), strict=True):
        assert torch.equal(s, t[:, :, 3:7])
    for t in (*c.k, *c.v):  # read returns copies: later writes to the cache do not reach them
        t.zero_()
    assert saved[0][0, 0, 0, 0] == 30

    other = KVCache.allocate(LAYERS, HEADS, DIM, LEN, torch.float32, "cpu")
    other.write(8, saved)
    for s, t in zip(saved, (*other.k, *other.v), strict=True):
        assert torch.equal(t[:, :, 8:12], s)
        assert not t[:, :, :8].any() and not t[:, :, 12:].any()
    assert all(torch.equal(a, b) for a, b in zip(other.read(8, 12), saved, strict=True))
