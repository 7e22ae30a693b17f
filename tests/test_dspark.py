"""DSpark on tiny random Llama targets (fp32, CPU): config refusals; training's teacher-forced logits and
confidence equal what drafting computes for the same tokens, for each sequential head; the loss (which slot reads
which target row, D-PACE weights, training lowers it and teaches the confidence head); the proposer in the engine
(greedy output identical to plain decoding for chains and trees, every slot a draft, the confidence handed to the
engine, distribution-exact sampling with the Markov bias on); folders without the sequential or confidence head
refused."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors.torch import save_file

from draftsmith.heads.drafter_folder import Recipe, own_state, read_drafter, save_drafter
from draftsmith.heads.dspark import DSparkConfig, DSparkHead
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_dspark import DSparkProposer
from draftsmith.train.loss_dflash import dflash_loss, sample_anchors
from draftsmith.train.loss_dspark import dspark_loss
from draftsmith.train.losses import dpace_weights
from helpers import (
    PROMPTS,
    SMALL,
    SMALL_PROMPT,
    exact_joint,
    greedy_continuations,
    head_features,
    joint_pvalues,
    left_out_four_steps_in_five,
    tiny_info,
)

GREEDY = SamplingParams()
MAX_NEW, MAX_SEQ, ALPHA = 24, 128, 1e-4
MARKOV = ["vanilla", "gated", "rnn"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def make_head(target, seed: int = 0, **overrides) -> DSparkHead:
    torch.manual_seed(seed)
    head = DSparkHead(DSparkConfig.from_target(target.config, **{"markov_rank": 8, **overrides}), target)
    with torch.no_grad():  # the Markov head starts near zero: give it a visible bias
        head.markov_head.markov_w1.weight.normal_(0, 1.0)
        head.markov_head.markov_w2.weight.normal_(0, 0.5)
    return head


def test_config_refusals(target):
    with pytest.raises(ValueError, match="markov_type must be one of vanilla, gated, rnn"):
        DSparkConfig.from_target(target.config, markov_type="lstm")
    with pytest.raises(ValueError, match="markov_rank must be >= 1.*head=dflash"):
        DSparkConfig.from_target(target.config, markov_rank=0)
    with pytest.raises(ValueError, match="block_size must be in"):
        DSparkConfig.from_target(target.config, block_size=1)


@pytest.mark.parametrize("markov", MARKOV)
def test_teacher_forced_logits_equal_drafting_the_same_tokens(markov, target):
    """Slot k of anchor a, teacher-forced on the true tokens a..a+k, is what the proposer computes when its
    drafts so far were those tokens: the same backbone block, bias, rnn state and confidence."""
    head = make_head(target, num_layers=2, block_size=4, markov_type=markov)
    c = head.config
    ids = torch.randint(0, c.vocab_size, (1, 16))
    batch = head_features(target, head, ids, torch.ones(1, 16))
    context = head.target_features(batch.hidden, batch.aux)
    a = 6
    with torch.no_grad():
        out = head.anchored(context, ids, torch.tensor([[a]]))
        logits, conf = head.teacher_forced(out, ids[:, a : a + 4][:, None])
        proposer = DSparkProposer(head, 4)
        proposer.cache = KVCache.allocate(2, c.num_key_value_heads, c.head_dim, 32, torch.float32, "cpu")
        head.write_context(context[0, :a], torch.arange(a), proposer.cache, 0)
        proposer.cached = a
        proposer.draft_block(ids[0, a])
        state = None
        for k in range(4):
            step, e, state = proposer.slot(k, ids[0, a + k], state)
            torch.testing.assert_close(step, logits[0, 0, k].float(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(head.confidence(proposer.hidden[k], e), conf[0, 0, k], atol=1e-5, rtol=1e-5)


def test_each_slot_reads_the_token_before_it_and_targets_the_one_after(target):
    """With only slot 0 weighted (a tiny decay gamma) and only the CE term, the loss is the CE of slot 0 (the
    Markov bias of the anchor token) against the target's distribution from hidden[a]."""
    head = make_head(target, block_size=4)
    ids = torch.randint(0, 128, (2, 16))
    batch = head_features(target, head, ids, torch.ones(2, 16))
    only = {"anchors": 6, "decay_gamma": 1e-3, "ce_weight": 1.0, "tv_weight": 0.0, "confidence_weight": 0.0}
    torch.manual_seed(3)
    first_only = dspark_loss(head, batch, **only)[0]
    torch.manual_seed(3)
    anchor = sample_anchors(batch.loss_mask, 6)[0]
    out = head.anchored(head.target_features(batch.hidden, batch.aux), ids, anchor)
    h = head.normed(out[:, :, 0])
    logits = head.base_logits(h) + head.markov_head.markov_w2(head.markov_head.embed(ids.gather(1, anchor)))
    rows = head.target_lm_head.weight[head.vocab_ids]
    soft = torch.softmax(batch.hidden.gather(1, anchor[..., None].expand(-1, -1, 64)) @ rows.T, -1)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), soft.flatten(0, 1))
    torch.testing.assert_close(first_only, ce, rtol=1e-4, atol=1e-5)


def test_dpace_weights_are_expected_accepted_drafts_behind_each_slot():
    q = torch.tensor([[0.5, 0.5, 1.0], [0.5, 0.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = dpace_weights(-torch.log(q), mask, alpha=0.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 0.25], [0.75, 0.25, 0.0]]))
    assert torch.allclose(dpace_weights(-torch.log(q), mask, alpha=1.0), torch.tensor([[3.0, 2, 1], [2, 1, 0]]))


def test_dflash_and_dspark_losses_take_dpace_weights_and_refuse_unknown_ones(target):
    from draftsmith.heads.dflash import DFlashConfig, DFlashHead

    dflash = DFlashHead(DFlashConfig.from_target(target.config, block_size=4), target)
    ids = torch.randint(0, 128, (2, 16))
    batch = head_features(target, dflash, ids, torch.ones(2, 16))
    losses = {}
    for head, loss in ((dflash, dflash_loss), (make_head(target), dspark_loss)):
        for weights in ("decay", "dpace"):
            torch.manual_seed(0)
            losses[loss.__name__, weights] = loss(head, batch, anchors=6, slot_weights=weights)[0].item()
        with pytest.raises(ValueError, match="slot_weights must be one of decay, dpace"):
            loss(head, batch, slot_weights="linear")
    assert losses["dflash_loss", "decay"] != losses["dflash_loss", "dpace"]
    assert losses["dspark_loss", "decay"] != losses["dspark_loss", "dpace"]
    with pytest.raises(ValueError, match="confidence_target must be one of greedy, overlap"):
        dspark_loss(make_head(target), batch, confidence_target="tv")


@pytest.mark.parametrize("confidence_target", ["greedy", "overlap"])
def test_training_lowers_the_loss_and_teaches_the_confidence_head(confidence_target, target):
    head = make_head(target, num_layers=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (4, 24), generator=g)
    mask = (torch.arange(24) >= 4).float().expand(4, 24).clone()
    batch = head_features(target, head, ids, mask)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    logs = []
    for _ in range(40):
        loss, log = dspark_loss(head, batch, anchors=16, confidence_target=confidence_target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        logs.append(log)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.2, logs
    assert logs[-1]["acc_1"] > logs[0]["acc_1"] + 0.1
    assert logs[-1]["conf_err"] < logs[0]["conf_err"] - 0.1
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert head.markov_head.markov_w1.weight.grad is not None and head.confidence_head.proj.weight.grad is not None


# ---------------------------------------------------------------- the proposer in the engine


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, MAX_NEW, GREEDY) for p in PROMPTS}


@pytest.fixture(scope="module", params=MARKOV)
def trained(request, target, plain):
    """A head trained briefly on the target's own greedy continuations, so drafts get accepted and rejected."""
    ids, mask = greedy_continuations(target, plain, MAX_SEQ)
    head = make_head(target, num_layers=2, block_size=4, markov_type=request.param)
    batch = head_features(target, head, ids, mask)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    torch.manual_seed(0)
    for _ in range(80):
        loss = dspark_loss(head, batch, anchors=24)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.mark.parametrize("num_tokens,topk,total", [(4, 1, 0), (2, 1, 0), (3, 3, 8)])
def test_greedy_output_equals_plain(num_tokens, topk, total, target, plain, trained):
    proposer = DSparkProposer(trained, num_tokens, TreeConfig(topk, total))
    trees, paths = [], []
    propose, accept = proposer.propose, proposer.accept
    proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]
    proposer.accept = lambda tokens, tree, path, out: (paths.append(path), accept(tokens, tree, path, out))
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted = 0
    for p in PROMPTS:
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == plain[tuple(p)].output_ids, (num_tokens, topk, p)
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and any(len(path) >= 2 for path in paths)
    full = [t for t in trees if len(t) == proposer.max_tree_size]
    assert full and proposer.max_tree_size == (num_tokens if topk == 1 else total)
    if topk == 1:  # a chain: every node carries the confidence head's estimate
        probs = torch.cat([t.accept_probs for t in full])
        assert ((probs > 0) & (probs < 1)).all()


def test_the_block_drafts_every_slot_and_the_markov_bias_changes_the_chain(target, plain):
    head = make_head(target, num_layers=2, block_size=5)
    assert DSparkProposer(head, 9).depth == 5  # anchor-first: block_size drafts, capped there
    engine = Engine(target, DSparkProposer(head, 5), max_seq_len=MAX_SEQ)
    biased = engine.generate(PROMPTS[0], 1, GREEDY)
    chain = engine.proposer.propose(torch.tensor([*PROMPTS[0], biased.output_ids[0]]), GREEDY, 5)
    with torch.no_grad():
        head.markov_head.markov_w2.weight.zero_()
    engine = Engine(target, DSparkProposer(head, 5), max_seq_len=MAX_SEQ)
    engine.generate(PROMPTS[0], 1, GREEDY)
    unbiased = engine.proposer.propose(torch.tensor([*PROMPTS[0], biased.output_ids[0]]), GREEDY, 5)
    base = engine.proposer.logits.argmax(-1)
    assert torch.equal(unbiased.tokens, head.vocab_ids[base])  # no bias: each slot's own argmax (DFlash-like)
    assert not torch.equal(chain.tokens, unbiased.tokens)


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    return tgt, exact_joint(tgt, SMALL_PROMPT, SamplingParams(temperature=1.0))


@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_sampled_chain_keeps_the_target_distribution(markov, small):
    """A sampled chain, each token drawn under the bias of the one before, over a draft vocabulary missing two
    target tokens: the first three tokens follow the target's joint law."""
    tgt, joint = small
    head = make_head(tgt, seed=3, draft_vocab_size=6, block_size=3, markov_type=markov)
    head.set_vocab(torch.tensor([9, 1, 8, 7, 0, 6, 5, 4]))
    engine = Engine(tgt, DSparkProposer(head.eval(), 2, TreeConfig(1, 0)), max_seq_len=16)
    draws, accepted = [], 0
    for i in range(1500):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=30_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0.1 * len(draws) < accepted
    pvalues = joint_pvalues(torch.tensor(draws), joint)
    assert min(pvalues) > ALPHA, pvalues


# ---------------------------------------------------------------- folders and configs


@pytest.mark.parametrize("part", ["markov_head.", "confidence_head."])
def test_a_folder_without_its_sequential_or_confidence_head_is_refused(part, target, tmp_path):
    head = make_head(target)
    folder = save_drafter(head, head.config, "dspark", tiny_info(target), Recipe(), tmp_path / "d")
    state = {k: v.contiguous() for k, v in own_state(head).items() if not k.startswith(part)}
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"does not fit a dspark drafter: missing \\['{part}"):
        read_drafter(folder, tiny_info(target), target)


def test_train_quick_makes_a_head_for_a_chain_of_its_block():
    with initialize_config_module("draftsmith.conf", version_base=None):
        cfg = compose("train", overrides=["head=dspark", "train=quick"])
    assert cfg.head.kind == "dspark" and cfg.head.args.block_size == 4 and cfg.head.draft.num_tokens == 4
    assert cfg.head.args.markov_type == "vanilla" and cfg.head.loss.slot_weights is None


def test_a_head_left_out_of_steps_stays_lossless(target, plain, trained):
    """Steps the head does not draft leave their outputs waiting; the draft after them takes them in first."""
    engine = Engine(target, DSparkProposer(trained, 4), max_seq_len=MAX_SEQ)
    accepted, _ = left_out_four_steps_in_five(engine, plain, PROMPTS, MAX_NEW)
    assert accepted > 0
