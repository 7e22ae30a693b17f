"""Tiny random HF models of each supported family, for tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# The keys results.json's "spec" (and each entry of "methods") always holds.
SPEC_KEYS = (
    "method",
    "tokens_per_s",
    "speedup",
    "mean_acceptance_length",
    "acceptance_rate_per_position",
    "draft_acceptance_rate",
    "target_forward_passes",
    "ttft_ms",
    "tpot_ms",
    "new_tokens",
)


# tests that must hold on whatever device is present: the CUDA case runs on a machine that has one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def build_tiny(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random `model_type` model (safetensors) into folder and return it."""
    cfg = CONFIGS[model_type](**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is small; widen it so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def build_tiny_chat_target(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random llama with a real tokenizer (SmolLM2's) and its chat template: CLI tests run on it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    build_tiny(
        folder,
        "llama",
        seed,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=1024,
        **overrides,
    )
    tokenizer.save_pretrained(folder)
    return Path(folder)


def truncated_copy(src: Path, folder: Path, num_layers: int) -> Path:
    """An HF folder holding src's first num_layers layers (a real small draft LM sharing the tokenizer)."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(folder)
    return Path(folder)


def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 12, 20)]
    return rand + [[5, 6, 7, 8] * 5, [1, 2, 3] * 6 + [1]]  # repeated patterns: n-gram lookup finds drafts


PROMPTS = tiny_prompts()  # token prompts for the tiny (vocab 128) models


def exact_joint(target, prompt: list[int], sp) -> torch.Tensor:
    """joint[a, b, c] = q(a) q(b | a) q(c | a, b): the exact plain-sampling distribution of the first three
    tokens after prompt, from the target's own logits (a tiny vocabulary keeps this small)."""
    from draftsmith.serve.engine.sampling import probs_from_logits

    def q(seq: list[int]) -> torch.Tensor:
        logits = target(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)), 0).logits[-1]
        return probs_from_logits(logits, sp).double()

    vocab = target.config.vocab_size
    with torch.inference_mode():
        q1 = q(prompt)
        joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
        for a in range(vocab):
            q2 = q(prompt + [a])
            for b in range(vocab):
                joint[a, b] = q1[a] * q2[b] * q(prompt + [a, b])
    return joint


TARGET_ID = "tiny@00000000"


def tiny_info(model, **changes):
    """The TargetInfo a drafter made for the tiny `model` records (fields overridden by `changes`)."""
    from draftsmith.heads.drafter import TargetInfo

    c = model.config
    fields = dict(id=TARGET_ID, hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_layers=c.num_hidden_layers)
    return TargetInfo(**{**fields, **changes})


def head_features(target, head, ids: torch.Tensor, mask: torch.Tensor):
    """A training batch for `head`: the target's last hidden states and the inputs of the layers it reads (None
    for a head that reads none, EAGLE-1/2)."""
    from draftsmith.train.batch import FeatureBatch

    with torch.no_grad():
        hidden, aux = target.hidden_states(ids, head.target_layers)
    return FeatureBatch(ids, mask, hidden, torch.cat(aux, dim=-1) if aux else None)


def perturbed(batch, name: str, pos: int):
    """batch with field `name` changed at position pos (a token moved by one id, a feature by 0.5)."""
    from draftsmith.train.batch import FeatureBatch

    fields = dict(vars(batch))
    x = fields[name].clone()
    x[:, pos] = (x[:, pos] + 1) % 128 if name == "input_ids" else x[:, pos] + 0.5
    fields[name] = x
    return FeatureBatch(**fields)


def greedy_continuations(target, plain: dict, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, n] and loss mask, right-padded: PROMPTS with their greedy continuations (plain: prompt -> output)
    and three random prompts with 32 greedy tokens each; what the engine tests briefly train a head on, so its
    drafts get accepted and rejected."""
    from draftsmith.serve.engine.engine import Engine
    from draftsmith.serve.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    seqs = [p + plain[tuple(p)].output_ids for p in PROMPTS]
    engine = Engine(target, max_seq_len=max_seq_len)
    for _ in range(3):
        p = torch.randint(0, 128, (8,), generator=g).tolist()
        seqs.append(p + engine.generate(p, 32, SamplingParams()).output_ids)
    n = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
    mask = torch.tensor([[1.0] * len(s) + [0.0] * (n - len(s)) for s in seqs])
    return ids, mask
