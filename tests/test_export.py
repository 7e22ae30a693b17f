"""Export (serve/export/pipeline.py) on tiny drafters of every kind for a tiny random Llama target: each format's key
names, shapes and config.json as the engines expect them; the validator catching a renamed key, a wrong shape,
a missing d2t and a wrong weight; the HF draft model as transformers' assistant_model; refusals and atomic
writes. The real-vLLM check is peers/vllm_crosscheck.py (its own environment, not run here)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, frequent_ids, save_drafter
from draftsmith.serve.export import export_eagle
from draftsmith.serve.export import export_eagle as export_mod
from draftsmith.serve.export.__main__ import ExportConfig, run
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, target_id
from helpers import (
    DRAFT_V,
    H,
    V,
    edit_json,
    edit_weights,
    export_drafters,
    flip_ten,
    layer_shapes,
    leftovers,
    rename,
    save_tiny,
    save_tiny_tokenizer,
    scale,
    tiny_head,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    ("eagle3", "vllm"),
    ("eagle3", "sglang"),
    ("eagle", "vllm"),
    ("eagle", "sglang"),
    ("medusa", "vllm"),
    ("medusa", "tgi"),
    ("draft_model", "hf"),
]


# the keys and shapes engines load, spelled out for the tiny sizes
EAGLE3_KEYS = {
    "fc.weight": (H, 3 * H),
    **layer_shapes("midlayer", 2 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "norm.weight": (H,),
    "lm_head.weight": (DRAFT_V, H),
    "d2t": (DRAFT_V,),
    "t2d": (V,),
}
EXPECTED = {
    ("eagle3", "vllm"): ("model.safetensors", EAGLE3_KEYS),
    ("eagle3", "sglang"): ("model.safetensors", EAGLE3_KEYS),
    # vLLM's fc has no bias: the trained bias moves into the attention's q/k/v/o biases
    ("eagle", "vllm"): ("model.safetensors", {"fc.weight": (H, 2 * H), **layer_shapes("layers.0", H, bias=True)}),
    ("eagle", "sglang"): (
        "model.safetensors",
        {"fc.weight": (H, 2 * H), "fc.bias": (H,), **layer_shapes("layers.0", H)},
    ),
    ("medusa", "vllm"): (
        "model.safetensors",
        {f"blocks.{h}.layers.0.{p}": (H, H) if p == "weight" else (H,) for h in range(3) for p in ("weight", "bias")}
        | {f"lm_heads.{h}.weight": (V, H) for h in range(3)},
    ),
    ("medusa", "tgi"): (
        "medusa_lm_head.safetensors",
        {f"{h}.0.linear.{p}": (H, H) if p == "weight" else (H,) for h in range(3) for p in ("weight", "bias")}
        | {f"{h}.1.weight": (V, H) for h in range(3)},
    ),
    ("draft_model", "hf"): (
        "model.safetensors",
        {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
        | {k: v for i in range(2) for k, v in layer_shapes(f"model.layers.{i}", H).items()}
        | {f"model.layers.{i}.input_layernorm.weight": (H,) for i in range(2)},
    ),
}
CONFIG = {
    ("eagle3", "vllm"): {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": DRAFT_V,
        "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
    },
    ("eagle", "vllm"): {"architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1, "attention_bias": True},
    ("eagle", "sglang"): {"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1},
    ("medusa", "vllm"): {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": 3,
        "num_hidden_layers": 1,
        "medusa_fc_bias": True,
    },
    ("medusa", "tgi"): {"medusa_num_heads": 3, "medusa_num_layers": 1},
    ("draft_model", "hf"): {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2},
}
CONFIG[("eagle3", "sglang")] = CONFIG[("eagle3", "vllm")]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """The target folder (with a tokenizer), its TargetConfig, and one saved drafter folder per kind."""
    return export_drafters(tiny_llama_dir("llama"), tmp_path_factory.mktemp("export"))


def do_export(tiny, kind: str, fmt: str, out: Path, **kw) -> Path:
    tcfg, drafters, _ = tiny
    return export(drafters[kind], fmt, out, tcfg, kw.pop("dtype", "fp32"), **kw)


# ---------------------------------------------------------------- each row of the table


@pytest.mark.parametrize("kind,fmt", ROWS)
def test_export_keys_shapes_config(tiny, tmp_path, kind, fmt):
    out = do_export(tiny, kind, fmt, tmp_path / "out")
    weights, shapes = EXPECTED[kind, fmt]
    tensors = load_file(str(out / weights))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    config = json.loads((out / "config.json").read_text())
    assert {k: config.get(k) for k in CONFIG[kind, fmt]} == CONFIG[kind, fmt]
    card = (out / "README.md").read_text()
    assert tiny[0].path in card and "2.50" in card  # target and measured tau
    assert leftovers(tmp_path) == []
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in [out, *out.iterdir()])  # readable by an engine's user
    if fmt == "tgi":
        assert "architectures" not in config and config["base_model_name_or_path"] == str(Path(tiny[0].path).resolve())
    if kind in ("eagle3", "eagle"):
        assert config["max_position_embeddings"] == 256 and config["rope_parameters"]["rope_theta"] == 10000.0
        assert "vllm serve" in card or "sglang.launch_server" in card


def test_eagle3_vocab_map_and_dtypes(tiny, tmp_path):
    out = do_export(tiny, "eagle3", "vllm", tmp_path / "out", dtype="bf16")
    t = load_file(str(out / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    target_ids = torch.arange(DRAFT_V) + t["d2t"]  # vLLM's reading: target id = draft id + d2t
    assert target_ids.unique().numel() == DRAFT_V and t["t2d"][target_ids].all() and t["t2d"].sum() == DRAFT_V
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_eagle_sglang_writes_the_token_map_from_the_training_counts(tiny, tmp_path):
    tcfg, _, target = tiny
    head, cfg = tiny_head("eagle", target)
    counts = torch.randint(0, 50, (V,))
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    drafter = save_drafter(head, cfg, "eagle", info, Recipe(), tmp_path / "eagle", token_counts=counts)
    out = export(drafter, "sglang", tmp_path / "sglang", tcfg, "fp32")
    ids = torch.load(out / "token_map.pt", weights_only=True)  # as SGLang's load_token_map reads it
    assert torch.equal(ids, frequent_ids(counts, V))  # a quarter of 128 ids is under the 8k floor: all of them
    assert f"--speculative-token-map {out.resolve()}/token_map.pt" in (out / "README.md").read_text()
    assert not (export(drafter, "vllm", tmp_path / "vllm", tcfg, "fp32") / "token_map.pt").exists()
    assert not (do_export(tiny, "eagle", "sglang", tmp_path / "no-counts") / "token_map.pt").exists()
    torch.save(torch.tensor([1, 1, 2]), out / "token_map.pt")
    with pytest.raises(ExportError, match="token_map.pt must hold distinct token ids"):
        validate(drafter, "sglang", out, tcfg)
    (drafter / "token_counts.safetensors").write_bytes(b"garbage")
    with pytest.raises(ExportError, match="token_counts.safetensors is corrupt"):
        export(drafter, "sglang", tmp_path / "bad", tcfg, "fp32")


def test_eagle_vllm_moves_fc_bias_into_attention(tiny, tmp_path):
    """EagleLlamaForCausalLM's fc has no bias: o_proj carries b, q/k/v carry W b; the validator's plain-torch
    vLLM forward (which passed inside export) matches the drafter, so the move is exact."""
    drafter = load_file(str(tiny[1]["eagle"] / "model.safetensors"))
    t = load_file(str(do_export(tiny, "eagle", "vllm", tmp_path / "out") / "model.safetensors"))
    b = drafter["fc.bias"]
    assert b.abs().max() > 0.01 and torch.equal(t["layers.0.self_attn.o_proj.bias"], b)
    q = drafter["layers.0.self_attn.q_proj.weight"].double() @ b.double()
    torch.testing.assert_close(t["layers.0.self_attn.q_proj.bias"].double(), q, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the validator


@pytest.mark.parametrize(
    "kind,fmt,change,message",
    [
        ("eagle3", "vllm", rename("midlayer.hidden_norm.weight", "midlayer.hidden_layernorm.weight"), "missing key"),
        ("eagle", "sglang", rename("fc.weight", "model.fc.weight"), "unexpected key model.fc.weight"),
        ("medusa", "tgi", rename("2.1.weight", "2.lm_head.weight"), "missing key 2.1.weight"),
        ("eagle3", "vllm", lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :128]), "fc.weight has shape"),
        ("eagle", "vllm", lambda t: t.__setitem__("fc.weight", t["fc.weight"].T.contiguous()), "has shape (128, 64)"),
        ("eagle3", "sglang", lambda t: t.pop("d2t"), "missing key d2t"),
        ("eagle3", "vllm", lambda t: t.__setitem__("d2t", t["d2t"].int()), "d2t is torch.int32"),
        ("medusa", "vllm", lambda t: t["blocks.1.layers.0.weight"].mul_(1.5), "forward differs"),
        ("eagle", "vllm", lambda t: t.pop("layers.0.self_attn.o_proj.bias"), "missing key"),
        ("eagle3", "vllm", lambda t: t["d2t"].add_(1), "target ids off"),
        ("draft_model", "hf", lambda t: t["model.layers.1.mlp.up_proj.weight"].mul_(-1), "forward differs"),
    ],
)
def test_validator_catches(tiny, tmp_path, kind, fmt, change, message):
    out = do_export(tiny, kind, fmt, tmp_path / "out")
    validate(tiny[1][kind], fmt, out, tiny[0])  # the untouched export is valid
    edit_weights(out, fmt, change)
    with pytest.raises(ExportError, match="fails validation") as e:
        validate(tiny[1][kind], fmt, out, tiny[0])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "kind,change",
    [
        ("eagle3", flip_ten("midlayer.self_attn.v_proj.weight")),
        ("eagle3", scale("norm.weight", 1.003)),
        ("eagle", flip_ten("layers.0.self_attn.v_proj.weight")),
        ("eagle", scale("layers.0.self_attn.v_proj.bias", 1.003)),  # fc's bias, moved: rounded apart
        ("medusa", flip_ten("blocks.1.layers.0.weight")),
    ],
    ids=["eagle3-v_proj", "eagle3-norm", "eagle-v_proj", "eagle-moved-bias", "medusa-block"],
)
def test_validator_catches_small_tampering_of_a_bf16_export(tiny, tmp_path, kind, change):
    """Rounding to bf16 explains ~3e-7 (relative) between the forwards, not 1e-3."""
    out = do_export(tiny, kind, "vllm", tmp_path / "out", dtype="bf16")
    before = load_file(str(out / "model.safetensors"))
    edit_weights(out, "vllm", change)
    assert any(not torch.equal(v, before[k]) for k, v in load_file(str(out / "model.safetensors")).items())
    with pytest.raises(ExportError, match="fails validation"):
        validate(tiny[1][kind], "vllm", out, tiny[0])


def test_validator_catches_a_missing_or_other_token_map(tiny, tmp_path):
    tcfg, _, target = tiny
    head, cfg = tiny_head("eagle", target)
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(0))
    drafter = save_drafter(head, cfg, "eagle", info, Recipe(), tmp_path / "eagle", token_counts=counts)
    out = export(drafter, "sglang", tmp_path / "sglang", tcfg)
    validate(drafter, "sglang", out, tcfg)
    torch.save(torch.arange(V - 1), out / "token_map.pt")  # valid ids, but not the drafter's
    with pytest.raises(ExportError, match="token_map.pt is not the 128 most frequent ids"):
        validate(drafter, "sglang", out, tcfg)
    (out / "token_map.pt").unlink()  # the card still passes --speculative-token-map
    with pytest.raises(ExportError, match="token_map.pt is missing, but README.md passes it"):
        validate(drafter, "sglang", out, tcfg)


def test_validator_catches_config_errors(tiny, tmp_path):
    out = do_export(tiny, "eagle3", "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    bad = config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}, "rope_theta": 500.0}
    del bad["rope_parameters"]
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ExportError) as e:
        validate(tiny[1]["eagle3"], "vllm", out, tiny[0])
    assert "eagle_config" in str(e.value) and "rope settings differ" in str(e.value)


# ---------------------------------------------------------------- the HF draft model


def test_hf_draft_model_is_a_lossless_assistant(tiny, tmp_path):
    out = do_export(tiny, "draft_model", "hf", tmp_path / "out")
    draft = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(tiny[0].path, local_files_only=True)
    assert type(draft).__name__ == "LlamaForCausalLM" and draft.config.num_hidden_layers == 2
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "dtype" not in config  # one dtype key, read by transformers 4 and 5
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    kw = dict(do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(assisted, plain) and plain.shape[1] == 30
    with torch.no_grad():  # the export is the drafter: same logits as draftsmith's DraftModel forward
        ours = load_model(out)
        mine = ours(ids[0], torch.arange(6), ours.new_cache(6), 0).logits
        torch.testing.assert_close(draft(ids).logits[0], mine, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file()


# ---------------------------------------------------------------- bad input, atomic writes


def test_refuses_a_kind_the_format_cannot_hold(tiny, tmp_path):
    with pytest.raises(ExportError, match=r"format=tgi cannot hold eagle3 drafters; use format=vllm\|sglang"):
        do_export(tiny, "eagle3", "tgi", tmp_path / "out")
    with pytest.raises(ExportError, match="unknown format 'onnx'"):
        do_export(tiny, "eagle3", "onnx", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists; pass overwrite=true"):
        do_export(tiny, "medusa", "vllm", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    do_export(tiny, "medusa", "vllm", out, overwrite=True)  # an empty folder
    do_export(tiny, "medusa", "tgi", out, overwrite=True)  # an earlier export
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "medusa_lm_head.safetensors"]
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_only_an_earlier_export(tiny, tmp_path, monkeypatch):
    """Not a training run (checkpoints included) or any other folder, and not the folder the command runs in."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    shutil.copytree(tiny[1]["medusa"], run / "final")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(ExportError, match="is not an earlier export .*overwrite=true replaces only an export"):
        do_export(tiny, "medusa", "vllm", run, overwrite=True)
    monkeypatch.chdir(run / "checkpoints")
    for out in (Path("."), Path(".."), tmp_path):
        with pytest.raises(ExportError, match="is the current folder or holds it"):
            do_export(tiny, "medusa", "vllm", out, overwrite=True)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before and leftovers(tmp_path) == []
    assert leftovers(run) == [] and leftovers(run / "checkpoints") == []


def test_refuses_out_overlapping_the_drafter(tiny):
    with pytest.raises(ExportError, match="overlaps the drafter folder"):
        do_export(tiny, "medusa", "vllm", tiny[1]["medusa"] / "export", overwrite=True)


def broken_copy(src: Path, folder: Path, fix) -> Path:
    shutil.copytree(src, folder)
    fix(folder)
    return folder


@pytest.mark.parametrize(
    "fix,message",
    [
        (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 64), "corrupt or not a safetensors file"),
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "config.json").write_text("{kind: eagle"), "not valid JSON"),
        (lambda f: edit_json(f / "config.json", lambda m: m["config"].update(bogus=1)), "config.json is corrupt"),
        (lambda f: edit_json(f / "config.json", lambda m: m["config"].pop("hidden_size")), "the config implies"),
        (lambda f: edit_json(f / "config.json", lambda m: m.pop("target")), "config.json is corrupt"),
    ],
)
def test_refuses_missing_or_corrupt_drafter(tiny, tmp_path, fix, message):
    drafter = broken_copy(tiny[1]["eagle"], tmp_path / "drafter", fix)
    with pytest.raises(ExportError, match=message):
        export(drafter, "vllm", tmp_path / "out", tiny[0], "fp32")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_refuses_a_drafter_for_another_target(tiny, tiny_llama_dir, tmp_path):
    other = TargetConfig(path=str(tiny_llama_dir("llama", rope_theta=500.0)))
    with pytest.raises(ExportError, match="train a drafter for this target"):
        export(tiny[1]["eagle"], "vllm", tmp_path / "out", other, "fp32")
    assert not (tmp_path / "out").exists()


def test_a_copied_target_folder_is_the_same_target(tiny, tmp_path):
    """Same config.json and weights under another folder name: its drafters fit it."""
    copy = Path(shutil.copytree(tiny[0].path, tmp_path / "copied-elsewhere"))
    tcfg = TargetConfig(path=str(copy))
    assert target_id(tcfg, copy) != target_id(tiny[0], Path(tiny[0].path))  # the readable name differs
    out = export(tiny[1]["eagle"], "vllm", tmp_path / "out", tcfg, "fp32")
    assert f"`{target_id(tiny[0], Path(tiny[0].path))}`" in (out / "README.md").read_text()


def test_refuses_an_unsupported_target_architecture(tiny, tmp_path):
    """A target the format's engines do not run these drafters for (a Qwen3 target for TGI's Medusa heads)."""
    tdir = tmp_path / "qwen3ish"
    shutil.copytree(tiny[0].path, tdir)
    edit_json(tdir / "config.json", lambda c: c.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"]))
    tcfg = TargetConfig(path=str(tdir))
    info = TargetInfo(target_id(tcfg, tdir), H, V, 3)
    drafter = save_tiny("medusa", tiny[2], info, tmp_path / "medusa")
    with pytest.raises(ExportError, match="model_type='qwen3'; format=tgi serves medusa drafters for llama"):
        export(drafter, "tgi", tmp_path / "out-tgi", tcfg, "fp32")
    assert not (tmp_path / "out-tgi").exists()
    export(drafter, "vllm", tmp_path / "out-vllm", tcfg, "fp32")  # vLLM runs Medusa heads on Qwen3


def test_failed_validation_writes_nothing(tiny, tmp_path, monkeypatch):
    out = do_export(tiny, "eagle", "sglang", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(exp_src):
        exp = export_mod.eagle_sglang(exp_src)
        exp.tensors["model.safetensors"]["fc.bias"] = exp.tensors["model.safetensors"]["fc.bias"] + 1.0
        return exp

    monkeypatch.setattr(export_eagle, "EAGLE_SGLANG", replace(export_eagle.EAGLE_SGLANG, export=broken))
    with pytest.raises(ExportError, match="forward differs"):
        do_export(tiny, "eagle", "sglang", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export is untouched
    with pytest.raises(ExportError, match="forward differs"):
        do_export(tiny, "eagle", "sglang", tmp_path / "new")
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_cli_run_check_and_push(tiny, tmp_path, capsys):
    tcfg, drafters, _ = tiny
    cfg = ExportConfig(str(drafters["medusa"]), "tgi", str(tmp_path / "out"), tcfg, dtype="fp16")
    run(cfg)
    assert load_file(str(tmp_path / "out" / "medusa_lm_head.safetensors"))["0.1.weight"].dtype == torch.float16
    run(ExportConfig(cfg.drafter, "tgi", cfg.out, tcfg, check=True))
    assert "a valid tgi export" in capsys.readouterr().out
    with pytest.raises(ExportError, match="push=true is not supported"):
        run(ExportConfig(cfg.drafter, "tgi", str(tmp_path / "pushed"), tcfg, push=True))
    assert not (tmp_path / "pushed").exists()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_targets(tiny_llama_dir, tmp_path, model_type):
    """Qwen2 heads carry q/k/v biases (the engines' attention_bias adds an o_proj bias: exported as zeros);
    a Qwen3 draft model keeps its q/k norms. Every export validated, as always."""
    tdir = tmp_path / "target"
    shutil.copytree(tiny_llama_dir(model_type), tdir)
    save_tiny_tokenizer(tdir)
    tcfg, target = TargetConfig(path=str(tdir)), load_model(tdir)
    info = TargetInfo(target_id(tcfg, tdir), H, V, 3)
    for kind, fmts in (("eagle3", ["vllm"]), ("eagle", ["vllm", "sglang"]), ("draft_model", ["hf"])):
        drafter = save_tiny(kind, target, info, tmp_path / kind)
        for fmt in fmts:
            t = load_file(str(export(drafter, fmt, tmp_path / f"{kind}-{fmt}", tcfg, "fp32") / "model.safetensors"))
            o_bias = {k: v for k, v in t.items() if k.endswith("o_proj.bias")}
            if kind == "draft_model":
                assert not o_bias and ("model.layers.0.self_attn.q_norm.weight" in t) == (model_type == "qwen3")
                assert ("model.layers.0.self_attn.q_proj.bias" in t) == (model_type == "qwen2")
            elif model_type == "qwen2":
                assert len(o_bias) == 1 and (kind == "eagle" and fmt == "vllm" or not next(iter(o_bias.values())).any())
