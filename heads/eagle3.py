"""EAGLE-3 head: fc over several target layers' inputs, one decoder layer whose attention reads
[input_layernorm(embed(token)); hidden_norm(feature)] (2H), its own norm and lm_head over a draft vocabulary.

The layer's output (before `norm`) is the next step's feature, as in vLLM: drafting feeds it back without fc.
Parameter names are those of the vLLM / SGLang checkpoint (fc, midlayer.*, norm, lm_head, d2t, t2d), so export
is a plain dump. The target's embedding (and, for the loss, its lm_head) is borrowed, frozen and not saved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.cpu_kernels import decoder_layer, eagle3_draft
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import MLP, Attention, ModelConfig, RMSNorm, Transformer

from .draft_vocab import DraftVocabHead
from .head_base import EagleConfig, borrow, default_target_layers, sdpa_mask
from .kinds import DraftShape, Kind

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from 3.11

# the methods cpu_kernels/eagle3_draft.py computes in one call (a subclass's or an instance's own takes the modules)
ONE_CALL = ("target_features", "forward", "fed_back", "logits", "rope")
INITS = ("scratch", "target", "layer")
DRAFT_VOCAB = 8192  # the default draft vocabulary: the training answers' most frequent tokens (at most the target's)
# what init=layer needs of the head's layer to copy the target's into it, and what it copies as it is
LAYER_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
COPIED = {  # the head's parameter: the target layer's
    "hidden_norm": "input_layernorm",  # the head's norm of the feature is the target layer's input norm
    **{m: m for m in ("self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")},
}


@dataclass
class Eagle3Config(EagleConfig):
    target_layers: tuple[int, ...] = (2, 16, 29)  # inputs of these target layers (L = the last layer's output)
    draft_vocab_size: int = DRAFT_VOCAB
    # target: norm and lm_head start as the target's final norm and lm_head rows; layer: those, and the midlayer as the
    # target layer that reads the last tapped feature (fc passing that tap on): the head starts as the target's own
    # computation from there, read out early, and learns the next token from a working part of the target
    init: str = "scratch"
    norm_before_fc: bool = False  # an RMSNorm (input_norm) over the concatenated target features before fc
    norm_output: bool = False  # EAGLE-3.1: the next depth reads norm(output), what the lm_head reads, not output
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(feature), not the feature (speculators')
    qk_norm: bool = False  # a Qwen3-style layer: per-head RMSNorm on q and k before rope (vLLM's Eagle3Qwen3)

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"eagle3 init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.init == "layer" and (self.norm_before_fc or self.norm_before_residual):
            raise ValueError(
                "init=layer starts the head as the target's layer over the last tap, which norm_before_fc and "
                "norm_before_residual change: drop them, or set head.init=target"
            )
        self.target_layers = tuple(self.target_layers)  # a list after a JSON round trip
        layers = self.target_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"target_layers must be distinct, ascending and >= 0, got {layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    def layer_config(self) -> ModelConfig:
        return replace(super().layer_config(), qk_norm=self.qk_norm)

    @classmethod
    def from_target(cls, cfg: ModelConfig, **overrides) -> Self:
        n = cfg.num_hidden_layers
        layers = tuple(overrides.pop("target_layers", None) or default_target_layers(n))
        if layers[-1] > n:
            raise ValueError(f"target_layers {layers} exceed the target's {n} layers")
        overrides.setdefault("draft_vocab_size", min(DRAFT_VOCAB, cfg.vocab_size))
        return super().from_target(cfg, target_layers=layers, **overrides)


class Eagle3Layer(nn.Module):
    """vLLM's `midlayer`: attention over 2H, residual = the feature (hidden_norm(feature) under
    norm_before_residual), then post-attention norm + MLP."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, in_dim=2 * h)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def attn_input(self, embeds: Tensor, feature: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)

    def finish(self, feature: Tensor, attn_out: Tensor) -> Tensor:
        x = (self.hidden_norm(feature) if self.norm_before_residual else feature) + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, embeds, feature, cos, sin, kc, vc, start: int, mask) -> Tensor:
        # fp32 CPU: one call, the same bits; the call's residual is the feature itself
        plan = None if self.norm_before_residual else decoder_layer.step_plan(self, embeds, (kc, vc), start, mask)
        if plan:
            return decoder_layer.run(plan, embeds, (cos, sin), (kc, vc), start, mask, feature)
        return self.finish(feature, self.self_attn(self.attn_input(embeds, feature), cos, sin, kc, vc, start, mask))


class Eagle3Head(DraftVocabHead):
    config: Eagle3Config

    def __init__(self, cfg: Eagle3Config, model: Transformer | None = None) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens, self.target_lm_head = borrow(model, cfg)  # target_lm_head: the loss's soft targets
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(len(cfg.target_layers) * h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg.layer_config(), cfg.norm_before_residual)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.vocab_buffers()
        self.rope_cache(cfg.max_position_embeddings)
        if model is not None and self.copies_target_rows:
            with torch.no_grad():
                self.norm.weight.copy_(model.model.norm.weight)
        if model is not None and cfg.init == "layer":
            self.copy_target_layer(model)

    @property
    def copies_target_rows(self) -> bool:
        return self.config.init != "scratch"

    @torch.no_grad()
    def copy_target_layer(self, model: Transformer) -> None:
        """The midlayer as the target's layer that reads the last tap (the last layer where that tap is the target's
        output), over that tap alone: fc passes it on, and the embedding's half of q, k and v starts at zero (both
        learn from there). Sizes must match; q/k norms are copied where both layers have them."""
        h, layers = self.config.hidden_size, model.model.layers
        tap = min(self.config.target_layers[-1], len(layers) - 1)  # a tap of the target's output: its last layer
        ours, theirs = self.config.layer_config(), model.config
        if differ := [k for k in LAYER_SIZES if getattr(ours, k) != getattr(theirs, k)]:
            raise ValueError(
                f"init=layer copies a target layer, so the head's layer must be sized as the target's "
                f"({', '.join(differ)} differ): leave those head sizes unset, or set head.init=scratch"
            )
        source, layer = layers[tap], self.midlayer
        self.fc.weight.zero_()
        self.fc.weight[:, -h:].copy_(torch.eye(h))
        for name in ("q_proj", "k_proj", "v_proj"):
            mine, target = getattr(layer.self_attn, name), getattr(source.self_attn, name)
            mine.weight.zero_()
            mine.weight[:, h:].copy_(target.weight)
            if mine.bias is not None:
                mine.bias.copy_(target.bias)
        # a Qwen3 target's q and k norms, where the head has them (EAGLE-3's formats draw its layer without: the start
        # is then the target's layer less those norms)
        norms = {n: n for n in ("self_attn.q_norm", "self_attn.k_norm")} if ours.qk_norm and theirs.qk_norm else {}
        for mine_name, their_name in (COPIED | norms).items():
            layer.get_parameter(f"{mine_name}.weight").copy_(source.get_parameter(f"{their_name}.weight"))

    def draft_plan(self) -> eagle3_draft.DraftPlan | None:
        """The plan of the draft forward in one call (cpu_kernels/eagle3_draft.py), which computes target_features,
        forward, rope and logits as this class does, without the options that change them; None where it does not run
        (an option on, or one of those methods another class's or set on the instance)."""
        c = self.config
        if c.norm_before_fc or c.norm_output or c.norm_before_residual or not self.computes_as_the_call():
            return None
        return eagle3_draft.plan(self)

    def computes_as_the_call(self) -> bool:
        ours = all(getattr(type(self), m) is getattr(Eagle3Head, m) and m not in self.__dict__ for m in ONE_CALL)
        return ours and type(self.midlayer).forward is Eagle3Layer.forward

    def target_features(self, hidden: Tensor | None, aux: Tensor | None) -> Tensor:
        """The fused feature: fc over the target's layer inputs [.., k*H] (in target_layers order)."""
        if aux is None:
            raise ValueError(f"EAGLE-3 needs the target's inputs to layers {self.config.target_layers}")
        aux = aux.to(self.fc.weight.dtype)
        return self.fc(self.input_norm(aux) if self.config.norm_before_fc else aux)

    def fed_back(self, output: Tensor) -> Tensor:
        """What the next depth reads of the layer's output (and logits() turns into the next token)."""
        return self.norm(output) if self.config.norm_output else output

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: what forward() returned (normed already under norm_output)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def forward(
        self,
        feature: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        start: int = 0,
        mask: Tensor | None = None,
    ) -> Tensor:
        """feature [b, n, H] (fused target feature_i, or the head's own previous output), tokens [b, n]
        (token_{i+1}), positions [n] -> the next feature [b, n, H] (before `norm`, but under norm_output).
        Cache and mask as EagleHead."""
        embeds = self.embed_tokens(tokens).to(self.fc.weight.dtype)  # the borrowed embedding may be wider
        cos, sin = self.rope(positions, embeds.dtype)
        kc, vc = (cache.k[0], cache.v[0]) if cache is not None else (None, None)
        out = self.midlayer(embeds, feature.to(embeds.dtype), cos, sin, kc, vc, start, sdpa_mask(mask))
        return self.fed_back(out)

    def unroll(self, feature: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        """Training-time test over m pairs: feature [b, m, H] fused target features 0..m-1, tokens [b, m]
        (token_{i+1}). Step 0 is forward(); step j feeds step j-1's output at the same index with token
        i+1+j (zero past the end) at position i+1+j, and attends to the real pairs 0..i plus its own steps
        1..j: what drafting at depth j+1 from a prefix ending at pair i sees. Returns each step's output."""
        b, m, _ = feature.shape
        tokens = F.pad(tokens, (0, steps - 1))
        feature = feature.to(self.fc.weight.dtype)
        attn, kv, outs = self.midlayer.self_attn, [], []
        for j in range(steps):
            embeds = self.embed_tokens(tokens[:, j : j + m]).to(feature.dtype)  # as in forward()
            cos, sin = self.rope(torch.arange(1 + j, m + 1 + j, device=tokens.device), embeds.dtype)
            q, k, v = attn.qkv(self.midlayer.attn_input(embeds, feature), cos, sin)
            kv.append((k, v))
            out = attn.o_proj(ttt_attention(q, kv).transpose(1, 2).reshape(b, m, -1))
            feature = self.fed_back(self.midlayer.finish(feature, out))
            outs.append(feature)
        return outs


def ttt_attention(q: Tensor, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
    """q [b, heads, m, d]; kv[0]: the real pairs' K/V (causal), kv[s]: step s's own K/V (index i sees only
    index i). One softmax over both; the diagonal terms cost O(m) each instead of an [m, m] block."""
    groups = q.shape[1] // kv[0][0].shape[1]
    kv = [(k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) for k, v in kv]
    m, scale = q.shape[2], q.shape[-1] ** -0.5
    causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ kv[0][0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True) * scale for k, _ in kv[1:]]
    p = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :m] @ kv[0][1]
    for s, (_, v) in enumerate(kv[1:]):
        out = out + p[..., m + s : m + s + 1] * v
    return out


KIND = Kind(
    name="eagle3",
    config=Eagle3Config,
    module=Eagle3Head,
    features=("hidden", "aux"),
    loss="draftsmith.train.loss_eagle3:eagle3_loss",
    proposer="draftsmith.serve.proposers.propose_eagle:eagle_proposer",
    formats={
        "vllm": "draftsmith.serve.export.export_eagle3:EAGLE3",
        "sglang": "draftsmith.serve.export.export_eagle3:EAGLE3",
        "speculators": "draftsmith.serve.export.speculators:SPECULATORS",
        "gguf": "draftsmith.serve.export.export_eagle3_gguf:EAGLE3_GGUF",
    },
    draft_shape=DraftShape(num_tokens=5, topk=4, total_tokens=12),  # a GPU's: a dozen verify rows cost ~1 step
    draft_keys=("num_tokens", "topk", "total_tokens"),
)
