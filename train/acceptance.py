"""Acceptance during training: the engine drafts with the current head on a few held-out prompts.

The hook saves the head as a drafter folder (temp dir), builds the engine's proposer for its kind
and reports tau (mean acceptance length) and the acceptance rate per draft position, greedy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from torch import nn

from draftsmith.heads.drafter_folder import Recipe, save_drafter
from draftsmith.heads.kinds import DraftShape, get
from draftsmith.serve.build import build_engine
from draftsmith.serve.drafters import target_info
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import LoadedTarget, encode_chat
from draftsmith.serve.shared.conversations import heldout_conversations
from draftsmith.serve.spec import SpecConfig

from .data import DataConfig


def heldout_prompts(data: DataConfig, tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    """The first user turns of up to n held-out conversations, chat-encoded, that fit in max_tokens; none when
    nothing is held out (the trainer then turns its acceptance eval off)."""
    prompts = []
    for conv in heldout_conversations(data.source, data.heldout_fraction, limit=4 * n, required=False):
        first = next((m for m in conv.messages if m["role"] == "user"), None)
        ids = encode_chat(tokenizer, [first]) if first else []
        if 0 < len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def acceptance_hook(
    target: LoadedTarget,
    config,
    prompts: list[list[int]],
    max_new_tokens: int,
    log: Callable,
    draft: DraftShape | None = None,
) -> Callable[[nn.Module, str], dict]:
    """hook(head, kind, weights=None) -> {"tau": .., "accept_pos_1": .., ...}, or {} (logged) where serve has no
    proposer. weights: the head's full weights where its module does not hold them (DeepSpeed).
    draft: the shape the head is made for (unset fields: its kind's default), what the eval drafts."""
    max_len = max(len(p) for p in prompts) + max_new_tokens

    def run(head: nn.Module, kind: str, weights: dict | None = None) -> dict:
        if not get(kind).proposer:
            log(f"acceptance eval skipped: serve has no proposer for {kind} (it registers none)")
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            info, folder = target_info(target), Path(tmp) / "drafter"
            folder = save_drafter(head, config, kind, info, Recipe(), folder, weights=weights, draft=draft)
            engine = build_engine(target, SpecConfig(get(kind).name, drafter=str(folder)), False, max_len)
            total = Metrics(requests=0)
            for ids in prompts:
                total.merge(engine.generate(ids, max_new_tokens, SamplingParams()).metrics)
        per_pos = {f"accept_pos_{i + 1}": r for i, r in enumerate(total.acceptance_rate_per_position)}
        return {"tau": total.mean_acceptance_length, **per_pos}

    return run
