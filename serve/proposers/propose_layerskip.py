"""spec=layerskip: the target's first layers (plus its final norm and lm_head) draft a chain, sharing its weights."""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.runtime.llama import Transformer
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.spec import SpecConfig


def layerskip_proposer(spec: SpecConfig, target: LoadedTarget) -> DraftModelProposer:
    assert spec.num_tokens is not None, "serve/build.py resolves it"
    return DraftModelProposer(layerskip_model(target.model, spec.layers), DraftChainConfig(spec.num_tokens))


def layerskip_model(model: Transformer, num_layers: int) -> Transformer:
    """The target's first num_layers layers + final norm + lm_head, sharing its weights."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"spec.layers must be in [1, {total - 1}] for a {total}-layer target, got {num_layers}")
    cfg = type(model.config)(**{**vars(model.config), "num_hidden_layers": 0})
    with torch.device("meta"):
        draft = Transformer(cfg)
    draft.config = type(cfg)(**{**vars(cfg), "num_hidden_layers": num_layers})
    draft.model.embed_tokens, draft.model.norm = model.model.embed_tokens, model.model.norm
    draft.model.layers = nn.ModuleList(model.model.layers[:num_layers])
    draft.lm_head = model.lm_head
    draft.cos, draft.sin = model.cos, model.sin
    draft.choose_path()
    return draft
