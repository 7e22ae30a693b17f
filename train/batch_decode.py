"""draftsmith's own batched decoder for regeneration: continuous batching over slots. A slot holds one chat's KV for
all its turns. A chat's prompt is prefilled alone into its slot by the engine's batch-1 prefill (a later turn only
past the tokens the slot holds), then every slot decodes one token per step in one batched forward, each at its own
position. A chat whose answer ends takes its next turn in the same slot, and a chat that is done gives its slot to
a waiting one at once, so the steps stay full until the last chats. Not HF's batched generate: it was slower side
by side, and would hold a second copy of the target. A batched step's logits differ from batch 1's by float
rounding only, so greedy answers are the target's greedy answers up to near-ties.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.engine.sampling import SamplingParams, pick_rows
from draftsmith.serve.engine.tree import causal_mask

from .turns import Chat

Todo = list[tuple[Chat, list[int]]]  # chats and their next prompts


@dataclass
class Turn:
    """What a slot is answering: its chat, the new tokens so far, how many it may make, its sampling generator."""

    chat: Chat
    out: list[int]
    budget: int
    generator: torch.Generator | None


class Slots:
    """One KV cache row per slot ([slots, kv_heads, max_len, head_dim] per layer) and the tokens each row holds."""

    def __init__(self, model: Transformer, slots: int, max_len: int) -> None:
        c = model.config
        shape = (slots, c.num_key_value_heads, max_len, c.head_dim)
        # zeros, not empty: masked slots still enter attention's weighted sum (with weight 0, and 0 * nan = nan)
        new = lambda: [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.model, self.cache = model, KVCache(new(), new())
        self.held: list[list[int]] = [[] for _ in range(slots)]  # tokens whose KV row i holds

    def row(self, i: int) -> KVCache:
        """Row i as a batch-1 cache (views: the engine's prefill writes into the slot)."""
        return KVCache([k[i : i + 1] for k in self.cache.k], [v[i : i + 1] for v in self.cache.v])

    def prefill(self, i: int, prompt: list[int]) -> Tensor:
        """The prompt's logits after its last token, prefilling only what row i does not hold yet."""
        hit = min(common_prefix(self.held[i], prompt), len(prompt) - 1)  # at least one token runs: the logits
        dev, n = self.model.device, len(prompt)
        ids, positions = torch.tensor(prompt[hit:], device=dev), torch.arange(hit, n, device=dev)
        out = self.model(ids, positions, self.row(i), hit, causal_mask(hit, n - hit, dev), slice(-1, None))
        self.held[i] = list(prompt)
        return out.logits[-1]

    @torch.inference_mode()
    def step(self, tokens: list[int], live: list[int]) -> Tensor:
        """Each live row's next token in at its own position, one batched forward; logits [len(live), vocab]. Rows
        not live run too (their write lands past what they hold) and get no logits."""
        dev = self.model.device
        lengths = torch.tensor([len(h) for h in self.held], device=dev)
        span = int(lengths.max()) + 1
        view = KVCache([k[:, :, :span] for k in self.cache.k], [v[:, :, :span] for v in self.cache.v])
        visible = torch.arange(span, device=dev) <= lengths[:, None]
        b = len(self.held)
        with self.model.kernels():  # the model's path: torch's ops alone on the reference
            x, _ = self.model.layers_forward(
                torch.tensor(tokens, device=dev).view(b, 1), lengths.view(b, 1, 1), view, lengths.view(b, 1),
                visible.view(b, 1, 1, span), (),
            )  # fmt: skip
            for i in live:
                self.held[i].append(tokens[i])
            rows = x[torch.tensor(live, device=dev), -1]
            return self.model.lm_head(self.model.model.norm(rows)).float()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Turns:
    """How chats' turns go: a prompt's new-token budget, an answer's sampling seed, and what a finished answer
    means for its chat (its next prompt, or None when the chat is done)."""

    budget: Callable[[list[int]], int]
    seed: Callable[[Chat], int]
    after: Callable[[Chat, list[int]], list[int] | None]


@torch.inference_mode()
def answer_in_slots(
    model: Transformer,
    todo: Todo,
    slots: int,
    max_len: int,
    sp: SamplingParams,
    eos,
    turns_go: Turns,
) -> Iterator[tuple[list[Chat], int]]:
    """Every turn of every chat in `todo`, up to `slots` chats at once; yields the chats that are done and the new
    tokens made since the last yield."""
    waiting = iter(todo)
    state = Slots(model, min(slots, len(todo)), max_len)
    turns: list[Turn | None] = [None] * len(state.held)
    logits: list[Tensor | None] = [None] * len(state.held)

    def start(i: int, chat: Chat, prompt: list[int]) -> None:
        gen = None if sp.greedy else torch.Generator(model.device).manual_seed(turns_go.seed(chat))
        turns[i] = Turn(chat, [], turns_go.budget(prompt), gen)
        logits[i] = state.prefill(i, prompt)

    def admit(i: int) -> None:
        state.held[i] = []  # an empty slot's row attends to nothing, and widens no step's span
        nxt = next(waiting, None)
        if nxt is None:
            turns[i] = logits[i] = None
            return
        start(i, *nxt)

    for i in range(len(turns)):
        admit(i)
    while any(turns):
        done, tokens = [], [-1] * len(turns)  # -1: the row does not step (empty, or its turn just began)
        active = [(i, t) for i, t in enumerate(turns) if t is not None]
        rows = torch.stack([logits[i] for i, _ in active])  # type: ignore[misc]  # an active row has logits
        picked = pick_rows(rows, sp, [t.generator for _, t in active])
        for (i, t), tok in zip(active, picked, strict=True):
            t.out.append(tok)
            if tok not in eos and len(t.out) < t.budget:
                tokens[i] = tok
            elif (prompt := turns_go.after(t.chat, t.out)) is not None:
                start(i, t.chat, prompt)
            else:
                done.append(t.chat)
                admit(i)
        live = [i for i, tok in enumerate(tokens) if tok >= 0]
        if live:
            stepped = state.step([max(tok, 0) for tok in tokens], live)
            for r, i in enumerate(live):
                logits[i] = stepped[r]
        yield done, len(active)
