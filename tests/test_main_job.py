"""The README's main job (scripts/main.sh) end to end on a tiny random target: regenerate the answers with the
target (through vLLM where bf16 is native, else draftsmith's own decoder), train an EAGLE-3 head on them,
evaluate it on MT-bench and the rag 2x2 study, export it for vLLM, print the headline; a second run reuses the head."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from draftsmith.serve.models.target import native_bf16
from helpers import build_tiny_chat_target

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    rows = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Count from {i} to {i + 5}."},
                {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6))},
            ],
        }
        for i in range(24)
    ]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main_job(out: Path, target: Path, chats: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    doc = tmp_path / "doc.md"
    doc.write_text("draftsmith trains drafters. " * 20)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "DRAFTSMITH_CACHE": str(tmp_path / "cache"),
        "MAIN_OUT": str(out),
        "MAIN_TARGET": f"target.path={target}",
        "MAIN_TRAIN_ARGS": f"data.source={chats} data.max_conversations=null data.max_length=64 "
        "train.max_steps=2 train.batch_size=2 train.eval_every=100 train.eval_prompts=1 wandb.enabled=false "
        "+data.regenerate.engine_args.enforce_eager=true data.regenerate.fidelity=2 data.regenerate.fidelity_tokens=4",
        "MAIN_RAG_ARGS": f"suite.document={doc}",
    }
    args = ["bash", "scripts/main.sh", "limit=2", "max_new_tokens=4", "wandb.enabled=false"]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_main_job_runs_end_to_end_and_reuses_the_head(smollm2_dir, chats, tmp_path):
    target = build_tiny_chat_target(tmp_path / "target", smollm2_dir, head_dim=32)  # one vLLM's CPU attention runs
    out = tmp_path / "main"
    first = main_job(out, target, chats, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for name in ("mt_bench", "rag"):
        results = json.loads((out / name / "results.json").read_text())
        assert results["lossless"]["identical"] == results["lossless"]["checked"] > 0
        assert (out / name / "report.md").stat().st_size > 0
    methods = json.loads((out / "mt_bench" / "results.json").read_text())["methods"]
    assert set(methods) == {"eagle3", "ngram", "eagle3_ngram"}
    assert len(json.loads((out / "rag" / "results.json").read_text())["study"]["cells"]) == 4
    config = json.loads((out / "export-vllm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "MT-bench (2 questions x 2 repeats" in first.stdout and "rag 2x2" in first.stdout
    assert "export-vllm" in first.stdout and "control (plain TPOT, cache on / off)" in first.stdout
    assert "machine: " in first.stdout and "speedup" in first.stdout
    vllm = native_bf16("cpu")  # else the own decoder answers, and there is no vLLM to check against draftsmith
    by = "by vllm 0.32" if vllm else "by draftsmith"
    assert "regenerated 23 conversations" in first.stdout and by in first.stdout  # one is held out
    assert ("fidelity (fp32 greedy, 2 first turns x 4 tokens)" in first.stdout) == vllm

    records = (out / "mt_bench" / "records.jsonl").read_bytes()
    (out / "mt_bench" / "results.json").unlink()  # as if the first run had been killed after its last prompt

    weights = (out / "eagle3" / "final" / "model.safetensors").read_bytes()
    second = main_job(out, target, chats, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "reusing" in second.stdout and (out / "eagle3" / "final" / "model.safetensors").read_bytes() == weights
    assert (out / "mt_bench" / "records.jsonl").read_bytes() == records  # resumed: nothing ran again
    assert (out / "mt_bench" / "results.json").is_file()
