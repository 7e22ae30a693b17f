"""vLLM's speculators format out (serve/export/speculators.py) and EAGLE-3 heads made elsewhere in
(serve/export/external_heads.py), on a tiny random Llama target: the export's keys against the speculators source,
validation, round trips that draft exactly what the original head drafts, and every bad folder refused before anything
loads. The real-vLLM check is peers/vllm_crosscheck.py (its own environment, not run here)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, own_state, save_drafter
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.kinds import DraftShape
from draftsmith.serve.build import build_engine, resolve_shape
from draftsmith.serve.drafters import folder_drafter
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.export import external_heads, speculators
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.target import TargetConfig, load_target
from draftsmith.serve.spec import SpecConfig
from helpers import PROMPTS, edit_json, leftovers, save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, DRAFT_V = 64, 128, 48
# written from the speculators 0.9.0 source's field list: config.py (SpeculatorModelConfig, SpeculatorsConfig,
# VerifierConfig), models/eagle3/config.py (Eagle3SpeculatorConfig), proposals/greedy.py (GreedyTokenProposalConfig)
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "speculators_eagle3_config.json").read_text())


def copy_target(tiny_llama_dir, folder: Path, model_type: str = "llama", **overrides) -> TargetConfig:
    shutil.copytree(tiny_llama_dir(model_type, **overrides), folder)
    save_tiny_tokenizer(folder)
    return TargetConfig(path=str(folder), dtype="float32", device="cpu")


def save_head(
    target, tcfg: TargetConfig, folder: Path, draft_vocab: int = DRAFT_V, draft: DraftShape | None = None, **norms
) -> Path:
    """An EAGLE-3 head of trained-looking weights, saved as draftsmith-train does (norms: EAGLE-3.1's switches)."""
    torch.manual_seed(1)
    config = Eagle3Config.from_target(target.model.config, draft_vocab_size=draft_vocab, **norms)
    head = Eagle3Head(config, target.model)
    head.set_vocab(torch.rand(V))  # a draft vocabulary that is not the first ids
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    info = TargetInfo(target.target_id, H, V, 3)
    return save_drafter(head, head.config, "eagle3", info, Recipe(data="tiny"), folder, draft=draft)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """(target config, loaded target, drafter folder, its speculators export, its format=vllm export)."""
    root = tmp_path_factory.mktemp("speculators")
    tcfg = copy_target(tiny_llama_dir, root / "target")
    target = load_target(tcfg)
    drafter = save_head(target, tcfg, root / "eagle3")
    spec = export(drafter, "speculators", root / "speculators", tcfg, "fp32")
    flat = export(drafter, "vllm", root / "vllm", tcfg, "fp32")
    return tcfg, target, drafter, spec, flat


def edit_weights(folder: Path, change) -> None:
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def broken(src: Path, folder: Path, change_config=None, change_weights=None) -> Path:
    shutil.copytree(src, folder)
    if change_config:
        edit_json(folder / "config.json", change_config)
    if change_weights:
        edit_weights(folder, change_weights)
    return folder


# ---------------------------------------------------------------- out: the export and its keys


def test_export_keys_and_shapes(tiny):
    _, _, _, out, _ = tiny
    tensors = load_file(str(out / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    assert tuple(tensors["fc.weight"].shape) == (H, 3 * H) and tuple(tensors["lm_head.weight"].shape) == (DRAFT_V, H)
    assert (
        tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool and tensors["t2d"].sum() == DRAFT_V
    )
    assert "embed_tokens.weight" not in tensors  # vLLM then shares the target's


def test_config_keys_are_the_speculators_fields(tiny):
    """Every key the export writes is a field of the speculators classes (the fixture, from their source), with
    the fixture's type; the layer config is a LlamaConfig; the keys vLLM's loader reads are all there."""
    tcfg, _, _, out, _ = tiny
    config = json.loads((out / "config.json").read_text())
    assert set(config) <= set(FIXTURE) and set(FIXTURE) == speculators.TOP_KEYS
    spec, want = config["speculators_config"], FIXTURE["speculators_config"]
    assert set(spec) == set(want) == speculators.SPECULATORS_CONFIG_KEYS
    assert set(spec["proposal_methods"][0]) == set(want["proposal_methods"][0]) == speculators.GREEDY_KEYS
    assert set(spec["verifier"]) == set(want["verifier"]) == speculators.VERIFIER_KEYS
    for k, v in config.items():
        if FIXTURE[k] is not None:
            assert type(v) is type(FIXTURE[k]), k
    # vLLM's SpeculatorsConfig.validate_speculators_config and update_eagle3 read these
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5 and config["speculators_model_type"] == "eagle3"
    assert spec["verifier"] == {"name_or_path": str(Path(tcfg.path).resolve()), "architectures": ["LlamaForCausalLM"]}
    assert config["norm_before_residual"] is False  # explicit: vLLM's default is true, speculators' false
    assert config["draft_vocab_size"] == DRAFT_V and config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    parsed = LlamaConfig(**layer)  # what speculators' validator builds from it
    assert (parsed.hidden_size, parsed.num_key_value_heads, parsed.head_dim) == (H, 2, 16)


def test_card_serves_with_vllm_alone_or_with_the_method_spelled_out(tiny):
    _, _, _, out, _ = tiny
    card = (out / "README.md").read_text()
    assert f"vllm serve {out.resolve()}\n" in card
    assert '"method": "eagle3"' in card and f'"model": "{out.resolve()}"' in card
    assert "sglang.launch_server" not in card  # SGLang reads format=sglang


def test_vllm_drafts_the_depth_the_folder_records(tiny, tmp_path):
    """speculative_tokens (what `vllm serve OUT` drafts) and the card's command: the drafter folder's draft depth."""
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "eagle3", draft=DraftShape(num_tokens=2, topk=3, total_tokens=4))
    out = export(drafter, "speculators", tmp_path / "out", tcfg, "fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert '"num_speculative_tokens": 2' in (out / "README.md").read_text()


def test_read_back_it_drafts_the_depth_the_folder_records(tiny, tmp_path):
    """spec.drafter=OUT with no shape set drafts what `vllm serve OUT` drafts: a chain of speculative_tokens, not
    eagle3's default tree."""
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "eagle3", draft=DraftShape(num_tokens=2, topk=3, total_tokens=4))
    out = export(drafter, "speculators", tmp_path / "out", tcfg, "fp32")
    spec = resolve_shape(SpecConfig("eagle3", drafter=str(out)))
    assert (spec.num_tokens, spec.tree.topk) == (2, 1)
    topk = resolve_shape(SpecConfig("eagle3", drafter=str(out), tree=TreeConfig(topk=4, total_tokens=None)))
    assert (topk.num_tokens, topk.tree) == (2, TreeConfig(topk=4, total_tokens=12))  # eagle3's node cap, as ever
    for depth in (0, -3, "3", 3.0, True, 100000):
        edit_json(
            out / "config.json",
            lambda c, d=depth: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=d),
        )
        with pytest.raises(ValueError, match=r"speculative_tokens=.* is no draft depth \(an integer 1..64\)"):
            resolve_shape(SpecConfig("eagle3", drafter=str(out)))


@pytest.mark.parametrize(
    "change_config,change_weights,message",
    [
        (lambda c: c.update(speculators_model_type="peagle"), None, "speculators_model_type='peagle', expected"),
        (lambda c: c["speculators_config"]["verifier"].update(name_or_path="/elsewhere"), None, "expected the target"),
        (None, lambda s: s.pop("d2t"), r"missing key d2t \(48,\)"),
        (None, lambda s: s.update(fc=s.pop("fc.weight")), "unexpected key fc"),
        (None, lambda s: s.update({"fc.weight": s["fc.weight"][:, :H]}), r"fc.weight has shape \(64, 64\)"),
        (lambda c: c.pop("norm_before_residual"), None, "norm_before_residual='<missing>', expected False"),
        (lambda c: c.update(bogus=1), None, "'bogus', which speculators does not define"),
        (lambda c: c["transformer_layer_config"].update(rope_theta=5.0), None, "rope settings differ"),
        (None, lambda s: s["layers.0.hidden_norm.weight"].mul_(1.01), "speculators forward differs"),
    ],
)
def test_validator_catches(tiny, tmp_path, change_config, change_weights, message):
    tcfg, _, drafter, out, _ = tiny
    bad = broken(out, tmp_path / "bad", change_config, change_weights)
    with pytest.raises(ExportError, match=message):
        validate(drafter, "speculators", bad, tcfg)


def test_failed_export_writes_nothing(tiny, tmp_path, monkeypatch):
    tcfg, _, drafter, _, _ = tiny

    def without_d2t(src):
        exp = speculators.eagle3_speculators(src)
        exp.tensors["model.safetensors"].pop("d2t")
        return exp

    monkeypatch.setattr(speculators, "SPECULATORS", replace(speculators.SPECULATORS, export=without_d2t))
    with pytest.raises(ExportError, match="missing key d2t"):
        export(drafter, "speculators", tmp_path / "out", tcfg, "fp32")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------- in: round trips draft what the original drafts


def chain(drafter: Path) -> SpecConfig:
    return SpecConfig("eagle3", 3, drafter=str(drafter), tree=TreeConfig(topk=1, total_tokens=0))


def drafted(target, drafter: Path) -> tuple[list, list]:
    """Each prompt's output and every draft proposed on the way, through the engine eval builds."""
    engine = build_engine(target, chain(drafter), False, 256)
    propose, drafts = engine.proposer.propose, []

    def recording(*args, **kwargs):
        tree = propose(*args, **kwargs)
        drafts.append(tree.tokens.tolist())
        return tree

    engine.proposer.propose = recording
    return [engine.generate(ids, 24, SamplingParams()).output_ids for ids in PROMPTS], drafts


def loaded(target, folder: Path):
    return folder_drafter(folder, target, "eagle3", target.model, dtype=torch.float32)


@pytest.mark.parametrize("which", [3, 4], ids=["speculators", "format=vllm"])
def test_round_trip_drafts_what_the_original_drafts(tiny, which):
    _, target, drafter, *_ = tiny
    folder = tiny[which]
    original, back = loaded(target, drafter), loaded(target, folder)
    assert back.config == original.config
    mine, theirs = own_state(original), own_state(back)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert drafted(target, folder) == drafted(target, drafter)


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_eagle31_heads_go_out_with_their_switches_and_come_back_drafting_the_same(tiny, tmp_path, fmt):
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "eagle31", norm_before_fc=True, norm_output=True)
    with torch.no_grad():  # a norm that is not all ones, so a reader that skipped it would draft otherwise
        state = load_file(str(drafter / "model.safetensors"))
        state["input_norm.weight"] = 1 + 0.5 * torch.rand_like(state["input_norm.weight"])
        save_file(state, str(drafter / "model.safetensors"))
    out = export(drafter, fmt, tmp_path / fmt, tcfg, "fp32")  # validated against vLLM's forward with the switches
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    if fmt == "vllm":
        assert config["eagle_config"]["norm_before_fc"] is True
    assert "input_norm.weight" in load_file(str(out / "model.safetensors"))
    back = loaded(target, out)
    assert back.config.norm_before_fc and back.config.norm_output
    assert drafted(target, out) == drafted(target, drafter)


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_a_head_whose_residual_is_normed_goes_out_and_comes_back_drafting_the_same(tiny, tmp_path, fmt):
    """norm_before_residual (speculators' default for the heads it trains): the layer's residual is
    hidden_norm(feature). The export is validated against vLLM's forward with the switch."""
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "normed", norm_before_residual=True)
    out = export(drafter, fmt, tmp_path / fmt, tcfg, "fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_residual"] is True
    back = loaded(target, out)
    assert back.config.norm_before_residual and back.midlayer.norm_before_residual
    assert drafted(target, out) == drafted(target, drafter)
    edit_json(out / "config.json", lambda c: c.update(norm_before_residual=False))
    assert drafted(target, out)[1] != drafted(target, drafter)[1]  # the switch changes the drafts: it is read
    if fmt == "vllm":  # SGLang's layer has no such switch: no command for it, and no format=sglang export
        assert "SGLang**: its EAGLE-3 layer computes none of norm_before_residual" in (out / "README.md").read_text()
        with pytest.raises(ExportError, match="SGLang's EAGLE-3 layer computes none of norm_before_residual"):
            export(drafter, "sglang", tmp_path / "sglang", tcfg, "fp32")


def test_a_qwen3_style_head_drafts_from_its_folder_and_no_format_takes_it_yet(tiny, tmp_path):
    """qk_norm (a Qwen3-style layer: q and k normed per head): saved and read back with its norms, it drafts the
    same; every export refuses it, as no engine's forward for it is checked yet, and nothing is written."""
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "qwen3", qk_norm=True)
    back = loaded(target, drafter)
    assert back.config.qk_norm and hasattr(back.midlayer.self_attn, "k_norm")
    assert any(drafted(target, drafter)[1])  # it drafts
    for fmt in ("vllm", "speculators", "sglang"):
        with pytest.raises(ExportError, match="Qwen3-style"):
            export(drafter, fmt, tmp_path / fmt, tcfg, "fp32")
        assert not (tmp_path / fmt).exists()


def test_specforge_folder_with_its_embedding_and_default_layers(tiny, tmp_path):
    """SpecForge saves the draft's (frozen) copy of the target embedding and, unless told otherwise, no layer ids:
    the engines' default 2, L/2, L-3 (here 0, 1, 2 for 3 layers), as the head was made with."""
    _, target, drafter, _, flat = tiny
    embed = target.model.model.embed_tokens.weight.detach().to(torch.bfloat16)  # a bf16 copy is the same embedding
    folder = broken(flat, tmp_path / "specforge", lambda c: c.pop("eagle_config"), lambda s: s.update(e=embed))
    edit_weights(folder, lambda s: s.update({"embed_tokens.weight": s.pop("e")}))
    assert drafted(target, folder) == drafted(target, drafter)


def test_an_fp32_embedding_is_the_embedding_of_a_bf16_target(tiny, tmp_path):
    """A head that ships the fp32 target's embedding serves the same target in bf16: there its embedding holds bf16
    values (in fp32 where draftsmith's kernels run), and the two are compared at bf16."""
    tcfg, target, _, spec, _ = tiny
    bf16 = load_target(replace(tcfg, dtype="bfloat16"))
    embed = target.model.model.embed_tokens.weight.detach().clone()
    folder = broken(spec, tmp_path / "with-embedding", None, lambda s: s.update({"embed_tokens.weight": embed}))
    assert drafted(bf16, folder) == drafted(bf16, spec)


def test_full_vocabulary_head_without_a_map(tiny, tmp_path):
    tcfg, target, *_ = tiny
    drafter = save_head(target, tcfg, tmp_path / "full", draft_vocab=V)
    out = export(drafter, "speculators", tmp_path / "out", tcfg, "fp32")
    assert "d2t" not in load_file(str(out / "model.safetensors"))  # vLLM has no slot for it then
    assert drafted(target, out) == drafted(target, drafter)


# ---------------------------------------------------------------- in: bad folders refused before anything loads


@pytest.fixture
def no_weights_read(monkeypatch):
    """Refusals must come from config.json and the safetensors header alone."""

    def fail(folder):
        raise AssertionError(f"weights of {folder} were read before the folder was checked")

    monkeypatch.setattr(external_heads, "load_state_dict", fail)


SPEC, FLAT = 3, 4
BAD = [
    (
        SPEC,
        lambda c: c.update(speculators_model_type="dflash"),
        None,
        r"speculators_model_type='dflash' \(dflash heads",
    ),
    (SPEC, lambda c: c.update(speculators_model_type="nope"), None, "draftsmith reads only eagle3 speculators"),
    (
        SPEC,
        lambda c: c["speculators_config"]["verifier"].update(architectures=["MistralForCausalLM"]),
        None,
        "is a Mis",
    ),
    (SPEC, lambda c: c.pop("norm_before_residual"), None, "missing norm_before_residual"),
    (SPEC, lambda c: c.update(norm_before_fc=True), None, "missing input_norm.weight"),
    (SPEC, lambda c: c.update(norm_output="yes"), None, "norm_output='yes': must be true or false"),
    (SPEC, lambda c: c.update(fc_norm=True), None, "fc_norm=True"),
    (SPEC, lambda c: c.pop("transformer_layer_config"), None, "missing transformer_layer_config"),
    (SPEC, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None, "num_hidden_layers=2"),
    (SPEC, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 9]), None, r"layer_ids=\[0, 1, 9\] \(the tar"),
    (
        SPEC,
        lambda c: c["transformer_layer_config"].update(vocab_size=256),
        None,
        r"vocab_size=256 \(the target has 128",
    ),
    (SPEC, lambda c: c.update(target_hidden_size=32), None, r"target_hidden_size=32 \(the target has 64"),
    (SPEC, None, lambda s: s.pop("d2t"), "d2t is missing: draft_vocab_size 48 < vocab 128"),
    (SPEC, None, lambda s: s.update({"fc.weight": s["fc.weight"][:, :H]}), r"fc.weight has shape \(64, 64\), exp"),
    (SPEC, None, lambda s: s.update(extra=s["norm.weight"]), "unknown keys extra"),
    (SPEC, None, lambda s: s.pop("norm.weight"), "missing norm.weight"),
    (FLAT, None, lambda s: s.update({"layers.0.mlp.up_proj.weight": s.pop("midlayer.mlp.up_proj.weight")}), "unknown"),
    (FLAT, lambda c: c.update(draft_vocab_size=50), None, r"lm_head.weight has shape \(48, 64\), expected \(50, 64\)"),
    (FLAT, lambda c: c.update(hidden_size=32), None, "hidden_size=32"),
    (FLAT, lambda c: c["eagle_config"].update(norm_before_fc=True), None, "missing input_norm.weight"),
    (SPEC, lambda c: c.update(draft_vocab_size="48"), None, r"draft_vocab_size='48' must be a positive integer"),
    (SPEC, lambda c: c.update(draft_vocab_size=48.0), None, r"draft_vocab_size=48.0 must be a positive integer"),
    (FLAT, lambda c: c.update(draft_vocab_size="48"), None, r"draft_vocab_size='48' must be a positive integer"),
    (SPEC, None, lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int32)}), "fc.weight is I32, expected a fl"),
    (SPEC, None, lambda s: s.update(d2t=s["d2t"].float()), "d2t is F32, expected an integer type"),
]


@pytest.mark.parametrize("which,change_config,change_weights,message", BAD)
def test_refuses_a_bad_folder(tiny, tmp_path, no_weights_read, which, change_config, change_weights, message):
    _, target, *_ = tiny
    folder = broken(tiny[which], tmp_path / "bad", change_config, change_weights)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError, match=message):
        build_engine(target, chain(folder), False, 256)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_refuses_weights_that_are_not_finite(tiny, tmp_path, value):
    _, target, _, spec, _ = tiny
    folder = broken(
        spec, tmp_path / "bad", None, lambda s: s.update({"fc.weight": torch.full_like(s["fc.weight"], value)})
    )
    with pytest.raises(ValueError, match="fc.weight hold NaN or infinite values"):
        build_engine(target, chain(folder), False, 256)


def test_refuses_a_verifier_that_is_another_target(tiny, tiny_llama_dir, tmp_path, no_weights_read):
    """Same sizes, another config.json: the verifier folder it names is not this target."""
    _, target, _, spec, _ = tiny
    other = tiny_llama_dir("llama", rope_theta=500.0)
    folder = broken(
        spec, tmp_path / "bad", lambda c: c["speculators_config"]["verifier"].update(name_or_path=str(other))
    )
    with pytest.raises(ValueError, match=rf"the verifier {other} is not the target {target.target_id}"):
        build_engine(target, chain(folder), False, 256)


def test_refuses_an_embedding_that_is_not_the_targets(tiny, tmp_path):
    _, target, _, spec, _ = tiny
    folder = broken(spec, tmp_path / "bad", None, lambda s: s.update({"embed_tokens.weight": torch.randn(V, H)}))
    with pytest.raises(ValueError, match="embed_tokens.weight differs from the target's embedding"):
        build_engine(target, chain(folder), False, 256)


@pytest.mark.parametrize("spec", ["eagle", "draft_model"])
def test_an_external_head_needs_spec_eagle3(tiny, spec):
    _, target, _, folder, _ = tiny
    with pytest.raises(ValueError, match=r"is an EAGLE-3 head \(speculators layout\); use it with spec=eagle3"):
        build_engine(target, SpecConfig(spec, 3, drafter=str(folder)), False, 256)


def test_round_trip_of_a_qwen2_head(tiny_llama_dir, tmp_path):
    """Qwen2 heads have q/k/v biases; the engines' attention_bias adds an o_proj bias, exported as zeros."""
    tcfg = copy_target(tiny_llama_dir, tmp_path / "target", "qwen2")
    target = load_target(tcfg)
    drafter = save_head(target, tcfg, tmp_path / "eagle3")
    out = export(drafter, "speculators", tmp_path / "out", tcfg, "fp32")
    assert "layers.0.self_attn.o_proj.bias" in load_file(str(out / "model.safetensors"))
    mine, theirs = own_state(loaded(target, drafter)), own_state(loaded(target, out))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
