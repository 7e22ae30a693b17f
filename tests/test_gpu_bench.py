"""eval/gpu_bench.py (the GPU check's benchmark) on CPU with a tiny shape: the HF twin is the same model as the
runner (so the speed comparison is like for like), and every section runs and lands in the JSON and Markdown the GPU
check returns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.eval import gpu_bench

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "hf", [TINY, {**TINY, "tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}], ids=["tied", "llama3-rope"]
)
def test_hf_twin_computes_the_runners_function(hf):
    model = gpu_bench.random_target(hf, torch.float32, "cpu")
    twin = gpu_bench.hf_twin(model, hf)
    assert twin.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # shared, no copy
    ids = torch.randint(0, hf["vocab_size"], (40,), generator=torch.Generator().manual_seed(0)).tolist()
    p = gpu_bench.parity(model, twin, ids)  # 40 > original_max_position_embeddings: the llama3 scaling matters
    assert p["rel_logit_error"] < 1e-5 and p["argmax_agreement"] == 1.0, p


def test_random_target_has_no_zero_or_unwritten_weights():
    model = gpu_bench.random_target(TINY, torch.float32, "cpu")
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and (p != 0).all(), name
    assert model.model.layers[0].mlp.up_proj.weight.std() > 0.01
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied as the config says


def tiny_args(monkeypatch, out: Path, *more: str) -> list[str]:
    monkeypatch.setitem(gpu_bench.SHAPES, "tiny", gpu_bench.Shape(hf=TINY, draft=dict(num_layers=1), new_tokens=4))
    args = ["--device", "cpu", "--cases", "tiny:float32", "--out", str(out), "--prompts", "1"]
    args += ["--prompt-len", "12", "--new-tokens", "6", "--repeats", "1", "--warmup", "2", "--ks", "1,2,4"]
    return args + ["--prefix", "8", "--max-seq-len", "64", "--verify-rounds", "1", *more]


def test_runs_every_section_on_cpu(tmp_path, monkeypatch):
    gpu_bench.main(tiny_args(monkeypatch, tmp_path))
    summary = json.loads((tmp_path / "gpu_bench.json").read_text())
    case = summary["cases"]["tiny fp32"]
    assert case["skipped"] == {}
    assert case["parity"]["rel_logit_error"] < 1e-5
    assert set(case["decode"]) == {"ours eager", "ours off", "HF generate"}
    assert all(v["new_tokens"] == 6 and v["tokens_per_s"]["median"] > 0 for v in case["decode"].values())
    assert case["decode"]["ours eager"]["first_divergence_vs_off"] == [None]  # fp32: the same tokens
    assert set(case["verify"]["modes"]) == {"eager", "off"}
    assert all(set(v) == {"1", "2", "4"} and v["1"]["x_decode_step"] == 1.0 for v in case["verify"]["modes"].values())
    drafters = {k: v for k, v in case["drafters"].items() if isinstance(v, dict)}
    assert len(drafters) == 6 and all(v["steps"] > 0 for v in drafters.values())
    assert all(v["draft_ms"] > 0 for k, v in drafters.items() if not k.startswith(("plain", "n-gram")))
    md = (tmp_path / "gpu_bench.md").read_text()
    assert gpu_bench.RANDOM_NOTE in md and "| HF generate |" in md and "| EAGLE-3 tree 5x4/12 |" in md


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("CUDA graph capture exploded")

    monkeypatch.setattr(gpu_bench, "verify_section", broken)
    with pytest.raises(SystemExit, match="failed: tiny fp32 verify"):
        gpu_bench.main(tiny_args(monkeypatch, tmp_path, "--sections", "verify,decode"))
    case = json.loads((tmp_path / "gpu_bench.json").read_text())["cases"]["tiny fp32"]
    assert case["errors"] == {"verify": "RuntimeError: CUDA graph capture exploded"}
    assert case["decode"]["HF generate"]["new_tokens"] == 6
    assert "**verify: failed** (RuntimeError: CUDA graph capture exploded)" in (tmp_path / "gpu_bench.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cases", "tiny:float16"], "bad case"),
        (["--ks", "2,4"], "must include 1"),
        (["--prefix", "500"], "exceed --max-seq-len"),
        (["--sections", "decode,speed"], "unknown sections"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
