"""EAGLE-3's draft forward in one call (cpu_kernels/eagle3_draft.py): the same bits as the head's modules, in the
engine's proposer through prefill, one-level and deeper drafts and plain steps; a plan remade when a weight changes; the
modules where a head's options are not the call's; bad operands refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch

from draftsmith.cpu_kernels import eagle3_draft, native
from draftsmith.cpu_kernels.packed import pack_linears
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.metrics import Metrics
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import DraftTree, TreeConfig
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_eagle import EagleProposer
from helpers import eagle_head, without

pytestmark = [
    pytest.mark.skipif(not native.usable(), reason="draftsmith's fp32 kernels run on AVX2 and AVX-512 CPUs"),
    pytest.mark.usefixtures("one_thread"),
]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), torch.float32, "cpu")


def packed_head(target, **options):
    head = eagle_head("eagle3", target, **options).eval().requires_grad_(False)
    pack_linears(head)
    return head


def decode(target, head, steps: int = 14, around=contextlib.nullcontext, ids=torch.long) -> list[torch.Tensor]:
    """A prompt, then target steps one token at a time; after most the head drafts (one level, or three levels of a
    two-wide tree), after every third it sits out, so the next draft takes in two steps' outputs (each draft within
    `around()`, the token ids in `ids`). Every draft's
    tokens, parents and accept probabilities, the head's last feature and logits, and its cache at the end."""
    proposer = EagleProposer(head, "eagle3", 3, TreeConfig(2, 6))
    engine = Engine(target, proposer, max_seq_len=64)
    tokens = torch.randint(0, 128, (24 + steps + 1,), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []
    with torch.inference_mode():
        n = engine.prefill(tokens[:25], 24, GREEDY, None, Metrics())
        for step in range(steps):
            out = engine.forward(tokens[n - 1 : n], torch.arange(n - 1, n), n - 1, None)
            proposer.accept(tokens[: n + 1], DraftTree.empty(), [], out)
            n += 1
            if step % 3 != 2:
                with around():
                    tree = proposer.propose(tokens[:n].to(ids), GREEDY, 1 if step % 2 else 3)
                seen += [tree.tokens, tree.parents, tree.accept_probs, proposer.feature, proposer.logits]
    assert proposer.cache is not None
    return [*seen, proposer.cache.k[0].clone(), proposer.cache.v[0].clone()]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_one_call_draft_gives_the_modules_bits(target):
    head = packed_head(target)
    assert head.draft_plan() is not None
    calls = []
    run = eagle3_draft.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eagle3_draft, "run", lambda *args: (calls.append(args[4].numel()), run(*args))[1])
        one_call = decode(target, head)
    assert calls and max(calls) > 1  # drafts after a plain step ran two new slots in the call
    with without(eagle3_draft):
        modules = decode(target, head)
    assert same(one_call, modules)


@pytest.mark.parametrize("around", [torch.enable_grad, native.switched_off], ids=["grad", "kernels-off"])
def test_where_the_modules_keep_torchs_ops_the_draft_does_too(target, around):
    head = packed_head(target)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eagle3_draft, "run", lambda *args: pytest.fail("the one call ran"))
        got = decode(target, head, steps=6, around=around)
    with without(eagle3_draft):
        assert same(got, decode(target, head, steps=6, around=around))


def test_int32_token_ids_draft_as_int64_ones_do(target):
    head = packed_head(target)
    assert same(decode(target, head, steps=6, ids=torch.int32), decode(target, head, steps=6))


def test_an_edited_head_weight_is_planned_anew(target):
    head = packed_head(target)
    before = decode(target, head)
    with torch.no_grad():
        head.lm_head.weight.mul_(0.5)  # in place: the packed copy and the plan are stale
        head.fc.weight.add_(0.01)
        head.norm.weight.add_(0.1)
    after = decode(target, head)
    with without(eagle3_draft):
        modules = decode(target, head)
    assert not same(after, before) and same(after, modules)


@pytest.mark.parametrize("option", ["norm_before_fc", "norm_output", "norm_before_residual"])
def test_options_the_call_does_not_compute_take_the_modules(target, option):
    head = packed_head(target, **{option: True})
    assert head.draft_plan() is None
    assert decode(target, head, steps=4)  # drafts, module by module


def test_an_unpacked_head_or_a_hooked_module_takes_the_modules(target):
    assert eagle_head("eagle3", target).eval().draft_plan() is None  # plain nn.Linear: nothing in panels
    head = packed_head(target)
    assert head.draft_plan() is not None
    handle = head.norm.register_forward_hook(lambda *args: None)  # the call would skip the hook
    assert head.draft_plan() is None
    handle.remove()
    assert head.draft_plan() is not None


def test_a_method_of_a_subclass_or_an_instance_takes_the_modules(target):
    class OwnRope(Eagle3Head):
        def rope(self, positions, dtype):
            return super().rope(positions * 0, dtype)

    head = packed_head(target)
    head.__class__ = OwnRope
    assert head.draft_plan() is None  # the call reads the rope table itself
    head.__class__ = Eagle3Head
    head.logits = lambda hidden: Eagle3Head.logits(head, hidden) * 2
    assert head.draft_plan() is None
    del head.logits
    assert head.draft_plan() is not None


def test_a_one_level_draft_is_the_first_level_of_a_deeper_one(target):
    head = packed_head(target)
    proposer = EagleProposer(head, "eagle3", 3, TreeConfig(3, 0))
    engine = Engine(target, proposer, max_seq_len=64)
    tokens = torch.randint(0, 128, (25,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        engine.prefill(tokens, 24, GREEDY, None, Metrics())
        deep, one = proposer.propose(tokens, GREEDY, 3), proposer.propose(tokens, GREEDY, 1)
    roots = deep.parents == -1
    assert len(one) == 3 and torch.equal(one.parents, deep.parents[roots])
    assert torch.equal(one.tokens, deep.tokens[roots]) and torch.equal(one.accept_probs, deep.accept_probs[roots])


def test_bad_operands_are_refused_by_name(target):
    head = packed_head(target)
    made = head.draft_plan()
    assert made is not None
    h, taps = head.config.hidden_size, len(head.config.target_layers)
    k = torch.zeros(1, head.config.num_key_value_heads, 16, head.config.head_dim)
    caches, rope = (k, k.clone()), (head.cos[1:2], head.sin[1:2])
    mask, store, rows = torch.ones(1, 2, dtype=torch.bool), torch.zeros(4, h), [torch.zeros(1, h)] * taps

    def call(tokens, tap_rows=rows, features=store[0:1]):
        return eagle3_draft.run(made, tap_rows, store[1:2], tokens, features, rope, caches, 1, mask)

    with torch.inference_mode():
        call(torch.tensor([5]))
        with pytest.raises(ValueError, match="token id 128 is past the embedding's 128 rows"):
            call(torch.tensor([128]))
        with pytest.raises(ValueError, match=f"fc reads {taps} tapped layers, got 1"):
            call(torch.tensor([5]), tap_rows=[torch.zeros(1, h)])
        with pytest.raises(ValueError, match="a tapped layer must be a contiguous fp32 CPU"):
            call(torch.tensor([5]), tap_rows=[torch.zeros(1, h, dtype=torch.float64)] * taps)
        with pytest.raises(ValueError, match="features must be a contiguous fp32 CPU"):
            call(torch.tensor([5]), features=store[0:2])
