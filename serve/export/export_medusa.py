"""Medusa heads out: vLLM's MedusaModel and FasterDecoding's layout that TGI reads, each with its validator's
table, config keys and forward."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.heads.drafter_folder import own_state
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.serve.export.base import Export, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, linear


def medusa_vllm(src: Source[MedusaHeads]) -> Export:
    c = src.head.config
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True,
        "truncated_vocab_size": c.vocab_size,
    }
    return Export(config, {"model.safetensors": own_state(src.head)})


def medusa_tgi(src: Source[MedusaHeads]) -> Export:
    """FasterDecoding's layout, which TGI reads: head h's block l is `h.l.linear`, its lm_head `h.L`."""
    c = src.head.config
    state = {}
    for name, t in own_state(src.head).items():
        part = name.split(".")  # blocks.h.layers.l.weight | lm_heads.h.weight
        key = f"{part[1]}.{part[3]}.linear.{part[4]}" if part[0] == "blocks" else f"{part[1]}.{c.num_layers}.weight"
        state[key] = t
    config = {
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": str(src.target_dir.resolve()),
    }
    return Export(config, {"medusa_lm_head.safetensors": state})


def medusa_names(tgi: bool, c) -> tuple[str, str]:
    """Format strings for head h's block l and its lm_head: FasterDecoding's (TGI) or vLLM's."""
    if tgi:
        return "{h}.{l}.linear", "{h}." + str(c.num_layers)
    return "blocks.{h}.layers.{l}", "lm_heads.{h}"


def medusa_shapes(src: Source[MedusaHeads], config: dict, tgi: bool = False) -> Shapes:
    c = src.head.config
    block, head = medusa_names(tgi, c)
    s: Shapes = {}
    for h in range(c.num_heads):
        for layer in range(c.num_layers):
            s |= {f"{block.format(h=h, l=layer)}.weight": (c.hidden_size, c.hidden_size)}
            s |= {f"{block.format(h=h, l=layer)}.bias": (c.hidden_size,)}
        s[f"{head.format(h=h)}.weight"] = (c.vocab_size, c.hidden_size)
    return s


def medusa_vllm_config(src: Source[MedusaHeads]) -> dict:
    c = src.head.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True,
    }


def medusa_tgi_config(src: Source[MedusaHeads]) -> dict:
    return {"medusa_num_heads": src.head.config.num_heads, "medusa_num_layers": src.head.config.num_layers}


def tgi_problems(src: Source[MedusaHeads], folder: Path, config: dict) -> list[str]:
    problems = []
    if "architectures" in config:
        problems.append("config.json has `architectures`: TGI then takes the folder for a full model")
    if not config.get("base_model_name_or_path"):
        problems.append("config.json has no base_model_name_or_path: TGI loads the target from it")
    return problems


def medusa_forward(w, tgi: bool, c, hidden: Tensor) -> Tensor:
    """[K, n, V]: head h = its blocks x + silu(W x + b), then its own lm_head."""
    block, head = medusa_names(tgi, c)
    out = []
    for h in range(c.num_heads):
        x = hidden
        for layer in range(c.num_layers):
            x = x + F.silu(linear(x, w, block.format(h=h, l=layer)))
        out.append(linear(x, w, head.format(h=h)))
    return torch.stack(out)


def medusa_pairs(src: Source[MedusaHeads], p: Probe[MedusaHeads], tgi: bool = False) -> dict[str, tuple]:
    c = src.head.config
    hidden = torch.randn(p.tokens.numel(), c.hidden_size, generator=p.g)
    return {"logits": (medusa_forward(p.w, tgi, c, hidden), p.head(hidden))}


MEDUSA_VLLM = Format(
    export=medusa_vllm,
    shapes=medusa_shapes,
    config=medusa_vllm_config,
    forward=medusa_pairs,
    vllm="medusa",
)


MEDUSA_TGI = Format(
    export=medusa_tgi,
    shapes=partial(medusa_shapes, tgi=True),
    config=medusa_tgi_config,
    forward=partial(medusa_pairs, tgi=True),
    problems=tgi_problems,
    weights="medusa_lm_head.safetensors",
    torch_dtype=False,
    target_types=("llama", "mistral", "qwen2"),
    tgi=True,
)
