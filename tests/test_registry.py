"""Every registered drafter kind through the same checks, parametrized over the registry (heads/kinds.py), so a
new kind gets them by registering: its references resolve and its spec and configs exist; one training step on a
tiny target; save and load; greedy output equal to plain decoding from the saved folder, drafting the shape the
folder records; speculative sampling keeping the target's distribution (chi-square on a vocabulary-8 target); both
with each draft verified whole and cut by the cost cut (spec.verify=cost); and export + validation in every
format it declares, the serve commands asking for the folder's shape."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import draftsmith.conf
from draftsmith.heads import kinds
from draftsmith.heads.drafter_folder import Recipe, TargetInfo, own_state, read_drafter, save_drafter
from draftsmith.heads.kinds import DraftShape
from draftsmith.serve.build import make_proposer, resolve_shape
from draftsmith.serve.engine.draft_cut import CostCut
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.policy import DraftPolicy
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.export.base import Format
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, load_tokenizer, target_id
from draftsmith.serve.spec import VERIFY, PolicyConfig, SpecConfig
from draftsmith.train.head import HeadConfig, build_head, trained_kind
from draftsmith.train.trainer import feature_batch, loss_for
from helpers import PROMPTS, SMALL, SMALL_PROMPT, exact_joint, pooled_chi2_pvalue, save_tiny_gguf, save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# the kinds draftsmith ships (a test may register its own, e.g. tests/standin_head.py, which serve cannot draft with)
BUILTIN = [k.name for k in kinds.trained() if k.module.__module__.startswith("draftsmith.")]
FORMATS = [(name, fmt) for name in BUILTIN for fmt in kinds.get(name).formats]
# not any kind's default: the folder's shape must be what the engine and the export's commands use
SHAPE = DraftShape(num_tokens=2, topk=2, total_tokens=3, choices=[[0], [1], [0, 0]])
CONF = Path(draftsmith.conf.__path__[0])
# a verify cost curve steep enough that a random head's drafts are cut often, and not always to nothing
STEEP = CostCut(lambda rows: 1.0 + 0.01 * rows)


def cut_by_cost(engine: Engine, verify: str) -> Engine:
    """The engine with spec.verify's schedule or policy, on a made-up cost curve (the measured one:
    test_cost_profile.py). The policy probes every 4th plain step and attaches its drafter to every request, so a random
    head's drafts keep being verified."""
    engine.draft_cut = STEEP if verify == "cost" else None
    policy = PolicyConfig(probe_every=4, bench_after=0)
    engine.policy = DraftPolicy(STEEP.cost, policy) if verify == "policy" else None
    return engine


def test_every_reference_resolves_and_every_kind_has_its_configs():
    for kind in kinds.KINDS.values():
        for ref in kinds.refs(kind):
            assert kinds.resolve(ref) is not None, (kind.name, ref)
        assert all(isinstance(kinds.resolve(ref), Format) for ref in kind.formats.values()), kind.name
        if kind.proposer:  # spec=NAME and methods=[NAME] compose
            assert all((CONF / group / f"{kind.name}.yaml").is_file() for group in ("spec", "methods")), kind.name
    for name in BUILTIN:
        kind = kinds.get(name)
        assert kind.loss and kind.proposer and kind.formats and (CONF / "head" / f"{name}.yaml").is_file(), name
    with pytest.raises(ValueError, match="does not resolve"):
        kinds.resolve("draftsmith.serve.proposers.propose_eagle:no_such_factory")


def test_specs_and_their_default_shapes_come_from_the_registry():
    served = [k for k in kinds.KINDS.values() if k.proposer]
    assert kinds.specs() == ("ar", *(k.name for k in served))
    for kind in served:
        spec = resolve_shape(SpecConfig(kind.name, drafter=str(CONF / "absent") if kind.drafter_help() else None))
        assert (spec.num_tokens, spec.tree.topk, spec.tree.total_tokens) == (
            kind.draft_shape.num_tokens,
            kind.draft_shape.topk,
            kind.draft_shape.total_tokens,
        )
    with pytest.raises(ValueError, match="unknown spec 'nope'; choose one of ar, "):
        SpecConfig("nope")
    with pytest.raises(ValueError, match="registered twice"):
        kinds.register(kinds.Kind(name="eagle", draft_shape=DraftShape(1, 1, 0)))


# ---------------------------------------------------------------- a tiny target and one drafter of each kind


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """A target folder with a tokenizer (exports copy it), the model, and what a drafter must agree on."""
    tdir = tmp_path_factory.mktemp("registry") / "target"
    shutil.copytree(tiny_llama_dir("llama"), tdir)
    save_tiny_tokenizer(tdir)
    tcfg = TargetConfig(path=str(tdir))
    model = load_model(tdir, torch.float32, "cpu")
    info = TargetInfo(target_id(tcfg, tdir), model.config.hidden_size, model.config.vocab_size, 3)
    gguf = save_tiny_gguf(tdir, tdir.parent / "target.gguf")  # format=gguf's target, as llama.cpp runs it
    return tcfg, LoadedTarget(model, load_tokenizer(tdir), info.id), info, str(gguf)


def one_step(kind: str, target: LoadedTarget, seed: int = 0) -> tuple[torch.nn.Module, object, float]:
    """The kind's head built as draftsmith-train builds it, after one AdamW step of its loss on the target's
    features; the loss before the step."""
    torch.manual_seed(seed)
    head, config = build_head(kind, target, HeadConfig(kind=kind))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.model.config.vocab_size, (2, 12), generator=g)
    batch = {"input_ids": ids, "loss_mask": (torch.arange(12) >= 3).float().expand(2, 12)}
    fb = feature_batch(batch, target.model, trained_kind(kind).target_layers(config), "cpu")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    loss, _ = loss_for(kind)(head, fb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return head.eval().requires_grad_(False), config, loss.item()


@pytest.fixture(scope="module")
def drafters(tiny, tmp_path_factory):
    """kind -> (head, its drafter folder recording SHAPE), made once per kind on first use."""
    made, root = {}, tmp_path_factory.mktemp("drafters")

    def get(kind: str):
        if kind not in made:
            head, config, _ = one_step(kind, tiny[1])
            made[kind] = head, save_drafter(head, config, kind, tiny[2], Recipe(data="tiny"), root / kind, draft=SHAPE)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", BUILTIN)
def test_trains_one_step_then_saves_and_loads(kind, tiny, drafters):
    target = tiny[1]
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    torch.manual_seed(0)  # as one_step builds it
    untrained, _ = build_head(kind, target, HeadConfig(kind=kind))
    head, config, loss = one_step(kind, target)
    assert torch.isfinite(torch.tensor(loss))
    mine, fresh = own_state(head), own_state(untrained)
    assert any(not torch.equal(v, fresh[k]) for k, v in mine.items())  # the step moved the head's own weights
    assert all(torch.equal(before[k], v) for k, v in target.model.state_dict().items())  # not the target's
    head, folder = drafters(kind)
    meta = json.loads((folder / "config.json").read_text())
    assert meta["kind"] == kind and meta["draft"] == asdict(kinds.get(kind).shape(SHAPE))
    loaded = read_drafter(folder, tiny[2], target.model)
    assert own_state(loaded).keys() == own_state(head).keys()
    assert all(torch.equal(v, own_state(head)[k]) for k, v in own_state(loaded).items())


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", BUILTIN)
def test_greedy_output_equals_plain_drafting_the_folders_shape(kind, verify, tiny, drafters):
    target, (_, folder), spec_name = tiny[1], drafters(kind), kinds.get(kind).name
    spec = resolve_shape(SpecConfig(spec_name, drafter=str(folder)))
    shape = kinds.get(kind).shape(SHAPE)
    assert (spec.num_tokens, spec.tree.topk, spec.tree.total_tokens, spec.choices) == tuple(asdict(shape).values())
    assert resolve_shape(SpecConfig(spec_name, 1, drafter=str(folder))).num_tokens == 1  # the spec's own wins
    proposer = make_proposer(SpecConfig(spec_name, drafter=str(folder)), target)
    rated = spy_accept_probs(proposer)
    engine = cut_by_cost(Engine(target.model, proposer, max_seq_len=96), verify)
    plain = Engine(target.model, max_seq_len=96)
    drafts, rows, steps = 0, Counter(), Counter()
    for p in PROMPTS:
        out = engine.generate(p, 16, SamplingParams())
        assert out.output_ids == plain.generate(p, 16, SamplingParams()).output_ids, (kind, p)
        m = out.metrics
        assert len(m.accepted_per_position) <= spec.num_tokens
        drafts += m.drafts
        rows.update({i + 1: c for i, c in enumerate(m.verify_rows) if c})
        steps.update(plain=m.plain_steps, probe=m.probe_steps, whole=m.whole_steps, cut=m.cut_steps)
        assert sum((m.plain_steps, m.probe_steps, m.whole_steps, m.cut_steps)) == m.target_forward_passes
    assert drafts > 0
    if verify == "cost" and any(rated):  # drafts with accept probabilities: most cut
        assert rows[1 + proposer.max_tree_size] < drafts / 2, sorted(rows.items())
    if verify == "policy":  # a random head stops paying: plain steps, with probes between them
        print("STEPS", kind, dict(steps), sorted(rows.items()))


def spy_accept_probs(proposer) -> list[bool]:
    """Records, per non-empty draft, whether it came with accept probabilities."""
    rated: list[bool] = []
    propose = proposer.propose

    def spied(*args):
        tree = propose(*args)
        if len(tree):
            rated.append(tree.accept_probs is not None)
        return tree

    proposer.propose = spied
    return rated


@pytest.mark.parametrize("kind", BUILTIN)
def test_a_draft_deeper_than_the_head_drafts_is_capped_saying_so(kind, drafters):
    """One rule for every kind: spec.num_tokens past the positions a head drafts is cut to them, with a warning."""
    folder, spec_name = drafters(kind)[1], kinds.get(kind).name
    cap = kinds.get(kind).depth_cap(json.loads((folder / "config.json").read_text())["config"])
    if cap is None:
        assert resolve_shape(SpecConfig(spec_name, 9, drafter=str(folder))).num_tokens == 9
        return
    with pytest.warns(UserWarning, match=f"spec.num_tokens={cap + 2} is past the {cap} positions"):
        assert resolve_shape(SpecConfig(spec_name, cap + 2, drafter=str(folder))).num_tokens == cap


@pytest.mark.parametrize("kind", BUILTIN)
def test_a_folder_without_a_draft_shape_or_a_corrupt_one_is_refused(kind, drafters, tmp_path):
    """Every drafter folder records its shape; a missing or corrupt one is named, not guessed around."""
    bad = Path(shutil.copytree(drafters(kind)[1], tmp_path / "bad"))
    meta = json.loads((bad / "config.json").read_text())
    del meta["draft"]
    (bad / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="config.json records no draft shape"):
        resolve_shape(SpecConfig(kinds.get(kind).name, drafter=str(bad)))
    (bad / "config.json").write_text(json.dumps(meta | {"draft": {"depth": 3}}))
    with pytest.raises(ValueError, match="config.json's draft .* takes only choices, num_tokens, topk, total_tokens"):
        resolve_shape(SpecConfig(kinds.get(kind).name, drafter=str(bad)))


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    """A vocabulary-8 target and the exact plain-sampling distribution of 3 tokens after SMALL_PROMPT."""
    model = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")
    return LoadedTarget(model, None, "small@00000000"), exact_joint(
        model, SMALL_PROMPT, SamplingParams(temperature=1.0)
    )


def sampling_engine(kind: str, small, folder: Path, verify: str, chain: bool = False) -> Engine:
    target = small[0]
    c = target.model.config
    info = TargetInfo(target.target_id, c.hidden_size, c.vocab_size, c.num_hidden_layers)
    head, config, _ = one_step(kind, target, seed=3)
    save_drafter(head, config, kind, info, Recipe(), folder, draft=SHAPE)
    spec = SpecConfig(kinds.get(kind).name, drafter=str(folder))
    if chain:
        spec.tree = TreeConfig(1, 0)
    return cut_by_cost(Engine(target.model, make_proposer(spec, target), max_seq_len=16), verify)


def check_sampling(kind: str, engine: Engine, joint: torch.Tensor) -> None:
    """400 draws of 3 tokens against the exact joint, by pairs of positions (too few draws for all 512 cells)."""
    draws, accepted = [], 0
    for i in range(400):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=30_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0 < accepted  # drafts were accepted (and, with a random head, rejected): both branches ran
    x = torch.tensor(draws)
    pvalues = (
        pooled_chi2_pvalue(x[:, 0] * 8 + x[:, 1], joint.sum(2).flatten()),
        pooled_chi2_pvalue(x[:, 1] * 8 + x[:, 2], joint.sum(0).flatten()),
    )
    assert min(pvalues) > 1e-4, (kind, pvalues)


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("kind", BUILTIN)
def test_speculative_sampling_keeps_the_target_distribution(kind, verify, small, tmp_path):
    check_sampling(kind, sampling_engine(kind, small, tmp_path / kind, verify), small[1])


# kinds whose draft a tree topk shapes: with topk 1 under sampling they draw a chain, which the schedule may cut only
# by what the levels above a level say (serve/engine/draft_cut.py)
CHAINS = [k for k in BUILTIN if "topk" in kinds.get(k).draft_keys]


@pytest.mark.parametrize("kind", CHAINS)
def test_a_sampled_chain_cut_by_the_cost_schedule_keeps_the_target_distribution(kind, small, tmp_path):
    engine = sampling_engine(kind, small, tmp_path / kind, "cost", chain=True)
    engine.draft_cut = CostCut(lambda rows: 1.0 + 0.02 * rows)  # the second level left out of many steps
    check_sampling(kind, engine, small[1])


@pytest.mark.parametrize("kind,fmt", FORMATS)
def test_exports_and_validates_in_each_declared_format(kind, fmt, tiny, drafters, tmp_path):
    tcfg = tiny[0]
    _, folder = drafters(kind)
    out = export(folder, fmt, tmp_path / "out", tcfg, "fp32", gguf_target=tiny[3])
    validate(folder, fmt, out, tcfg, tiny[3])
    card, f = (out / "README.md").read_text(), kinds.resolve(kinds.get(kind).formats[fmt])
    shape = kinds.get(kind).shape(SHAPE)
    if f.vllm:  # vLLM's dspark block is num_speculative_tokens slots: the head's whole block, as trained
        depth = drafters(kind)[0].config.block_size if kind == "dspark" else shape.num_tokens
        assert f'"num_speculative_tokens": {depth}' in card
    if f.sglang:
        steps = f"--speculative-num-steps {shape.num_tokens} --speculative-eagle-topk {shape.topk} "
        assert steps + f"--speculative-num-draft-tokens {shape.draft_tokens() + 1}" in card
    if f.tgi:
        assert f"--speculate {shape.num_tokens}" in card
    if f.llamacpp:  # llama.cpp's block is n-max + 1 slots for dflash, n-max for dspark: the head's whole block
        block = getattr(drafters(kind)[0].config, "block_size", 0)
        depth = {"dflash": block - 1, "dspark": block}.get(kind, shape.num_tokens)
        assert f"--spec-type {f.llamacpp} --spec-draft-n-max {depth}" in card


@pytest.mark.parametrize("spec", ["own", "draft_model"])
@pytest.mark.parametrize("kind,fmt", FORMATS)
def test_an_export_read_back_drafts_or_is_refused_with_a_fix_that_works(kind, fmt, spec, tiny, drafters, tmp_path):
    """spec.drafter=EXPORT with the kind's spec, and as a draft model: it drafts, or the refusal names the folder
    and what it is, and a spec it suggests instead loads it."""
    _, folder = drafters(kind)
    out = export(folder, fmt, tmp_path / "out", tiny[0], "fp32", gguf_target=tiny[3])
    try:
        make_proposer(SpecConfig(kinds.get(kind).name if spec == "own" else spec, drafter=str(out)), tiny[1])
        return
    except (ValueError, FileNotFoundError) as e:
        message = str(e)
    assert str(out) in message and "None" not in message, message
    suggested = re.search(r"use it with spec=(\w+)", message)
    if suggested:
        make_proposer(SpecConfig(suggested[1], drafter=str(out)), tiny[1])
    else:
        assert "the draftsmith drafter folder it was exported from" in message, message
