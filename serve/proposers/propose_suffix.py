"""Suffix decoding (arXiv 2411.04975; vLLM's `method: suffix`, from Snowflake's ArcticInference): draft what most
often followed the latest tokens, from a suffix tree over this request's prompt and output and one over earlier
responses. No model, no training.

A tree counts every substring of at most `max_tree_depth` tokens of its sequences: a node's count is how often its
path occurs, so count(child) / count(node) estimates the next token's probability. For each match length m (the
last m tokens found in the tree) a tree drafts the likeliest continuation of up to max_spec_factor * m tokens,
stopping where the path's probability drops under min_token_prob; a draft scores the sum of its tokens'
probabilities (its expected accepted length) and the best score over match lengths and both trees wins (the
request's tree on ties), as ArcticInference does.

Memory is linear in the tokens held: a node that only one occurrence reaches is a leaf standing for the rest of
that occurrence (a reference into its sequence), split into nodes when a second occurrence arrives. The global
tree keeps the responses of the last `max_cached_requests` requests (the running one included, learnt token by
token) and drops the oldest past that.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.base import Proposer
from draftsmith.serve.spec import SpecConfig, SuffixConfig

UNBOUNDED = sys.maxsize  # no budget: drafts only as deep as num_tokens and the match allow
MAX_CLIENTS = 64  # clients whose global trees are kept (draftsmith-serve with API keys or cache_salt)


class Node:
    """One substring: its last token, length (depth) and count. Reached by one occurrence only, it can be a leaf
    standing for that occurrence's next tokens: seq[at:], up to the tree's depth."""

    __slots__ = ("token", "depth", "count", "kids", "best", "seq", "at")

    def __init__(self, token: int, depth: int, seq: list[int] | None = None, at: int = 0) -> None:
        self.token, self.depth, self.count = token, depth, 1
        self.kids: dict[int, Node] | None = None if seq is not None else {}  # a leaf has none
        self.best: Node | None = None  # the child with the highest count (ties: the latest to reach it)
        self.seq, self.at = seq, at  # a leaf's sequence and the index its chain continues at; seq None: not a leaf


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the root (the pending token)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0  # sum of probs: the expected accepted length, by the counts
    match_len: int = 0


class SuffixTree:
    """Substrings of at most `depth` tokens of its sequences, counted. A list of positions `at[m - 1]` stands for
    substrings of length m = 1, 2, ...: a node of depth m, or a leaf of smaller depth whose chain holds them."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node(-1, 0)
        self.root.count = 0  # one per suffix start: every token held
        self.seqs: dict[int, list[int]] = {}
        self.open: dict[int, list[Node]] = {}  # per sequence: its suffixes shorter than depth

    def extend(self, sid: int, tokens: list[int]) -> None:
        for t in tokens:
            self.append(sid, t)

    def append(self, sid: int, token: int) -> None:
        """Count the suffixes ending at the new token: each open suffix steps into its child for it. Those in a
        leaf of their own (the longest ones: a suffix met once makes every longer one met once) need nothing:
        the leaf's chain grows with seq."""
        seq = self.seqs.setdefault(sid, [])
        seq.append(token)
        end = len(seq) - 1  # the new token's index
        self.root.count += 1
        old = self.open.get(sid, [])
        shared = self.shared(old, seq, end)
        # longest first: a shorter suffix that splits a leaf then sees every longer one already extended
        grown = [self.enter(node, token, seq, end + 1) for node in [*reversed(shared), self.root]]
        self.open[sid] = (grown[::-1] + old[len(shared) :])[: self.depth - 1]

    def shared(self, at: list[Node], seq: list[int], end: int) -> list[Node]:
        """The positions of seq[end - m : end] (at[m - 1]) up to the first one in a leaf, resolved."""
        out = []
        for m, node in enumerate(at, 1):
            node = self.resolve(node, m, seq, end)
            if node.seq is not None:
                break
            out.append(node)
        return out

    def enter(self, node: Node, token: int, seq: list[int], after: int) -> Node:
        """One more occurrence of node's substring + token, continuing at seq[after:]."""
        assert node.kids is not None, "not a leaf"
        child = node.kids.get(token)
        if child is None:
            child = node.kids[token] = Node(token, node.depth + 1, seq, after)
            node.best = node.best or child
            return child
        if child.seq is not None:  # another occurrence's leaf: give that occurrence its own next node
            self.split(child)
        child.count += 1
        assert node.best is not None, "set with its first child"
        if child.count >= node.best.count:
            node.best = child
        return child

    def split(self, leaf: Node) -> None:
        seq, at = leaf.seq, leaf.at
        assert seq is not None, "a leaf"
        leaf.seq, leaf.kids = None, {}
        if at < len(seq) and leaf.depth < self.depth:
            leaf.best = leaf.kids[seq[at]] = Node(seq[at], leaf.depth + 1, seq, at + 1)

    def resolve(self, node: Node, d: int, seq: list[int], end: int) -> Node:
        """The node holding seq[end - d : end] now (a leaf it sat in may have been split since)."""
        while node.seq is None and node.depth < d:
            assert node.kids is not None, "seq None: not a leaf"
            node = node.kids[seq[end - d + node.depth]]
        return node

    def remove(self, sid: int) -> None:
        """Uncount every suffix of sequence sid; nodes no other occurrence reaches go."""
        seq = self.seqs.pop(sid, [])
        self.open.pop(sid, None)
        for i in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for t in seq[i : i + self.depth]:
                assert node.kids is not None, "a counted occurrence runs through inner nodes"
                child = node.kids[t]
                child.count -= 1
                if child.count == 0:  # only this occurrence reached it: its whole subtree goes
                    del node.kids[t]
                if node.best is child and node is not self.root:  # (drafts never start at the root)
                    node.best = max(node.kids.values(), key=by_count, default=None)
                if child.count == 0:
                    break
                node = child

    # ------------------------------------------------------------ matching

    def step(self, node: Node, d: int, token: int) -> Node | None:
        """Where substring + token sits, given where the substring (length d) does."""
        if node.seq is None:
            assert node.kids is not None, "seq None: not a leaf"
            return node.kids.get(token)
        i = node.at + d - node.depth
        return node if d < self.depth and i < len(node.seq) and node.seq[i] == token else None

    def follow(self, matches: list[Node], context: list[int], token: int) -> list[Node]:
        """matches[m - 1]: where context's last m tokens sit, for every m below depth that the tree holds with a
        token after it. Returns them for context + [token] (context must already end with token)."""
        out: list[Node] = []
        end = len(context) - 1
        for d, node in enumerate([self.root, *matches[: self.depth - 2]]):
            found = self.step(self.resolve(node, d, context, end), d, token)
            if found is None or self.dead_end(found, d + 1):
                break  # nor can a longer suffix (it occurs only where this one does) have anything after it
            out.append(found)
        return out

    def dead_end(self, node: Node, d: int) -> bool:
        """Nothing follows the substring (length d) in node: a leaf at its sequence's end, so far."""
        return node.seq is not None and node.at + d - node.depth >= len(node.seq)

    def suffixes(self, sid: int) -> list[Node]:
        """Where the sequence's own last m tokens sit, m = 1, 2, ..., as far as others share them (the rest are
        in leaves of its own: nothing follows them)."""
        seq = self.seqs[sid]
        return self.shared(self.open[sid], seq, len(seq))

    # ------------------------------------------------------------ drafting

    def speculate(self, matches: list[Node], k: int, cfg: SuffixConfig, deepest: int = UNBOUNDED) -> Draft:
        """The best-scored draft over match lengths, longest first: ties go to the longer match, and a match
        whose length caps its draft at no more than the best score so far cannot beat it, nor can a shorter.
        No node deeper than `deepest` (the tokens the request may still emit)."""
        best = Draft()
        for m in range(len(matches), 0, -1):
            n = min(k, int(m * cfg.max_spec_factor + 1e-6))
            if n <= best.score:
                break
            if cfg.tree:
                draft = self.draft_tree(matches[m - 1], m, n, cfg.min_token_prob, deepest)
            else:
                draft = self.draft_path(matches[m - 1], m, min(n, deepest), cfg.min_token_prob)
            if draft.score > best.score:
                best, draft.match_len = draft, m
        return best

    def draft_path(self, node: Node, d: int, n: int, min_prob: float) -> Draft:
        """The likeliest path: the highest-count child at each node."""
        out, prob = Draft(), 1.0
        while len(out.tokens) < n:
            if node.seq is not None:  # one occurrence: its next tokens, each with probability 1 given the last
                i = node.at + d - node.depth
                more = node.seq[i : i + min(n - len(out.tokens), self.depth - d)]
                out.tokens += more
                out.probs += [prob] * len(more)
                break
            child = node.best
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            out.tokens.append(child.token)
            out.probs.append(prob)
            node, d = child, d + 1
        out.parents = list(range(-1, len(out.tokens) - 1))
        out.score = sum(out.probs)
        return out

    def draft_tree(self, node: Node, d: int, n: int, min_prob: float, deepest: int) -> Draft:
        """The n likeliest continuations, best first (a node's probability: the product of count ratios on its
        path), each at least min_prob, none deeper than `deepest` below the match."""
        heap: list[tuple[float, int, int, Node, int, int]] = []  # (-prob, order, token, node, depth, parent)
        out, order, top = Draft(), itertools.count(), d + deepest

        def expand(node: Node, d: int, prob: float, parent: int) -> None:
            if d >= top:
                return
            for token, child, p in self.children(node, d, prob):
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(order), token, child, d + 1, parent))

        expand(node, d, 1.0, -1)
        while heap and len(out.tokens) < n:
            negp, _, token, child, depth, parent = heapq.heappop(heap)
            out.tokens.append(token)
            out.parents.append(parent)
            out.probs.append(-negp)
            expand(child, depth, -negp, len(out.tokens) - 1)
        out.score = sum(out.probs)
        return out

    def children(self, node: Node, d: int, prob: float) -> list[tuple[int, Node, float]]:
        if node.seq is None:
            assert node.kids is not None, "seq None: not a leaf"
            return [(c.token, c, prob * c.count / node.count) for c in node.kids.values()]
        i = node.at + d - node.depth
        return [(node.seq[i], node, prob)] if d < self.depth and i < len(node.seq) else []


def by_count(node: Node) -> int:
    return node.count


class SuffixProposer(Proposer):
    """The request's tree (prompt + output) and the engine's global tree of responses; both learn each token the
    target emits (in prefill and accept), so the next propose only matches and drafts."""

    name = "suffix"
    by_lookup = True

    def __init__(self, cfg: SuffixConfig, num_tokens: int = 24, min_score: float = 0.0) -> None:
        if num_tokens < 1:
            raise ValueError(f"spec.num_tokens must be >= 1, got {num_tokens}")
        self.cfg, self.num_tokens, self.min_score = cfg, num_tokens, min_score
        self.max_tree_size = num_tokens
        self.local = SuffixTree(cfg.max_tree_depth)
        self.forget()

    def forget(self) -> None:
        # per client: its global tree of responses and their ids in it, oldest first (the least recent client first)
        self.clients: OrderedDict[str, tuple[SuffixTree | None, deque[int]]] = OrderedDict()
        self.matches: list[Node] = []  # where the request's latest tokens sit in the global tree
        self.requests = 0
        self.set_client("")

    def set_client(self, client: str) -> None:
        """The global tree of this client's responses: one client's drafts never follow another's text, whose
        acceptance (or speed) would confirm a guess at it. At most MAX_CLIENTS trees, the least recent dropped."""
        if client not in self.clients:
            glob = SuffixTree(self.cfg.max_tree_depth) if self.cfg.max_cached_requests else None
            self.clients[client] = (glob, deque())
            while len(self.clients) > MAX_CLIENTS:
                self.clients.popitem(last=False)
        self.clients.move_to_end(client)
        self.glob, self.cached = self.clients[client]

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        ids = tokens.tolist()
        self.start(ids[:-1])
        self.learn(ids[-1:])

    def accept(self, tokens: Tensor, tree: DraftTree, path: list[int], out: ForwardOut) -> None:
        self.learn(tokens[len(self.local.seqs[0]) :].tolist())

    def start(self, prompt: list[int]) -> None:
        """A new request: its own tree over the prompt, and a slot in the global tree for its response."""
        self.local = SuffixTree(self.cfg.max_tree_depth)
        self.local.extend(0, prompt)
        self.requests += 1
        if self.glob is None:
            return
        self.cached.append(self.requests)
        while len(self.cached) > self.cfg.max_cached_requests:
            self.glob.remove(self.cached.popleft())
        self.matches = []
        tail = prompt[-(self.cfg.max_tree_depth - 1) :]
        for i in range(len(tail)):
            self.matches = self.glob.follow(self.matches, tail[: i + 1], tail[i])

    def learn(self, tokens: list[int]) -> None:
        """Tokens the target emitted: into the request's tree and (as its response) the global tree."""
        seq = self.local.seqs.setdefault(0, [])
        for t in tokens:
            self.local.append(0, t)
            if self.glob is not None:
                self.glob.append(self.requests, t)
                self.matches = self.glob.follow(self.matches, seq, t)

    def propose(self, tokens: Tensor, sp: SamplingParams, budget: int) -> DraftTree:
        draft = self.speculate(budget)
        if not draft.tokens or draft.score < self.min_score:
            return DraftTree.empty(tokens.device)
        as_tensor = torch.tensor
        dev = tokens.device
        return DraftTree(
            as_tensor(draft.tokens, device=dev), as_tensor(draft.parents, device=dev), match_len=draft.match_len
        )

    def speculate(self, deepest: int = UNBOUNDED) -> Draft:
        """The better of the request tree's and the global tree's drafts (the request's on ties), no node deeper
        than `deepest`."""
        best = self.local.speculate(self.local.suffixes(0), self.num_tokens, self.cfg, deepest)
        if self.glob is not None:
            other = self.glob.speculate(self.matches, self.num_tokens, self.cfg, deepest)
            if other.score > best.score:
                best = other
        return best


def suffix_proposer(spec: SpecConfig, target: LoadedTarget) -> SuffixProposer:
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return SuffixProposer(spec.suffix, spec.num_tokens)
