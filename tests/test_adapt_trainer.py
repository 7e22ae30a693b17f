"""The adaptation trainer (train/adapt/) on a tiny target: a capture store written in the server's format from
the target's real features, a replay cache, rounds that publish (or not) atomically, damaged shards skipped, a
publish killed half-way, rollbacks followed, and the offline tau's run counting. No client steers it: each client's
held-back requests judge as one group (identical prompts once), one client alone publishes nothing, a candidate that
loses on any group is refused, a rolled-back version's line is never trained from, and a live version is judged
against the one it replaced on the same requests it served."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.heads.drafter_folder import Recipe, TargetInfo, read_meta, save_drafter
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.kinds import DraftShape
from draftsmith.serve.adapt.capture import prompt_digest
from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.verdict import Verdict
from draftsmith.serve.adapt.versions import Workspace
from draftsmith.serve.drafters import load_drafter
from draftsmith.serve.models.target import load_target
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.adapt import publish
from draftsmith.train.adapt.data import Shard, split_heldout
from draftsmith.train.adapt.gate import offline_tau, run_lengths
from draftsmith.train.adapt.groups import GroupScore, refusal
from draftsmith.train.adapt.loop import start
from draftsmith.train.adapt.review import review
from draftsmith.train.adapt.round import Abandoned, TrainerState, run_round
from draftsmith.train.features import target_states
from helpers import ENV, export_drafters

LAYERS = (0, 1, 2)  # EAGLE-3's default layers of the 3-layer tiny target
FAST = dict(publish_every=4, holdout=0.25, steps=40, batch_size=4, lr=3e-3, ttt_steps=2, max_length=64)
FAST |= dict(min_gain=0.0)  # the tiny head's gains are small; the default's reason is in docs/serving.md


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory, one_thread):
    """(target config, loaded target, a v0000 eagle3 drafter folder drafting chains of 3, requests' tensors, an
    EAGLE-1 drafter folder)."""
    root = tmp_path_factory.mktemp("adapt")
    tcfg, drafters, _ = export_drafters(tiny_llama_dir("llama"), root)
    target = load_target(tcfg)
    c = target.model.config
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(c, draft_vocab_size=c.vocab_size), target.model)
    info = read_meta(root / "eagle3")["target"]
    folder = save_drafter(
        head, head.config, "eagle3", TargetInfo(**info), Recipe(data="tiny"), root / "v0000", draft=DraftShape(3, 1)
    )
    return tcfg, target, folder, requests(target, 16), drafters["eagle"]


def requests(target, count: int) -> list[dict]:
    """Chats of the tiny target: a short random prompt and 24 tokens of its greedy answer, with their features."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 128, (1, 5), generator=g)
        for _ in range(24):
            hidden, _ = target.model.hidden_states(ids)
            ids = torch.cat([ids, target.model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)], 1)
        hidden, aux = target_states(target.model, ids, LAYERS)
        mask = torch.tensor([0] * 5 + [1] * 24, dtype=torch.uint8)
        out.append({"input_ids": ids[0].int(), "loss_mask": mask, "hidden": hidden[0], "aux": aux[0]})
    return out


def write_capture(folder: Path, reqs: list[dict], clients: list[str] | None = None, version: str = "v0000") -> None:
    """One shard per request as the server writes them (the last row never ran: have=0, zeros), and the manifest;
    clients: each request's (None: a store written before clients were recorded)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for seq, r in enumerate(reqs):
        n = r["input_ids"].shape[0]
        have = torch.ones(n, dtype=torch.uint8)
        have[-1] = 0
        hidden, aux = r["hidden"].clone(), r["aux"].clone()
        hidden[-1], aux[-1] = 0, 0
        tensors = {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "offsets": torch.tensor([0, n])}
        tensors |= {"hidden": hidden.bfloat16(), "aux": aux.bfloat16(), "have": have}
        name = f"shard-{seq:08d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"seq": str(seq), "version": version})
        shards.append({"file": name, "examples": 1, "seq": seq, "bytes": (folder / name).stat().st_size})
        shards[-1] |= {"version": version, "prompt": prompt_digest(r["input_ids"][:5].tolist())}
        if clients is not None:
            shards[-1]["client"] = clients[seq]
    key = {"format_version": 1, "target": "tiny", "layers": list(LAYERS), "dtype": "bfloat16", "source": "capture"}
    manifest = {"key": key, "target": "tiny", "layers": list(LAYERS), "dtype": "bfloat16", "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def write_replay(folder: Path, reqs: list[dict], target_id: str) -> Path:
    """A train/features.py cache of reqs in one shard."""
    folder.mkdir(parents=True)
    lengths = [r["input_ids"].shape[0] for r in reqs]
    tensors = {k: torch.cat([r[k] for r in reqs]) for k in ("input_ids", "loss_mask")}
    tensors |= {k: torch.cat([r[k] for r in reqs]).bfloat16() for k in ("hidden", "aux")}
    tensors["offsets"] = torch.tensor([0, *lengths]).cumsum(0)
    save_file(tensors, str(folder / "shard-00000.safetensors"))
    manifest = {"target": target_id, "layers": list(LAYERS), "dtype": "bfloat16"}
    manifest["shards"] = [{"file": "shard-00000.safetensors", "examples": len(reqs)}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def workspace(tmp_path: Path, tiny, replay: bool = True, clients: list[str] | None = None, **options) -> Path:
    """ADAPT_DIR as the server leaves it: adapt.json, versions/v0000, 12 captured requests."""
    tcfg, target, v0000, reqs, _ = tiny
    root = tmp_path / "adapt"
    shutil.copytree(v0000, root / "versions" / "v0000")
    write_capture(root / "capture", reqs[:12], clients)
    folder = write_replay(tmp_path / "replay", reqs[12:], target.target_id) if replay else None
    opts = {**FAST, "replay": str(folder) if folder else None, **options}
    adapt = {"target": asdict(tcfg), "drafter": str(root / "versions" / "v0000"), "options": opts}
    (root / "adapt.json").write_text(json.dumps(adapt))
    return root


def test_run_lengths_count_leading_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert run_lengths(hits).tolist() == [2, 0, 4, 1]
    starts = torch.tensor([True, True, False, True])
    assert offline_tau(run_lengths(hits), starts) == pytest.approx(1 + (2 + 0 + 1) / 3)
    assert offline_tau(run_lengths(hits), torch.zeros(4, dtype=torch.bool)) == 1.0


def test_a_better_candidate_is_published(tmp_path, tiny):
    root = workspace(tmp_path, tiny)
    trainer = start(root)
    result = run_round(trainer, TrainerState())
    assert result.published == "v0001", result
    assert result.tau_candidate > result.tau_live
    assert (result.captured, result.heldout, result.skipped) == (9, 3 + 1, 0) and result.replay == 3  # 1: replay's
    assert set(result.groups) == {"unknown", "replay"}  # the store's requests (no clients recorded) and the replay
    versions = root / "versions"
    assert (versions / "LATEST").read_text() == "v0001\n"
    record = json.loads((versions / "v0001" / "version.json").read_text())
    assert record["version"] == 1 and record["parent"] == 0 and record["trained_on"]["steps"] == FAST["steps"]
    parent, child = read_meta(versions / "v0000"), read_meta(versions / "v0001")
    assert all(child[k] == parent[k] for k in ("kind", "target", "config", "draft"))
    assert child["recipe"]["extra"]["adapted_from"] == "v0000"
    head = load_drafter(
        SpecConfig(name="eagle3", drafter=str(versions / "v0001")), trainer.target, trainer.target.model
    )
    assert head is not None
    row = json.loads((root / "trainer.jsonl").read_text().splitlines()[-1])
    assert row["published"] == "v0001" and row["cpu_s"] > 0 and row["loss"] is not None


def test_nothing_is_published_below_min_gain(tmp_path, tiny):
    root = workspace(tmp_path, tiny, replay=False, min_gain=100.0, steps=3, min_clients=1)
    result = run_round(start(root), TrainerState())
    assert result.published is None and "not above" in result.reason and result.replay == 0
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v0000"]


def test_damaged_shards_are_skipped(tmp_path, tiny, caplog):
    root = workspace(tmp_path, tiny, steps=3, min_gain=100.0)  # 3 steps of 4: room for all 9 training requests
    (root / "capture" / "shard-00000001.safetensors").unlink()
    corrupt = root / "capture" / "shard-00000002.safetensors"
    corrupt.write_bytes(corrupt.read_bytes()[:200])
    with caplog.at_level(logging.WARNING):
        result = run_round(start(root), TrainerState())
    assert result.skipped == 2 and result.captured + result.heldout == 7 + 3 + 1 and result.steps == 3
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 2
    assert json.loads((root / "trainer.jsonl").read_text())["skipped"] == 2


def test_a_publish_killed_half_way_leaves_latest_whole(tmp_path, tiny, monkeypatch):
    root = workspace(tmp_path, tiny)
    versions = root / "versions"
    (versions / "LATEST").write_text("v0000\n")
    rename = publish.os.replace

    def killed(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt("killed mid-publish")
        rename(src, dst)

    monkeypatch.setattr(publish.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run_round(start(root), TrainerState())
    monkeypatch.setattr(publish.os, "replace", rename)
    assert (versions / "LATEST").read_text() == "v0000\n"
    assert (versions / ".v0001.partial" / "version.json").is_file()
    (versions / "..v0002.partial-abc").mkdir()  # a save_drafter temp folder of a kill earlier still
    start(root)
    assert sorted(p.name for p in versions.iterdir()) == ["LATEST", "v0000"]


def test_rounds_start_from_the_live_version(tmp_path, tiny):
    root = workspace(tmp_path, tiny, steps=2, min_gain=100.0)
    versions = root / "versions"
    for name in ("v0001", "v0002"):
        shutil.copytree(versions / "v0000", versions / name)
    live = {"live": "v0001", "previous": "v0002", "rejected": ["v0002"], "tau": {}}
    (root / "live.json").write_text(json.dumps(live))
    trainer, state = start(root), TrainerState()
    assert run_round(trainer, state).base == "v0001"
    (root / "live.json").write_text(json.dumps({**live, "live": "v0002"}))  # a rejected one is never trained on
    assert run_round(trainer, state).base == "v0001"  # the newest version not rolled back
    assert trainer.ws.next_version() == 3
    shutil.copytree(versions / "v0000", versions / "v0003")
    trainer.ws.publish("v0003")  # published, not swapped in yet: the next round goes on from it, not from live
    assert run_round(trainer, state).base == "v0003"


def test_rounds_never_continue_a_rolled_back_versions_line(tmp_path, tiny):
    root = workspace(tmp_path, tiny, steps=2, min_gain=100.0)
    versions = root / "versions"
    for number, parent in ((1, 0), (2, 1), (3, 2)):  # v0002 trained from v0001 before v0001 was rolled back
        shutil.copytree(versions / "v0000", versions / f"v000{number}")
        (versions / f"v000{number}" / "version.json").write_text(json.dumps({"version": number, "parent": parent}))
    (versions / "LATEST").write_text("v0003\n")
    live = {"live": "v0000", "previous": None, "rejected": ["v0001"], "tau": {}}
    (root / "live.json").write_text(json.dumps(live))
    trainer, state = start(root), TrainerState()
    assert run_round(trainer, state).base == "v0000"
    assert trainer.ws.tainted("v0003", ["v0001"]) and not trainer.ws.tainted("v0000", ["v0001"])


def test_a_line_that_cannot_be_read_to_its_root_is_never_served(tmp_path):
    """v0003's parent v0002 (a child of the rejected v0001) deleted by hand, or a version.json unreadable: its line
    cannot be checked, so it counts as tainted."""
    ws = Workspace(tmp_path)
    ws.versions.mkdir(parents=True)
    for number, parent in ((0, None), (3, 2), (4, 0)):
        folder = ws.versions / f"v000{number}"
        folder.mkdir()
        if parent is not None:
            (folder / "version.json").write_text(json.dumps({"version": number, "parent": parent}))
    assert ws.tainted("v0003", ["v0001"]) and not ws.tainted("v0004", ["v0001"])
    (ws.versions / "v0004" / "version.json").write_text("{not json")
    assert ws.tainted("v0004", []) and not ws.tainted("v0000", [])


def test_min_gain_defaults_above_zero():
    assert AdaptConfig().min_gain > 0 and AdaptConfig().min_clients >= 2 and AdaptConfig().client_cap >= 1


def test_the_held_back_slice_spans_clients_and_counts_a_prompt_once():
    normal = [Shard(f"b{i}", i, "user:bob", f"p{i}") for i in range(8)]
    burst = [Shard(f"a{i}", 8 + i, "key:attacker", "garbage" if i < 4 else f"g{i}") for i in range(8)]
    split = split_heldout(normal + burst, 0.25)
    held = {s.client for s in split.heldout}
    assert held == {"user:bob", "key:attacker"}  # not the newest requests, which are all the attacker's
    assert [s.client for s in split.heldout].count("key:attacker") == 1  # 5 distinct prompts: 4 repeats count once
    everything = split.train + split.heldout
    assert len(everything) == 8 + 5 and sum(s.prompt == "garbage" for s in everything) == 1
    assert not {s.file for s in split.train} & {s.file for s in split.heldout}
    again = split_heldout(normal + burst + [Shard(f"a{i}", 90 + i, "key:attacker", f"h{i}") for i in range(8)], 0.25)
    bob = [s.file for s in split.heldout if s.client == "user:bob"]
    assert [s.file for s in again.heldout if s.client == "user:bob"] == bob  # another client's burst moves nothing


def test_one_clients_traffic_alone_publishes_nothing(tmp_path, tiny):
    root = workspace(tmp_path, tiny, replay=False, clients=["key:attacker"] * 12, min_clients=2)
    result = run_round(start(root), TrainerState())
    assert result.published is None and "min_clients=2" in result.reason and result.steps == 0
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v0000"]


def test_a_candidate_that_loses_on_any_client_is_refused():
    def scores(**gains: float) -> dict[str, GroupScore]:
        return {name: GroupScore(4, 1.5, 1.5 + gain) for name, gain in gains.items()}

    assert "loses" in refusal(scores(attacker=0.3, bob=-0.05), 2, 0.02)  # a big gain on one client's own text
    assert "not above" in refusal(scores(attacker=0.03, bob=0.0), 2, 0.02)
    assert refusal(scores(attacker=0.05, bob=0.01), 2, 0.02) is None
    assert "min_clients" in refusal(scores(attacker=0.5), 2, 0.02)


def test_a_live_version_is_judged_against_the_one_it_replaced_on_the_requests_it_served(tmp_path, tiny):
    clients = ["key:a", "key:b"] * 6
    root = workspace(tmp_path, tiny, clients=clients, rollback_window=4)
    trainer = start(root)
    assert run_round(trainer, TrainerState()).published == "v0001"  # better on held-out requests
    versions, capture = root / "versions", root / "capture"
    shutil.copytree(versions / "v0000", versions / "v0002")  # the untrained head again: worse than v0001
    (root / "live.json").write_text(json.dumps({"live": "v0002", "previous": "v0001", "rejected": []}))
    assert review(trainer) is None  # it has served nothing yet
    write_capture(capture, tiny[3][:6], clients[:6], version="v0002")
    verdict = review(trainer)
    assert verdict is not None and verdict.roll_back and verdict.gain < 0 and verdict.against == "v0001"
    assert set(verdict.groups) == {"key:a", "key:b"} and verdict.requests == 6
    assert Verdict.read(trainer.ws, "v0002") == verdict and review(trainer) is None  # judged once
    (root / "live.json").write_text(json.dumps({"live": "v0001", "previous": "v0000", "rejected": ["v0002"]}))
    write_capture(capture, tiny[3][:6], clients[:6], version="v0001")
    kept = review(trainer)
    assert kept is not None and not kept.roll_back and kept.gain > 0


def test_a_stopped_round_publishes_nothing(tmp_path, tiny):
    root = workspace(tmp_path, tiny)
    with pytest.raises(Abandoned):
        run_round(start(root), TrainerState(stop=True))
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v0000"]
    assert json.loads((root / "trainer.jsonl").read_text())["reason"].startswith("abandoned")


def test_an_eagle_head_adapts_too(tmp_path, tiny):
    root = workspace(tmp_path, tiny, steps=2, min_gain=100.0)
    shutil.rmtree(root / "versions" / "v0000")
    shutil.copytree(tiny[4], root / "versions" / "v0000")
    result = run_round(start(root), TrainerState())
    assert result.steps == 2 and result.tau_live is not None and result.loss is not None


def test_the_command_runs_rounds_and_stops_on_sigterm(tmp_path, tiny):
    root = workspace(tmp_path, tiny, steps=2, min_gain=100.0)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), ENV["PYTHONPATH"]])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.train.adapt", str(root)], env=env, text=True, stderr=subprocess.PIPE
    )
    journal = root / "trainer.jsonl"
    deadline = time.monotonic() + 600  # a hang's guard only: a loaded 2-core CI machine took over 120 s
    while not journal.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(journal.read_text().splitlines()[0])["round"] == 1
    assert "stopped" in err


def test_rows_restored_from_the_prefix_cache_are_not_read_as_context(tiny, tmp_path):
    from draftsmith.train.adapt.data import read_shard

    r = requests(tiny[1], 1)[0]
    n = r["input_ids"].shape[0]
    have = torch.ones(n, dtype=torch.uint8)
    have[:3] = 0  # a prefix-cache hit: no forward ran the first rows, they are zeros
    tensors = {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "offsets": torch.tensor([0, n])}
    tensors |= {"hidden": r["hidden"].bfloat16(), "aux": r["aux"].bfloat16(), "have": have}
    save_file(tensors, str(tmp_path / "s.safetensors"))
    item = read_shard(tmp_path / "s.safetensors", LAYERS, list(LAYERS))
    assert torch.equal(item["input_ids"], r["input_ids"][3:].long())
    assert item["loss_mask"][0] == 0 and item["loss_mask"].sum() == 24


def test_a_round_is_due_on_requests_captured_even_when_the_store_evicted_them(tiny, tmp_path):
    from draftsmith.serve.adapt.config import AdaptConfig
    from draftsmith.serve.adapt.versions import Workspace
    from draftsmith.train.adapt.loop import due, hold_lock, orphaned
    from draftsmith.train.adapt.round import Trainer

    root = workspace(tmp_path, tiny)
    manifest = json.loads((root / "capture" / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][-2:]  # a cap of two requests: ten evicted
    manifest["capture"] = {"next_seq": 12}
    (root / "capture" / "manifest.json").write_text(json.dumps(manifest))
    trainer = Trainer(Workspace(root), AdaptConfig(publish_every=8), tiny[1], None)
    assert due(trainer, TrainerState())
    assert not due(trainer, TrainerState(last_seq=6))
    assert not orphaned(os.getppid()) and orphaned(os.getppid() + 1)
    lock = hold_lock(Workspace(root))
    second = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from draftsmith.train.adapt.loop import hold_lock; from pathlib import Path; "
            f"from draftsmith.serve.adapt.versions import Workspace; hold_lock(Workspace(Path({str(root)!r})))",
        ],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert second.returncode != 0 and "another trainer runs" in second.stderr
    lock.close()
