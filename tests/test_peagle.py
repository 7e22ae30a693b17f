"""P-EAGLE on tiny random Llama targets (fp32, CPU): the head (config, COD training forward vs
drafting with the KV cache, save/load under speculators' names), its loss (COD anchors, shifts, training), the
proposer in the engine (one head forward per draft, greedy output identical to plain decoding for chains and
trees, drafts within the budget, prefix-cache hits restoring the drafter's state, seeded and distribution-exact
sampling), building it from the spec config, refusing bad drafter folders, and training through the CLI."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, read_drafter, save_drafter
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.kinds import DraftShape
from draftsmith.heads.peagle import PEagleConfig, PEagleHead
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.build import make_proposer
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, target_id
from draftsmith.serve.proposers import base
from draftsmith.serve.proposers.propose_peagle import PEagleProposer
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.config import RunConfig
from draftsmith.train.loss_peagle import cod_anchors, peagle_loss
from draftsmith.train.trainer import check_loss_options, loss_for
from helpers import (
    PROMPTS,
    SMALL,
    SMALL_PROMPT,
    TARGET_ID,
    H,
    V,
    build_tiny_chat_target,
    check_metrics,
    cli_args,
    edit_weights,
    exact_joint,
    export_drafters,
    greedy_continuations,
    head_features,
    joint_pvalues,
    kv_prefix,
    layer_shapes,
    left_out_four_steps_in_five,
    perturbed,
    run_command,
    same_kv,
    save_tiny_tokenizer,
    spy_budgets,
    sum_chats,
    tiny_info,
)

GREEDY = SamplingParams()
MAX_NEW, MAX_SEQ, ALPHA = 24, 128, 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def make_head(target, seed: int = 0, **overrides) -> PEagleHead:
    torch.manual_seed(seed)
    return PEagleHead(PEagleConfig.from_target(target.config, **overrides), target)


# ---------------------------------------------------------------- the head


def test_config_defaults_and_refusals():
    smol = ModelConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, eos_token_ids=[2]
    )
    cfg = PEagleConfig.from_target(smol)
    assert (cfg.num_layers, cfg.num_depths, cfg.mask_token_id, cfg.target_layers) == (1, 4, 2, (2, 15, 27))
    assert PEagleConfig.from_target(smol, mask_token_id=None, num_layers=4).mask_token_id == 2
    assert PEagleConfig.from_target(ModelConfig(vocab_size=100, num_hidden_layers=3)).mask_token_id == 0
    for overrides, message in (
        ({"num_layers": 5}, r"num_layers must be in \[1, 4\], got 5"),
        ({"num_layers": 0}, r"num_layers must be in \[1, 4\], got 0"),
        ({"num_depths": 0}, "num_depths .* must be >= 1"),
        ({"mask_token_id": 49152}, r"mask_token_id=49152 is not in the target's vocabulary of 49152 tokens"),
        ({"mask_token_id": -1}, "is not in the target's vocabulary"),
        ({"target_layers": (2, 31)}, "exceed the target's 30 layers"),
    ):
        with pytest.raises(ValueError, match=message):
            PEagleConfig.from_target(smol, **overrides)


@pytest.mark.parametrize("layers", [1, 2])
def test_cod_training_forward_is_what_drafting_sees(layers, target):
    """Depth d at anchor a in cod_forward equals the proposer's forward with the KV cache: the real pairs 0..a in
    slots 1..a+1, then d mask slots; depth 0 is the plain causal forward over the real pairs."""
    head = make_head(target, num_layers=layers)
    c, m = head.config, 9
    g = torch.Generator().manual_seed(0)
    feature = torch.randn(2, m, c.hidden_size, generator=g)
    toks = torch.randint(0, c.vocab_size, (2, m), generator=g)
    anchors = [torch.tensor([[0, 3, 5, 8], [1, 2, 6, 7]]), torch.tensor([[3, 8], [2, 6]]), torch.tensor([[8], [6]])]
    with torch.no_grad():
        outs = head.cod_forward(feature, toks, anchors)
        assert [o.shape[1] for o in outs] == [m, 4, 2, 1]
        assert torch.allclose(outs[0], head(feature, toks, torch.arange(1, m + 1)), atol=1e-5)
        for row in (0, 1):
            for d, chosen in enumerate(anchors, 1):
                for j, a in enumerate(chosen[row].tolist()):
                    cache = KVCache.allocate(layers, c.num_key_value_heads, c.head_dim, 32, torch.float32, "cpu")
                    feats = torch.cat([feature[row : row + 1, : a + 1], head.mask_feature().expand(1, d, -1)], 1)
                    ids = torch.cat([toks[row : row + 1, : a + 1], torch.full((1, d), c.mask_token_id)], 1)
                    n = a + 1 + d
                    mask = torch.ones(n, n + 1, dtype=torch.bool).tril(1)
                    mask[:, 0] = False
                    h = head(feats, ids, torch.arange(1, n + 1), cache, 1, mask)[0, -1]
                    assert torch.allclose(h, outs[d][row, j], atol=1e-5), (row, d, a)


@pytest.mark.parametrize("layers", [1, 3])
def test_save_load_round_trip_under_speculators_names(layers, target, tmp_path):
    head = make_head(target, num_layers=layers, num_depths=3, draft_vocab_size=64)
    head.set_vocab(torch.randint(0, 1000, (target.config.vocab_size,)))
    folder = save_drafter(head, head.config, "peagle", tiny_info(target), Recipe(), tmp_path / "d")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "mask_hidden"} <= keys
    assert "layers.0.hidden_norm.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {str(i) for i in range(layers)}
    assert not any(k.startswith(("embed_tokens", "target_lm_head", "midlayer")) for k in keys)
    loaded = read_drafter(folder, tiny_info(target), target)
    assert loaded.config == head.config and isinstance(loaded, PEagleHead)
    assert loaded.embed_tokens is target.model.embed_tokens  # borrowed, not copied
    ids = torch.randint(0, target.config.vocab_size, (2, 6))
    batch = head_features(target, head, ids, torch.ones(2, 6))
    with torch.no_grad():
        a = head.logits(head(head.target_features(batch.hidden, batch.aux), ids, torch.arange(1, 7)))
        b = loaded.logits(loaded(loaded.target_features(batch.hidden, batch.aux), ids, torch.arange(1, 7)))
    assert torch.equal(a, b) and torch.equal(loaded.mask_hidden, head.mask_hidden)


def test_a_folder_whose_mask_token_is_not_in_the_targets_vocabulary_is_refused(target, tmp_path):
    head = make_head(target)
    folder = save_drafter(head, head.config, "peagle", tiny_info(target), Recipe(), tmp_path / "d")
    meta = json.loads((folder / "config.json").read_text())
    meta["config"]["mask_token_id"] = target.config.vocab_size + 5
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"mask_token_id=133 is not in the target's vocabulary of 128 tokens"):
        read_drafter(folder, tiny_info(target), target)
    with pytest.raises(ValueError, match="mask_token_id=133"):
        make_proposer(SpecConfig("peagle", drafter=str(folder)), LoadedTarget(target, None, TARGET_ID))


# ---------------------------------------------------------------- the loss


def test_cod_anchors_shrink_per_depth_nest_and_prefer_answer_tokens():
    torch.manual_seed(0)
    mask = torch.zeros(3, 40)
    mask[0, 5:35] = 1
    mask[1, 10:20] = 1  # a short answer: fewer positions to predict
    anchors = cod_anchors(mask, 39, 5, 0.7, 0.2)
    assert len(anchors) == 4
    valid = [torch.nn.functional.pad(mask, (0, 7))[:, 2 + d : 2 + d + 39] > 0 for d in range(5)]
    want = [39]
    for d in range(1, 5):  # max(0.7**d, 0.2) of the fullest row's positions depth d can predict
        want.append(min(want[-1], math.ceil(max(0.7**d, 0.2) * int(valid[d].sum(1).max()))))
    assert [a.shape[1] for a in anchors] == want[1:] == [21, 15, 11, 7]
    previous = torch.arange(39).expand(3, 39)
    for d, a in enumerate(anchors, 1):
        assert torch.all(a[:, 1:] > a[:, :-1])  # ascending, distinct
        assert all(set(a[r].tolist()) <= set(previous[r].tolist()) for r in range(3))  # chains stay whole
        for r in range(3):  # answer-token anchors first: a row takes an invalid one only when it lacks valid ones
            took = valid[d][r][a[r]]
            assert took.all() or int((valid[d][r] & torch.isin(torch.arange(39), previous[r])).sum()) < a.shape[1]
        previous = a
    assert cod_anchors(torch.zeros(2, 12), 11, 4, 0.7, 0.2) == []  # nothing to predict: depth 0 only


def test_peagle_loss_shifts(target):
    """Weight only on token t: depth 0 predicts it from pair t-2, depth 1 from a mask slot after pair t-3 (and no
    deeper depth can: its chain would need t+1); both against hidden[t-1]."""
    head = make_head(target)
    n, t = 12, 7
    ids = torch.randint(0, target.config.vocab_size, (1, n))
    mask = torch.zeros(1, n)
    mask[0, t] = 1
    base = head_features(target, head, ids, mask)
    options = dict(ratio=1.0, ratio_min=1.0)
    loss, logs = peagle_loss(head, base, **options)
    assert set(logs) == {"loss", "acc_0", "acc_1", "acc_2", "acc_3"}
    for name, pos, changes in (
        ("hidden", t, False),
        ("hidden", t - 1, True),
        ("aux", t - 1, False),
        ("aux", t - 2, True),  # depth 0's pair
        ("aux", t - 3, True),  # depth 1's last real pair
        ("input_ids", t, False),
        ("input_ids", t - 1, True),  # depth 0's token
    ):
        assert (peagle_loss(head, perturbed(base, name, pos), **options)[0] != loss) == changes, (name, pos)
    with pytest.raises(ValueError, match="head.loss.ratio must be in"):
        peagle_loss(head, base, ratio=0.0)


@pytest.mark.parametrize("layers", [1, 2])
def test_loss_decreases_at_every_depth_and_the_target_stays_frozen(layers, target):
    head = make_head(target, num_layers=layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (4, 24), generator=g)
    batch = head_features(target, head, ids, (torch.arange(24) >= 4).float().expand(4, 24).clone())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    logs = []
    for _ in range(30):
        loss, row = peagle_loss(head, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        logs.append(row)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.2, logs
    assert all(logs[-1][f"acc_{d}"] > logs[0][f"acc_{d}"] for d in range(4)), (logs[0], logs[-1])
    assert head.mask_hidden.grad is not None and head.embed_tokens.weight.grad is None
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


# ---------------------------------------------------------------- the proposer in the engine


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, MAX_NEW, GREEDY) for p in PROMPTS}


@pytest.fixture(scope="module")
def trained(target, plain):
    """1- and 2-layer heads trained briefly on the target's own greedy continuations, so drafts get accepted and
    rejected at several depths."""
    ids, mask = greedy_continuations(target, plain, MAX_SEQ)
    heads = {}
    for layers in (1, 2):
        head = make_head(target, num_layers=layers)
        batch = head_features(target, head, ids, mask)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(60):
            loss = peagle_loss(head, batch)[0]
            opt.zero_grad()
            loss.backward()
            opt.step()
        heads[layers] = head.eval().requires_grad_(False)
    return heads


def count_forwards(head) -> list[int]:
    calls, forward = [], head.forward
    head.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    return calls


CASES = [(1, 4, 1, 0), (2, 4, 1, 0), (1, 4, 3, 10), (2, 3, 2, 0)]  # layers, K, topk, total_tokens


@pytest.mark.parametrize("layers,k,topk,total", CASES)
def test_greedy_output_equals_plain_with_one_head_forward_per_draft(layers, k, topk, total, target, plain, trained):
    proposer = PEagleProposer(trained[layers], k, TreeConfig(topk, total))
    calls = count_forwards(trained[layers])
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted, deep, passes = 0, 0, 0
    try:
        for p in PROMPTS:
            out = engine.generate(p, MAX_NEW, GREEDY)
            assert out.output_ids == plain[tuple(p)].output_ids, (layers, k, topk, p)
            m = out.metrics
            check_metrics(m, out.output_ids, k)
            assert m.draft_tokens <= m.drafts * proposer.max_tree_size
            assert len(calls) == m.target_forward_passes  # the prefill's, then one per later draft
            calls.clear()
            accepted, passes = accepted + m.accepted_tokens, passes + m.target_forward_passes
            deep += sum(m.accepted_per_position[1:])
    finally:
        del trained[layers].forward
    assert accepted > 0 and deep > 0  # drafts past the first slot were accepted too
    assert passes < sum(r.metrics.target_forward_passes for r in plain.values())
    drafted = topk + (k - 1) * topk * topk
    assert proposer.max_tree_size == (min(total, drafted) if total else drafted)


def test_drafts_never_reach_past_max_new_tokens(target, plain, trained):
    proposer = PEagleProposer(trained[1], 4, TreeConfig(2, 6))
    calls = spy_budgets(proposer)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    p = PROMPTS[3]
    for n in range(1, 9):
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == plain[tuple(p)].output_ids[:n]
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
    assert all(depth <= budget for _, budget, depth in calls)
    assert any(0 < depth == budget < 4 for _, budget, depth in calls)


@pytest.mark.parametrize("layers,topk,total", [(1, 3, 8), (2, 1, 0)])
def test_prefix_cache_hit_restores_drafter_state(layers, topk, total, target, trained):
    a = PROMPTS[1] + PROMPTS[0][:2]  # 14 tokens: a hit covers 3 blocks of 4
    b = a[:8] + [100, 101, 102, 103, 104, 105]  # shares a's first 2 blocks
    c = PROMPTS[2]

    def proposer():
        return PEagleProposer(trained[layers], 4, TreeConfig(topk, total))

    def cold(prompt):
        engine = Engine(target, proposer(), max_seq_len=MAX_SEQ)
        out = engine.generate(prompt, 12, GREEDY)
        return out, kv_prefix(engine, len(prompt)), engine.proposer.cache.read(1, len(prompt))

    pc = PrefixCache(block_size=4)
    engine = Engine(target, proposer(), prefix_cache=pc, max_seq_len=MAX_SEQ)
    engine.generate(a, 12, GREEDY)
    accepted = 0
    for prompt, hit in ((c, 0), (a, 12), (c, 16), (b, 8)):
        ref, ref_target_kv, ref_drafter_kv = cold(prompt)
        out = engine.generate(prompt, 12, GREEDY)
        assert out.metrics.prefix_hit_tokens == hit
        assert out.output_ids == ref.output_ids
        assert same_kv(kv_prefix(engine, len(prompt)), ref_target_kv)
        assert same_kv(engine.proposer.cache.read(1, len(prompt)), ref_drafter_kv)
        assert out.metrics.accepted_per_position == ref.metrics.accepted_per_position  # it drafts as it would cold
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and pc.hit_tokens == 12 + 16 + 8


@pytest.mark.parametrize("topk", [1, 2])
def test_sampling_is_deterministic_given_a_seed(topk, target, trained):
    engine = Engine(target, PEagleProposer(trained[1], 4, TreeConfig(topk, 0)), max_seq_len=MAX_SEQ)
    runs = [
        engine.generate(PROMPTS[3], 20, SamplingParams(temperature=1.0, seed=seed)).output_ids
        for seed in (3, None, 3, 4)
    ]
    assert runs[0] == runs[2] and runs[0] != runs[3]


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    """Vocabulary-8 target; joint[a, b, c]: the exact plain-sampling distribution of 3 tokens after SMALL_PROMPT."""
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    return tgt, exact_joint(tgt, SMALL_PROMPT, SamplingParams(temperature=1.0))


def test_sampled_chain_with_a_draft_vocabulary_matches_plain_distribution(small):
    """A sampled chain (draft probs, widened over a draft vocabulary missing two target tokens); the tree case is
    test_registry's."""
    tgt, joint = small
    head = make_head(tgt, seed=3, draft_vocab_size=6, num_depths=3)
    head.set_vocab(torch.tensor([9, 1, 8, 7, 0, 6, 5, 4]))  # 2 target tokens the drafter cannot propose
    engine = Engine(tgt, PEagleProposer(head.eval(), 3, TreeConfig(1, 0)), max_seq_len=16)
    draws, accepted = [], 0
    for i in range(1500):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=20_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0.1 * len(draws) < accepted  # drafts get accepted (and rejected): both branches ran
    x = torch.tensor(draws)
    pvalues = joint_pvalues(x, joint)
    assert min(pvalues) > ALPHA, pvalues


# ---------------------------------------------------------------- building from the spec config


def test_spec_config_builds_the_proposer_and_refuses_bad_folders(target, plain, trained, tiny_llama_dir, tmp_path):
    loaded = LoadedTarget(target, None, TARGET_ID)
    head = trained[2]
    folder = save_drafter(head, head.config, "peagle", tiny_info(target), Recipe(), tmp_path / "p")
    proposer = make_proposer(SpecConfig("peagle", 3, drafter=str(folder), draft_dtype="float32"), loaded)
    assert isinstance(proposer, PEagleProposer) and proposer.depth == 3 and proposer.target_layers == (0, 1, 2)
    assert proposer.head.embed_tokens is target.model.embed_tokens and proposer.max_tree_size == 3
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids == plain[tuple(PROMPTS[0])].output_ids
    small = load_model(tiny_llama_dir("llama", num_hidden_layers=1), torch.float32, "cpu")  # same id below
    with pytest.raises(ValueError, match=r"reads the inputs of target layers \[0, 1, 2\], but the target has 1 layers"):
        make_proposer(SpecConfig("peagle", drafter=str(folder)), LoadedTarget(small, None, TARGET_ID))
    eagle3 = tmp_path / "e3"
    e3 = Eagle3Head(Eagle3Config.from_target(target.config), target)
    save_drafter(e3, e3.config, "eagle3", tiny_info(target), Recipe(), eagle3)
    with pytest.raises(ValueError, match="is a eagle3 drafter; spec=peagle needs a peagle drafter"):
        make_proposer(SpecConfig("peagle", drafter=str(eagle3)), loaded)
    with pytest.raises(ValueError, match="spec=peagle needs spec.drafter=DIR: a peagle drafter folder"):
        SpecConfig("peagle")


# ---------------------------------------------------------------- training through the command line


@pytest.fixture(scope="module")
def chat_target(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat-target"), smollm2_dir)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """test_trainer's chats."""
    return sum_chats(tmp_path_factory.mktemp("data"))


def test_train_quick_through_the_cli_with_its_in_training_eval(chat_target, data, tmp_path):
    out = tmp_path / "run"
    args = [a for a in cli_args(chat_target, data) if not a.startswith(("head.kind", "~head", "imports"))]
    r = run_command(
        [
            sys.executable,
            "-m",
            "draftsmith.train",
            *args,
            "head=peagle",
            "train=quick",
            "head.num_layers=2",
            "head.draft_vocab_size=256",
            "train.max_steps=2",
            "train.eval_every=2",
            "train.eval_prompts=2",
            "train.eval_max_new_tokens=8",
            "train.features.mode=online",
            f"out={out}",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["kind"] == "peagle" and meta["config"]["num_layers"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("acc_3" in row for row in rows)
    evals = [row for row in rows if "eval/tau" in row]
    assert len(evals) == 1 and evals[0]["eval/tau"] >= 1.0


# ---------------------------------------------------------------- export: speculators `peagle`, as vLLM loads it


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """test_export's tiny target folder (with a tokenizer) and drafters."""
    return export_drafters(tiny_llama_dir("llama"), tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module")
def exportable(tiny):
    """A 2-layer peagle drafter (draft vocabulary of 48) for test_export's tiny target folder."""
    tcfg, _, tgt = tiny
    torch.manual_seed(1)
    head = PEagleHead(PEagleConfig.from_target(tgt.config, num_layers=2, draft_vocab_size=48, num_depths=3), tgt)
    head.set_vocab(torch.rand(tgt.config.vocab_size))
    with torch.no_grad():  # trained-looking weights
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    folder = save_drafter(head, head.config, "peagle", info, Recipe(data="tiny"), Path(tcfg.path).parent / "peagle")
    return tcfg, folder


def test_export_is_speculators_peagle_with_vllms_names(exportable, tmp_path):
    tcfg, drafter = exportable
    out = export(drafter, "vllm", tmp_path / "out", tcfg, "fp32")
    tensors = load_file(str(out / "model.safetensors"))
    want = {"fc.weight": (H, 3 * H), "mask_hidden": (1, 1, 3 * H), "norm.weight": (H,), "lm_head.weight": (48, H)}
    want |= {"d2t": (48,), "t2d": (V,), "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,)}
    want |= layer_shapes("layers.0", 2 * H) | layer_shapes("layers.1", H) | {"layers.1.input_layernorm.weight": (H,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 2  # the tiny target's EOS
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(Path(tcfg.path).resolve())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2 and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["draft_vocab_size"] == 48
    card = (out / "README.md").read_text()
    assert '"parallel_drafting": true' in card and '"num_speculative_tokens": 3' in card
    for fmt in ("sglang", "tgi", "hf"):
        with pytest.raises(ExportError, match=f"format={fmt} cannot hold peagle drafters; use format=vllm"):
            export(drafter, fmt, tmp_path / fmt, tcfg)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("mask_hidden"), "missing key mask_hidden"),
        (lambda t: t.__setitem__("mask_hidden", t["mask_hidden"] * 1.01), "logits off by"),
        (lambda t: t["layers.1.mlp.down_proj.weight"].mul_(-1), "logits off by"),
        (lambda t: t.__setitem__("layers.2.input_layernorm.weight", torch.ones(H)), "unexpected key layers.2"),
        (lambda t: t["d2t"].add_(1), "target ids off"),
    ],
    ids=["no-mask_hidden", "mask_hidden", "layer-1", "extra-layer", "d2t"],
)
def test_export_validator_catches_bad_tensors(change, message, exportable, tmp_path):
    tcfg, drafter = exportable
    out = export(drafter, "vllm", tmp_path / "out", tcfg, "bf16")
    validate(drafter, "vllm", out, tcfg)  # the untouched export is valid
    edit_weights(out, "vllm", change)
    with pytest.raises(ExportError, match="fails validation") as e:
        validate(drafter, "vllm", out, tcfg)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.__setitem__("mask_token_id", 999), "mask_token_id=999 is not a token id below 128"),
        (lambda c: c.pop("mask_token_id"), "mask_token_id='<missing>'"),
        (lambda c: c["transformer_layer_config"].__setitem__("num_hidden_layers", 1), "num_hidden_layers=1"),
        (lambda c: c.__setitem__("norm_before_residual", True), "norm_before_residual=True"),
        (lambda c: c.__setitem__("speculators_model_type", "eagle3"), "speculators_model_type='eagle3'"),
        (lambda c: c["transformer_layer_config"].__setitem__("rope_theta", 500.0), "rope settings differ"),
    ],
    ids=["mask-id", "no-mask-id", "layers", "norm", "type", "rope"],
)
def test_export_validator_catches_bad_config(edit, message, exportable, tmp_path):
    tcfg, drafter = exportable
    out = export(drafter, "vllm", tmp_path / "out", tcfg, "fp32")
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="fails validation") as e:
        validate(drafter, "vllm", out, tcfg)
    assert message in str(e.value)


def test_export_for_a_qwen2_target_carries_zero_o_proj_biases(tiny_llama_dir, tmp_path):
    tdir = tmp_path / "target"
    shutil.copytree(tiny_llama_dir("qwen2"), tdir)
    save_tiny_tokenizer(tdir)
    tcfg, tgt = TargetConfig(path=str(tdir)), load_model(tdir)
    head = PEagleHead(PEagleConfig.from_target(tgt.config, num_layers=2, draft_vocab_size=48), tgt)
    info = TargetInfo(target_id(tcfg, tdir), H, V, 3)
    drafter = save_drafter(head, head.config, "peagle", info, Recipe(), tmp_path / "peagle")
    t = load_file(str(export(drafter, "vllm", tmp_path / "out", tcfg, "fp32") / "model.safetensors"))
    o_bias = {k: v for k, v in t.items() if k.endswith("o_proj.bias")}
    assert set(o_bias) == {"layers.0.self_attn.o_proj.bias", "layers.1.self_attn.o_proj.bias"}
    assert not any(v.any() for v in o_bias.values()) and "layers.1.self_attn.q_proj.bias" in t


def test_quick_and_full_presets_for_peagle():
    """train=quick: the eagle3-quick budget (4 epochs of COD steps), the head made for a chain of num_depths (what its
    in-training eval drafts); the loss options of conf/head/peagle.yaml are the loss's own."""
    with initialize_config_module("draftsmith.conf", version_base=None):
        quick = typed(compose("train", overrides=["out=x", "head=peagle"]), RunConfig)
        full = typed(compose("train", overrides=["out=x", "head=peagle", "train=full", "head.num_layers=2"]), RunConfig)
    chain = DraftShape(num_tokens=4, topk=1, total_tokens=0)
    assert quick.train.epochs == 4 and quick.head.draft == chain == full.head.draft and full.train.epochs == 4
    assert quick.head.args["num_depths"] == 4
    assert full.head.kwargs()["num_layers"] == 2 and quick.head.loss_options() == {}  # the loss function's defaults
    check_loss_options(loss_for("peagle"), quick.head.loss_options(), "peagle")
    with pytest.raises(ValueError, match="head.loss.ttt_steps is not an option of the peagle loss"):
        check_loss_options(loss_for("peagle"), {"ttt_steps": 2}, "peagle")


def test_a_head_left_out_of_steps_runs_no_forward_on_them(target, plain, trained, monkeypatch):
    """Steps the head does not draft keep the target's outputs for its next draft (or until BACKLOG pile up): one
    head forward per draft, none for the steps between; output stays plain decoding's and drafts still get accepted."""
    monkeypatch.setattr(base, "BACKLOG", 6)
    calls = count_forwards(trained[1])
    try:
        engine = Engine(target, PEagleProposer(trained[1], 4), max_seq_len=MAX_SEQ)
        accepted, waiting = left_out_four_steps_in_five(engine, plain, PROMPTS, MAX_NEW)
    finally:
        del trained[1].forward
    steps = len(waiting)
    assert accepted > 0 and max(waiting) <= 6 + 4  # taken in once past the bound (a step adds at most 4 rows)
    assert len(calls) <= len(PROMPTS) + steps // 5 + 1  # the prefills' and the drafts', not one per step


def test_a_prefill_drafts_afresh_whatever_the_last_request_drafted_after(target, trained):
    """A new request as long as the last one's last draft point: its prefill still runs the head, no stale logits."""
    prompt = PROMPTS[1]
    seen = []

    def after_prefill(engine) -> None:
        prefill = engine.proposer.prefill
        engine.proposer.prefill = lambda *a: (prefill(*a), seen.append(engine.proposer.logits.clone()))

    fresh, used = (Engine(target, PEagleProposer(trained[1], 4), max_seq_len=MAX_SEQ) for _ in range(2))
    for engine in (fresh, used):
        after_prefill(engine)
    fresh.generate(prompt, 1, GREEDY)
    used.generate(PROMPTS[0], 8, GREEDY)
    used.proposer.drafted_for = len(prompt) + 1  # as if the last request's last draft came after that many tokens
    used.generate(prompt, 1, GREEDY)
    assert torch.equal(seen[0], seen[-1])
