"""The CPU forward is bit-exact across row counts, in bf16 (runtime/attention.py, cpu_kernels/packed.py) and in fp32
where draftsmith's own kernels run (cpu_kernels/panels.py, cpu_kernels/rope_attention.py): the same token at the same
position gives identical hidden states, logits and KV in a 1-row decode, a k-row verify (chain or tree), a whole
prefill and a chunked prefill after a prefix-cache hit. So speculative output equals plain output, and a hit equals a
cold run."""

from __future__ import annotations

import pytest
import torch

from draftsmith.cpu_kernels import native, panels
from draftsmith.cpu_kernels.packed import can_pack
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.runtime.attention import BLOCK, make_plans
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree, TreeConfig, causal_mask
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_eagle import EagleProposer
from draftsmith.serve.proposers.propose_layerskip import layerskip_model
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import PROMPTS, assert_same_bits, assert_same_kv, node_path

pytestmark = pytest.mark.usefixtures("one_thread")
NO_BF16 = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 kernels")
NO_FP32 = pytest.mark.skipif(
    not (panels.available() and native.usable()), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs"
)
DTYPES = [pytest.param(torch.bfloat16, marks=NO_BF16, id="bf16"), pytest.param(torch.float32, marks=NO_FP32, id="fp32")]
# Qwen3's q and k norms run inside the fp32 attention kernel
TARGETS = [
    pytest.param(("llama", torch.bfloat16), marks=NO_BF16, id="bf16"),
    pytest.param(("llama", torch.float32), marks=NO_FP32, id="fp32"),
    pytest.param(("qwen3", torch.float32), marks=NO_FP32, id="qwen3-fp32"),
]
SEQ = 3 * BLOCK + 14  # past three key blocks
MAX_SEQ = SEQ + 50


@pytest.fixture(scope="module", params=TARGETS)
def target(tiny_llama_dir, request) -> Transformer:
    # 3 query heads per KV head, as SmolLM2: a decode step's 3 rows are below MKL's 4-row kernel
    model_type, dtype = request.param
    folder = tiny_llama_dir(model_type, hidden_size=96, intermediate_size=192, num_attention_heads=6)
    return load_model(folder, dtype, "cpu", decode=False)  # bf16: torch's ops (oneDNN), not fp32 on the kernels


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (SEQ,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def whole(target, tokens):
    """The reference: one prefill of the whole sequence; (hidden, logits, cache)."""
    cache = target.new_cache(MAX_SEQ)
    with torch.inference_mode():
        out = target(tokens, torch.arange(SEQ), cache, 0, causal_mask(0, SEQ, "cpu"))
    return out.hidden, out.logits, cache


def run(target, cache, tokens, positions, start, mask=None):
    with torch.inference_mode():
        return target(tokens, positions, cache, start, mask)


def prefilled(target, tokens, n: int):
    cache = target.new_cache(MAX_SEQ)
    run(target, cache, tokens[:n], torch.arange(n), 0, causal_mask(0, n, "cpu"))
    return cache


def test_decode_steps_equal_the_whole_prefill(target, tokens, whole):
    hidden, logits, cache_ref = whole
    cache = prefilled(target, tokens, BLOCK - 2)
    for p in range(BLOCK - 2, SEQ):  # crosses three block boundaries
        out = run(target, cache, tokens[p : p + 1], torch.tensor([p]), p)
        assert_same_bits(out.hidden, hidden[p : p + 1], f"decode at {p}: hidden")
        assert_same_bits(out.logits, logits[p : p + 1], f"decode at {p}: logits")
    assert_same_kv(cache, cache_ref, slice(0, SEQ))


@pytest.mark.parametrize("start", [5, BLOCK - 1, 2 * BLOCK - 4, 3 * BLOCK - 6])
@pytest.mark.parametrize("k", [2, 3, 4, 8, 16])
def test_chain_verify_equals_the_whole_prefill(target, tokens, whole, start, k):
    hidden, logits, _ = whole
    cache = prefilled(target, tokens, start)
    out = run(
        target, cache, tokens[start : start + k], torch.arange(start, start + k), start, causal_mask(start, k, "cpu")
    )
    assert_same_bits(out.hidden, hidden[start : start + k], f"verify {k} at {start}: hidden")
    assert_same_bits(out.logits, logits[start : start + k], f"verify {k} at {start}: logits")


@pytest.mark.parametrize("hit", [1, BLOCK, BLOCK + 15, 2 * BLOCK, 3 * BLOCK + 4])
def test_chunked_prefill_after_a_prefix_hit_equals_the_whole_prefill(target, tokens, whole, hit):
    hidden, logits, cache_ref = whole
    cache = prefilled(target, tokens, hit)
    out = run(target, cache, tokens[hit:], torch.arange(hit, SEQ), hit, causal_mask(hit, SEQ - hit, "cpu"))
    assert_same_bits(out.hidden, hidden[hit:], f"prefill after {hit}: hidden")
    assert_same_bits(out.logits, logits[hit:], f"prefill after {hit}: logits")
    assert_same_kv(cache, cache_ref, slice(0, SEQ))


def tree_cases():
    """(parents, depth): siblings, a deep branch beside a chain, 16 nodes spanning two blocks."""
    return {
        "siblings": [-1, -1, -1],
        "branches": [-1, -1, 0, 1, 1, 4, 2, 6],
        "wide16": [-1, -1, -1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    }


@pytest.mark.parametrize("shape", tree_cases())
@pytest.mark.parametrize("start", [20, BLOCK - 1, 2 * BLOCK - 2, 3 * BLOCK - 1])
def test_tree_verify_rows_equal_a_prefill_of_their_own_path(target, tokens, shape, start):
    """Each tree node's row equals the last row of a plain prefill of prefix + the node's ancestors + the node."""
    parents = torch.tensor(tree_cases()[shape])
    nodes = torch.randint(0, 128, (len(parents),), generator=torch.Generator().manual_seed(start))
    assert_tree_rows_equal_own_paths(target, tokens, start, nodes, parents, f"{shape} at {start}")


def assert_tree_rows_equal_own_paths(model, tokens, start: int, nodes, parents, what: str) -> None:
    """Verify the tree after tokens[:start+1]; each node's row must equal the last row of a plain prefill of
    prefix + the node's ancestors + the node."""
    tree = DraftTree(nodes, parents)
    inputs = torch.cat([tokens[start : start + 1], nodes])
    out = run(model, prefilled(model, tokens, start), inputs, tree.positions(start), start, tree.attention_mask(start))
    for i in range(len(parents)):
        seq = torch.cat([tokens[: start + 1], torch.tensor(node_path(nodes, parents, i))])
        ref = run(model, model.new_cache(MAX_SEQ), seq, torch.arange(len(seq)), 0, causal_mask(0, len(seq), "cpu"))
        assert_same_bits(out.hidden[i + 1 : i + 2], ref.hidden[-1:], f"{what}, node {i}: hidden")
        assert_same_bits(out.logits[i + 1 : i + 2], ref.logits[-1:], f"{what}, node {i}: logits")


def test_plans_read_in_place_until_the_first_draft_off_its_position():
    s = 2 * BLOCK + 6
    chain = make_plans(causal_mask(s, 8, "cpu"), s, 8, 3, "cpu")[0]
    assert chain.in_place == 3 and chain.tail == 0  # slot = position everywhere: positions 0..s+7 in 3 blocks
    tree = DraftTree(torch.zeros(3, dtype=torch.long), torch.tensor([-1, -1, 0]))
    plan = make_plans(tree.attention_mask(s), s, 4, 3, "cpu")[0]
    assert plan.in_place == 2 and plan.tail == 1  # node 1 sits at slot s+2, position s+1
    slots = plan.tail_slots.view(4, BLOCK)
    col = s + 1 - 2 * BLOCK  # position s+1 in the tail block
    assert slots[2, col] == s + 2 and slots[3, col] == s + 1 and slots[3, col + 1] == s + 3  # node 2's parent is 0
    assert make_plans(None, 0, 1, 3, "cpu")[0].padded == 2  # 3 heads x 1 row -> 2 rows: MKL's 4-row kernel


# ---------------------------------------------------------------- the engine: speculative == plain


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, 48, SamplingParams()).output_ids for p in PROMPTS}


def eagle3_proposer(target):
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config), target).to(target.dtype).eval()
    return EagleProposer(head, "eagle3", 3, TreeConfig(topk=2, total_tokens=6))


@pytest.mark.parametrize("name", ["ngram", "eagle3-tree", "layerskip", "draft-self"])
def test_greedy_speculation_equals_plain(name, target, plain):
    proposer = {
        "ngram": lambda: NgramProposer(NgramConfig(num_tokens=5)),
        "eagle3-tree": lambda: eagle3_proposer(target),
        "layerskip": lambda: DraftModelProposer(layerskip_model(target, 1), DraftChainConfig(3)),
        "draft-self": lambda: DraftModelProposer(target, DraftChainConfig(6)),  # every draft accepted: 7-row verifies
    }[name]()
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    drafted = 0
    for p in PROMPTS:
        out = engine.generate(p, 48, SamplingParams())
        assert out.output_ids == plain[tuple(p)], (name, p)
        drafted += out.metrics.draft_tokens
    assert drafted > 0


def test_a_prefix_cache_hit_equals_a_cold_prefill(target):
    prompt = PROMPTS[1] * 5  # 60 tokens: a 48-token hit in blocks of 16
    cold = Engine(target, max_seq_len=MAX_SEQ)
    want = cold.generate(prompt, 24, SamplingParams())
    warm = Engine(target, prefix_cache=PrefixCache(block_size=16), max_seq_len=MAX_SEQ)
    warm.generate(prompt[:50], 1, SamplingParams())
    got = warm.generate(prompt, 24, SamplingParams())
    assert got.metrics.prefix_hit_tokens == 48
    assert got.output_ids == want.output_ids
    assert_same_kv(warm.cache, cold.cache, slice(0, 60 + 24 - 1))


# ---------------------------------------------------------------- several threads, a single KV head


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 6])
def test_a_single_kv_head_keeps_its_bits_under_two_threads(tiny_llama_dir, heads, dtype):
    """With 2+ threads MKL splits a lone GEMM's rows between them, and a piece under 4 rows rounds differently: with
    one KV head (MQA) the per-head score GEMM is alone, so every attention GEMM runs in a batch of two or more."""
    folder = tiny_llama_dir(
        "llama",
        hidden_size=64 * heads,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=64,
    )
    mqa = load_model(folder, dtype, "cpu", decode=False)
    seq = torch.randint(0, 128, (2 * BLOCK + 30,), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = run(mqa, mqa.new_cache(MAX_SEQ), seq, torch.arange(len(seq)), 0, causal_mask(0, len(seq), "cpu"))
        cache = prefilled(mqa, seq, 10)
        for p in range(10, len(seq)):
            out = run(mqa, cache, seq[p : p + 1], torch.tensor([p]), p)
            assert_same_bits(out.hidden, ref.hidden[p : p + 1], f"decode at {p}")
        for start in (5, BLOCK - 3, 2 * BLOCK + 3):
            cache = prefilled(mqa, seq, start)
            for k in (2, 3, 5, 9, 11, 16):
                out = run(
                    mqa,
                    cache,
                    seq[start : start + k],
                    torch.arange(start, start + k),
                    start,
                    causal_mask(start, k, "cpu"),
                )
                assert_same_bits(out.hidden, ref.hidden[start : start + k], f"verify {k} at {start}")
        parents = torch.tensor(tree_cases()["wide16"])
        nodes = torch.randint(0, 128, (len(parents),), generator=torch.Generator().manual_seed(2))
        assert_tree_rows_equal_own_paths(mqa, seq, 2 * BLOCK - 2, nodes, parents, "tree")
    finally:
        torch.set_num_threads(threads)
