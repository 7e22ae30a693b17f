"""draftsmith-serve adapt=true as a client sees it (the trainer left off: its own tests are test_adapt_trainer.py):
each finished request lands in the capture store, a head version published beside the server is swapped in between
requests without a restart, /metrics says which version serves, and output stays the target's. adapt=false keeps
nothing."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, save_drafter
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.serve.adapt.versions import Workspace
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, target_id
from helpers import build_tiny_chat_target, user
from serve_process import running_server

MODEL = "tiny"
QUESTIONS = ["Tell me about the sea.", "Name three colours.", "What is two plus two?"]


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve-adapt")
    folder = build_tiny_chat_target(root / "target", smollm2_dir)
    model = load_model(folder)
    c = model.config
    info = TargetInfo(target_id(TargetConfig(path=str(folder)), folder), c.hidden_size, c.vocab_size, 3)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(c, draft_vocab_size=256), model)
    head.set_vocab(torch.rand(c.vocab_size))  # a random draft vocabulary of the real tokenizer's
    return folder, save_drafter(head, head.config, "eagle3", info, Recipe(data="tiny"), root / "eagle3")


def args(tiny, *more: str) -> list[str]:
    _, drafter = tiny
    return [
        "spec=eagle3",
        f"spec.drafter={drafter}",
        f"model_name={MODEL}",
        "max_tokens=24",
        *more,
    ]


def ask(client: openai.OpenAI, question: str) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[user(question)], max_tokens=24, temperature=0)
    return r.choices[0].message.content or ""


def wait_for(check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


def captured(ws: Workspace) -> int:
    try:
        return json.loads((ws.capture / "manifest.json").read_text())["examples"]
    except (OSError, json.JSONDecodeError):
        return 0


def test_served_traffic_is_captured_and_a_new_version_swapped_in(tiny, tmp_path):
    ws = Workspace(tmp_path / "ws")
    extra = ["adapt=true", f"adaptation.dir={ws.root}", "adaptation.trainer=false"]
    with running_server(tiny[0], tmp_path, *args(tiny, *extra)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        before = [ask(client, q) for q in QUESTIONS]
        wait_for(lambda: captured(ws) == 3)
        assert server.metrics()["draftsmith_adapt_captured_requests"] == 3
        assert server.metrics()["draftsmith_adapt_head_version"] == 0
        shutil.copytree(ws.folder("v0000"), ws.folder("v0001"))
        weights = load_file(ws.folder("v0000") / "model.safetensors")
        save_file({k: v * 0.5 for k, v in weights.items()}, str(ws.folder("v0001") / "model.safetensors"))
        ws.publish("v0001")
        after = [ask(client, q) for q in QUESTIONS]
        assert after == before  # another head drafts; the target decides every token
        assert server.metrics()["draftsmith_adapt_head_version"] == 1
        live = json.loads(ws.live_file.read_text())
        assert live["live"] == "v0001" and live["previous"] == "v0000"
    assert captured(ws) == 6


def test_without_adapt_nothing_is_kept(tiny, tmp_path):
    with running_server(tiny[0], tmp_path, *args(tiny, f"adaptation.dir={tmp_path / 'ws'}")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert ask(client, QUESTIONS[0])
        assert "draftsmith_adapt_captured_requests" not in server.metrics()
    assert not (tmp_path / "ws").exists()
