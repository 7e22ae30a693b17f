"""Online adaptation, the server's side (serve/adapt/): the capture of each request from the forwards the engine
ran, the bounded store the trainer reads as a feature cache (identical prompts once, each client capped), head
versions swapped in between requests, the rollback of a version the trainer's paired verdict judged worse, and a
rolled-back version's line never served. Output stays the target's throughout."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.serve.adapt import store as store_module
from draftsmith.serve.adapt.adaptation import Adaptation
from draftsmith.serve.adapt.capture import Captured, CaptureObserver
from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.judge import LiveTally
from draftsmith.serve.adapt.store import CaptureStore
from draftsmith.serve.adapt.verdict import Verdict
from draftsmith.serve.adapt.versions import LiveRecord, Workspace
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import load_target
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.features import CachedFeatures
from helpers import PROMPTS, export_drafters

GREEDY = SamplingParams()
MAX_NEW = 20

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    tcfg, drafters, _ = export_drafters(tiny_llama_dir("llama"), tmp_path_factory.mktemp("adapt"))
    return tcfg, drafters["eagle3"], load_target(tcfg)


def engine_for(setup, prefix_cache: bool = True):
    tcfg, drafter, target = setup
    spec = SpecConfig(name="eagle3", drafter=str(drafter), num_tokens=3)
    return build_engine(target, spec, prefix_cache, 128), spec


def capture(engine, prompt: list[int], max_new: int = MAX_NEW, client: str = "local") -> tuple[list[int], Captured]:
    got: list[Captured] = []
    g = engine.generate(prompt, max_new, GREEDY, CaptureObserver(prompt, "v0000", got.append, client))
    assert len(got) == 1
    return g.output_ids, got[0]


def test_capture_holds_the_features_a_fresh_forward_gives(setup):
    engine, _ = engine_for(setup)
    prompt = PROMPTS[2]  # 20 tokens: one 16-token block to restore from the prefix cache
    out, c = capture(engine, prompt)
    ids = torch.tensor(prompt + out)
    assert torch.equal(c.input_ids.long(), ids)
    assert c.loss_mask.tolist() == [0] * len(prompt) + [1] * len(out)
    assert c.have[:-1].all() and c.have[-1] == 0  # every row ran but the last token's
    hidden, aux = setup[2].model.hidden_states(ids[None], engine.target_layers)
    have = c.have.bool()
    torch.testing.assert_close(c.hidden[have].float(), hidden[0][have].float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(c.aux[have].float(), torch.cat(aux, -1)[0][have].float(), atol=0.05, rtol=0.02)
    # the same prompt again: its leading blocks come from the prefix cache, and no forward ran them
    _, again = capture(engine, prompt)
    assert again.have[:16].sum() == 0 and again.hidden[:16].abs().sum() == 0
    assert again.have[len(prompt) : -1].all()


def test_capture_changes_no_output(setup):
    engine, _ = engine_for(setup, prefix_cache=False)
    for prompt in PROMPTS[:3]:
        plain = engine.generate(prompt, MAX_NEW, GREEDY).output_ids
        assert capture(engine, prompt)[0] == plain


def test_the_store_is_a_feature_cache_the_trainer_reads(setup, tmp_path):
    engine, _ = engine_for(setup, prefix_cache=False)
    store = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30)
    made = [capture(engine, p)[1] for p in PROMPTS[:3]]
    for c in made:
        store.add(c)
    store.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["examples"] == 3 and manifest["tokens"] == sum(c.tokens for c in made)
    data = CachedFeatures(tmp_path, manifest, tuple(engine.target_layers))
    for i, c in enumerate(made):
        item = data[i]
        assert torch.equal(item["input_ids"], c.input_ids.long())
        assert torch.equal(item["hidden"], c.hidden) and torch.equal(item["aux"], c.aux)
        assert torch.equal(item["loss_mask"], c.loss_mask.float())
    with safe_open(str(tmp_path / manifest["shards"][0]["file"]), "pt") as f:
        assert f.metadata()["version"] == "v0000" and f.metadata()["seq"] == "0"


def test_past_its_cap_the_oldest_requests_go_first(setup, tmp_path):
    engine, _ = engine_for(setup, prefix_cache=False)
    made = [capture(engine, p)[1] for p in PROMPTS[:4]]
    store = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1)
    for c in made[:3]:
        store.add(c)
    store.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["seq"] for s in manifest["shards"]] == [2] and manifest["capture"]["evicted"] == 2
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000002.safetensors"]
    again = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30)  # a restart numbers on
    again.add(made[3])
    again.close()
    assert [s["seq"] for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]] == [2, 3]
    with pytest.raises(ValueError, match="another target"):
        CaptureStore(tmp_path, "other", engine.target_layers, cap_bytes=1)


def test_shards_captured_under_another_client_salt_are_dropped(setup, tmp_path):
    """Client ids keyed with another salt name the same clients differently (and one made without a salt could
    confirm a guessed key): a restart under a new salt drops them rather than count a client twice."""
    engine, _ = engine_for(setup, prefix_cache=False)
    made = [capture(engine, p, client="key:a")[1] for p in PROMPTS[:2]]
    store = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30, client_ids="salt-one")
    store.add(made[0])
    store.close()
    same = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30, client_ids="salt-one")
    same.close()
    assert len(same.shards) == 1
    other = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30, client_ids="salt-two")
    other.add(made[1])
    other.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["seq"] for s in manifest["shards"]] == [1] and manifest["client_ids"] == "salt-two"
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000001.safetensors"]


def test_identical_prompts_count_once_and_each_client_keeps_its_cap(setup, tmp_path):
    engine, _ = engine_for(setup, prefix_cache=False)
    store = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30, client_cap=2)
    garbage = [capture(engine, PROMPTS[0], client="key:attacker")[1] for _ in range(4)]  # the same prompt, 4 times
    garbage += [capture(engine, p, client="key:attacker")[1] for p in PROMPTS[1:4]]
    normal = [capture(engine, p, client="user:alice")[1] for p in (PROMPTS[4], PROMPTS[4][1:])]
    for c in [normal[0], *garbage, normal[1]]:
        store.add(c)
    store.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    clients = [s["client"] for s in manifest["shards"]]
    assert clients.count("key:attacker") == 2 and clients.count("user:alice") == 2  # the first normal one stays
    assert manifest["capture"]["duplicates"] == 3
    kept = [s["prompt"] for s in manifest["shards"] if s["client"] == "key:attacker"]
    assert kept == [garbage[-2].meta["prompt"], garbage[-1].meta["prompt"]]  # the client's own oldest went
    assert len({s["prompt"] for s in manifest["shards"]}) == 4
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == sorted(s["file"] for s in manifest["shards"])


def test_past_the_byte_cap_the_heaviest_client_gives_up_its_own_requests(setup, tmp_path):
    engine, _ = engine_for(setup, prefix_cache=False)
    victim = [capture(engine, p, client="user:alice")[1] for p in PROMPTS[:2]]
    burst = [p[cut:] for p in PROMPTS[2:] for cut in range(3)]  # distinct prompts: none counted as a duplicate
    attacker = [capture(engine, p, client="key:attacker")[1] for p in burst]
    sizes = CaptureStore(tmp_path / "size", "tiny", engine.target_layers, cap_bytes=1 << 30)
    for c in victim + attacker:
        sizes.add(c)
    sizes.close()  # the writes are done
    held = {
        client: sum(s["bytes"] for s in sizes.shards if s["client"] == client)
        for client in ("user:alice", "key:attacker")
    }
    cap = held["user:alice"] + held["key:attacker"] // 3  # the burst passes it; the victim holds under half of it
    assert held["user:alice"] <= cap // 2
    store = CaptureStore(tmp_path / "store", "tiny", engine.target_layers, cap_bytes=cap, client_cap=64)
    for c in victim + attacker:  # the victim first, then the burst
        store.add(c)
    store.close()
    clients = [s["client"] for s in json.loads((tmp_path / "store" / "manifest.json").read_text())["shards"]]
    assert clients.count("user:alice") == 2 and 0 < clients.count("key:attacker") < len(attacker)


def test_a_full_disk_stops_capture_not_serving(setup, tmp_path, monkeypatch, caplog):
    engine, _ = engine_for(setup, prefix_cache=False)
    store = CaptureStore(tmp_path, "tiny", engine.target_layers, cap_bytes=1 << 30)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "save_file", full)
    out, c = capture(engine, PROMPTS[0])
    store.add(c)
    store.close()
    assert store.stopped and "No space left" in store.stopped
    assert "capture stopped, serving goes on" in caplog.text
    assert json.loads((tmp_path / "manifest.json").read_text())["capture"]["stopped"]
    assert not list(tmp_path.glob("*shard*"))  # no half-written shard
    assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids == out


def nudged_version(ws: Workspace, version: str, scale: float, parent: int | None = None) -> None:
    """A published head version: v0000's weights scaled, written like the trainer writes one (version.json naming
    its parent, when given)."""
    src = ws.folder("v0000")
    out = ws.folder(version)
    shutil.copytree(src, out)
    weights = {k: v * scale if v.is_floating_point() else v for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"kind": "eagle3"})
    if parent is not None:
        (out / "version.json").write_text(json.dumps({"version": int(version[1:]), "parent": parent}))
    ws.publish(version)


def adaptation_for(setup, tmp_path, window: int = 2) -> Adaptation:
    tcfg, _, target = setup
    engine, spec = engine_for(setup)
    cfg = AdaptConfig(dir=str(tmp_path / "ws"), trainer=False, rollback_window=window)
    return Adaptation(cfg, target, tcfg, spec, engine)


def serve(a: Adaptation, prompt: list[int]) -> list[int]:
    a.between_requests()
    return a.engine.generate(prompt, MAX_NEW, GREEDY, a.observer(prompt)).output_ids


def test_a_published_version_is_swapped_in_between_requests(setup, tmp_path):
    a = adaptation_for(setup, tmp_path)
    plain = [a.engine.generate(p, MAX_NEW, GREEDY).output_ids for p in PROMPTS[:4]]
    assert a.ws.latest() == "v0000" and (a.ws.folder("v0000") / "model.safetensors").is_file()
    drafted = json.loads((a.ws.folder("v0000") / "config.json").read_text())["draft"]
    assert drafted["num_tokens"] == 3  # the shape served (spec.num_tokens=3), not the folder's own
    first = a.engine.proposer
    assert [serve(a, p) for p in PROMPTS[:2]] == plain[:2]
    nudged_version(a.ws, "v0001", 0.5)
    assert [serve(a, p) for p in PROMPTS[2:4]] == plain[2:]  # the new head drafts, the target decides
    assert a.engine.proposer is not first and a.record.live == "v0001" and a.record.previous == "v0000"
    assert LiveRecord.read(a.ws).live == "v0001"
    a.store.close()
    shards = json.loads((a.ws.capture / "manifest.json").read_text())["shards"]
    versions = [safe_open(str(a.ws.capture / s["file"]), "pt").metadata()["version"] for s in shards]
    assert versions == ["v0000", "v0000", "v0001", "v0001"]


def verdict(ws: Workspace, version: str, against: str, gain: float) -> None:
    """What the trainer writes once `version` served its window (train/adapt/review.py)."""
    Verdict(version, against, requests=2, gain=gain, roll_back=gain < 0).write(ws)


def test_a_version_the_trainer_judged_worse_is_rolled_back(setup, tmp_path):
    a = adaptation_for(setup, tmp_path, window=2)
    for _ in range(2):
        a.tally.served("v0000", accepted=10, drafts=10)  # live tau 2: not compared with another version's
    nudged_version(a.ws, "v0001", 0.5, parent=0)
    a.between_requests()
    assert a.record.live == "v0001"
    a.tally.served("v0001", accepted=0, drafts=10)  # a far lower live tau, on other requests: no judgment
    a.between_requests()
    assert a.record.live == "v0001"
    verdict(a.ws, "v0001", "v0000", gain=-0.2)
    a.between_requests()
    record = LiveRecord.read(a.ws)
    assert record.live == "v0000" and record.rejected == ["v0001"] and a.ws.latest() == "v0001"
    a.between_requests()
    assert a.record.live == "v0000"  # the rejected version is not taken again
    nudged_version(a.ws, "v0002", 0.8, parent=0)
    a.between_requests()
    assert a.record.live == "v0002"
    verdict(a.ws, "v0002", "v0000", gain=0.0)  # no worse on the same requests: it stays, for good
    a.between_requests()
    assert a.record.live == "v0002" and a.record.rejected == ["v0001"]
    a.store.close()


def test_a_rolled_back_versions_line_never_serves(setup, tmp_path):
    a = adaptation_for(setup, tmp_path)
    plain = a.engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids
    nudged_version(a.ws, "v0001", 0.5, parent=0)
    assert serve(a, PROMPTS[0]) == plain and a.record.live == "v0001"
    nudged_version(a.ws, "v0002", 0.7, parent=1)  # trained from v0001 while it served, published before its verdict
    verdict(a.ws, "v0001", "v0000", gain=-0.1)
    assert serve(a, PROMPTS[0]) == plain and a.record.live == "v0000" and a.record.rejected == ["v0001"]
    nudged_version(a.ws, "v0003", 0.9, parent=2)  # v0002's child: the line still descends from v0001
    assert serve(a, PROMPTS[0]) == plain and a.record.live == "v0000"
    assert a.ws.tainted("v0003", a.record.rejected) and a.ws.live_version() == "v0000"
    nudged_version(a.ws, "v0004", 0.6, parent=0)
    assert serve(a, PROMPTS[0]) == plain and a.record.live == "v0004" and a.ws.live_version() == "v0004"
    a.store.close()
    shards = json.loads((a.ws.capture / "manifest.json").read_text())["shards"]
    assert all(s["version"] in ("v0000", "v0001", "v0004") for s in shards)


def test_a_version_that_does_not_load_is_passed_over(setup, tmp_path):
    a = adaptation_for(setup, tmp_path)
    nudged_version(a.ws, "v0001", 0.5)
    (a.ws.folder("v0001") / "model.safetensors").write_bytes(b"garbage")
    out = serve(a, PROMPTS[0])
    assert a.record.live == "v0000" and a.record.rejected == ["v0001"]
    assert out == a.engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids
    a.store.close()


def test_the_live_tally_counts_only_requests_that_drafted():
    t = LiveTally()
    t.served("v0000", 8, 4)  # tau 3
    for _ in range(5):
        t.served("v0001", 0, 0)  # max_tokens=1, an EOS first: nothing drafted, nothing said about the head
    assert t.summary() == {"v0000": {"requests": 1, "accepted": 8, "drafts": 4, "tau": 3.0}}


def test_adapt_needs_a_drafter_that_reads_features(setup, tmp_path):
    tcfg, _, target = setup
    engine = build_engine(target, SpecConfig(name="ngram"), True, 128)
    with pytest.raises(ValueError, match="adapt=true adapts a trained drafter"):
        Adaptation(AdaptConfig(dir=str(tmp_path)), target, tcfg, SpecConfig(name="ngram"), engine)


def test_a_workspace_is_carried_on_only_with_its_own_drafter(setup, tmp_path):
    a = adaptation_for(setup, tmp_path)
    a.store.close()
    nudged_version(a.ws, "v0001", 0.5)
    with pytest.raises(ValueError, match="started with another drafter"):
        a.ws.start(a.ws.folder("v0001"))
    a.ws.start(setup[1])  # the same drafter: carried on
    (a.ws.live_file).write_text(json.dumps({"live": "v0007", "previous": None, "rejected": [], "tau": {}, "new": 1}))
    again = adaptation_for(setup, tmp_path)  # a live version that is gone: v0000 serves, unknown keys are ignored
    assert again.record.live == "v0000"
    again.store.close()
    a.ws.live_file.write_text("{not json")
    with pytest.raises(ValueError, match="live.json is unreadable"):
        adaptation_for(setup, tmp_path)
