"""The target's one switch (runtime/llama.py, Transformer.path): chosen once when it is loaded, cpu_kernels running
each step through the whole C++ stack and the reference running torch's ops alone, what each calls, what a run
records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from draftsmith.cpu_kernels import decoder_layer, decoder_stack, layer_ops, native, panels, rope_attention
from draftsmith.runtime.llama import CPU_KERNELS, REFERENCE
from draftsmith.serve.engine.cost_profile import kernel_library
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import PROMPTS, four_steps

KERNEL_CALLS = (
    (decoder_stack, "run"),
    (decoder_layer, "run"),
    (rope_attention, "rope_attention"),
    (layer_ops, "rms_norm"),
    (layer_ops, "silu_mul"),
    (panels, "panel_linear"),
)
needs_kernels = pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs")


def tiny(tiny_llama_dir, model_type: str = "llama", dtype: torch.dtype = torch.float32, **kwargs):
    return load_model(tiny_llama_dir(model_type, hidden_size=96, num_attention_heads=6), dtype, "cpu", **kwargs)


@contextlib.contextmanager
def counted() -> Iterator[dict[str, mock.MagicMock]]:
    """Each of draftsmith's kernel entry points, wrapped to count its calls."""
    with contextlib.ExitStack() as stack:
        spies = {
            f"{owner.__name__.rsplit('.', 1)[-1]}.{name}": stack.enter_context(
                mock.patch.object(owner, name, wraps=getattr(owner, name))
            )
            for owner, name in KERNEL_CALLS
        }
        yield spies


@needs_kernels
def test_an_fp32_cpu_model_is_loaded_on_the_cpu_kernels_path(tiny_llama_dir):
    model = tiny(tiny_llama_dir)
    assert model.path == CPU_KERNELS and model.stacked and model.why_not_stacked() == ""
    with counted() as calls:
        four_steps(model)
    assert calls["decoder_stack.run"].call_count == 4  # prefill, decode, chain and tree verify: one call each
    inside = ("decoder_layer.run", "rope_attention.rope_attention", "layer_ops.silu_mul")
    assert all(calls[name].call_count == 0 for name in inside)
    assert calls["layer_ops.rms_norm"].call_count == 4  # the final norm, before the lm_head


@needs_kernels
def test_calls_that_are_not_steps_run_the_modules_on_the_kernels(tiny_llama_dir):
    """Training features (no cache) have no stack call; on the cpu_kernels path their norms and linears still take the
    kernels, and their values are the reference's up to rounding."""
    model = tiny(tiny_llama_dir)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), counted() as calls:
        fast, _ = model.hidden_states(tokens)
    assert calls["layer_ops.rms_norm"].call_count > 0 and calls["panels.panel_linear"].call_count > 0
    model.path = REFERENCE
    with torch.inference_mode(), counted() as calls:
        reference, _ = model.hidden_states(tokens)
    assert sum(c.call_count for c in calls.values()) == 0
    assert torch.allclose(fast, reference, atol=1e-4)


def test_the_reference_path_calls_none_of_draftsmiths_kernels(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    model = tiny(tiny_llama_dir)
    assert model.path == REFERENCE and "do not run" in model.why_not_stacked()
    with counted() as calls:
        outs, _ = four_steps(model)
    assert sum(c.call_count for c in calls.values()) == 0
    monkeypatch.delenv(native.ENV)
    if native.usable():  # the same weights on the kernels: the same logits up to rounding
        fast, _ = four_steps(tiny(tiny_llama_dir))
        assert all(torch.allclose(f.logits, r.logits, atol=1e-4) for f, r in zip(fast, outs, strict=True))


def test_half_precision_takes_the_reference_and_unpacked_linears_step_module_by_module(tiny_llama_dir):
    """bf16 arithmetic (an offline load, decode=False) is not what the kernels run: the reference, chosen at load. fp32
    linears left unpacked do not fit the stack: the model stays on the kernels, its steps module by module."""
    half = tiny(tiny_llama_dir, dtype=torch.bfloat16, decode=False)
    assert half.path == REFERENCE and not half.stacked and "bfloat16" in half.why_not_stacked()
    with counted() as calls:
        four_steps(half)
    assert sum(c.call_count for c in calls.values()) == 0
    unpacked = tiny(tiny_llama_dir, pack=False)
    if native.usable():
        assert unpacked.path == CPU_KERNELS and not unpacked.stacked and "not packed" in unpacked.choose_path()
        with counted() as calls:
            four_steps(unpacked)
        assert calls["decoder_stack.run"].call_count == 0 and calls["layer_ops.rms_norm"].call_count > 0


@pytest.mark.parametrize("path", [CPU_KERNELS, REFERENCE])
def test_greedy_speculation_equals_plain_on_either_path(path, tiny_llama_dir):
    model = tiny(tiny_llama_dir)
    if path == CPU_KERNELS and model.path != CPU_KERNELS:
        pytest.skip("draftsmith's fp32 kernels do not run here")
    model.path = path
    plain = Engine(model, max_seq_len=128)
    spec = Engine(model, NgramProposer(NgramConfig(num_tokens=5)), max_seq_len=128)
    drafted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, 40, SamplingParams())
        got = spec.generate(prompt, 40, SamplingParams())
        assert got.output_ids == want.output_ids, prompt
        drafted += got.metrics.draft_tokens
    assert drafted > 0
    assert (kernel_library(spec) is not None) == (path == CPU_KERNELS)  # what a run records as its kernels


@needs_kernels
def test_a_hooked_target_stays_lossless_at_near_ties(tiny_llama_dir):
    """A hook keeps a model off the whole stack: its steps run module by module on the kernels, which give a row the
    same bits decoded or verified, so speculation still equals plain greedy where two tokens nearly tie (torch's ops
    would part: their one-row and many-row products round differently)."""
    model = tiny(tiny_llama_dir)
    with torch.no_grad():  # rows 64..127 of the lm_head a hair from rows 0..63: near-ties everywhere
        w = model.lm_head.weight
        noise = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
        w[64:128] = w[:64] * (1 + 3e-7 * noise)
    model.model.layers[1].register_forward_hook(lambda module, args, out: out)
    plain = Engine(model, max_seq_len=128)
    spec = Engine(model, DraftModelProposer(model, DraftChainConfig(5)), max_seq_len=128)
    with mock.patch.object(decoder_stack, "run", wraps=decoder_stack.run) as ran:
        for prompt in PROMPTS:
            assert (
                spec.generate(prompt, 60, SamplingParams()).output_ids
                == plain.generate(prompt, 60, SamplingParams()).output_ids
            ), prompt
    assert ran.call_count == 0 and model.path == CPU_KERNELS and not model.stacked


@needs_kernels
def test_a_model_off_the_stack_then_moved_to_bf16_takes_the_reference(tiny_llama_dir):
    model = tiny(tiny_llama_dir)
    handle = model.model.layers[1].register_forward_hook(lambda module, args, out: out)
    four_steps(model)
    handle.remove()
    assert model.path == CPU_KERNELS and not model.stacked  # module by module
    model.to(torch.bfloat16)
    with counted() as calls:
        four_steps(model)
    assert model.path == REFERENCE and sum(c.call_count for c in calls.values()) == 0
