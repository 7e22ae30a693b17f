"""A draft model out: a plain HF causal-LM folder (transformers' assistant_model, vLLM's draft_model, SGLang's
STANDALONE), with its validator's table, config keys and a forward checked against transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from draftsmith.heads.draft_model import DraftModel
from draftsmith.heads.drafter_folder import own_state
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.export.base import TOKENIZER_FILES, Export, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, attn_shapes, mlp_shapes, sizes_config, tokenizer_problems


def draft_model_hf(src: Source[DraftModel]) -> Export:
    """A plain HF causal-LM folder: the target's config.json with the draft's sizes, its tokenizer files."""
    m = src.head.config
    config = {k: v for k, v in src.target_hf.items() if k not in DROPPED_HF_KEYS}
    config |= {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim,
        "rms_norm_eps": m.rms_norm_eps,
        "max_position_embeddings": m.max_position_embeddings,
        "tie_word_embeddings": m.tie_word_embeddings,
    }
    if isinstance(config.get("layer_types"), list):  # per-layer list (Qwen2/3): sized to the draft's layers
        config["layer_types"] = config["layer_types"][: m.num_hidden_layers]
    copy = [f for f in TOKENIZER_FILES if (src.target_dir / f).is_file()]
    return Export(config, {"model.safetensors": own_state(src.head)}, copy)


# the dtype goes in once, as torch_dtype, which transformers 4 and 5 both read
DROPPED_HF_KEYS = (
    "_name_or_path",
    "_model_name_or_path",
    "quantization_config",
    "auto_map",
    "transformers_version",
    "dtype",
)


def hf_llama_shapes(m: ModelConfig) -> Shapes:
    h = m.hidden_size
    s = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}"
        s |= attn_shapes(f"{p}.self_attn", h, m, False) | mlp_shapes(f"{p}.mlp", m)
        s |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        if m.attention_bias:  # Qwen2: q/k/v only
            s |= {f"{p}.self_attn.{n}_proj.bias": (s[f"{p}.self_attn.{n}_proj.weight"][0],) for n in "qkv"}
        if m.qk_norm:
            s |= {f"{p}.self_attn.q_norm.weight": (m.head_dim,), f"{p}.self_attn.k_norm.weight": (m.head_dim,)}
    return s if m.tie_word_embeddings else s | {"lm_head.weight": (m.vocab_size, h)}


def draft_model_shapes(src: Source[DraftModel], config: dict) -> Shapes:
    return hf_llama_shapes(src.head.config)


def draft_model_config(src: Source[DraftModel]) -> dict:
    c = src.head.config
    return sizes_config(c) | {"model_type": src.target_hf["model_type"], "num_hidden_layers": c.num_hidden_layers}


def draft_model_pairs(src: Source[DraftModel], p: Probe[DraftModel]) -> dict[str, tuple]:
    head = p.head
    return {"logits": (hf_logits(p.folder, p.tokens), head.lm_head(head.hidden_states(p.tokens[None])[0])[0])}


def hf_logits(folder: Path, tokens: Tensor) -> Tensor:
    """What the HF engines see: transformers' own model class for the folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model(tokens[None]).logits[0]


# a plain HF causal LM: transformers' assistant_model, vLLM's draft_model, SGLang's STANDALONE
DRAFT_MODEL_HF = Format(
    export=draft_model_hf,
    shapes=draft_model_shapes,
    config=draft_model_config,
    forward=draft_model_pairs,
    problems=tokenizer_problems,
    vllm="draft_model",
    sglang="STANDALONE",
    hf=True,
)
