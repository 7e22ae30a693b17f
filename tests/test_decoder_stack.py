"""A model's whole stack of fp32 layers in one call (cpu_kernels/decoder_stack.py): the bits of the layers run one call
each and of their modules, the residual taps the drafters read, a stack replanned when any layer changes, and the
layer-by-layer road wherever a layer does not fit."""

from __future__ import annotations

import copy
from collections import OrderedDict
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.cpu_kernels import decoder_layer, decoder_stack, native, panels
from draftsmith.cpu_kernels.layer_ops import RMSNorm
from draftsmith.cpu_kernels.packed import PackedLinear
from draftsmith.runtime.llama import CPU_KERNELS, MLP, DecoderLayer
from draftsmith.serve.models.loader import load_model
from helpers import exactly, four_steps, without

pytestmark = pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs")
TAPS = (0, 2, 2, 3, 9, -1)  # as EAGLE-3 asks: the first layer's input, a middle one, the output; repeats, strays


def tiny(model_type: str, tiny_llama_dir):
    return load_model(tiny_llama_dir(model_type, hidden_size=96, num_attention_heads=6), torch.float32, "cpu")


def steps(model, cache=None) -> list:
    """Logits, hidden states and taps of a prefill, a decode, a chain and a tree verify, then K and V."""
    outs, cache = four_steps(model, cache, TAPS)
    return [t for o in outs for t in (o.logits, o.hidden, *o.aux)] + [torch.stack(cache.k), torch.stack(cache.v)]


def current(layers):
    return decoder_stack.current(layers, DecoderLayer.forward)


def same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_stack_gives_the_layers_bits_and_taps(model_type, tiny_llama_dir):
    model = tiny(model_type, tiny_llama_dir)
    with mock.patch.object(decoder_stack, "run", wraps=decoder_stack.run) as ran:
        with mock.patch.object(decoder_stack, "make_stack", wraps=decoder_stack.make_stack) as made:
            with mock.patch.object(decoder_layer, "make_plan", wraps=decoder_layer.make_plan) as planned:
                stacked = steps(model)
    assert ran.call_count == 4 and made.call_count == 0 and planned.call_count == 0  # planned at load, then kept
    with without(decoder_stack):
        layer_by_layer = steps(model)
    with without(decoder_stack, decoder_layer):
        modules = steps(model)
    assert len(stacked) == 4 * (2 + 3) + 2  # taps 0, 2 and 3 (the output), each once
    assert same(stacked, layer_by_layer) and same(stacked, modules)


@pytest.mark.parametrize("code", ["q4", "q8", "bf16"])
def test_coded_weights_give_the_fp32_panels_bits(code, tiny_llama_dir, monkeypatch):
    """Weights a narrower format holds exactly run from it (cpu_kernels/panel_codes.py) through the whole stack, lm_head
    included, with the bits of the same weights in fp32 panels."""
    models = [tiny("llama", tiny_llama_dir) for _ in range(2)]
    for model in models:
        with torch.no_grad():
            for w in (p for p in model.parameters() if p.dim() == 2):
                w.copy_(exactly(code, w))  # edited in place: the packed copies are made again when next used
    coded = steps(models[0])
    held = [decoder_layer.current_tensors(layer) for layer in models[0].model.layers]
    formats = {t.dtype for h in held if h is not None for name, t in h.items() if name in decoder_layer.LINEARS}
    assert len(held) == 3 and formats == {panels.CODED[code]}
    assert models[0].lm_head.current().dtype == panels.CODED[code]
    monkeypatch.setenv(panels.ENV, "fp32")
    assert same(coded, steps(models[1]))
    assert models[1].lm_head.current().dtype == torch.float32


def edit_in_place(model) -> None:
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(0.5)


def swap_data(model) -> None:
    o = model.model.layers[1].self_attn.o_proj
    o.weight.data = o.weight.detach() * 1.5


def replace_parameter(model) -> None:
    k = model.model.layers[0].self_attn.k_proj
    k.weight = nn.Parameter(k.weight.detach().flip(0))


def change_eps(model) -> None:
    for norm in (model.model.layers[1].input_layernorm, model.model.layers[1].post_attention_layernorm):
        norm.eps = 0.25


def replace_layer(model) -> None:
    model.model.layers[1] = copy.deepcopy(model.model.layers[2])


def edit_a_q_norm(model) -> None:
    with torch.no_grad():
        model.model.layers[1].self_attn.q_norm.weight.mul_(1.5)


def change_the_q_and_k_norms_eps(model) -> None:
    attn = model.model.layers[2].self_attn
    attn.q_norm.eps = attn.k_norm.eps = 0.25


@pytest.mark.parametrize(
    ("change", "model_type"),
    [
        (edit_in_place, "llama"),
        (swap_data, "llama"),
        (replace_parameter, "llama"),
        (change_eps, "llama"),
        (replace_layer, "llama"),
        (edit_a_q_norm, "qwen3"),
        (change_the_q_and_k_norms_eps, "qwen3"),
    ],
)
def test_a_changed_layer_is_replanned(change, model_type, tiny_llama_dir):
    model = tiny(model_type, tiny_llama_dir)
    before = steps(model)
    change(model)
    after = steps(model)
    with without(decoder_stack, decoder_layer):
        modules = steps(model)
    assert not same(after, before) and same(after, modules)


def test_a_layer_added_or_removed_is_replanned(tiny_llama_dir):
    model = tiny("llama", tiny_llama_dir)
    steps(model)
    model.model.layers.append(copy.deepcopy(model.model.layers[0]))
    model.config.num_hidden_layers = 4  # for new_cache
    grown = steps(model)
    with without(decoder_stack, decoder_layer):
        assert same(grown, steps(model))
    del model.model.layers[0]
    stack = current(model.model.layers)
    assert stack is not None and len(stack.plans) == 3


def unpack_an_o_projection(model) -> None:
    attn = model.model.layers[1].self_attn
    plain = nn.Linear(96, 96, bias=False)
    plain.weight = attn.o_proj.weight  # the same weights, not packed
    attn.o_proj = plain


def put_in_a_layer_of_another_kind(model) -> None:
    model.model.layers[1] = Skip()


class Skip(nn.Module):
    def forward(self, x, *args):
        return x


class GeluMLP(MLP):
    """An MLP of another activation: the one-call layer computes SiLU's, so a layer holding it must run its forward."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class ScaledNorm(RMSNorm):
    def forward(self, x):
        return 2 * super().forward(x)


def put_in_an_mlp_of_its_own(model) -> None:
    mlp = model.model.layers[1].mlp
    own = GeluMLP.__new__(GeluMLP)
    own.__dict__ = dict(mlp.__dict__)  # the same (packed) linears
    model.model.layers[1].mlp = own


def give_an_mlp_another_class(model) -> None:
    model.model.layers[2].mlp.__class__ = GeluMLP


def give_a_norm_another_class(model) -> None:
    model.model.layers[0].post_attention_layernorm.__class__ = ScaledNorm


class NegatedLinear(PackedLinear):
    def forward(self, x):
        return -super().forward(x)


def give_an_o_projection_a_forward_of_its_own(model) -> None:
    model.model.layers[1].self_attn.o_proj.__class__ = NegatedLinear


@pytest.mark.parametrize(
    "change",
    [
        unpack_an_o_projection,
        put_in_a_layer_of_another_kind,
        put_in_an_mlp_of_its_own,
        give_an_mlp_another_class,
        give_a_norm_another_class,
        give_an_o_projection_a_forward_of_its_own,
    ],
)
def test_a_layer_that_no_longer_fits_sends_the_steps_module_by_module(change, tiny_llama_dir, caplog):
    """Whether the steps run as one stack is decided at load; a model changed after it so that one layer does not fit
    runs them module by module on the kernels from then on (the same bits a row gets in any step), with a warning."""
    model = tiny("llama", tiny_llama_dir)
    assert model.path == CPU_KERNELS and model.stacked
    change(model)
    with mock.patch.object(decoder_stack, "run", wraps=decoder_stack.run) as ran, caplog.at_level("WARNING"):
        got = steps(model)
    assert ran.call_count == 0 and model.path == CPU_KERNELS and not model.stacked
    assert "changed since it was loaded" in caplog.text and "module by module" in caplog.text
    with without(decoder_stack, decoder_layer):
        assert same(got, steps(model))


def test_a_forward_patched_on_the_class_after_load_is_run(tiny_llama_dir, monkeypatch, caplog):
    """MLP.forward replaced on the class (every instance at once): the stack sees it at the next step and the steps
    run module by module, the new forward called."""
    model = tiny("llama", tiny_llama_dir)
    plain = steps(model)
    silu = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: 2 * silu(self, x))
    with caplog.at_level("WARNING"):
        doubled = steps(model)
    assert not model.stacked and "module by module" in caplog.text and not same(doubled, plain)
    with without(decoder_stack, decoder_layer):
        assert same(doubled, steps(model))


def test_what_the_stack_does_not_take(tiny_llama_dir):
    llama, qwen3 = tiny("llama", tiny_llama_dir), tiny("qwen3", tiny_llama_dir)
    x = torch.zeros(1, 1, 96)
    assert current(llama.model.layers) is not None
    assert current(qwen3.model.layers) is not None  # q/k norms in the call
    qwen3.model.layers[1].self_attn.q_norm.register_forward_hook(lambda *_: None)
    assert current(qwen3.model.layers) is None  # the call would skip the hook
    with torch.inference_mode():
        assert decoder_stack.steps(x, llama.new_cache(8), 0, None)
        assert not decoder_stack.steps(x, None, 0, None)  # training: no cache
        assert not decoder_stack.steps(x, llama.new_cache(8), torch.tensor([0]), None)  # slot tensors
        assert not decoder_stack.steps(x.expand(2, 1, 96), llama.new_cache(8), 0, None)  # a batch
        assert not decoder_stack.steps(x, llama.new_cache(8), 0, torch.zeros(1, 1))  # an additive mask
    assert not decoder_stack.steps(x, llama.new_cache(8), 0, None)  # gradients flow


def test_a_cache_for_another_model_is_named(tiny_llama_dir):
    model = tiny("llama", tiny_llama_dir)
    short = model.new_cache(64)
    short.k, short.v = short.k[:2], short.v[:2]
    with pytest.raises(ValueError, match="cache holds 2 layers"):
        steps(model, short)
    odd = model.new_cache(64)
    odd.v[2] = torch.zeros(1, 2, 32, 16)
    with pytest.raises(ValueError, match="every layer's cache must be"):
        steps(model, odd)


def test_a_deep_copy_stacks_its_own_weights(tiny_llama_dir):
    model = tiny("llama", tiny_llama_dir)
    want = steps(model)
    twin = copy.deepcopy(model)
    del model  # the copy must not point into the original's freed tensors
    assert same(steps(twin), want)


def parametrize_down(model) -> None:
    down = model.model.layers[1].mlp.down_proj
    torch.nn.utils.parametrize.register_parametrization(down, "weight", Scale())
    model(torch.arange(3), torch.arange(3), model.new_cache(8), 0, None)  # planned, then the original edited
    with torch.no_grad():
        down.parametrizations.weight.original.mul_(3)


class Scale(nn.Module):
    def forward(self, w):
        return w * 2


def reverse_the_layer_dict(model) -> None:
    layers = model.model.layers
    layers._modules = dict(zip(layers._modules, reversed(layers._modules.values()), strict=True))


@pytest.mark.parametrize("change", [parametrize_down, reverse_the_layer_dict])
def test_what_a_module_computes_or_holds_anew_is_seen(change, tiny_llama_dir):
    model = tiny("llama", tiny_llama_dir)
    steps(model)
    with torch.inference_mode():
        change(model)
    after = steps(model)
    with without(decoder_stack, decoder_layer):
        assert same(after, steps(model))


def hook_a_layer(model) -> object:
    return model.model.layers[1].register_forward_hook(lambda module, args, out: out * 0 + args[0])  # skips it


def hook_an_mlp(model) -> object:
    return model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)


def hook_every_module(model) -> object:
    return torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)


def patch_a_forward(model) -> object:
    model.model.layers[2].forward = lambda x, *args: x
    return mock.Mock()


@pytest.mark.parametrize("hook", [hook_a_layer, hook_an_mlp, hook_every_module, patch_a_forward])
def test_hooks_and_a_patched_forward_are_honoured(hook, tiny_llama_dir, caplog):
    """The kernels run in place of modules: where one of those has a hook or its own forward, the steps run module by
    module (with a warning), each module running the hook; choose_path() brings the stack back once it is gone."""
    model = tiny("llama", tiny_llama_dir)
    plain = steps(model)
    handle = hook(model)
    try:
        with caplog.at_level("WARNING"):
            hooked = steps(model)
        with without(decoder_stack, decoder_layer):
            assert same(hooked, steps(model))
    finally:
        handle.remove()
    assert "changed since it was loaded" in caplog.text and not model.stacked and model.path == CPU_KERNELS
    why = model.choose_path()
    if hook is patch_a_forward:  # a forward set on an instance stays
        assert "does not fit" in why and not model.stacked
    else:
        assert not why and model.stacked and same(steps(model), plain)


def test_layers_under_their_own_names_are_planned_once(tiny_llama_dir):
    model = tiny("llama", tiny_llama_dir)
    named = OrderedDict((f"block{i}", layer) for i, layer in enumerate(model.model.layers))
    model.model.layers = nn.Sequential(named)
    with mock.patch.object(decoder_stack, "make_stack", wraps=decoder_stack.make_stack) as made:
        got = steps(model)
    assert made.call_count == 1
    with without(decoder_stack, decoder_layer):
        assert same(got, steps(model))


def bias_the_o_projection(model) -> None:
    o = model.model.layers[1].self_attn.o_proj
    o.bias = nn.Parameter(torch.full((96,), 0.5))


def drop_a_q_bias(model) -> None:
    model.model.layers[1].self_attn.q_proj.bias = None


def drop_a_k_bias(model) -> None:
    model.model.layers[0].self_attn.k_proj.bias = None


@pytest.mark.parametrize("change", [bias_the_o_projection, drop_a_q_bias, drop_a_k_bias])
def test_biases_added_or_dropped_after_packing(change, tiny_llama_dir):
    """The kernel adds only the q/k/v bias; a fused projection whose parts differ in having one fills in zeros."""
    model = tiny("qwen2", tiny_llama_dir)
    steps(model)
    change(model)
    reference = load_model(
        tiny_llama_dir("qwen2", hidden_size=96, num_attention_heads=6), torch.float32, "cpu", pack=False
    )
    change(reference)
    reference.load_state_dict(model.state_dict())
    got, want = steps(model), steps(reference)
    assert all(torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want, strict=True))


def test_direct_calls_with_operands_of_another_shape_are_refused(tiny_llama_dir):
    """run() is reachable without takes(): an input of two sequences, or a cache whose heads and head size multiply
    to the layer's width but split it otherwise, must be refused before the kernel writes past the cache."""
    model = tiny("llama", tiny_llama_dir)
    layer = model.model.layers[0]
    with torch.inference_mode():
        made = decoder_layer.plan(layer)
        assert made is not None
        caches = (torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16))
        rope = (torch.ones(20, 16), torch.zeros(20, 16))
        with pytest.raises(ValueError, match="must be one sequence"):
            decoder_layer.run(made, torch.zeros(2, 20, 96), rope, caches, 0, None)
        other = (torch.zeros(1, 1, 64, 20), torch.zeros(1, 1, 64, 20))  # (6 + 2 x 1) x 20 = the qkv width of 6/2 x 16
        with pytest.raises(ValueError, match="is not the layer's \\[1, 2, max_len, 16\\]"):
            decoder_layer.run(made, torch.zeros(1, 20, 96), (torch.ones(20, 20), torch.zeros(20, 20)), other, 0, None)
