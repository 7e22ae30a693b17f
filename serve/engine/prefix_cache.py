"""Prefix cache: full blocks of tokens -> saved slots of every cache of a sequence (target + drafters: KV caches,
feature stores).

A block's key chains its parent's key, so a key names the whole prefix up to the block's end. All caches
of a sequence are stored in the same block, so a hit restores target and drafter state together.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from draftsmith.runtime.kv_cache import SlotCache


def block_key(parent: int | None, tokens: tuple[int, ...], salt: str) -> int:
    return hash((parent, tokens, salt))


@dataclass(slots=True)
class Block:
    key: int
    parent: int | None
    tokens: tuple[int, ...]
    salt: str
    kv: list[list[Tensor]]  # kv[j]: cache j's read() of this block's slots
    nbytes: int
    children: set[int] = field(default_factory=set)

    def matches(self, parent: int | None, tokens: tuple[int, ...], salt: str, n_caches: int) -> bool:
        # Guards against hash collisions and against a different set of caches under the same salt.
        return (self.parent, self.tokens, self.salt, len(self.kv)) == (parent, tokens, salt, n_caches)


class PrefixCache:
    def __init__(self, block_size: int = 16, max_bytes: int = 1 << 30) -> None:
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # LRU first
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self._nbytes = 0

    def reset(self) -> None:
        """Empty, with counters back at zero (e.g. after a warm-up that must not count as hits)."""
        self.clear()
        self.queried_tokens = self.hit_tokens = 0

    def lookup(self, tokens: Sequence[int], salt: str, caches: list[SlotCache]) -> int:
        """Restore the longest stored prefix into caches; return its length (a multiple of block_size).

        At least one token is always left over, so the engine still prefills something and gets logits.
        """
        hits = self._walk(tokens, (len(tokens) - 1) // self.block_size, salt, len(caches))
        for i, block in enumerate(hits):
            for cache, saved in zip(caches, block.kv, strict=True):
                cache.write(i * self.block_size, saved)
        self._touch(hits)
        hit = len(hits) * self.block_size
        self.queried_tokens += len(tokens)
        self.hit_tokens += hit
        return hit

    def insert(self, tokens: Sequence[int], salt: str, caches: list[SlotCache], upto: int | None = None) -> None:
        """Store every full block of tokens[:upto] not stored yet, reading its slots from caches."""
        upto = len(tokens) if upto is None else upto
        if upto > len(tokens) or any(upto > c.max_len for c in caches):
            raise ValueError(f"upto={upto} exceeds the tokens or a cache's max_len")
        n = upto // self.block_size
        chain = self._walk(tokens, n, salt, len(caches))
        parent = chain[-1].key if chain else None
        for i in range(len(chain), n):
            start, end = i * self.block_size, (i + 1) * self.block_size
            toks = tuple(tokens[start:end])
            key = block_key(parent, toks, salt)
            if key in self.blocks:  # a collision or a different cache set: this chain cannot go on
                break
            kv = [c.read(start, end) for c in caches]
            block = Block(key, parent, toks, salt, kv, sum(t.nbytes for saved in kv for t in saved))
            self.blocks[key] = block
            self._nbytes += block.nbytes
            if parent is not None:
                self.blocks[parent].children.add(key)
            chain.append(block)
            parent = key
        self._touch(chain)
        self._evict()

    def _walk(self, tokens: Sequence[int], n: int, salt: str, n_caches: int) -> list[Block]:
        """The stored blocks matching the first (up to) n full blocks of tokens."""
        found: list[Block] = []
        parent = None
        for i in range(n):
            toks = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.blocks.get(block_key(parent, toks, salt))
            if block is None or not block.matches(parent, toks, salt, n_caches):
                break
            found.append(block)
            parent = block.key
        return found

    def _touch(self, chain: list[Block]) -> None:
        # Leaf first, root last: ancestors stay more recent than descendants, so LRU evicts leaves first.
        for block in reversed(chain):
            self.blocks.move_to_end(block.key)

    def _evict(self) -> None:
        while self._nbytes > self.max_bytes and self.blocks:
            self._remove(next(iter(self.blocks)))

    def _remove(self, key: int) -> None:
        # Descendants go too: without their parent they can never be reached again.
        block = self.blocks.pop(key)
        self._nbytes -= block.nbytes
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children.discard(key)
        for child in list(block.children):
            if child in self.blocks:
                self._remove(child)
