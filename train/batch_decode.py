"""draftsmith's own batched decoder for regeneration, the fallback when vLLM is missing: many conversations decode in
lockstep on the engine's runner, reading the weights once per step for all rows (a step of many rows costs little
more than a single-row one: docs/benchmarks.md, Figures behind design choices). Not HF's batched generate: it was
slower side by side, and would hold a second copy of the target. Each row is prefilled alone as the engine does (a
later turn only past the chat's KV so far); a batched step's logits differ from batch 1's by float rounding only, so
greedy answers are the target's greedy answers up to near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.heads.kv_cache import KVCache
from draftsmith.heads.llama import Transformer
from draftsmith.serve.engine.sampling import SamplingParams, pick
from draftsmith.serve.engine.tree import causal_mask


@dataclass
class Past:
    """A chat's tokens so far and their KV (each layer's K, then V: [kv_heads, n, head_dim]). The next turn's
    prompt extends them, so only its new tokens need a prefill."""

    ids: list[int]
    kv: list[torch.Tensor]


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    budgets: list[int],
    sp: SamplingParams,
    seeds: list[int],
    eos,
    pasts: list[Past | None],
) -> tuple[list[list[int]], list[Past]]:
    """Decode all prompts in lockstep. Prompts sit right-aligned in one cache (row i's at slots [p - len, p)),
    each at its own positions; a row stops at an end-of-turn token or its budget (finished rows ride along).
    Returns the new tokens and each row's Past for its next turn."""
    b, p, dev = len(prompts), max(map(len, prompts)), model.device
    cache = batch_cache(model, b, p + max(budgets))
    valid = torch.zeros(b, p + max(budgets), dtype=torch.bool, device=dev)  # slots a row may attend to
    rows = zip(prompts, pasts, strict=True)
    logits = torch.stack([prefill_row(model, cache, i, q, p, valid, past) for i, (q, past) in enumerate(rows)])
    gens = [torch.Generator(dev).manual_seed(s) for s in seeds]
    lengths = torch.tensor([len(q) for q in prompts], device=dev)
    out: list[list[int]] = [[] for _ in range(b)]
    live = [True] * b
    for t in range(max(budgets)):
        nxt = logits.argmax(-1).tolist() if sp.greedy else [pick(r, sp, g) for r, g in zip(logits, gens, strict=True)]
        for i in range(b):
            if live[i]:
                out[i].append(nxt[i])
                live[i] = nxt[i] not in eos and len(out[i]) < budgets[i]
        if not any(live):
            break
        valid[:, p + t] = True
        logits = decode_step(model, cache, torch.tensor(nxt, device=dev), lengths + t, p + t, valid[:, : p + t + 1])
    return out, [row_past(cache, i, q, o, p) for i, (q, o) in enumerate(zip(prompts, out, strict=True))]


def batch_cache(model: Transformer, b: int, slots: int) -> KVCache:
    c = model.config
    shape = (b, c.num_key_value_heads, slots, c.head_dim)
    # zeros, not empty: masked slots still enter attention's weighted sum (with weight 0, and 0 * nan = nan)
    new = lambda: [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
    return KVCache(new(), new())


def prefill_row(
    model: Transformer, cache: KVCache, i: int, prompt: list[int], p: int, valid, past: Past | None
) -> torch.Tensor:
    """The engine's own prefill of one prompt (after the tokens `past` already holds), its KV then copied into
    row i, right-aligned at slot p."""
    n, dev = len(prompt), model.device
    hit = min(common_prefix(past.ids, prompt), n - 1) if past else 0  # at least one token runs: the logits
    row = model.new_cache(n)
    if hit:
        assert past is not None, "a hit is in a past"
        row.write(0, [t[None, :, :hit] for t in past.kv])
    ids, positions = torch.tensor(prompt[hit:], device=dev), torch.arange(hit, n, device=dev)
    out = model(ids, positions, row, hit, causal_mask(hit, n - hit, dev), slice(-1, None))
    for big, small in zip((*cache.k, *cache.v), (*row.k, *row.v), strict=True):
        big[i, :, p - n : p] = small[0]
    valid[i, p - n : p] = True
    return out.logits[-1]


def row_past(cache: KVCache, i: int, prompt: list[int], out: list[int], p: int) -> Past:
    """Row i's prompt and new tokens but the last (which never ran), and their KV."""
    end = p + len(out) - 1
    return Past(prompt + out[:-1], [t[i, :, p - len(prompt) : end].clone() for t in (*cache.k, *cache.v)])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decode_step(model: Transformer, cache: KVCache, tokens, positions, slot: int, valid) -> torch.Tensor:
    """One token per row at cache slot `slot`; positions [b] per row, shaped [b, 1, 1] so rope broadcasts over
    heads."""
    b = tokens.shape[0]
    x, _ = model.layers_forward(tokens.view(b, 1), positions.view(b, 1, 1), cache, slot, valid.view(b, 1, 1, -1), ())
    return model.lm_head(model.model.norm(x[:, -1])).float()
