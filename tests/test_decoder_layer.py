"""A whole fp32 decoder layer in one call (cpu_kernels/decoder_layer.py): the same bits as the layer's modules run one
by one, a plan rebuilt when a weight changes, and the modules wherever a layer does not fit the kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.cpu_kernels import decoder_layer, decoder_stack, native
from draftsmith.cpu_kernels.packed import pack_linears
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import CPU_KERNELS
from draftsmith.serve.models.loader import load_model
from helpers import eagle_head, four_steps, without

pytestmark = pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])  # qwen3: q and k norms in the call
def target(tiny_llama_dir, request):
    return load_model(tiny_llama_dir(request.param, hidden_size=96, num_attention_heads=6), torch.float32, "cpu")


@pytest.fixture(autouse=True)
def layer_by_layer():
    """These tests are about one layer's call; tests/test_decoder_stack.py runs the stack."""
    with without(decoder_stack):
        yield


def steps(model) -> list:
    """(logits, hidden) of a prefill, a decode, a chain and a tree verify, then K and V."""
    outs, cache = four_steps(model)
    return [(o.logits, o.hidden) for o in outs] + [torch.stack(cache.k), torch.stack(cache.v)]


def test_one_call_gives_the_modules_bits(target):
    layer = target.model.layers[0]
    with torch.inference_mode():
        assert decoder_layer.step_plan(layer, torch.zeros(1, 1, 96), (torch.zeros(1), torch.zeros(1)), 0, None)
    one_call = steps(target)
    with without(decoder_layer):
        modules = steps(target)
    for got, want in zip(one_call, modules, strict=True):
        for g, w in zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]:
            assert torch.equal(g, w)


def test_an_edited_weight_is_replanned(tiny_llama_dir):
    model = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    before = steps(model)[1][0]
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)  # in place: the packed copy and the plan are stale
        model.model.layers[0].input_layernorm.weight.add_(0.1)
    after = steps(model)[1][0]
    with without(decoder_layer):
        modules = steps(model)[1][0]
    assert not torch.equal(after, before) and torch.equal(after, modules)


def test_a_deep_copy_plans_its_own_weights(tiny_llama_dir):
    model = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    want = steps(model)[1][0]
    twin = copy.deepcopy(model)
    del model  # the copy must not point into the original's freed tensors
    assert torch.equal(steps(twin)[1][0], want)


def test_layers_that_do_not_fit_take_the_modules(tiny_llama_dir):
    qwen3 = load_model(tiny_llama_dir("qwen3", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    x, caches = torch.zeros(1, 1, 96), (torch.zeros(1), torch.zeros(1))
    qwen3.model.layers[0].self_attn.k_norm.eps = 1e-3  # q and k norms of two eps: the kernel applies one
    with torch.inference_mode():
        assert decoder_layer.step_plan(qwen3.model.layers[0], x, caches, 0, None) is None
        assert decoder_layer.step_plan(qwen3.model.layers[1], x, caches, 0, None) is not None
        llama = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
        slots = torch.tensor([0])
        assert decoder_layer.step_plan(llama.model.layers[0], x, caches, slots, None) is None
        assert decoder_layer.step_plan(llama.model.layers[0], x.double(), caches, 0, None) is None
    assert decoder_layer.step_plan(llama.model.layers[0], x, caches, 0, None) is None  # gradients flow


def test_a_norm_moved_or_changed_under_the_same_parameter_is_replanned(tiny_llama_dir):
    """The plan points into the norms' storage: a .data swap moves it, and eps lives on the module."""
    model = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    steps(model)
    layer = model.model.layers[0]
    layer.input_layernorm.weight.data = layer.input_layernorm.weight.detach().clone() * 1.5
    layer.input_layernorm.eps = layer.post_attention_layernorm.eps = 0.5
    after = steps(model)
    with without(decoder_layer):
        modules = steps(model)
    assert torch.equal(after[1][0], modules[1][0])


def test_a_norm_the_kernel_cannot_read_takes_the_modules(tiny_llama_dir):
    model = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    norm = model.model.layers[0].input_layernorm
    w = norm.weight.detach()
    norm.weight = torch.nn.Parameter(torch.stack([w * 2, w], 1)[:, 1])  # the same values, every other float
    x, caches = torch.zeros(1, 1, 96), (torch.zeros(1), torch.zeros(1))
    with torch.inference_mode():
        assert decoder_layer.step_plan(model.model.layers[0], x, caches, 0, None) is None
    norm.weight = torch.nn.Parameter(w.double())
    with torch.inference_mode():
        assert decoder_layer.step_plan(model.model.layers[0], x, caches, 0, None) is None


def test_a_norm_of_another_class_takes_the_modules(tiny_llama_dir):
    """A LayerNorm has a weight and an eps too; the kernel would replace its arithmetic with RMSNorm's."""
    model = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    layer = model.model.layers[0]
    layer.input_layernorm = torch.nn.LayerNorm(96, eps=layer.post_attention_layernorm.eps)
    x, caches = torch.zeros(1, 1, 96), (torch.zeros(1), torch.zeros(1))
    with torch.inference_mode():
        assert decoder_layer.step_plan(layer, x, caches, 0, None) is None
    got = steps(model)[1][0]
    assert model.path == CPU_KERNELS and not model.stacked  # its steps run module by module from now on
    with without(decoder_layer):
        assert torch.equal(got, steps(model)[1][0])


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama-layer", "qwen3-layer"])
def test_eagle3_midlayer_in_one_call_gives_the_modules_bits(tiny_llama_dir, qk_norm):
    """EAGLE-3's midlayer (two normed halves in, the feature as residual; Qwen3-style: q and k normed per head) in
    one call: a prefill and a draft level of two siblings give the modules' outputs and cache, bit for bit."""
    target = load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")
    head = eagle_head("eagle3", target, qk_norm=qk_norm).eval().requires_grad_(False)
    assert hasattr(head.midlayer.self_attn, "q_norm") == qk_norm
    pack_linears(head)
    c, gen = head.config, torch.Generator().manual_seed(0)
    feats, toks = torch.randn(1, 6, c.hidden_size, generator=gen), torch.randint(0, c.vocab_size, (1, 6), generator=gen)
    prefill = torch.ones(4, 5, dtype=torch.bool).tril(1)
    prefill[:, 0] = False  # slot 0 holds no pair
    level = torch.zeros(2, 7, dtype=torch.bool)
    level[:, 1:5], level[0, 5], level[1, 6] = True, True, True

    def run() -> list[torch.Tensor]:
        cache = KVCache.allocate(1, c.num_key_value_heads, c.head_dim, 8, torch.float32, "cpu")
        with torch.inference_mode():
            first = head(feats[:, :4], toks[:, :4], torch.arange(1, 5), cache, 1, prefill)
            second = head(feats[:, 4:], toks[:, 4:], torch.tensor([5, 5]), cache, 5, level)
        return [first, second, cache.k[0].clone(), cache.v[0].clone()]

    with torch.inference_mode():
        x, caches = torch.zeros(1, 1, c.hidden_size), (torch.zeros(1), torch.zeros(1))
        assert decoder_layer.step_plan(head.midlayer, x, caches, 0, None) is not None
    one_call = run()
    with without(decoder_layer):
        modules = run()
    assert all(torch.equal(g, w) for g, w in zip(one_call, modules, strict=True))
