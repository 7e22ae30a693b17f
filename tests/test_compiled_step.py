"""The compiled step (serve/engine/compiled.py, runtime/static_forward.py) keeps the engine's exactness: a token's
hidden state, logits and KV carry the same bits in a 1-row decode, a chain or tree verify, a whole prefill and a
chunked prefill after a prefix-cache hit, in bf16 and in fp32. So speculative output equals plain output token for
token under the compiled step too. Its numbers are not the eager forward's (the compiler fuses the norms and the
softmax), yet its logits are the eager forward's within rounding, and it falls back to the eager forward when the
compiler fails."""

from __future__ import annotations

import os

import pytest
import torch

from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import MAX_ROWS, can_pack
from draftsmith.runtime.attention import BLOCK
from draftsmith.runtime.llama import Transformer
from draftsmith.runtime.static_forward import MAX_TREE, min_rows
from draftsmith.serve.engine import compiled
from draftsmith.serve.engine.compiled import CompiledStep, cache_slots
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.graphs import resolve_mode
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree, causal_mask
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import cache_root
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import PROMPTS, assert_same_bits, assert_same_kv, node_path

SEQ = 2 * BLOCK + 30  # past two key blocks
MAX_SEQ = SEQ + 40
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 kernels"),
)
pytestmark = pytest.mark.usefixtures("one_thread")


FP32 = pytest.param(
    torch.float32,
    marks=pytest.mark.skipif(
        torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"),
        reason="fp32 row invariance is measured on x86 AVX2 and AVX-512 kernels only",
    ),
)


@pytest.fixture(scope="module", params=[FP32, BF16], ids=["fp32", "bf16"])
def target(request, tiny_llama_dir) -> Transformer:
    # 3 query heads per KV head, as SmolLM2
    folder = tiny_llama_dir("llama", hidden_size=96, intermediate_size=192, num_attention_heads=6)
    return load_model(folder, request.param, "cpu", decode=False)  # bf16 on torch's ops, which inductor compiles


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (SEQ,), generator=torch.Generator().manual_seed(3))


def new_step(target) -> CompiledStep:
    return CompiledStep(target, target.new_cache(cache_slots(MAX_SEQ)))


def run(step, tokens, positions, start, mask=None):
    with torch.inference_mode():
        return step(tokens, positions, start, mask)


def prefilled(target, tokens, n: int) -> CompiledStep:
    step = new_step(target)
    run(step, tokens[:n], torch.arange(n), 0, causal_mask(0, n, "cpu"))
    return step


@pytest.fixture(scope="module")
def whole(target, tokens):
    """The reference: one prefill of the whole sequence (in chunks of MAX_ROWS rows)."""
    step = new_step(target)
    out = run(step, tokens, torch.arange(SEQ), 0, causal_mask(0, SEQ, "cpu"))
    return out, step.cache


def test_decode_steps_equal_the_whole_prefill(target, tokens, whole):
    ref, cache_ref = whole
    assert SEQ > MAX_ROWS  # the reference prefill ran in chunks
    begin = BLOCK - 3
    step = prefilled(target, tokens, begin)
    for p in range(begin, SEQ):  # crosses two block boundaries
        out = run(step, tokens[p : p + 1], torch.tensor([p]), p)
        assert_same_bits(out.hidden, ref.hidden[p : p + 1], f"decode at {p}: hidden")
        assert_same_bits(out.logits, ref.logits[p : p + 1], f"decode at {p}: logits")
    assert_same_kv(step.cache, cache_ref, slice(0, SEQ))


@pytest.mark.parametrize("start", [5, BLOCK - 2, 2 * BLOCK + 3])
@pytest.mark.parametrize("k", [2, 5, 16])
def test_chain_verify_equals_the_whole_prefill(target, tokens, whole, start, k):
    ref, _ = whole
    step = prefilled(target, tokens, start)
    span = torch.arange(start, start + k)
    out = run(step, tokens[start : start + k], span, start, causal_mask(start, k, "cpu"))
    assert_same_bits(out.hidden, ref.hidden[start : start + k], f"verify {k} at {start}: hidden")
    assert_same_bits(out.logits, ref.logits[start : start + k], f"verify {k} at {start}: logits")


@pytest.mark.parametrize("hit", [1, BLOCK + 15, 2 * BLOCK])
def test_chunked_prefill_after_a_prefix_hit_equals_the_whole_prefill(target, tokens, whole, hit):
    ref, cache_ref = whole
    step = prefilled(target, tokens, hit)
    out = run(step, tokens[hit:], torch.arange(hit, SEQ), hit, causal_mask(hit, SEQ - hit, "cpu"))
    assert_same_bits(out.hidden, ref.hidden[hit:], f"prefill after {hit}: hidden")
    assert_same_kv(step.cache, cache_ref, slice(0, SEQ))


TREES = {
    "branches": [-1, -1, 0, 1, 1, 4, 2, 6],  # siblings and a deep branch beside a chain
    "deep40": [-1, -1, -1, 0, *range(3, 39)],  # 40 nodes, two chunks of rows: the second chunk's drafts off position
}


@pytest.mark.parametrize("shape", TREES)
@pytest.mark.parametrize("start", [20, BLOCK - 1, 2 * BLOCK - 2])
def test_tree_verify_rows_equal_a_prefill_of_their_own_path(target, tokens, start, shape):
    parents = torch.tensor(TREES[shape])
    nodes = torch.randint(0, 128, (len(parents),), generator=torch.Generator().manual_seed(start))
    tree = DraftTree(nodes, parents)
    inputs = torch.cat([tokens[start : start + 1], nodes])
    out = run(prefilled(target, tokens, start), inputs, tree.positions(start), start, tree.attention_mask(start))
    for i in range(len(parents)):
        seq = torch.cat([tokens[: start + 1], torch.tensor(node_path(nodes, parents, i))])
        ref = run(new_step(target), seq, torch.arange(len(seq)), 0, causal_mask(0, len(seq), "cpu"))
        assert_same_bits(out.hidden[i + 1 : i + 2], ref.hidden[-1:], f"node {i}: hidden")
        assert_same_bits(out.logits[i + 1 : i + 2], ref.logits[-1:], f"node {i}: logits")


def test_a_tree_deeper_than_the_tail_is_refused(target, tokens):
    """After 62 tokens the tail starts at position 0 and holds 128: a branch 66 deep reaches position 128."""
    start = BLOCK - 2
    parents = torch.tensor([-1, -1, *range(1, MAX_TREE + 2)])  # a sibling, then a branch MAX_TREE + 2 deep
    tree = DraftTree(torch.zeros(len(parents), dtype=torch.long), parents)
    inputs = torch.cat([tokens[start : start + 1], tree.tokens])
    step = prefilled(target, tokens, start)
    with pytest.raises(ValueError, match="draft trees of at most"):
        run(step, inputs, tree.positions(start), start, tree.attention_mask(start))


def test_steps_of_other_cache_lengths_and_target_layers_share_the_bits(target, tokens):
    """One graph for every engine of a model: another would round a row differently (in bf16 it does)."""
    n = BLOCK + 5

    def prefill(slots: int, layers: tuple[int, ...]):
        step = CompiledStep(target, target.new_cache(cache_slots(slots)), layers)
        return run(step, tokens[:n], torch.arange(n), 0, causal_mask(0, n, "cpu"))

    first = prefill(MAX_SEQ, ())
    for slots, layers in ((MAX_SEQ + 37, (0, 1)), (MAX_SEQ, ()), (2 * MAX_SEQ, (1,))):
        out = prefill(slots, layers)
        assert_same_bits(out.hidden, first.hidden, f"{slots} slots, layers {layers}")
        assert len(out.aux) == len(layers)


def test_a_short_context_compiles(target):
    engine = compiled_engine(target, max_seq_len=20)
    engine.generate(PROMPTS[0][:8], 8, SamplingParams())
    assert not engine.static.failed


def test_a_step_pads_to_the_rows_every_gemm_needs(target):
    assert min_rows(target.config) == 2  # 3 heads per KV head: 2 rows give the prefix GEMM 6
    one_kv = target.config.__class__(num_attention_heads=4, num_key_value_heads=4)
    assert min_rows(one_kv) == 4  # 1 head per KV head: 4 rows


# ---------------------------------------------------------------- the engine: speculative == plain, compiled


def compiled_engine(target, proposer=None, max_seq_len: int = MAX_SEQ, **kw) -> Engine:
    return Engine(target, proposer, max_seq_len=max_seq_len, cuda_graphs="compile", **kw)


def test_compiled_speculation_equals_compiled_plain(target):
    plain = compiled_engine(target)
    assert isinstance(plain.static, CompiledStep)
    want = {tuple(p): plain.generate(p, 40, SamplingParams()).output_ids for p in PROMPTS}
    for proposer in (NgramProposer(NgramConfig(num_tokens=5)), DraftModelProposer(target, DraftChainConfig(6))):
        engine = compiled_engine(target, proposer)
        drafted = 0
        for p in PROMPTS:
            out = engine.generate(p, 40, SamplingParams())
            assert out.output_ids == want[tuple(p)], (proposer.name, p)
            drafted += out.metrics.draft_tokens
        assert drafted > 0
    assert not plain.static.failed


def test_compiled_prefix_cache_hit_equals_a_cold_prefill(target):
    prompt = PROMPTS[1] * 5  # 60 tokens: a 48-token hit in blocks of 16
    want = compiled_engine(target).generate(prompt, 24, SamplingParams())
    warm = compiled_engine(target, prefix_cache=PrefixCache(block_size=16))
    warm.generate(prompt[:50], 1, SamplingParams())
    got = warm.generate(prompt, 24, SamplingParams())
    assert got.metrics.prefix_hit_tokens == 48
    assert got.output_ids == want.output_ids


def test_compiled_logits_match_the_eager_forward(target, tokens, whole):
    """Other bits than the eager forward's (the compiler fuses the norms and the softmax), the same function."""
    ref, _ = whole
    with torch.inference_mode():
        eager = target(tokens, torch.arange(SEQ), target.new_cache(MAX_SEQ), 0, causal_mask(0, SEQ, "cpu"))
    tol = 1e-4 if target.dtype == torch.float32 else 0.05
    torch.testing.assert_close(ref.logits, eager.logits, rtol=tol, atol=tol * eager.logits.abs().max().item())


def test_a_weight_edited_in_place_reaches_the_compiled_graph(target, tokens):
    """The graph reads the packed copies as they are: a weight edited between calls is repacked before the next one
    (cpu_kernels/packed.py refresh), so the compiled step computes the edited model, as the eager forward does."""
    step, n = new_step(target), 40
    before = run(step, tokens[:n], torch.arange(n), 0, causal_mask(0, n, "cpu")).logits
    weight = target.model.layers[1].mlp.down_proj.weight
    try:
        with torch.no_grad():
            weight.mul_(0.5)
            eager = target(tokens[:n], torch.arange(n), target.new_cache(MAX_SEQ), 0, causal_mask(0, n, "cpu")).logits
        after = run(step, tokens[:n], torch.arange(n), 0, causal_mask(0, n, "cpu")).logits
    finally:
        with torch.no_grad():
            weight.mul_(2.0)  # exact: the module's other tests see the weights they began with
    tol = 1e-4 if target.dtype == torch.float32 else 0.05
    torch.testing.assert_close(after, eager, rtol=tol, atol=tol * eager.abs().max().item())
    # the edit moves the logits several times the tolerance (a bf16 logit moves ~7x it, an fp32 one far more)
    assert (after - before).abs().max() > 3 * tol * eager.abs().max()


def test_a_compiler_failure_falls_back_to_the_eager_forward(target, monkeypatch):
    engine = compiled_engine(target)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(engine.static, "graph", broken)
    eager = Engine(target, max_seq_len=MAX_SEQ, cuda_graphs="off")
    prompt = (PROMPTS[0] * 10)[:70]  # a prefill of three chunks: one warning, one attempt
    with pytest.warns(UserWarning, match="compiled step failed") as caught:
        got = engine.generate(prompt, 16, SamplingParams())
    assert engine.static.failed and len(caught) == 1
    assert got.output_ids == eager.generate(prompt, 16, SamplingParams()).output_ids


def test_after_a_compiler_failure_no_mask_still_means_causal_rows(target, tokens):
    """A step's mask None means causal rows from its start, compiled or not (the eager forward's own None means
    causal from position 0 only)."""
    steps = [prefilled_eagerly(target, tokens) for _ in range(2)]
    rows = torch.arange(8, 12)
    none, causal = run(steps[0], tokens[rows], rows, 8), run(steps[1], tokens[rows], rows, 8, causal_mask(8, 4, "cpu"))
    assert torch.equal(none.logits, causal.logits)


def prefilled_eagerly(target, tokens) -> CompiledStep:
    step = new_step(target)
    step.failed = True  # as after a compiler failure
    run(step, tokens[:8], torch.arange(8), 0, causal_mask(0, 8, "cpu"))
    return step


def test_compiled_code_is_cached_under_the_cache_root(target, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiled.compile_available(target)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_root() / "inductor")


def test_auto_compiles_on_cpu_unless_switched_off(target, monkeypatch):
    monkeypatch.setenv(compiled.DISABLE_ENV, "1")
    # a bf16 target on AVX-512 compiles; an fp32 one runs draftsmith's kernels eagerly (2.2-2.7x the compiled step)
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    on_kernels = target.dtype == torch.float32 and native.usable()
    assert resolve_mode("auto", target) == ("compile" if avx512 and not on_kernels else "off")
    if avx512 and on_kernels:
        monkeypatch.setenv(native.ENV, "0")
        assert resolve_mode("auto", target) == "compile"  # on oneDNN's kernels, the compiled step pays
        monkeypatch.delenv(native.ENV)
    monkeypatch.setenv(compiled.DISABLE_ENV, "0")
    assert resolve_mode("auto", target) == "off"
    with pytest.raises(ValueError, match="unknown static-step mode"):
        resolve_mode("fast", target)
    monkeypatch.setenv(compiled.DISABLE_ENV, "1")
    assert resolve_mode("auto", target, tree=MAX_TREE + 1) == "off"  # its deepest rows would overflow the tail
    with pytest.raises(ValueError, match="at most"):
        resolve_mode("compile", target, tree=MAX_TREE + 1)
