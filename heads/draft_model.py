"""A small Llama sharing the target's tokenizer, distilled from the target; drafts a chain in the engine.

It is a runtime.llama Transformer (HF parameter names), sized by DraftModelConfig (0 = the target's size).
The resolved ModelConfig is saved in the config, so a folder rebuilds without the target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from draftsmith.runtime.llama import ModelConfig, Transformer

from .drafter_folder import restricted_linear
from .kinds import DraftShape, Kind

INITS = ("target", "scratch")


@dataclass
class DraftModelConfig:
    num_layers: int = 2  # 0 = the target's (as for every size below)
    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    init: str = "target"  # target: embedding, norm, lm_head and evenly spaced layers copied where sizes match
    model: dict | None = None  # the full ModelConfig, resolved from the target when the head is first built

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"draft_model init must be one of {', '.join(INITS)}, got {self.init!r}")
        if min(self.num_layers, self.hidden_size, self.intermediate_size) < 0:
            raise ValueError(f"draft_model sizes must be >= 0 (0 = the target's), got {self}")

    def resolve(self, target_config: ModelConfig) -> ModelConfig:
        """The target's config (vocab, rope, eps, ties) with this config's sizes."""
        hidden = self.hidden_size or target_config.hidden_size
        heads = self.num_attention_heads or target_config.num_attention_heads
        same_shape = hidden == target_config.hidden_size and heads == target_config.num_attention_heads
        return replace(
            target_config,
            num_hidden_layers=self.num_layers or target_config.num_hidden_layers,
            hidden_size=hidden,
            intermediate_size=self.intermediate_size or target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=self.num_key_value_heads or target_config.num_key_value_heads,
            head_dim=target_config.head_dim if same_shape else hidden // heads,
        )


class DraftModel(Transformer):
    target_lm_head: nn.Linear  # set only when built with the target (see __init__)

    def __init__(self, cfg: DraftModelConfig, model: Transformer | None = None) -> None:
        if cfg.model is None:
            if model is None:
                raise ValueError("a new draft_model needs the target (its config fills in the sizes)")
            cfg.model = asdict(cfg.resolve(model.config))
        super().__init__(ModelConfig(**cfg.model))
        self.draft_config = cfg
        # a tied lm_head is the embedding: saved once, under model.embed_tokens
        self.shared_prefixes = ("lm_head.",) if self.config.tie_word_embeddings else ()
        if model is not None:
            # the target's lm_head, for the distillation loss: held outside the module tree, so it is not
            # saved, trained, cast by .to() on the head, nor broadcast by DDP; it follows the target instead
            object.__setattr__(self, "target_lm_head", model.lm_head)
            if cfg.init == "target":
                init_from_target(self, model)
            else:
                init_scratch(self)
        self.vocab_ids: torch.Tensor | None = None  # target id of each logit, once restricted

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """To serve: logits over target ids `ids` only (their lm_head rows), for a cheaper draft step."""
        self.lm_head = restricted_linear(self.lm_head, ids, self.lm_head.weight.dtype)
        self.vocab_ids = ids.to(self.lm_head.weight.device)


def init_layers(num_layers: int, num_target_layers: int) -> list[int]:
    """Evenly spaced target layers, first and last included: 2 of 30 -> [0, 29]."""
    if num_layers == 1:
        return [0]
    return [round(i * (num_target_layers - 1) / (num_layers - 1)) for i in range(num_layers)]


@torch.no_grad()
def init_from_target(draft: Transformer, model: Transformer) -> None:
    """Copy what fits: embedding, final norm and lm_head when the hidden size matches; the layers too when
    every layer dimension matches. The rest keeps a from-scratch init."""
    d, t = draft.config, model.config
    init_scratch(draft)
    if d.hidden_size != t.hidden_size:
        return
    draft.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    draft.model.norm.weight.copy_(model.model.norm.weight)
    if not d.tie_word_embeddings:
        draft.lm_head.weight.copy_(model.lm_head.weight)
    dims = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    if all(getattr(d, k) == getattr(t, k) for k in dims):
        for mine, i in zip(draft.model.layers, init_layers(d.num_hidden_layers, t.num_hidden_layers), strict=True):
            mine.load_state_dict(model.model.layers[i].state_dict())


def init_scratch(model: Transformer, std: float = 0.02) -> None:
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            bias = getattr(m, "bias", None)  # nn.Embedding has none
            if bias is not None:
                nn.init.zeros_(bias)


KIND = Kind(
    name="draft_model",
    config=DraftModelConfig,
    module=DraftModel,
    loss="draftsmith.train.loss_draft_model:draft_model_loss",
    proposer="draftsmith.serve.proposers.propose_draft_model:draft_proposer",
    formats={"hf": "draftsmith.serve.export.export_draft_model:DRAFT_MODEL_HF"},
    draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0),
    drafter="an HF folder of a small LM with the target's tokenizer, or a draft_model drafter folder",
)
