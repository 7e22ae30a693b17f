"""draftsmith-serve adapt=true as a client sees it (the trainer left off: its own tests are test_adapt_trainer.py):
each finished request lands in the capture store, a head version published beside the server is swapped in between
requests without a restart, /metrics says which version serves, and output stays the target's. adapt=false keeps
nothing. The probe: one client's repeated garbage beside another client's normal traffic publishes no version trained
only on the garbage, and a rolled-back version's line never serves again."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from starlette.requests import Request

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, save_drafter
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.verdict import Verdict
from draftsmith.serve.adapt.versions import Workspace, version_name, version_number
from draftsmith.serve.http.auth import KeyCheck
from draftsmith.serve.http.client import client_id, hashed, new_salt, tagged
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import TargetConfig, target_id
from draftsmith.train.adapt.loop import start
from draftsmith.train.adapt.round import TrainerState, run_round
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
    assert captured(ws) == 3 and manifest(ws)["capture"]["duplicates"] == 3  # the same questions again count once


def test_without_adapt_nothing_is_kept(tiny, tmp_path):
    with running_server(tiny[0], tmp_path, *args(tiny, f"adaptation.dir={tmp_path / 'ws'}")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert ask(client, QUESTIONS[0])
        assert "draftsmith_adapt_captured_requests" not in server.metrics()
    assert not (tmp_path / "ws").exists()


def test_a_client_is_its_key_else_its_user_else_its_address():
    def request(headers: dict[str, str]) -> Request:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return Request({"type": "http", "headers": raw, "client": ("10.0.0.7", 51234)})

    salt = new_salt()
    assert client_id(request({"Authorization": "Bearer k1"}), "alice", salt) == tagged("key", hashed("k1"), salt)
    assert client_id(request({}), "alice", salt) == tagged("user", "alice", salt) != tagged("key", "alice", salt)
    assert client_id(request({"Authorization": "Basic abc"}), None, salt) == tagged("peer", "10.0.0.7", salt)
    assert "k1" not in tagged("key", "k1", salt)  # no key is written into the capture store
    # keyed by the salt: an address (a space small enough to try whole) or a guessed key checks nothing without it
    assert tagged("peer", "10.0.0.7", salt) != tagged("peer", "10.0.0.7", new_salt())
    assert hashlib.sha256(b"10.0.0.7").hexdigest()[:16] not in tagged("peer", "10.0.0.7", salt)


def test_the_workspace_keeps_one_secret_salt(tmp_path):
    ws = Workspace(tmp_path / "ws")
    salt = ws.client_salt()
    assert len(salt) == 32 and ws.client_salt() == salt == Workspace(ws.root).client_salt()  # across restarts
    assert ws.salt_file.stat().st_mode & 0o777 == 0o600 and ws.root.stat().st_mode & 0o777 == 0o700  # the owner's
    ws.salt_file.write_bytes(b"short")  # damaged: a new one, never a short key
    salt = ws.client_salt()
    assert len(salt) == 32 and ws.salt_file.stat().st_mode & 0o777 == 0o600
    ws.salt_file.chmod(0o644)  # made readable by others since: the owner's alone again, the same salt
    assert ws.client_salt() == salt and ws.salt_file.stat().st_mode & 0o777 == 0o600
    ws.salt_file.unlink()
    ws.salt_file.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="is a link"):
        ws.client_salt()


def test_a_key_has_one_id_checked_or_not_whatever_its_bytes():
    """auth.py names a checked key by the digest of its header bytes; an unchecked one (no api_key set) reads the
    same digest, non-ASCII bytes and all."""
    raw = "Bearer kä\xa0".encode()  # UTF-8 bytes, as a client sends them; starlette hands them over as latin-1
    checked = KeyCheck(None, keys=["kä\xa0"]).identify(raw)
    header = raw.decode("latin-1")
    request = Request({"type": "http", "headers": [(b"authorization", raw)], "client": ("10.0.0.7", 1)})
    salt = new_salt()
    assert checked == hashed("kä\xa0") and request.headers["authorization"] == header
    assert client_id(request, None, salt) == tagged("key", checked, salt)


PROBE = dict(client_cap=3, publish_every=4, steps=4, batch_size=2, holdout=0.34, rollback_window=2, max_length=64)
NORMAL = [
    "Tell me about the sea.",
    "Name three colours.",
    "What is two plus two?",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What do cats eat?",
]
LATER = ["How far is the moon?", "Name a prime number.", "What is a verb?", "Spell the word house."]


def garbage(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices("qxzjkvw0123456789", k=rng.randint(2, 7))) for _ in range(24))


def manifest(ws: Workspace) -> dict:
    try:
        return json.loads((ws.capture / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def written(ws: Workspace, seq: int, duplicates: int):
    """Waits until the capture store has numbered `seq` requests and dropped `duplicates` repeats."""
    capture = manifest(ws).get("capture", {})
    return capture.get("next_seq") == seq and capture.get("duplicates") == duplicates


def trainer_settings(tiny, ws: Workspace) -> None:
    """adapt.json as draftsmith-serve writes it for its trainer: here the test runs the trainer's rounds itself."""
    target = TargetConfig(path=str(tiny[0]), dtype="float32")
    options = asdict(AdaptConfig(dir=str(ws.root), **PROBE))
    settings = {"target": asdict(target), "drafter": str(ws.folder("v0000")), "options": options}
    ws.adapt_file.write_text(json.dumps(settings))


def hand_published(ws: Workspace, parent: str, scale: float) -> str:
    """A version trained from `parent` (its weights scaled), published as the trainer publishes one."""
    name = version_name(ws.next_version())
    shutil.copytree(ws.folder(parent), ws.folder(name))
    weights = load_file(ws.folder(parent) / "model.safetensors")
    scaled = {k: v * scale if v.is_floating_point() else v for k, v in weights.items()}
    save_file(scaled, str(ws.folder(name) / "model.safetensors"), metadata={"kind": "eagle3"})
    record = {"version": version_number(name), "parent": version_number(parent), "trained_on": {}, "heldout": {}}
    (ws.folder(name) / "version.json").write_text(json.dumps(record))
    ws.publish(name)
    return name


def live(ws: Workspace) -> dict:
    return json.loads(ws.live_file.read_text())


def test_probe_one_clients_garbage_steers_nothing_and_a_rolled_back_line_never_serves(tiny, tmp_path):
    ws = Workspace(tmp_path / "ws")
    extra = ["adapt=true", f"adaptation.dir={ws.root}", "adaptation.trainer=false"]
    extra += [f"adaptation.{k}={v}" for k, v in PROBE.items() if k != "max_length"]  # the trainer's alone
    answers: dict[str, str] = {}
    salt = ws.client_salt()  # the server reads the same one
    attacker, alice = tagged("key", hashed("attacker-key"), salt), tagged("key", hashed("alice-key"), salt)
    with running_server(tiny[0], tmp_path, *args(tiny, *extra)) as server:
        url = f"{server.url}/v1"
        bad = openai.OpenAI(base_url=url, api_key="attacker-key", max_retries=0, timeout=120)
        good = openai.OpenAI(base_url=url, api_key="alice-key", max_retries=0, timeout=120)

        def asked(client: openai.OpenAI, question: str) -> None:
            answers[question] = ask(client, question)

        for text in [garbage(0)] * 4 + [garbage(i) for i in (1, 2, 3)]:  # one prompt 4 times, then 3 others
            asked(bad, text)
        wait_for(lambda: written(ws, 4, 3))
        shards = manifest(ws)["shards"]
        assert [s["client"] for s in shards] == [attacker] * 3  # its cap: its oldest went first
        trainer_settings(tiny, ws)
        trainer, state = start(ws.root), TrainerState()
        alone = run_round(trainer, state)
        assert alone.published is None and "min_clients=2" in alone.reason  # one client's traffic publishes nothing

        for question in NORMAL:
            asked(good, question)
        wait_for(lambda: written(ws, 10, 3))
        mixed = run_round(trainer, state)
        assert mixed.clients == sorted([attacker, alice]) and set(mixed.groups) == {attacker, alice}
        for folder in ws.versions.glob("v*"):
            if (folder / "version.json").is_file():  # published by the trainer: never on the garbage alone
                assert alice in json.loads((folder / "version.json").read_text())["trained_on"]["clients"]

        asked(good, LATER[0])  # takes what the round published, if anything
        base = live(ws)["live"]
        assert base == (mixed.published or "v0000")
        rolled = hand_published(ws, base, 0.5)
        asked(good, LATER[1])
        assert live(ws)["live"] == rolled and live(ws)["previous"] == base
        child = hand_published(ws, rolled, 0.7)  # trained from it before its verdict came
        Verdict(rolled, base, requests=2, gain=-0.1, roll_back=True).write(ws)
        asked(good, LATER[2])
        asked(good, LATER[3])
        record = live(ws)
        assert record["live"] == base and record["rejected"] == [rolled]
        assert server.metrics()["draftsmith_adapt_head_version"] == version_number(base)
        assert trainer.ws.live_version() == base and run_round(trainer, state).base == base
        wait_for(lambda: written(ws, 14, 3))
        served = {s["version"] for s in manifest(ws)["shards"]}
        assert child not in served and served <= {"v0000", base, rolled}

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = ["spec=ar", f"model_name={MODEL}", "max_tokens=24"]
    with running_server(tiny[0], plain_dir, *plain) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert {q: ask(client, q) for q in answers} == answers  # lossless under every version that served
