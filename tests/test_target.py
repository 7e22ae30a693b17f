"""Target resolution (built-in GGUF, path=, gguf=), its cache, and the loader's error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cpu_kernels import decoder_layer, native, panels
from draftsmith.cpu_kernels.packed import pack_linears, panel_formats
from draftsmith.runtime.llama import ModelConfig, Transformer
from draftsmith.serve.build import engine_salt
from draftsmith.serve.drafters import auto_draft_dtype, draft_lm
from draftsmith.serve.models import target as target_mod
from draftsmith.serve.models.loader import fp32_arithmetic, load_model
from draftsmith.serve.models.target import TargetConfig, load_target, resolve_target, torch_dtype
from draftsmith.serve.spec import SpecConfig
from helpers import four_steps


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_smollm2_folder_is_complete(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg


def test_smollm2_is_converted_once(smollm2_dir: Path, monkeypatch) -> None:
    mtime = (smollm2_dir / "model.safetensors").stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(target_mod, "convert_gguf", fail)
    assert resolve_target(TargetConfig()) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_load_target_smollm2(smollm2_dir: Path) -> None:
    loaded = load_target(TargetConfig(device="cpu"))
    model, tok, tid = loaded.model, loaded.tokenizer, loaded.target_id
    assert isinstance(model, Transformer) and model.dtype == torch_dtype("auto", "cpu")
    assert tok.decode(tok("hello world")["input_ids"]).endswith("hello world")
    assert tid.startswith("smollm2-135m@") and len(tid.split("@")[1]) == 8


def test_a_plain_draft_lm_keeps_its_exact_codes_under_auto(smollm2_dir: Path) -> None:
    """spec.draft_dtype=auto rounds a trained drafter to bf16 for an fp32 target (serve/drafters.py) but not a plain
    HF draft LM: SmolLM2's fp32 weights are its GGUF's q4/q8 codes, which bf16 would lose (2.4x the bytes)."""
    loaded = load_target(TargetConfig(dtype="float32", device="cpu"))
    draft = draft_lm(smollm2_dir, loaded)
    assert draft.weights_dtype == torch.float32
    if fp32_arithmetic(torch.bfloat16, "cpu"):
        assert auto_draft_dtype(loaded.model) == torch.bfloat16  # what a trained head or draft model gets
        assert set(panel_formats(draft)) == set(panel_formats(loaded.model)) == {"q4", "q8"}
        assert set(panel_formats(draft_lm(smollm2_dir, loaded, torch.bfloat16))) == {"bf16"}  # by name


def test_path_without_tokenizer(tiny_llama_dir) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_target(TargetConfig(path=str(tiny_llama_dir("llama")), device="cpu"))


def test_unknown_target() -> None:
    with pytest.raises(ValueError, match="smollm2-135m") as e:
        resolve_target(TargetConfig(name="llama-70b"))
    assert "'llama-70b'" in str(e.value) and "target.path=" in str(e.value) and "target.gguf=" in str(e.value)


def test_missing_path_and_gguf(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_target(TargetConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        resolve_target(TargetConfig(gguf=str(tmp_path / "absent.gguf")))
    with pytest.raises(ValueError, match="only one"):
        resolve_target(TargetConfig(path=str(tmp_path), gguf=str(tmp_path / "x.gguf")))


def test_path_is_used_as_is(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    assert resolve_target(TargetConfig(path=str(folder))) == folder


def test_gguf_converted_once_into_cache(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "my-model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / target_mod.DONE).write_text("")

    monkeypatch.setattr(target_mod, "convert_gguf", fake_convert)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    first = resolve_target(TargetConfig(gguf=str(gguf)))
    second = resolve_target(TargetConfig(gguf=str(gguf)))
    assert first == second and calls == [gguf]
    assert first.parent == tmp_path / "cache" / "targets" and first.name.startswith("gguf-my-model.Q8_0-")


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers/gguf raise for a bad file
        resolve_target(TargetConfig(gguf=str(gguf), cache_dir=str(cache)))
    assert list((cache / "targets").iterdir()) == []


def test_dtype_and_device_helpers() -> None:
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert torch_dtype("auto", "cuda:0") == (torch.bfloat16 if cuda_bf16 else torch.float32)
    assert torch_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="float8"):
        torch_dtype("float8", "cpu")
    assert target_mod.pick_device("cpu") == "cpu"


@pytest.mark.skipif(not panels.available(), reason="the panel kernel runs fp32 on AVX2 and AVX-512 CPUs")
def test_smollm2_runs_from_its_gguf_codes_with_the_fp32_bits(smollm2_dir: Path, monkeypatch) -> None:
    """SmolLM2's fp32 weights are its GGUF's Q4_1 (layers) and Q8_0 (the tied embedding) values: the target packs
    them as q4 and q8 panels, a fifth of the bytes, and every step's logits and cache equal fp32 panels' bit for bit."""
    coded = load_target(TargetConfig(dtype="float32")).model
    layers = [decoder_layer.current_tensors(layer) for layer in coded.model.layers]
    formats = {t.dtype for h in layers if h is not None for name, t in h.items() if name in decoder_layer.LINEARS}
    assert len(layers) == 30 and formats == {torch.uint8} and coded.lm_head.current().dtype == torch.int8
    outs, cache = four_steps(coded)
    monkeypatch.setenv(panels.ENV, "fp32")
    plain = load_target(TargetConfig(dtype="float32")).model
    assert plain.lm_head.current().dtype == torch.float32
    want, want_cache = four_steps(plain)
    assert all(torch.equal(o.logits, w.logits) for o, w in zip(outs, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v, strict=True))


def test_the_auto_dtype_is_fp32_on_the_kernels_else_bf16_only_where_the_cpu_has_bf16_kernels(monkeypatch) -> None:
    """Where draftsmith's fp32 kernels run, auto is fp32 (they read the weights' exact narrower codes). Without them,
    on an AVX2-only CPU oneDNN has no bf16 kernels (bf16 is emulated, far slower): auto must mean fp32 there; with
    oneDNN's bf16 kernels, bf16 (the runner is bit-exact across row counts there, tests/test_batch_invariance.py)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
        onednn_bf16 = True
    except RuntimeError:
        onednn_bf16 = False
    assert target_mod.native_bf16("cpu") == onednn_bf16
    assert torch_dtype("auto", "cpu") == (torch.float32 if native.usable() or not onednn_bf16 else torch.bfloat16)
    monkeypatch.setenv(native.ENV, "0")
    assert torch_dtype("auto", "cpu") == (torch.bfloat16 if onednn_bf16 else torch.float32)
    with pytest.raises(ValueError, match="unknown dtype 'fast'; use auto, float32"):
        torch_dtype("fast", "cpu")


@pytest.mark.skipif(not panels.available(), reason="the panel kernel runs fp32 on AVX2 and AVX-512 CPUs")
def test_bf16_runs_as_bf16_weights_in_fp32_on_the_kernels(tiny_llama_dir, smollm2_dir, tmp_path, monkeypatch) -> None:
    """On a CPU with draftsmith's kernels, a bf16 model for the engine is an fp32 model whose weights are the bf16
    values, packed as bf16 panels, with fp32 rope tables: the same bits as an fp32 model rounded by hand. It records
    bf16 as its weights' dtype (and separates its prefix cache by it). Offline work and DRAFTSMITH_KERNELS=0 get
    torch's bf16 ops."""
    folder = copy_of(tiny_llama_dir("llama", hidden_size=96, num_attention_heads=6), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # load_target reads one
        shutil.copy(smollm2_dir / name, folder / name)
    bf16 = load_model(folder, torch.bfloat16, "cpu")
    assert bf16.dtype == torch.float32 and bf16.weights_dtype == torch.bfloat16
    assert all(torch.equal(p, p.bfloat16().float()) for p in bf16.parameters())
    fp32 = load_model(folder, torch.float32, "cpu", pack=False)
    assert torch.equal(bf16.cos, fp32.cos) and torch.equal(bf16.sin, fp32.sin)
    assert fp32.weights_dtype == torch.float32 and not torch.equal(bf16.lm_head.weight, fp32.lm_head.weight)
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.bfloat16())
    pack_linears(fp32)
    assert not fp32.stacked and fp32.choose_path() == "" and fp32.stacked  # packed now: chosen again, it fits
    packed_weights = [t for h in map(decoder_layer.current_tensors, bf16.model.layers) if h for t in h.values()]
    assert {t.dtype for t in packed_weights if t.dim() == 3} == {torch.bfloat16}
    outs, cache = four_steps(bf16)
    want, want_cache = four_steps(fp32)
    assert all(torch.equal(o.logits, w.logits) for o, w in zip(outs, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v, strict=True))
    offline = load_target(TargetConfig(path=str(folder), dtype="bfloat16"), offline=True)
    assert offline.model.dtype == torch.bfloat16 == load_model(folder, torch.bfloat16, "cpu", decode=False).dtype
    engine_target = load_target(TargetConfig(path=str(folder), dtype="bfloat16"))
    assert engine_salt(engine_target, SpecConfig("ar")) != engine_salt(
        load_target(TargetConfig(path=str(folder), dtype="float32")), SpecConfig("ar")
    )
    monkeypatch.setenv(native.ENV, "0")
    assert load_model(folder, torch.bfloat16, "cpu").dtype == torch.bfloat16


def test_corrupt_safetensors(tiny_llama_dir, tmp_path: Path) -> None:
    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(folder)


def zeroed_norm(folder: Path) -> dict[str, torch.Tensor]:
    return {"model.norm.weight": torch.zeros_like(load_file(str(folder / "model.safetensors"))["model.norm.weight"])}


def test_a_stray_weights_file_beside_the_weights_is_refused(tiny_llama_dir, tmp_path: Path) -> None:
    """A later file merged over the weights would win silently: a zeroed final norm still loads and generates."""
    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    save_file(zeroed_norm(folder), str(folder / "zz-extra.safetensors"))
    with pytest.raises(ValueError, match="zz-extra.safetensors.*no model.safetensors.index.json"):
        load_model(folder)


def test_an_index_reads_only_the_files_it_lists_and_each_tensor_once(tiny_llama_dir, tmp_path: Path) -> None:
    """As transformers: a file the index does not list is never read (Mistral ships consolidated.safetensors beside
    its shards); a tensor two listed files hold is refused."""
    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    keys = list(load_file(str(folder / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    norm = load_model(folder).model.norm.weight.clone()  # an index listing the one file loads
    save_file(zeroed_norm(folder), str(folder / "zz-extra.safetensors"))
    assert torch.equal(load_model(folder).model.norm.weight, norm)  # the unlisted file is not read
    index["weight_map"]["model.norm.weight"] = "zz-extra.safetensors"  # listed, but model.safetensors holds it too
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="another weight file holds too.*model.norm.weight"):
        load_model(folder)


def test_pickled_weights_alone_are_named_and_never_loaded(tiny_llama_dir, tmp_path: Path) -> None:
    """A folder of pytorch_model.bin only (no safetensors): the error names the pickle and the fix, before any
    weights are read; the eval's parameter count goes through the same refusal."""
    from draftsmith.eval.methods import drafter_params
    from draftsmith.serve.spec import SpecConfig

    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    for read in (lambda: load_model(folder), lambda: drafter_params(SpecConfig("draft_model", drafter=str(folder)))):
        with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin: pickles.*save_pretrained"):
            read()


def test_missing_config(tiny_llama_dir, tmp_path: Path) -> None:
    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(folder)


def test_unsupported_model_type(tiny_llama_dir, tmp_path: Path) -> None:
    folder = copy_of(tiny_llama_dir("llama"), tmp_path)
    edit_config(folder, model_type="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(folder)


def test_weights_the_config_does_not_announce(tiny_llama_dir, tmp_path: Path) -> None:
    folder = copy_of(tiny_llama_dir("qwen2"), tmp_path)  # q/k/v biases
    edit_config(folder, model_type="llama", attention_bias=False)
    with pytest.raises(ValueError, match="bias"):
        load_model(folder)


def test_qwen2_always_has_attention_bias() -> None:
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "attention_bias": None}).attention_bias
    assert not ModelConfig.from_hf({**base, "model_type": "mistral"}).attention_bias


def test_cache_dir_set_explicitly_wins_over_the_environment(tmp_path: Path, monkeypatch) -> None:
    """Precedence of the cache root, the same for converted targets, feature caches and regenerated answers:
    target.cache_dir, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    from draftsmith.train.features import FeatureConfig, cache_folder

    explicit, env, home = tmp_path / "explicit", tmp_path / "env", tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(env))
    assert target_mod.cache_root(str(explicit)) == explicit
    assert target_mod.cache_root(None) == env
    key = {"target": "t@1234abcd"}
    assert cache_folder(FeatureConfig(), key, str(explicit)).parent == explicit / "features"
    assert cache_folder(FeatureConfig(), key, None).parent == env / "features"
    # the entry names existing caches were written under: a change would orphan them and rebuild
    assert cache_folder(FeatureConfig(), key, None).name == "t_1234abcd-c4a9d927f0d7"
    assert (
        target_mod.keyed_cache_path(None, "regenerate", "t@1", {}, ".jsonl")
        == env / "regenerate/t_1-44136fa355b3.jsonl"
    )
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert target_mod.cache_root(None) == home / ".cache" / "draftsmith"
    assert TargetConfig().cache_dir is None  # "not set" is distinguishable from the default


def test_failed_conversion_leaves_nothing_whatever_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "elsewhere"))
    test_failed_conversion_leaves_nothing(tmp_path)
    assert not (tmp_path / "elsewhere").exists()
