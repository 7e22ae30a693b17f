"""DFlash on tiny random Llama targets (fp32, CPU): the head (config checks, training's anchored blocks
equal drafting's, save/load with vLLM's names), its loss (which inputs count, training), the one-forward proposer
in the engine (greedy output identical to plain decoding for chains and trees, prefix-cache hits equal cold
prefills, drafts cut at the request's end, seeded and distribution-exact sampling), building it from the spec
config, bad drafter folders refused, and draftsmith-train head=dflash train=quick end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors import safe_open

from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.drafter_folder import Recipe, read_drafter, save_drafter
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.build import make_proposer
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers import base
from draftsmith.serve.proposers.propose_dflash import DFlashProposer
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.loss_dflash import dflash_loss, sample_anchors
from helpers import (
    PROMPTS,
    SMALL,
    SMALL_PROMPT,
    TARGET_ID,
    build_tiny_chat_target,
    check_metrics,
    exact_joint,
    greedy_continuations,
    head_features,
    joint_pvalues,
    kv_prefix,
    left_out_four_steps_in_five,
    perturbed,
    same_kv,
    spy_budgets,
    tiny_info,
)

GREEDY = SamplingParams()
MAX_NEW, MAX_SEQ, ALPHA = 24, 128, 1e-4
VLLM_DFLASH_KEYS = {  # what vLLM's DFlashQwen3ForCausalLM loads for a 2-layer drafter with a draft vocabulary
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            *(f"self_attn.{p}_proj" for p in "qkvo"),
            "self_attn.q_norm",
            "self_attn.k_norm",
            *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
            "input_layernorm",
            "post_attention_layernorm",
        )
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def make_head(target, seed: int = 0, **overrides) -> DFlashHead:
    torch.manual_seed(seed)
    return DFlashHead(DFlashConfig.from_target(target.config, **overrides), target)


SMOL = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    eos_token_ids=[2],
)


# ---------------------------------------------------------------- the head


def test_config_defaults_and_refusals():
    cfg = DFlashConfig.from_target(SMOL)
    assert cfg.target_layers == (2, 15, 27)  # EAGLE-3's: one feature cache serves both
    assert (cfg.num_layers, cfg.block_size, cfg.mask_token_id, cfg.draft_vocab_size) == (1, 4, 2, 8192)
    assert cfg.layer_config().qk_norm and cfg.layer_config().num_hidden_layers == 1
    assert DFlashConfig.from_target(SMOL, num_layers=4, block_size=8, mask_token_id=7).mask_token_id == 7
    assert DFlashConfig.from_target(ModelConfig(vocab_size=100, num_hidden_layers=3)).mask_token_id == 0
    cases = [
        (dict(num_layers=5), r"num_layers must be in \[1, 4\], got 5"),
        (dict(num_layers=0), r"num_layers must be in \[1, 4\], got 0"),
        (dict(block_size=1), r"block_size must be in \[2, 8192\] \(the target's context\), got 1"),
        (dict(block_size=8193), r"block_size must be in \[2, 8192\] \(the target's context\), got 8193"),
        (dict(mask_token_id=49152), r"mask_token_id=49152 is not in the target's vocabulary of 49152 tokens"),
        (dict(target_layers=(2, 31)), r"target_layers \[2, 31\] name layers the target does not have \(it has 30"),
        (dict(target_layers=(5, 2)), r"distinct, ascending"),
        (dict(draft_vocab_size=0), r"draft_vocab_size must be in \[1, 49152\]"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            DFlashConfig.from_target(SMOL, **overrides)


def test_anchored_training_blocks_equal_drafting_with_the_cache(target):
    """Block a of anchored() is what drafting computes with the pending token at a: context slots [0, a) from
    write_context, then the block at positions a.. attending to them and to itself."""
    head = make_head(target, num_layers=2, block_size=5)
    c = head.config
    ids = torch.randint(0, c.vocab_size, (2, 14))
    batch = head_features(target, head, ids, torch.ones(2, 14))
    context = head.target_features(batch.hidden, batch.aux)
    anchors = torch.tensor([[3, 9, 1], [12, 5, 6]])
    with torch.no_grad():
        out = head.anchored(context, ids, anchors)
        assert out.shape == (2, 3, 5, c.hidden_size)
        for r in range(2):
            for j, a in enumerate(anchors[r].tolist()):
                cache = KVCache.allocate(2, c.num_key_value_heads, c.head_dim, 32, torch.float32, "cpu")
                cache.k[0].fill_(float("nan"))  # slots past the block must not be read
                head.write_context(context[r, :a], torch.arange(a), cache, 0)
                x = head.draft(head.block_tokens(ids[r, a]), a, cache)
                torch.testing.assert_close(x, out[r, j], atol=1e-5, rtol=1e-5)
        # non-causal inside the block: the first slot sees the mask slots after it; and no later context
        shorter = head.anchored(context[:, :10], ids[:, :10], anchors[:1, :1].expand(2, 1))
        torch.testing.assert_close(shorter[0, 0], out[0, 0], atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_with_vllm_names(target, tmp_path):
    head = make_head(target, num_layers=2, draft_vocab_size=40)
    head.set_vocab(torch.randint(0, 1000, (target.config.vocab_size,)))
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.vocab_ids])  # the target's rows
    assert not head.lm_head.weight.requires_grad and not head.embed_tokens.weight.requires_grad
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    folder = save_drafter(head, head.config, "dflash", tiny_info(target), Recipe(data="random"), tmp_path / "d")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == VLLM_DFLASH_KEYS  # nothing borrowed from the target (embedding, its lm_head)
    loaded = read_drafter(folder, tiny_info(target), target)
    assert loaded.config == head.config and loaded.embed_tokens is target.model.embed_tokens
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.lm_head.weight, head.lm_head.weight)
    ids = torch.randint(0, 128, (1, 9))
    batch = head_features(target, head, ids, torch.ones(1, 9))
    with torch.no_grad():
        a = head.logits(head.anchored(head.target_features(batch.hidden, batch.aux), ids, torch.tensor([[4]])))
        b = loaded.logits(loaded.anchored(loaded.target_features(batch.hidden, batch.aux), ids, torch.tensor([[4]])))
    assert torch.equal(a, b)
    assert json.loads((folder / "config.json").read_text())["config"]["block_size"] == 4


def test_bad_drafter_folders_are_refused_by_name(target, tiny_llama_dir, tmp_path):
    """A mask token outside the target's vocabulary, a block beyond its context, target layers it lacks: each a
    one-line error when the folder loads, before any drafting."""
    head = make_head(target)
    folder = save_drafter(head, head.config, "dflash", tiny_info(target), Recipe(), tmp_path / "d")
    meta = json.loads((folder / "config.json").read_text())
    cases = [
        ("mask_token_id", 128, r"mask_token_id=128 is not in the target's vocabulary of 128 tokens: retrain"),
        ("block_size", 300, r"block_size must be in \[2, 256\] \(the target's context\), got 300"),
        ("target_layers", [1, 2, 7], r"target_layers \[1, 2, 7\] name layers the target does not have"),
    ]
    loaded = LoadedTarget(target, None, TARGET_ID)
    for key, value, message in cases:
        bad = tmp_path / key
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        (bad / "config.json").write_text(json.dumps({**meta, "config": {**meta["config"], key: value}}))
        with pytest.raises(ValueError, match=message):
            make_proposer(SpecConfig("dflash", 3, drafter=str(bad)), loaded)


# ---------------------------------------------------------------- the loss


def test_anchors_are_answer_tokens_with_a_token_after():
    torch.manual_seed(0)
    mask = torch.zeros(3, 10)
    mask[0, [0, 2, 3, 9]] = 1  # 0: no context before it, 9: nothing after it
    mask[1, 4:] = 1
    anchors, real = sample_anchors(mask, 4)
    assert anchors.shape == real.shape == (3, 4)
    assert sorted(anchors[0][real[0]].tolist()) == [2, 3] and real[1].all() and not real[2].any()
    assert set(anchors[1].tolist()) <= set(range(4, 9)) and len(set(anchors[1].tolist())) == 4


def test_loss_reads_the_context_before_the_anchor_and_targets_after_it(target):
    """One anchor (t) alone is possible: its slot i predicts token t+i from hidden[t+i-1], sees the context of
    positions < t and the anchor token, and is weighted by loss_mask[t+i]."""
    head = make_head(target, block_size=3)
    n, t = 12, 6
    ids = torch.randint(0, target.config.vocab_size, (1, n))
    mask = torch.zeros(1, n)
    mask[0, t] = 1  # the only anchor; it also weights nothing (slots predict t+1, t+2)
    base = head_features(target, head, ids, mask)
    base.loss_mask[0, t + 2] = 1  # slot 2 counts; t+2 could be an anchor too: keep one anchor by making it the last
    base = FeatureBatch(ids[:, : t + 3], base.loss_mask[:, : t + 3], base.hidden[:, : t + 3], base.aux[:, : t + 3])
    loss, logs = dflash_loss(head, base, anchors=4)
    assert set(logs) == {"loss", "acc_1", "acc_2"} and math.isfinite(loss.item())
    for name, pos, changes in (
        ("aux", t - 1, True),  # context
        ("aux", 0, True),
        ("aux", t, False),  # the anchor's own features are not known when drafting from it
        ("aux", t + 1, False),
        ("hidden", t + 1, True),  # slot 2's soft target
        ("hidden", t, False),  # slot 1's target, weighted 0
        ("input_ids", t, True),  # the anchor token
        ("input_ids", t + 1, False),  # drafted, never seen
    ):
        assert (dflash_loss(head, perturbed(base, name, pos), anchors=4)[0] != loss) == changes, (name, pos)
    with pytest.raises(ValueError, match="anchors >= 1, decay_gamma > 0"):
        dflash_loss(head, base, anchors=0)


def test_slot_weights_decay_with_distance_from_the_anchor(target):
    """decay_gamma sets how fast later slots' weights fall: with a tiny gamma only slot 1 counts."""
    head = make_head(target, block_size=4)
    ids = torch.randint(0, 128, (2, 16))
    batch = head_features(target, head, ids, torch.ones(2, 16))
    torch.manual_seed(3)
    first_only = dflash_loss(head, batch, anchors=6, decay_gamma=1e-3)[0]
    torch.manual_seed(3)
    out = head.anchored(head.target_features(batch.hidden, batch.aux), ids, sample_anchors(batch.loss_mask, 6)[0])
    torch.manual_seed(3)
    anchor = sample_anchors(batch.loss_mask, 6)[0]
    rows = head.target_lm_head.weight[head.vocab_ids]
    soft = torch.softmax(batch.hidden.gather(1, anchor[..., None].expand(-1, -1, 64)) @ rows.T, -1)
    ce = torch.nn.functional.cross_entropy(head.logits(out[:, :, 1]).flatten(0, 1), soft.flatten(0, 1))
    torch.testing.assert_close(first_only, ce, rtol=1e-4, atol=1e-5)


def test_loss_decreases_and_target_stays_frozen(target):
    head = make_head(target, num_layers=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (4, 24), generator=g)
    mask = (torch.arange(24) >= 4).float().expand(4, 24).clone()
    batch = head_features(target, head, ids, mask)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    logs = []
    for _ in range(30):
        loss, log = dflash_loss(head, batch, anchors=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        logs.append(log)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.2, logs
    assert logs[-1]["acc_1"] > logs[0]["acc_1"] + 0.2
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert head.embed_tokens.weight.grad is None and head.lm_head.weight.grad is None


# ---------------------------------------------------------------- the proposer in the engine


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, MAX_NEW, GREEDY) for p in PROMPTS}


@pytest.fixture(scope="module")
def trained(target, plain):
    """A head trained briefly on the target's own greedy continuations, so drafts get accepted and rejected."""
    ids, mask = greedy_continuations(target, plain, MAX_SEQ)
    head = make_head(target, num_layers=2, block_size=5)
    batch = head_features(target, head, ids, mask)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    torch.manual_seed(0)
    for _ in range(80):
        loss = dflash_loss(head, batch, anchors=24)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


TREES = [(4, 1, 0), (2, 1, 0), (3, 3, 8)]


@pytest.mark.parametrize("num_tokens,topk,total", TREES)
def test_greedy_output_equals_plain(num_tokens, topk, total, target, plain, trained):
    proposer = DFlashProposer(trained, num_tokens, TreeConfig(topk, total))
    paths, forwards = [], []
    accept, draft = proposer.accept, trained.draft
    proposer.accept = lambda tokens, tree, path, out: (paths.append(path), accept(tokens, tree, path, out))
    trained.draft = lambda *a: forwards.append(1) or draft(*a)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted = passes = 0
    try:
        for p in PROMPTS:
            out = engine.generate(p, MAX_NEW, GREEDY)
            assert out.output_ids == plain[tuple(p)].output_ids, (num_tokens, topk, p)
            m = out.metrics
            assert m.drafts == m.target_forward_passes and m.draft_tokens <= m.drafts * proposer.max_tree_size
            assert sum(m.accepted_per_position) == m.accepted_tokens and len(m.accepted_per_position) <= num_tokens
            accepted += m.accepted_tokens
            passes += m.target_forward_passes
    finally:
        del trained.draft
    assert len(forwards) == passes  # one drafter forward per draft: the prefill's drafts the first step
    assert accepted > 0 and passes < sum(r.metrics.target_forward_passes for r in plain.values())
    assert any(len(path) >= 2 for path in paths)  # a later slot was accepted too
    if topk == 1:
        assert proposer.max_tree_size == num_tokens
    else:
        assert proposer.max_tree_size == total
        assert any(path != list(range(len(path))) for path in paths)  # a branch other than the first was taken


def test_drafts_never_reach_past_max_new_tokens(target, plain, trained):
    proposer = DFlashProposer(trained, 4)
    calls = spy_budgets(proposer)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    p = PROMPTS[3]
    ref = plain[tuple(p)].output_ids
    for n in range(1, 8):
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == ref[:n], n
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
    assert all(depth <= budget for _, budget, depth in calls)
    assert any(0 < depth == budget < 4 for _, budget, depth in calls)


@pytest.mark.parametrize("topk,total", [(1, 0), (2, 4)])
def test_prefix_cache_hit_equals_a_cold_prefill(topk, total, target, trained):
    a = PROMPTS[1] + PROMPTS[0][:2]  # 14 tokens: a hit covers 3 blocks of 4
    b = a[:8] + [100, 101, 102, 103, 104, 105]  # shares a's first 2 blocks
    c = PROMPTS[2]

    def cold(prompt):
        engine = Engine(target, DFlashProposer(trained, 3, TreeConfig(topk, total)), max_seq_len=MAX_SEQ)
        out = engine.generate(prompt, 12, GREEDY)
        return out, kv_prefix(engine, len(prompt)), engine.proposer.cache.read(0, len(prompt))

    pc = PrefixCache(block_size=4)
    engine = Engine(target, DFlashProposer(trained, 3, TreeConfig(topk, total)), prefix_cache=pc, max_seq_len=MAX_SEQ)
    engine.generate(a, 12, GREEDY)
    accepted = 0
    for prompt, hit in ((c, 0), (a, 12), (c, 16), (b, 8)):
        ref, ref_target_kv, ref_drafter_kv = cold(prompt)
        out = engine.generate(prompt, 12, GREEDY)
        assert out.metrics.prefix_hit_tokens == hit
        assert out.output_ids == ref.output_ids
        assert same_kv(kv_prefix(engine, len(prompt)), ref_target_kv)
        assert same_kv(engine.proposer.cache.read(0, len(prompt)), ref_drafter_kv)
        assert out.metrics.accepted_per_position == ref.metrics.accepted_per_position  # it drafts as it would cold
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and pc.hit_tokens == 12 + 16 + 8


def test_rejected_slots_leave_no_trace(target, trained):
    """After any step the drafter's context slots equal a fresh prefill's of the same tokens: the block's scratch
    keys and values (rejected drafts included) are overwritten before anything reads them."""
    engine = Engine(target, DFlashProposer(trained, 4), max_seq_len=MAX_SEQ)
    out = engine.generate(PROMPTS[0], 16, GREEDY)
    assert out.metrics.draft_tokens > out.metrics.accepted_tokens  # some drafts were rejected
    seq = PROMPTS[0] + out.output_ids
    n = min(engine.proposer.cached, len(seq))
    fresh = Engine(target, DFlashProposer(trained, 4), max_seq_len=MAX_SEQ)
    fresh.generate(seq[:n], 1, GREEDY)
    assert same_kv(engine.proposer.cache.read(0, n), fresh.proposer.cache.read(0, n))


@pytest.mark.parametrize("topk", [1, 2])
def test_sampling_is_deterministic_given_a_seed(topk, target, trained):
    engine = Engine(target, DFlashProposer(trained, 3, TreeConfig(topk, 0)), max_seq_len=MAX_SEQ)
    runs = [
        engine.generate(PROMPTS[3], 20, SamplingParams(temperature=1.0, seed=seed)).output_ids
        for seed in (3, None, 3, 4)
    ]
    assert runs[0] == runs[2] and runs[0] != runs[3]


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    return tgt, exact_joint(tgt, SMALL_PROMPT, SamplingParams(temperature=1.0))


def test_sampled_chain_keeps_the_target_distribution(small):
    """A sampled chain (each slot's own distribution, draft probs) over a draft vocabulary missing two target
    tokens: the first three tokens follow the target's joint law (test_registry samples the kind's trees)."""
    tgt, joint = small
    head = make_head(tgt, seed=3, draft_vocab_size=6, block_size=3)
    head.set_vocab(torch.tensor([9, 1, 8, 7, 0, 6, 5, 4]))
    engine = Engine(tgt, DFlashProposer(head.eval(), 2, TreeConfig(1, 0)), max_seq_len=16)
    draws, accepted = [], 0
    for i in range(1500):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=30_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0.1 * len(draws) < accepted  # drafts get accepted (and rejected): both branches ran
    x = torch.tensor(draws)
    pvalues = joint_pvalues(x, joint)
    assert min(pvalues) > ALPHA, pvalues


# ---------------------------------------------------------------- building from the spec config


def test_spec_config_builds_the_proposer(target, plain, tmp_path):
    head = make_head(target, block_size=5)
    folder = save_drafter(head, head.config, "dflash", tiny_info(target), Recipe(), tmp_path / "d")
    loaded = LoadedTarget(target, None, TARGET_ID)
    with initialize_config_module("draftsmith.conf", version_base=None):
        composed = compose("eval", overrides=["spec=dflash", f"spec.drafter={folder}"])
    assert (composed.spec.name, composed.spec.num_tokens, composed.spec.tree.topk) == ("dflash", None, None)
    proposer = make_proposer(SpecConfig("dflash", 4, drafter=str(folder), draft_dtype="float32"), loaded)
    assert isinstance(proposer, DFlashProposer) and proposer.target_layers == (0, 1, 2) and proposer.max_tree_size == 4
    assert proposer.head.embed_tokens is target.model.embed_tokens
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids == plain[tuple(PROMPTS[0])].output_ids
    assert make_proposer(SpecConfig("dflash", 9, drafter=str(folder)), loaded).depth == 4  # one block's drafts
    assert make_proposer(SpecConfig("dflash", drafter=str(folder)), loaded).depth == 3  # the kind's default
    with pytest.raises(ValueError, match="spec=dflash needs spec.drafter=DIR"):
        SpecConfig("dflash")
    with pytest.raises(ValueError, match="is a dflash drafter; spec=eagle3 needs a eagle3 drafter"):
        make_proposer(SpecConfig("eagle3", drafter=str(folder)), loaded)


# ---------------------------------------------------------------- training from the command line


@pytest.fixture(scope="module")
def chat_target(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


def test_draftsmith_train_head_dflash_train_quick(chat_target, tmp_path):
    """The quick recipe on a tiny chat target: cached features, the in-training tau drafted by DFlash's own
    proposer, a drafter folder spec=dflash loads."""
    answers = [" ".join(map(str, range(i + 3))) for i in range(24)]
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": a}]}
        for i, a in enumerate(answers)
    ]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [
        f"target.path={chat_target}",
        "head=dflash",
        "train=quick",
        f"out={out}",
        f"data.source={chats}",
        "data.max_conversations=null",
        "data.max_length=64",
        "data.heldout_fraction=0.2",
        "data.regenerate.backend=draftsmith",  # vLLM's CPU attention has no head size 16
        "train.epochs=1",
        "train.eval_every=4",
        "train.eval_max_new_tokens=8",
        f"train.features.dir={tmp_path / 'features'}",
        "wandb.enabled=false",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "draftsmith.train", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["kind"] == "dflash" and meta["recipe"]["extra"]["train"] == "quick"
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "eval/tau" in x]
    assert evals and all(e["eval/tau"] >= 1.0 for e in evals)
    assert "acceptance eval skipped" not in done.stdout + done.stderr


def test_a_head_left_out_of_steps_runs_no_forward_on_them(target, plain, trained, monkeypatch):
    """Steps the head does not draft keep the target's outputs for its next draft (or until BACKLOG pile up): one
    block forward per draft, none for the steps between; output stays plain decoding's."""
    monkeypatch.setattr(base, "BACKLOG", 6)
    forwards, draft = [], trained.draft
    trained.draft = lambda *a: forwards.append(1) or draft(*a)
    try:
        engine = Engine(target, DFlashProposer(trained, 3), max_seq_len=MAX_SEQ)
        accepted, waiting = left_out_four_steps_in_five(engine, plain, PROMPTS, MAX_NEW)
    finally:
        del trained.draft
    assert accepted > 0 and max(waiting) <= 6 + 4  # taken in once past the bound (a step adds at most 4 rows)
    assert len(forwards) <= len(PROMPTS) + len(waiting) // 5 + 1  # the prefills' and the drafts', not one per step
