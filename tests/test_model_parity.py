"""Our runner's logits and hidden states match HF transformers (fp32) for each supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.serve.models.loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
SEQ = 100  # past llama3-rope's original 64 positions


def causal_mask(start: int, n: int) -> torch.Tensor:
    """bool [n, start+n]: row i attends to slots <= start+i."""
    return torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)


def hf_reference(folder: Path, tokens: torch.Tensor):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        out = hf(input_ids=tokens[None], output_hidden_states=True)
    return hf, out.logits[0], [h[0] for h in out.hidden_states]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel} x scale {scale:.3g}"


def prefill_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(len(tokens))
    return model(tokens, torch.arange(len(tokens)), cache, 0).logits


def chunked_logits(model, tokens: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Prefill tokens[:cuts[0]], then each further chunk with an explicit mask (KV-cache path)."""
    cache = model.new_cache(len(tokens))
    rows, bounds = [], [0, *cuts, len(tokens)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        mask = None if start == 0 else causal_mask(start, end - start)
        out = model(tokens[start:end], torch.arange(start, end), cache, start, mask=mask)
        rows.append(out.logits)
    return torch.cat(rows)


def check_parity(folder: Path, tokens: torch.Tensor, cuts: list[int]) -> None:
    model = load_model(folder, torch.float32, "cpu")
    hf, ref_logits, ref_hidden = hf_reference(folder, tokens)
    assert_close(prefill_logits(model, tokens), ref_logits)
    assert_close(chunked_logits(model, tokens, cuts), ref_logits)

    n_layers = model.config.num_hidden_layers
    cache = model.new_cache(len(tokens))
    out = model(tokens, torch.arange(len(tokens)), cache, 0, target_layers=(0, 1, n_layers))
    # HF hidden_states[i] is the input to layer i (i < L); the last entry is after the final norm.
    assert len(ref_hidden) == n_layers + 1
    assert_close(out.aux[0], ref_hidden[0])
    assert_close(out.aux[1], ref_hidden[1])
    assert_close(out.hidden, ref_hidden[n_layers])
    with torch.no_grad():
        assert_close(hf.model.norm(out.aux[2][None])[0], ref_hidden[n_layers])


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_parity(family: str, tiny_llama_dir) -> None:
    model_type, overrides = FAMILIES[family]
    folder = tiny_llama_dir(model_type, **overrides)
    tokens = torch.randint(0, 128, (SEQ,), generator=torch.Generator().manual_seed(1))
    check_parity(folder, tokens, cuts=[37, 38, 50, 71])


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, LINEAR_ROPE], ids=["llama3", "linear"])
def test_rope_scaling_is_applied(rope: dict, tiny_llama_dir) -> None:
    """The scaled config must differ from plain rope past the original context (so parity means something)."""
    plain = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
    scaled = load_model(tiny_llama_dir("llama", rope_parameters=rope), torch.float32, "cpu")
    assert scaled.config.rope_scaling["rope_type"] == rope["rope_type"]
    assert not torch.allclose(plain.cos[80], scaled.cos[80])


def test_linear_rope_stretches_positions(tiny_llama_dir) -> None:
    """linear: position p under factor f is rotated as plain rope rotates p / f."""
    plain = load_model(tiny_llama_dir("llama"), torch.float32, "cpu")
    scaled = load_model(tiny_llama_dir("llama", rope_parameters=LINEAR_ROPE), torch.float32, "cpu")
    f = int(LINEAR_ROPE["factor"])
    torch.testing.assert_close(scaled.cos[::f][:20], plain.cos[:20])
    torch.testing.assert_close(scaled.sin[::f][:20], plain.sin[:20])


@pytest.mark.slow
def test_smollm2_parity(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Speculative decoding drafts several tokens cheaply, then the target verifies them in one pass."
    tokens = torch.tensor(tok(text)["input_ids"])
    check_parity(smollm2_dir, tokens, cuts=[len(tokens) // 2, len(tokens) // 2 + 1])


@pytest.mark.parametrize("n", [1, 5])
def test_grouped_attention_matches_sdpa(n: int) -> None:
    """The bf16 CPU decode/verify path: GQA by reshaping, masked like the tree verifier masks."""
    import torch.nn.functional as F

    from draftsmith.runtime.llama import grouped_attention, use_grouped_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, m, 16, generator=g) for h, m in ((6, n), (2, 40), (2, 40)))
    mask = torch.rand(1, 1, n, 40, generator=g) > 0.3
    mask[..., 0] = True
    mask = mask if n > 1 else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)
    assert use_grouped_attention(q.bfloat16(), mask) and not use_grouped_attention(q, mask)
    assert not use_grouped_attention(torch.zeros(1, 6, 3, 16, dtype=torch.bfloat16), None)  # causal prefill: SDPA


def test_grouped_attention_masks_each_row_of_a_batched_decode() -> None:
    """Batched distillation decodes b rows of different lengths: a mask per row, sliced from a longer one."""
    import torch.nn.functional as F

    from draftsmith.runtime.llama import grouped_attention, use_grouped_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, m, 16, generator=g) for h, m in ((6, 1), (2, 40), (2, 40)))
    valid = torch.arange(48).expand(3, 48) < torch.tensor([[10], [25], [40]])
    mask = valid[:, :40].view(3, 1, 1, 40)  # not contiguous, as train/regenerate.py slices it
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)
    assert use_grouped_attention(q.bfloat16(), mask)
