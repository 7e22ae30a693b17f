"""Medusa-1 heads: K heads on the frozen target's final hidden state, head k predicting token t+k+2.

Each head is `num_layers` residual blocks x + SiLU(Wx + b) (W, b zero-initialised, so a fresh head is the
identity) followed by its own copy of the target's lm_head. Parameter names follow vLLM's Medusa layout
(`blocks.{h}.layers.{l}`, `lm_heads.{h}`); TGI's is `{h}.{l}.linear` / `{h}.{num_layers}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.runtime.llama import Transformer

from .drafter_folder import restricted_linear
from .kinds import DraftShape, Kind

# Medusa's mc_sim_7b_63 (paths sorted by their simulated acceptance on Vicuna-7B)
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip
# its 24 most likely paths, plus the top-1 chain to depth 4: verifying ~25 tokens stays cheap on a CPU
DEFAULT_CHOICES = MC_SIM_7B_63[:24] + [[0, 0, 0, 0]]


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(
                f"medusa needs num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}"
            )


class ResBlocks(nn.Module):
    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        linears = [nn.Linear(hidden, hidden) for _ in range(num_layers)]
        for layer in linears:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(linears)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig, model: Transformer | None = None) -> None:
        super().__init__()
        self.config = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        self.blocks = nn.ModuleList(ResBlocks(h, cfg.num_layers) for _ in range(cfg.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(cfg.num_heads))
        self.vocab_ids: Tensor | None = None  # target id of each logit, once restricted
        if model is not None:
            self.init_from(model)

    @torch.no_grad()
    def init_from(self, model: Transformer) -> None:
        w = model.lm_head.weight
        if tuple(w.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"medusa config (vocab {self.config.vocab_size}, hidden {self.config.hidden_size}) does not fit "
                f"the target's lm_head {tuple(w.shape)}"
            )
        for head in self.linears():
            head.weight.copy_(w)  # a copy: each head's lm_head is trained and saved on its own

    def linears(self) -> Sequence[nn.Linear]:
        """The heads' lm_heads, typed as what they are (nn.ModuleList types its items as plain Modules)."""
        return cast("Sequence[nn.Linear]", self.lm_heads)

    def head_logits(self, k: int, hidden: Tensor) -> Tensor:
        """Head k's logits for token t+k+2 from the target's final hidden states at t: [..., H] -> [..., V]."""
        return self.lm_heads[k](self.blocks[k](hidden))

    def restrict_vocab(self, ids: Tensor) -> None:
        """To serve: every head's logits over target ids `ids` only (their lm_head rows)."""
        self.lm_heads = nn.ModuleList(restricted_linear(h, ids, h.weight.dtype) for h in self.linears())
        self.vocab_ids = ids.to(self.linears()[0].weight.device)

    def forward(self, hidden: Tensor, num_heads: int | None = None) -> Tensor:
        """[..., H] -> [K, ..., V] (the first num_heads heads only, when given)."""
        return torch.stack([self.head_logits(k, hidden) for k in range(num_heads or self.config.num_heads)])


KIND = Kind(
    name="medusa",
    config=MedusaConfig,
    module=MedusaHeads,
    loss="draftsmith.train.loss_medusa:medusa_loss",
    proposer="draftsmith.serve.proposers.propose_medusa:medusa_proposer",
    formats={
        "vllm": "draftsmith.serve.export.export_medusa:MEDUSA_VLLM",
        "tgi": "draftsmith.serve.export.export_medusa:MEDUSA_TGI",
    },
    draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0, choices=DEFAULT_CHOICES),
    draft_keys=("num_tokens", "choices"),
    max_depth="num_heads",
)
