"""DSpark head (arXiv 2607.05147; DeepSeek's DeepSpec): DFlash's parallel backbone, a sequential head that
conditions each drafted token on the one before it, and a confidence head that predicts its acceptance.

- Backbone: DFlash's (heads/dflash.py), shared. DSpark's block is anchor-first, as DeepSpec, speculators'
  default (`sample_from_anchor`) and vLLM's `dspark` draft: the block [pending token, mask x (B-1)] runs at
  positions p .. p+B-1 and every slot predicts the next token, slot k the token at p+k+1, so one forward drafts
  block_size tokens (DFlash's mask slots predict their own position: block_size - 1).
- Sequential head (`markov_head`): slot k's logits get a bias from the token before it, x_{k-1} (the pending
  token for slot 0, then the drafts): vanilla, the low-rank transition W1[x_{k-1}] @ W2 (W1 over the target
  vocabulary, W2 onto the draft vocabulary); gated, W2(sigmoid(gate([h_k; W1[x]])) * W1[x]); rnn, a GRU-like state
  over the block. Drafting runs it left to right after the one backbone forward: a few r-wide products per token.
- Confidence head (`confidence_head`): sigmoid(proj([h_k; W1[x_{k-1}]])), the chance that slot k's draft is
  accepted given the tokens before it were. The engine verifies only as much of a draft as pays.

h_k is the backbone's output after the final norm (what the lm_head reads). Parameter names are speculators'
(markov_head.markov_w1 / markov_w2 / gate_proj / joint_proj, confidence_head.proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.runtime.llama import Transformer

from .dflash import DFlashConfig, DFlashHead
from .kinds import DraftShape, Kind

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    block_size: int = 4  # slots per forward, each a draft: the pending token's slot drafts the first token
    markov_rank: int = 64  # r of the sequential head: W1 [vocab, r], W2 [r, draft vocab]
    markov_type: str = "vanilla"  # vanilla | gated | rnn (vLLM serves vanilla)
    confidence_with_markov: bool = True  # the confidence head reads W1[x_{k-1}] beside h_k

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_type not in MARKOV_TYPES:
            raise ValueError(f"dspark markov_type must be one of {', '.join(MARKOV_TYPES)}, got {self.markov_type!r}")
        if self.markov_rank < 1:
            raise ValueError(
                f"dspark markov_rank must be >= 1, got {self.markov_rank}: without the sequential head it is DFlash "
                "(head=dflash)"
            )


class MarkovHead(nn.Module):
    """Slot k's logit bias from the token before it (and, gated / rnn, from h_k)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the backbone alone
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [gate; candidate; output]

    def embed(self, prev: Tensor) -> Tensor:
        """W1[x_{k-1}] of target ids prev [...] -> [..., r]."""
        return self.markov_w1(prev)

    def step(self, e: Tensor, h: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One slot: e = W1[x_{k-1}] [.., r], h = h_k [.., H], the rnn state before it -> (bias [.., V], state)."""
        e = e.to(self.markov_w2.weight.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        h = h.to(e.dtype)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e), state
        s = e.new_zeros(e.shape) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        s = gate * s + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), s

    def block_bias(self, prev: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced: prev [.., B] the tokens before each slot, hidden [.., B, H] -> bias [.., B, V]."""
        e = self.embed(prev)
        if self.kind != "rnn":
            return self.step(e, hidden, None)[0]
        out, state = [], None
        for k in range(prev.shape[-1]):
            bias, state = self.step(e[..., k, :], hidden[..., k, :], state)
            out.append(bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    """The logit of slot k's acceptance: proj([h_k; W1[x_{k-1}]]) (or of h_k alone)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


class DSparkHead(DFlashHead):
    config: DSparkConfig

    def __init__(self, cfg: DSparkConfig, model: Transformer | None = None) -> None:
        super().__init__(cfg, model)
        h, r = cfg.hidden_size, cfg.markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, r, h, cfg.markov_type)
        self.confidence_head = ConfidenceHead(h + (r if cfg.confidence_with_markov else 0))

    def normed(self, out: Tensor) -> Tensor:
        """h_k: the backbone's output [.., H] after the final norm."""
        return self.norm(out)

    def base_logits(self, h: Tensor) -> Tensor:
        """The backbone's logits over the draft vocabulary, before the sequential bias."""
        return self.lm_head(h)

    def confidence(self, h: Tensor, e: Tensor) -> Tensor:
        """Acceptance logits of slots with normed outputs h [.., H] and previous-token embeddings e [.., r]."""
        features = torch.cat([h, e.to(h.dtype)], dim=-1) if self.config.confidence_with_markov else h
        return self.confidence_head(features.to(self.confidence_head.proj.weight.dtype)).float()

    def teacher_forced(self, out: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """Training: backbone outputs out [.., B, H] and the true tokens before each slot prev [.., B] -> the
        corrected logits [.., B, V] and the confidence logits [.., B]."""
        h = self.normed(out)
        logits = self.base_logits(h) + self.markov_head.block_bias(prev, h)
        return logits, self.confidence(h, self.markov_head.embed(prev))


KIND = Kind(
    name="dspark",
    config=DSparkConfig,
    module=DSparkHead,
    features=("hidden", "aux"),
    loss="draftsmith.train.loss_dspark:dspark_loss",
    proposer="draftsmith.serve.proposers.propose_dspark:dspark_proposer",
    formats={
        "vllm": "draftsmith.serve.export.export_dspark:DSPARK_VLLM",
        "gguf": "draftsmith.serve.export.export_dspark_gguf:DSPARK_GGUF",
    },
    # a chain of the whole block (block_size 4: 4 drafts from one forward); the engine's spec.verify=cost verifies
    # only the prefix the confidence head says pays
    draft_shape=DraftShape(num_tokens=4, topk=1, total_tokens=0),
    draft_keys=("num_tokens", "topk", "total_tokens"),
    max_depth="block_size",
)
