"""format=gguf: EAGLE-3 heads as llama.cpp's `eagle3` GGUF (serve/export/export_eagle3_gguf.py), DFlash heads as
its `dflash` GGUF (serve/export/export_dflash_gguf.py) and DSpark heads as that with its Markov and confidence heads
(serve/export/export_dspark_gguf.py), beside a GGUF of their target. The files read back with the
gguf package as llama.cpp reads them (names, ne order, types, absolute d2t, the target's tokenizer, DFlash's mask
token); the validators' llama.cpp-convention forwards catching a wrongly permuted q, a renamed tensor, a shifted
d2t, another tokenizer or mask token, a causal flag; refusals of what llama.cpp cannot run and of a GGUF target that
is not the drafter's. Running the files in llama.cpp is peers/engines_crosscheck.py (it needs a llama.cpp build)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from safetensors.torch import load_file

from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.drafter_folder import Recipe, TargetInfo, save_drafter
from draftsmith.heads.dspark import DSparkConfig, DSparkHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.serve.export.__main__ import ExportConfig, run
from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.export_eagle3_gguf import permute
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, target_id
from helpers import DRAFT_V, FF, KV, H, Q, V, edit_gguf, export_drafters, save_tiny, save_tiny_gguf, save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GGUF_SHAPES = {  # llama.cpp's ne order: the input dimension first
    "fc.weight": [3 * H, H],
    "blk.0.attn_norm.weight": [H],
    "blk.0.attn_norm_2.weight": [H],
    "blk.0.attn_q.weight": [2 * H, Q],
    "blk.0.attn_k.weight": [2 * H, KV],
    "blk.0.attn_v.weight": [2 * H, KV],
    "blk.0.attn_output.weight": [Q, H],
    "blk.0.ffn_norm.weight": [H],
    "blk.0.ffn_gate.weight": [H, FF],
    "blk.0.ffn_up.weight": [H, FF],
    "blk.0.ffn_down.weight": [FF, H],
    "output_norm.weight": [H],
    "output.weight": [H, DRAFT_V],
    "d2t": [DRAFT_V],
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """The tiny target (tokenizer, drafters) and a GGUF of it."""
    root = tmp_path_factory.mktemp("gguf")
    tcfg, drafters, target = export_drafters(tiny_llama_dir("llama"), root)
    return tcfg, drafters, target, save_tiny_gguf(Path(tcfg.path), root / "target.gguf")


def gguf_export(tiny, out: Path, dtype: str = "fp32", **kw) -> Path:
    tcfg, drafters, _, target_gguf = tiny
    return export(kw.pop("drafter", drafters["eagle3"]), "gguf", out, tcfg, dtype, gguf_target=str(target_gguf), **kw)


def test_gguf_export_is_llamacpps_eagle3_file(tiny, tmp_path):
    out = gguf_export(tiny, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "eagle3.gguf"]
    r = gguf.GGUFReader(str(out / "eagle3.gguf"))
    f = r.fields
    assert f["general.architecture"].contents() == "eagle3"
    assert f["eagle3.target_layers"].contents() == [0, 1, 2]
    assert f["eagle3.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]  # llama.cpp's get_arr
    sizes = {
        "target_hidden_size": H,
        "embedding_length": H,
        "block_count": 1,
        "feed_forward_length": FF,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "vocab_size": V,
        "context_length": 256,
    }
    assert {k: f[f"eagle3.{k}"].contents() for k in sizes} == sizes
    assert f["eagle3.rope.freq_base"].contents() == 10000.0
    target = gguf.GGUFReader(str(tiny[3]))
    assert f["tokenizer.ggml.tokens"].contents() == target.fields["tokenizer.ggml.tokens"].contents()
    assert {t.name: t.shape.tolist() for t in r.tensors} == GGUF_SHAPES
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["d2t"] == GGMLQuantizationType.I64 and types["fc.weight"] == GGMLQuantizationType.F32

    mine = load_file(str(tiny[1]["eagle3"] / "model.safetensors"))
    t = {x.name: x for x in r.tensors}
    d2t = torch.from_numpy(t["d2t"].data.copy())
    assert torch.equal(d2t, torch.arange(DRAFT_V) + mine["d2t"])  # absolute target ids, not offsets
    q = torch.from_numpy(t["blk.0.attn_q.weight"].data.copy())
    hf_q = mine["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(q[1], hf_q[8]) and torch.equal(q[2], hf_q[1])  # head 0: rows 0, 8, 1, 9, ... (dims 16)
    assert torch.equal(q, permute(hf_q, 4))

    card = (out / "README.md").read_text()
    assert f"-md {out.resolve()}/eagle3.gguf --spec-type draft-eagle3" in card and "--no-repack" in card
    spaced = gguf_export(tiny, tmp_path / "with space")
    assert f"-md '{spaced.resolve()}/eagle3.gguf'" in (spaced / "README.md").read_text()
    assert f"-m {tiny[3].resolve()}" in card and "GGUF." in card and "convert_hf_to_gguf.py" in card


def test_gguf_dtypes_keep_norms_in_float32(tiny, tmp_path):
    for dtype, want, file_type in (("bf16", GGMLQuantizationType.BF16, 32), ("fp16", GGMLQuantizationType.F16, 1)):
        r = gguf.GGUFReader(str(gguf_export(tiny, tmp_path / dtype, dtype) / "eagle3.gguf"))
        types = {t.name: t.tensor_type for t in r.tensors}
        assert types["blk.0.attn_q.weight"] == want and types["output.weight"] == want
        assert types["blk.0.ffn_norm.weight"] == GGMLQuantizationType.F32 and types["d2t"] == GGMLQuantizationType.I64
        assert r.fields["general.file_type"].contents() == file_type


def unpermute_q(meta, tensors):
    q = tensors["blk.0.attn_q.weight"]
    tensors["blk.0.attn_q.weight"] = q.reshape(4, 8, 2, 2 * H).swapaxes(1, 2).reshape(q.shape)


def shift_d2t(meta, tensors):
    tensors["d2t"] = tensors["d2t"].roll(1)


def other_token(meta, tensors):
    tokens = list(meta["tokenizer.ggml.tokens"].value)
    tokens[5] = "other"
    meta["tokenizer.ggml.tokens"] = gguf.GGUFValue(tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)


def rename_norm(meta, tensors):
    tensors["blk.0.hidden_norm.weight"] = tensors.pop("blk.0.attn_norm_2.weight")


def scale_norm(meta, tensors):
    tensors["output_norm.weight"] = tensors["output_norm.weight"] * 1.003


def extra_key(meta, tensors):
    meta["eagle3.expert_count"] = gguf.GGUFValue(4, GGUFValueType.UINT32)


def other_layers(meta, tensors):
    meta["eagle3.target_layers"] = gguf.GGUFValue([0, 1, 1], GGUFValueType.ARRAY, GGUFValueType.INT32)


@pytest.mark.parametrize(
    "change,message",
    [
        (unpermute_q, "forward differs from the drafter's: feature"),
        (shift_d2t, "target ids off"),
        (other_token, "tokenizer.ggml.tokens differs from the target GGUF's"),
        (rename_norm, "missing key blk.0.attn_norm_2.weight"),
        (scale_norm, "forward differs from the drafter's: logits"),
        (other_layers, "GGUF metadata eagle3.target_layers=[0, 1, 1], expected [0, 1, 2]"),
        (extra_key, "unexpected GGUF metadata eagle3.expert_count"),
    ],
)
def test_gguf_validator_catches(tiny, tmp_path, change, message):
    out = gguf_export(tiny, tmp_path / "out")
    tcfg, drafters, _, target_gguf = tiny
    validate(drafters["eagle3"], "gguf", out, tcfg, str(target_gguf))
    edit_gguf(out / "eagle3.gguf", change)
    with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(drafters["eagle3"], "gguf", out, tcfg, str(target_gguf))


def test_gguf_refuses_kinds_llamacpp_does_not_draft_with(tiny, tmp_path):
    for kind in ("medusa", "eagle", "draft_model"):
        with pytest.raises(ExportError, match=f"format=gguf cannot hold {kind} drafters"):
            gguf_export(tiny, tmp_path / kind, drafter=tiny[1][kind])
    cases = {"norm_output": dict(norm_output=True), "exactly 3": dict(target_layers=(0, 2))}
    assert_refused(tiny, tmp_path, "eagle3", Eagle3Config, Eagle3Head, cases)


def assert_refused(tiny, tmp_path: Path, kind: str, config, head, cases: dict[str, dict]) -> None:
    """Each case's drafter (the kind's config with those changes) is refused, naming the reason; nothing written."""
    tcfg, _, target, _ = tiny
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    for i, (reason, change) in enumerate(cases.items()):
        cfg = config.from_target(target.config, draft_vocab_size=DRAFT_V, **change)
        folder = save_drafter(head(cfg, target), cfg, kind, info, Recipe(), tmp_path / f"drafter-{i}")
        with pytest.raises(ExportError, match=f"llama.cpp cannot run .* as a draft \\({kind}\\): .*{reason}"):
            gguf_export(tiny, tmp_path / f"out-{i}", drafter=folder)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_gguf_refuses_a_target_gguf_that_is_not_the_drafters(tiny, tmp_path):
    tcfg, drafters, _, _ = tiny
    tdir = Path(tcfg.path)
    vocab = [f"t{i}" for i in range(V)]
    cases = {
        "embedding": (save_tiny_gguf(tdir, tmp_path / "other.gguf", seed=7), "token embedding is .* away"),
        "tokens": (
            save_tiny_gguf(tdir, tmp_path / "tok.gguf", tokens=vocab[:9] + ["x"] + vocab[10:]),
            "1 token strings differ .*id 9",
        ),
        "layers": (save_tiny_gguf(tdir, tmp_path / "deep.gguf", layers=4), "block_count=4"),
        "eos": (save_tiny_gguf(tdir, tmp_path / "eos.gguf", eos=5), "its EOS token is 5, the target's 2"),
        "missing": (tmp_path / "nowhere.gguf", "does not exist"),
    }
    (tmp_path / "cut.gguf").write_bytes(tiny[3].read_bytes()[:200])
    cases["corrupt"] = (tmp_path / "cut.gguf", "not a readable GGUF file")
    for name, (path, message) in cases.items():
        with pytest.raises(ExportError, match=message):
            export(drafters["eagle3"], "gguf", tmp_path / f"out-{name}", tcfg, "fp32", gguf_target=str(path))
    with pytest.raises(ExportError, match="needs the target as a GGUF.*convert_hf_to_gguf.py.*gguf_target="):
        export(drafters["eagle3"], "gguf", tmp_path / "out-none", tcfg, "fp32")
    assert not any(p.name.startswith(("out", ".")) for p in tmp_path.iterdir())


def test_gguf_export_command_and_check(tiny, tmp_path, capsys):
    tcfg, drafters, _, target_gguf = tiny
    cfg = ExportConfig(
        str(drafters["eagle3"]), "gguf", str(tmp_path / "out"), tcfg, "bf16", gguf_target=str(target_gguf)
    )
    run(cfg)
    run(replace(cfg, check=True))
    assert "a valid gguf export" in capsys.readouterr().out
    edit_gguf(tmp_path / "out" / "eagle3.gguf", scale_norm)
    with pytest.raises(ExportError, match="fails validation"):
        run(replace(cfg, check=True))


# ---------------------------------------------------------------- DFlash: llama.cpp's `dflash` architecture


def dflash_layer(i: int) -> dict[str, list[int]]:
    b = f"blk.{i}"
    s = {f"{b}.attn_norm.weight": [H], f"{b}.attn_q.weight": [H, Q], f"{b}.attn_k.weight": [H, KV]}
    s |= {f"{b}.attn_v.weight": [H, KV], f"{b}.attn_output.weight": [Q, H], f"{b}.attn_q_norm.weight": [16]}
    s |= {f"{b}.attn_k_norm.weight": [16], f"{b}.ffn_norm.weight": [H], f"{b}.ffn_gate.weight": [H, FF]}
    return s | {f"{b}.ffn_up.weight": [H, FF], f"{b}.ffn_down.weight": [FF, H]}


DFLASH_SHAPES = {"fc.weight": [3 * H, H], "enc.output_norm.weight": [H], "output_norm.weight": [H]}
DFLASH_SHAPES |= dflash_layer(0) | dflash_layer(1)
DFLASH_VOCAB = {"output.weight": [H, DRAFT_V], "d2t": [DRAFT_V]}


@pytest.fixture(scope="module")
def dflash(tiny, tmp_path_factory):
    """2-layer DFlash drafters of the tiny target: over a draft vocabulary, and over the full one."""
    target = tiny[2]
    full = DFlashHead(DFlashConfig.from_target(target.config, num_layers=2, draft_vocab_size=V), target)
    return two_vocabularies(tiny, tmp_path_factory.mktemp("dflash"), "dflash", full)


def two_vocabularies(tiny, root: Path, kind: str, full) -> dict[str, Path]:
    """The kind's tiny drafter over a draft vocabulary, and `full` (nudged off its initial weights) over the full
    one."""
    tcfg, _, target, _ = tiny
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    with torch.no_grad():
        for p in full.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    folder = save_drafter(full, full.config, kind, info, Recipe(), root / "full")
    return {"draft-vocab": save_tiny(kind, target, info, root / "draft-vocab"), "full-vocab": folder}


def test_dflash_gguf_is_llamacpps_dflash_file(tiny, dflash, tmp_path):
    out = gguf_export(tiny, tmp_path / "out", drafter=dflash["draft-vocab"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "dflash.gguf"]
    r = gguf.GGUFReader(str(out / "dflash.gguf"))
    f = r.fields
    assert f["general.architecture"].contents() == "dflash"
    assert f["dflash.target_layers"].contents() == [0, 1, 2]  # layer inputs, as llama_set_embeddings_layer_inp
    assert f["dflash.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    sizes = {
        "block_count": 2,
        "block_size": 4,
        "embedding_length": H,
        "feed_forward_length": FF,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "context_length": 256,
    }
    assert {k: f[f"dflash.{k}"].contents() for k in sizes} == sizes
    assert f["dflash.block_size"].types == [GGUFValueType.UINT32]
    assert f["dflash.rope.freq_base"].contents() == 10000.0 and "dflash.attention.causal" not in f
    assert f["tokenizer.ggml.mask_token_id"].contents() == 2  # the mask slots' token: llama_vocab_mask
    assert f["tokenizer.ggml.mask_token_id"].types == [GGUFValueType.UINT32]
    target = gguf.GGUFReader(str(tiny[3]))
    assert f["tokenizer.ggml.tokens"].contents() == target.fields["tokenizer.ggml.tokens"].contents()
    assert {t.name: t.shape.tolist() for t in r.tensors} == DFLASH_SHAPES | DFLASH_VOCAB
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["d2t"] == GGMLQuantizationType.I64 and types["blk.1.attn_q.weight"] == GGMLQuantizationType.F32

    mine = load_file(str(dflash["draft-vocab"] / "model.safetensors"))
    t = {x.name: torch.from_numpy(x.data.copy()) for x in r.tensors}
    assert torch.equal(t["d2t"], torch.arange(DRAFT_V) + mine["d2t"])  # absolute target ids
    hf = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
    for ours, theirs in hf.items():  # NEOX rope: HF's row order, nothing permuted
        assert torch.equal(t[f"blk.1.{ours}.weight"], mine[f"layers.1.self_attn.{theirs}.weight"])
    assert torch.equal(t["enc.output_norm.weight"], mine["hidden_norm.weight"])

    card = (out / "README.md").read_text()
    assert f"-md {out.resolve()}/dflash.gguf --spec-type draft-dflash --spec-draft-n-max 3" in card


def test_dflash_card_asks_llamacpp_for_the_heads_whole_block(tiny, tmp_path):
    """llama.cpp's block is n-max + 1 slots: a head of block_size 6 drafting 3 still needs n-max 5 there."""
    tcfg, _, target, _ = tiny
    info = TargetInfo(target_id(tcfg, Path(tcfg.path)), H, V, 3)
    head = DFlashHead(DFlashConfig.from_target(target.config, block_size=6, draft_vocab_size=V), target)
    folder = save_drafter(head, head.config, "dflash", info, Recipe(), tmp_path / "b6")
    card = (gguf_export(tiny, tmp_path / "out", drafter=folder) / "README.md").read_text()
    assert "--spec-type draft-dflash --spec-draft-n-max 5" in card


def test_dflash_gguf_over_the_full_vocabulary_uses_the_targets_output(tiny, dflash, tmp_path):
    out = gguf_export(tiny, tmp_path / "out", "bf16", drafter=dflash["full-vocab"])
    r = gguf.GGUFReader(str(out / "dflash.gguf"))
    assert {t.name: t.shape.tolist() for t in r.tensors} == DFLASH_SHAPES  # no output, no d2t: llama.cpp's own
    types = {t.name: t.tensor_type for t in r.tensors}
    assert (
        types["fc.weight"] == GGMLQuantizationType.BF16
        and types["blk.0.attn_k_norm.weight"] == GGMLQuantizationType.F32
    )


def permute_q(meta, tensors):  # q rows as a NORM-rope (adjacent pairs) architecture wants them
    tensors["blk.0.attn_q.weight"] = permute(tensors["blk.0.attn_q.weight"], 4)


def other_mask(meta, tensors):
    meta["tokenizer.ggml.mask_token_id"] = gguf.GGUFValue(5, GGUFValueType.UINT32)


def no_mask(meta, tensors):
    del meta["tokenizer.ggml.mask_token_id"]


def causal(meta, tensors):
    meta["dflash.attention.causal"] = gguf.GGUFValue(True, GGUFValueType.BOOL)


def output_layers(meta, tensors):  # vLLM's target_layer_ids, not their + 1
    meta["dflash.target_layers"] = gguf.GGUFValue([-1, 0, 1], GGUFValueType.ARRAY, GGUFValueType.INT32)


def rename_hidden_norm(meta, tensors):
    tensors["hidden_norm.weight"] = tensors.pop("enc.output_norm.weight")


def mask_as_int32(meta, tensors):  # the right value, a type llama.cpp refuses to load
    meta["tokenizer.ggml.mask_token_id"] = gguf.GGUFValue(2, GGUFValueType.INT32)


def block_as_int32(meta, tensors):
    meta["dflash.block_size"] = gguf.GGUFValue(4, GGUFValueType.INT32)


def scale_k_norm(meta, tensors):
    tensors["blk.1.attn_k_norm.weight"] = tensors["blk.1.attn_k_norm.weight"] * 1.003


@pytest.mark.parametrize(
    "change,message",
    [
        (permute_q, "forward differs from the drafter's: hidden"),
        (shift_d2t, "target ids off"),
        (other_mask, "tokenizer.ggml.mask_token_id differs from the target GGUF's"),
        (no_mask, "tokenizer.ggml.mask_token_id differs from the target GGUF's"),
        (causal, "unexpected GGUF metadata dflash.attention.causal"),
        (output_layers, "dflash.target_layers=[-1, 0, 1], expected [0, 1, 2]"),
        (rename_hidden_norm, "missing key enc.output_norm.weight"),
        (scale_k_norm, "forward differs from the drafter's: hidden"),
        (mask_as_int32, "tokenizer.ggml.mask_token_id is INT32, llama.cpp reads UINT32"),
        (block_as_int32, "dflash.block_size is INT32, llama.cpp reads UINT32"),
        (other_token, "tokenizer.ggml.tokens differs from the target GGUF's"),
    ],
)
def test_dflash_gguf_validator_catches(tiny, dflash, tmp_path, change, message):
    tcfg, _, _, target_gguf = tiny
    out = gguf_export(tiny, tmp_path / "out", drafter=dflash["draft-vocab"])
    validate(dflash["draft-vocab"], "gguf", out, tcfg, str(target_gguf))
    edit_gguf(out / "dflash.gguf", change)
    with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(dflash["draft-vocab"], "gguf", out, tcfg, str(target_gguf))


def test_dflash_gguf_refuses_what_llamacpps_dflash_cannot_run(tiny, tmp_path):
    cases = {  # layer 3: the tiny target's last layer's output, a layer input llama.cpp's graphs do not hand over
        "its attention has biases": dict(attention_bias=True),
        "it reads target layer 3 .the last layer's output.; .* layers 0..2 only": dict(target_layers=(1, 3)),
    }
    assert_refused(tiny, tmp_path, "dflash", DFlashConfig, DFlashHead, cases)


def test_gguf_refuses_a_qwen2_target(tiny_llama_dir, tmp_path):
    """llama.cpp's qwen2 graph sets no layer inputs (res->t_layer_inp): a head could not read its target there."""
    tdir = tmp_path / "qwen2"
    shutil.copytree(tiny_llama_dir("qwen2"), tdir)
    save_tiny_tokenizer(tdir)
    tcfg, target_gguf = TargetConfig(path=str(tdir)), str(save_tiny_gguf(tdir, tmp_path / "qwen2.gguf"))
    info, target = TargetInfo(target_id(tcfg, tdir), H, V, 3), load_model(tdir)
    for kind in ("eagle3", "dflash"):
        folder = save_tiny(kind, target, info, tmp_path / kind)
        refusal = f"model_type='qwen2'; format=gguf serves {kind} drafters for llama, mistral, qwen3 targets only"
        with pytest.raises(ExportError, match=refusal):
            export(folder, "gguf", tmp_path / f"out-{kind}", tcfg, "fp32", gguf_target=target_gguf)


# ---------------------------------------------------------------- DSpark: `dflash` with the Markov and confidence heads

DSPARK_HEADS = {"markov_w1.weight": [8, V], "markov_w2.weight": [8, DRAFT_V], "conf_proj.weight": [H + 8, 1]}
DSPARK_HEADS |= {"conf_proj.bias": [1]}


@pytest.fixture(scope="module")
def dspark(tiny, tmp_path_factory):
    """DSpark drafters of the tiny target: over a draft vocabulary, and over the full one with a block of 3 and a
    confidence head that reads h_k alone."""
    target = tiny[2]
    cfg = DSparkConfig.from_target(
        target.config, draft_vocab_size=V, markov_rank=8, block_size=3, confidence_with_markov=False
    )
    return two_vocabularies(tiny, tmp_path_factory.mktemp("dspark"), "dspark", DSparkHead(cfg, target))


def test_dspark_gguf_is_llamacpps_dflash_file_with_its_markov_head(tiny, dspark, tmp_path):
    out = gguf_export(tiny, tmp_path / "out", drafter=dspark["draft-vocab"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "dspark.gguf"]
    r = gguf.GGUFReader(str(out / "dspark.gguf"))
    f = r.fields
    assert f["general.architecture"].contents() == "dflash" and f["dflash.block_size"].contents() == 4
    for flag in ("dflash.sample_from_anchor", "dflash.has_confidence_head"):  # anchor-first, conf(i) computed
        assert f[flag].contents() is True and f[flag].types == [GGUFValueType.BOOL]
    assert {t.name: t.shape.tolist() for t in r.tensors} == DFLASH_SHAPES | DFLASH_VOCAB | DSPARK_HEADS
    mine = load_file(str(dspark["draft-vocab"] / "model.safetensors"))
    t = {x.name: torch.from_numpy(x.data.copy()) for x in r.tensors}
    assert torch.equal(t["markov_w1.weight"], mine["markov_head.markov_w1.weight"])
    assert torch.equal(t["conf_proj.bias"], mine["confidence_head.proj.bias"])
    assert torch.equal(t["d2t"], torch.arange(DRAFT_V) + mine["d2t"])
    card = (out / "README.md").read_text()
    assert f"-md {out.resolve()}/dspark.gguf --spec-type draft-dspark --spec-draft-n-max 4" in card


def test_dspark_gguf_over_the_full_vocabulary_pads_a_confidence_head_of_h_alone(tiny, dspark, tmp_path):
    out = gguf_export(tiny, tmp_path / "out", drafter=dspark["full-vocab"])
    t = {x.name: torch.from_numpy(x.data.copy()) for x in gguf.GGUFReader(str(out / "dspark.gguf")).tensors}
    assert "output.weight" not in t and "d2t" not in t  # llama.cpp runs the target's output, as DFlash's
    assert t["markov_w2.weight"].shape == (V, 8) and t["conf_proj.weight"].shape == (1, H + 8)
    assert not t["conf_proj.weight"][:, H:].any()  # W1[x]'s columns: zero, conf reads h_k alone
    assert "--spec-type draft-dspark --spec-draft-n-max 3" in (out / "README.md").read_text()


def rename_markov(meta, tensors):
    tensors["markov_head.markov_w1.weight"] = tensors.pop("markov_w1.weight")


def drop_confidence(meta, tensors):
    del tensors["conf_proj.weight"], tensors["conf_proj.bias"]


def scale_markov(meta, tensors):
    tensors["markov_w2.weight"] = tensors["markov_w2.weight"] * 1.5


def shift_confidence(meta, tensors):
    tensors["conf_proj.bias"] = tensors["conf_proj.bias"] + 0.1


def bonus_anchor(meta, tensors):  # SpecForge's layout: slot 0 a bonus token, the drafts one later
    meta["dflash.sample_from_anchor"] = gguf.GGUFValue(False, GGUFValueType.BOOL)


def no_confidence_flag(meta, tensors):
    del meta["dflash.has_confidence_head"]


@pytest.mark.parametrize(
    "change,message",
    [
        (rename_markov, "missing key markov_w1.weight"),
        (drop_confidence, "missing key conf_proj.weight"),
        (shift_d2t, "target ids off"),
        (scale_markov, "forward differs from the drafter's: markov logits"),
        (shift_confidence, "forward differs from the drafter's: confidence"),
        (bonus_anchor, "dflash.sample_from_anchor=False, expected True"),
        (no_confidence_flag, "dflash.has_confidence_head='<missing>', expected True"),
        (other_mask, "tokenizer.ggml.mask_token_id differs from the target GGUF's"),
    ],
)
def test_dspark_gguf_validator_catches(tiny, dspark, tmp_path, change, message):
    tcfg, _, _, target_gguf = tiny
    out = gguf_export(tiny, tmp_path / "out", drafter=dspark["draft-vocab"])
    edit_gguf(out / "dspark.gguf", change)
    with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(dspark["draft-vocab"], "gguf", out, tcfg, str(target_gguf))


def test_dspark_gguf_refuses_sequential_heads_llamacpp_does_not_compute(tiny, tmp_path):
    cases = {
        "Markov head is 'gated'; .* vanilla head .*head.args.markov_type=vanilla": dict(markov_type="gated"),
        "Markov head is 'rnn'": dict(markov_type="rnn"),
        "its attention has biases": dict(attention_bias=True),
    }
    assert_refused(tiny, tmp_path, "dspark", DSparkConfig, DSparkHead, cases)
