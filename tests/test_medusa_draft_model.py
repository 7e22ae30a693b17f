"""Medusa heads and the distilled draft model on a tiny random Llama target (fp32, CPU): shapes, init,
save/load, the losses' offsets and descent, and lossless output through the engine (also from folders
loaded by serve.build, with a prefix-cache hit, and seeded sampling)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import can_pack
from draftsmith.heads.draft_model import DraftModel, DraftModelConfig, init_layers
from draftsmith.heads.drafter_folder import Recipe, TargetInfo, frequent_ids, read_drafter, save_drafter
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.build import make_proposer, resolve_shape
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.loader import fp32_arithmetic, load_model
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers.hybrid import HybridProposer
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_medusa import DEFAULT_CHOICES, MedusaProposer, tree_from_choices
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.batch import FeatureBatch
from draftsmith.train.loss_draft_model import draft_model_loss
from draftsmith.train.loss_medusa import medusa_loss
from draftsmith.train.trainer import loss_for

GREEDY = SamplingParams()
INFO = TargetInfo("tiny@0123abcd", 64, 128, 3)
PROMPT_LEN, NEW = 6, 26


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def data(target):
    """Regenerated tiny data: random prompts and the target's greedy answers (the masked part)."""
    g = torch.Generator().manual_seed(0)
    engine = Engine(target, max_seq_len=64)
    prompts = [torch.randint(0, 128, (PROMPT_LEN,), generator=g).tolist() for _ in range(8)]
    ids = torch.tensor([p + engine.generate(p, NEW, GREEDY).output_ids for p in prompts])
    mask = torch.zeros(ids.shape)
    mask[:, PROMPT_LEN:] = 1.0
    with torch.no_grad():
        hidden, _ = target.hidden_states(ids)
    return prompts, FeatureBatch(ids, mask, hidden)


def train(head, loss_fn, batch: FeatureBatch, steps: int = 30) -> list[float]:
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = loss_fn(head, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    """Both heads trained 30 steps and saved as drafter folders for INFO; the loss curves."""
    folder = tmp_path_factory.mktemp("drafters")
    out = {}
    for kind, head in (
        ("medusa", MedusaHeads(MedusaConfig(64, 128, num_heads=4, num_layers=1), target)),
        ("draft_model", DraftModel(DraftModelConfig(num_layers=2), target)),
    ):
        curve = train(head, loss_for(kind), data[1])
        cfg = head.config if kind == "medusa" else head.draft_config
        save_drafter(head, cfg, kind, INFO, Recipe(data="tiny", steps=30), folder / kind)
        out[kind] = (head.eval().requires_grad_(False), folder / kind, curve)
    return out


def plain_outputs(target, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(target, max_seq_len=64)
    return [engine.generate(p, n, GREEDY).output_ids for p in prompts]


# ---------------------------------------------------------------- heads


def test_medusa_shapes_names_and_identity_init(target):
    heads = MedusaHeads(MedusaConfig(64, 128, num_heads=3, num_layers=2), target)
    hidden = torch.randn(2, 5, 64)
    assert heads(hidden).shape == (3, 2, 5, 128) and heads(hidden, 2).shape == (2, 2, 5, 128)
    names = set(heads.state_dict())
    assert {"blocks.2.layers.1.weight", "blocks.2.layers.1.bias", "lm_heads.2.weight"} <= names  # vLLM's layout
    with torch.no_grad():
        for k in range(3):  # zero-initialised blocks: every fresh head is the target's lm_head
            assert torch.equal(heads.head_logits(k, hidden), target.lm_head(hidden))
    assert heads.lm_heads[0].weight.data_ptr() != target.lm_head.weight.data_ptr()  # owned, saved, trained


def test_draft_model_init_from_target(target):
    assert init_layers(1, 3) == [0] and init_layers(2, 3) == [0, 2] and init_layers(3, 30) == [0, 14, 29]
    draft = DraftModel(DraftModelConfig(num_layers=2), target)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == 128
    for mine, i in zip(draft.model.layers, [0, 2], strict=True):
        for (name, a), b in zip(mine.state_dict().items(), target.model.layers[i].state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(draft.state_dict()[name], target.state_dict()[name])
    assert draft.target_lm_head is target.lm_head  # for the loss; neither a parameter nor saved:
    assert all(p.data_ptr() != target.lm_head.weight.data_ptr() for p in draft.parameters())
    assert not any(k.startswith("target") for k in draft.state_dict())
    full = DraftModel(DraftModelConfig(num_layers=0), target)  # all sizes the target's, every layer copied
    x = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        # the same numbers up to fp32 rounding: the target's linears are packed, the copy's are not
        torch.testing.assert_close(full.hidden_states(x)[0], target.hidden_states(x)[0])

    narrow = DraftModel(DraftModelConfig(num_layers=1, intermediate_size=32), target)  # layers cannot be copied
    assert torch.equal(narrow.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert narrow.model.layers[0].mlp.up_proj.weight.shape == (32, 64)
    small = DraftModel(DraftModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2), target)
    assert small.model.embed_tokens.weight.shape == (128, 32) and small.config.head_dim == 16
    scratch = DraftModel(DraftModelConfig(num_layers=2, init="scratch"), target)
    assert not torch.equal(scratch.model.embed_tokens.weight, target.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="init must be one of target, scratch"):
        DraftModelConfig(init="copy")


# ---------------------------------------------------------------- save / load


def heads_and_outputs(target, tied_target):
    x = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        hidden, _ = target.hidden_states(x)
    medusa = MedusaHeads(MedusaConfig(64, 128, 2, 1), target)
    with torch.no_grad():
        for p in medusa.blocks.parameters():  # not the identity: the blocks' weights must round-trip too
            p.normal_(0, 0.1)
    out = [("medusa", medusa, medusa.config, lambda m: m(hidden))]
    for t in (target, tied_target):
        draft = DraftModel(DraftModelConfig(num_layers=2), t)
        out.append(("draft_model", draft, draft.draft_config, lambda m: m.lm_head(m.hidden_states(x)[0])))
    return out


def test_save_load_round_trip_and_wrong_target_refused(target, tiny_llama_dir, tmp_path):
    tied = load_model(tiny_llama_dir("llama", tie_word_embeddings=True), torch.float32, "cpu")
    for i, (kind, head, cfg, run) in enumerate(heads_and_outputs(target, tied)):
        folder = save_drafter(head, cfg, kind, INFO, Recipe(), tmp_path / f"d{i}")
        loaded = read_drafter(folder, INFO)  # no target needed: the folder holds everything
        assert type(loaded) is type(head)
        with torch.no_grad():
            assert torch.equal(run(loaded), run(head)), kind
        other = TargetInfo("other@fedcba98", 64, 128, 3)
        with pytest.raises(ValueError, match=r"tiny@0123abcd.*other@fedcba98"):
            read_drafter(folder, other)
        with pytest.raises(ValueError, match=r"hidden_size=64.*other@fedcba98 has hidden_size=32"):
            read_drafter(folder, TargetInfo("other@fedcba98", 32, 128, 3))
    assert tied.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight


# ---------------------------------------------------------------- losses


def test_medusa_loss_offsets(target, data):
    """Head k at position t is scored on token t+k+2, where the mask marks that token."""
    heads = MedusaHeads(MedusaConfig(64, 128, 3, 1), target)
    b = data[1]
    j = 12
    mask = torch.zeros_like(b.loss_mask)
    mask[0, j] = 1.0
    loss, logs = medusa_loss(heads, FeatureBatch(b.input_ids, mask, b.hidden), decay=0.5)
    expected = 0.0
    for k in range(3):
        ce = F.cross_entropy(heads.head_logits(k, b.hidden[0, j - k - 2]), b.input_ids[0, j])
        assert logs[f"ce_{k}"] == pytest.approx(ce.item(), rel=1e-5)
        expected += 0.5**k * ce.item()
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_draft_model_loss_offsets(target, data):
    """Forward KL(target || draft) of the next-token distributions at positions whose next token is masked."""
    draft = DraftModel(DraftModelConfig(num_layers=1), target)
    b = data[1]
    j, temp = 12, 2.0
    mask = torch.zeros_like(b.loss_mask)
    mask[1, j] = 1.0
    loss, logs = draft_model_loss(draft, FeatureBatch(b.input_ids, mask, b.hidden), temperature=temp)
    with torch.no_grad():
        q = F.log_softmax(draft.lm_head(draft.hidden_states(b.input_ids[1:2])[0][0, j - 1]) / temp, -1)
        p = F.log_softmax(target.lm_head(b.hidden[1, j - 1]) / temp, -1)
    kl = (p.exp() * (p - q)).sum().item()
    assert loss.item() == pytest.approx(temp**2 * kl, rel=1e-4) and logs["kl"] == pytest.approx(kl, rel=1e-4)
    loaded = DraftModel(draft.draft_config)  # rebuilt without the target: no target lm_head to distil from
    with pytest.raises(ValueError, match="built with the target"):
        draft_model_loss(loaded, b)


def test_losses_decrease(trained):
    for kind, (_, _, curve) in trained.items():
        assert curve[-1] < 0.5 * curve[0], (kind, curve[0], curve[-1])


# ---------------------------------------------------------------- tree


def test_tree_from_choices():
    assert tree_from_choices([[1], [0, 0], [0], [0, 1], [0, 0, 0]], 2) == [(0,), (1,), (0, 0), (0, 1)]
    paths = tree_from_choices(DEFAULT_CHOICES, 4)
    assert len(paths) == 25 and max(map(len, paths)) == 4
    with pytest.raises(ValueError, match=r"path \[1, 0\] has no parent \[1\]"):
        tree_from_choices([[0], [1, 0]], 4)


def test_medusa_proposer_tree_uses_head_d_minus_1_at_depth_d(target, data):
    heads = MedusaHeads(MedusaConfig(64, 128, 3, 1))
    proposer = MedusaProposer(heads, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 2], [0, 0, 0, 0]], max_depth=4)
    assert proposer.max_tree_size == 6  # three heads: the depth-4 path is dropped
    hidden = data[1].hidden[0, :5]
    proposer.prefill(data[1].input_ids[0, :6], 0, ForwardOut(torch.zeros(1, 128), hidden, []))
    with torch.no_grad():
        tree = proposer.propose(data[1].input_ids[0, :6], GREEDY, 4)
        top = [heads.head_logits(k, hidden[-1]).topk(3).indices.tolist() for k in range(3)]
    assert tree.tokens.tolist() == [top[0][0], top[0][1], top[1][0], top[1][1], top[1][0], top[2][2]]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2] and tree.draft_probs is None


# ---------------------------------------------------------------- through the engine


def loaded_target(target) -> LoadedTarget:
    return LoadedTarget(target, None, INFO.id)  # the draftsmith-folder paths never read the tokenizer


@pytest.mark.parametrize("spec", ["medusa", "draft_model"])
def test_engine_greedy_is_lossless_from_saved_folders(spec, target, data, trained):
    kind = "medusa" if spec == "medusa" else "draft_model"
    proposer = make_proposer(SpecConfig(spec, 3, drafter=str(trained[kind][1])), loaded_target(target))
    assert isinstance(proposer, MedusaProposer if spec == "medusa" else DraftModelProposer)
    prompts = data[0][:3] + [list(range(40, 49))]  # three seen in training, one not
    refs = plain_outputs(target, prompts, 24)
    engine = Engine(target, proposer, prefix_cache=PrefixCache(block_size=4), max_seq_len=64)
    accepted = 0
    for p, ref in zip(prompts, refs, strict=True):
        for hit in (0, (len(p) - 1) // 4 * 4):  # the second run restores the prompt's full blocks
            out = engine.generate(p, 24, GREEDY)
            assert out.output_ids == ref, (spec, p)
            assert out.metrics.prefix_hit_tokens == hit
            accepted += out.metrics.accepted_tokens
    assert accepted >= 2 * 3 * 10  # trained on the first three prompts' answers: most drafts are accepted


def test_auto_draft_dtype_gives_an_fp32_targets_draft_model_bf16_weights(target, trained):
    """spec.draft_dtype=auto: a trained draft model of an fp32 target drafts in bf16 (its own weights rounded; on the
    kernels computed in fp32, as a bf16 target is); float32 by name keeps the weights it was saved with."""
    folder, head = str(trained["draft_model"][1]), trained["draft_model"][0]
    lt = loaded_target(target)
    auto, fp32 = (
        dict(make_proposer(SpecConfig("draft_model", 3, drafter=folder, draft_dtype=d), lt).model.named_parameters())
        for d in ("auto", "float32")
    )
    saved = dict(head.named_parameters())
    name = next(n for n in saved if "layers.0" in n and n.endswith("weight") and saved[n].dim() == 2)
    assert torch.equal(fp32[name], saved[name])
    on_kernels = fp32_arithmetic(torch.bfloat16, "cpu")  # bf16 values computed in fp32
    on_onednn = can_pack(torch.empty(0, dtype=torch.bfloat16)) and not native.runs(target.lm_head.weight)
    if on_kernels or on_onednn:
        assert auto[name].dtype == (torch.float32 if on_kernels else torch.bfloat16)
        assert torch.equal(auto[name].float(), saved[name].bfloat16().float())
    else:  # bf16 would run on neither: auto keeps fp32
        assert torch.equal(auto[name], saved[name])


@pytest.mark.parametrize("policy", ["prefer", "merge"])
def test_medusa_with_ngram_lookup_is_lossless(policy, target, data, trained):
    spec = SpecConfig("medusa", 3, drafter=str(trained["medusa"][1]), ngram_tokens=4, ngram_policy=policy)
    proposer = make_proposer(spec, loaded_target(target))
    assert isinstance(proposer, HybridProposer) and proposer.name == "medusa_ngram"
    prompts = [p + p for p in data[0][:2]] + [list(range(40, 49)) * 2]  # repeated: the lookup finds matches
    engine = Engine(target, proposer, prefix_cache=PrefixCache(block_size=4), max_seq_len=96)
    for p, ref in zip(prompts, plain_outputs(target, prompts, 24), strict=True):
        assert engine.generate(p, 24, GREEDY).output_ids == ref, (policy, p)
    assert proposer.merged > 0


@pytest.mark.parametrize("spec", ["medusa", "draft_model"])
def test_draft_vocab_is_lossless_and_drafts_only_those_tokens(spec, target, data, trained, tmp_path, tiny_llama_dir):
    kind = "medusa" if spec == "medusa" else "draft_model"
    module, batch = trained[kind][0], data[1]
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=INFO.vocab_size)
    cfg = module.config if kind == "medusa" else module.draft_config
    folder = save_drafter(module, cfg, kind, INFO, Recipe(), tmp_path / kind, token_counts=counts)
    choices = [[0], [1], [0, 0]] if spec == "medusa" else None
    proposer = make_proposer(
        SpecConfig(spec, 3, drafter=str(folder), choices=choices, draft_vocab=16), loaded_target(target)
    )
    drafter = proposer.heads if spec == "medusa" else proposer.model
    ids = frequent_ids(counts, 16)
    assert torch.equal(drafter.vocab_ids, ids)
    drafted, propose = [], proposer.propose
    proposer.propose = lambda tokens, sp, budget: drafted.append(propose(tokens, sp, budget)) or drafted[-1]
    engine = Engine(target, proposer, max_seq_len=64)
    prompts = data[0][:3] + [list(range(40, 49))]
    accepted = 0
    for p, ref in zip(prompts, plain_outputs(target, prompts, 24), strict=True):
        out = engine.generate(p, 24, GREEDY)
        assert out.output_ids == ref, p
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and torch.isin(torch.cat([t.tokens for t in drafted]), ids).all()
    with pytest.raises(FileNotFoundError, match="holds no token counts"):
        make_proposer(SpecConfig(spec, 3, drafter=str(trained[kind][1]), draft_vocab=16), loaded_target(target))
    if spec == "draft_model":  # a plain HF draft LM has no training answers to count
        with pytest.raises(ValueError, match="is a plain HF model: set spec.draft_vocab=0"):
            make_proposer(
                SpecConfig(spec, 3, drafter=str(tiny_llama_dir("llama")), draft_vocab=16), loaded_target(target)
            )


def test_medusa_choices_and_depth_from_spec(target, trained):
    lt, folder = loaded_target(target), str(trained["medusa"][1])
    deep = SpecConfig("medusa", 2, drafter=folder, choices=[[0], [0, 0], [0, 0, 0]])
    with pytest.warns(UserWarning, match=r"spec.choices goes 3 levels deep, past the 2 this medusa drafter drafts"):
        chain = make_proposer(deep, lt)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resolve_shape(resolve_shape(deep))  # build_engine resolves, then make_proposer again
    assert len([w for w in said if "spec.choices" in str(w.message)]) == 1  # once, not per resolution
    assert chain.max_tree_size == 2
    assert make_proposer(SpecConfig("medusa", 4, drafter=folder), lt).max_tree_size == len(DEFAULT_CHOICES)


def test_medusa_drafts_never_reach_past_max_new_tokens(target, data, trained):
    """Near the end of a request the static tree is cut to the depth still allowed: its first nodes, the paths
    that short (they come first); output stays plain decoding's."""
    proposer = MedusaProposer(trained["medusa"][0])
    trees, propose = [], proposer.propose
    proposer.propose = lambda tokens, sp, budget: trees.append((budget, t := propose(tokens, sp, budget))) or t
    engine = Engine(target, proposer, max_seq_len=64)
    p = data[0][0]
    ref = plain_outputs(target, [p], 8)[0]
    for n in range(1, 9):
        assert engine.generate(p, n, GREEDY).output_ids == ref[:n], n
    paths = tree_from_choices(DEFAULT_CHOICES, 4)
    for budget, tree in trees:
        assert len(tree) == sum(len(q) <= budget for q in paths) and int(tree.depths.max()) <= budget
    assert {min(b, 4) for b, _ in trees} == {1, 2, 3, 4}


def test_medusa_tree_ranks_past_the_heads_vocabulary_are_refused_at_build(target, data, trained, tmp_path):
    """A tree rank at or past the drafted vocabulary is refused when the proposer is built: left in, the first
    step's topk would be out of range."""
    lt, heads = loaded_target(target), trained["medusa"][0]
    with pytest.raises(ValueError, match=r"ranks up to 200, but the heads draft over 128 tokens; set spec.draft_vocab"):
        MedusaProposer(heads, [[0], [200]])
    batch = data[1]
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=INFO.vocab_size)
    folder = save_drafter(heads, heads.config, "medusa", INFO, Recipe(), tmp_path / "medusa", token_counts=counts)
    top = max(c[-1] for c in DEFAULT_CHOICES if len(c) <= 3)  # 8: the default tree needs 9 tokens per head
    with pytest.raises(ValueError, match=rf"ranks up to {top}, .* over 8 tokens; set spec.draft_vocab >= {top + 1}"):
        make_proposer(SpecConfig("medusa", 3, drafter=str(folder), draft_vocab=8), lt)
    ok = make_proposer(SpecConfig("medusa", 3, drafter=str(folder), draft_vocab=8, choices=[[0], [7], [0, 1]]), lt)
    assert len(Engine(target, ok, max_seq_len=64).generate(data[0][0], 6, GREEDY).output_ids) == 6


def test_wrong_kind_or_target_is_refused_by_the_engine_builder(target, trained):
    lt = loaded_target(target)
    with pytest.raises(ValueError, match="is a medusa drafter; spec=draft_model needs a draft_model drafter"):
        make_proposer(SpecConfig("draft_model", drafter=str(trained["medusa"][1])), lt)
    with pytest.raises(ValueError, match="spec=medusa needs spec.drafter"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match=r"tiny@0123abcd, not other@00000000"):
        make_proposer(
            SpecConfig("medusa", drafter=str(trained["medusa"][1])), LoadedTarget(target, None, "other@00000000")
        )


def test_sampling_is_deterministic_given_a_seed(target, data, trained):
    p = data[0][0]
    for proposer in (
        MedusaProposer(trained["medusa"][0]),
        DraftModelProposer(trained["draft_model"][0], DraftChainConfig(3)),
    ):
        engine = Engine(target, proposer, max_seq_len=64)
        runs = [engine.generate(p, 20, SamplingParams(temperature=1.0, seed=s)).output_ids for s in (3, None, 3, 4)]
        assert runs[0] == runs[2] and runs[0] != runs[3], proposer.name
