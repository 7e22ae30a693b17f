"""The trainer on a tiny target with a stand-in head: loss goes down, features cache and are refused for another
target, checkpoints resume exactly (also past a corrupt one), and the command lines (hydra multirun, 2-process
CPU DDP through accelerate launch) work."""

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import standin_head
import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from draftsmith.heads import kinds
from draftsmith.heads.drafter_folder import load_token_counts, read_drafter
from draftsmith.heads.kinds import DraftShape
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.build import resolve_shape
from draftsmith.serve.drafters import target_info
from draftsmith.serve.models.target import TargetConfig, load_target, native_bf16
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.shared.wandb_run import WandbConfig
from draftsmith.train import acceptance as acceptance_mod
from draftsmith.train import features as features_mod
from draftsmith.train import trainer as trainer_mod
from draftsmith.train.config import RunConfig, TrainConfig
from draftsmith.train.data import DataConfig
from draftsmith.train.features import FeatureConfig
from draftsmith.train.head import HeadConfig
from draftsmith.train.trainer import train
from helpers import build_tiny_chat_target, cli_args, run_command, sum_chats

TESTS = Path(__file__).parent
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]  # this interpreter's, venv or not


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return sum_chats(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def target(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-target"), smollm2_dir)


@pytest.fixture(scope="module")
def other_target(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("other-target"), smollm2_dir, rms_norm_eps=1e-5)


def config(out, target, data, head: str = standin_head.KIND, **train) -> RunConfig:
    features = train.pop("features", FeatureConfig())
    tc = dict(max_steps=10, batch_size=4, grad_accum=2, lr=1e-2, warmup_steps=2, log_every=1, checkpoint_every=2)
    return RunConfig(
        out=str(out),
        target=TargetConfig(path=str(target), dtype="float32"),  # as cli_args: the same on every CPU
        head=HeadConfig(kind=head),
        data=DataConfig(source=data, max_conversations=None, max_length=64, heldout_fraction=0.1),
        train=TrainConfig(**{**tc, **train}, features=features),
        wandb=WandbConfig(enabled=False),
    )


def losses(out) -> list[tuple]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"]) for r in rows if "loss" in r]


def weights(out) -> dict:
    return load_file(str(Path(out) / "final" / "model.safetensors"))


def record_batches(monkeypatch) -> list[int]:
    """Each micro-batch's token-id checksum, in training order."""
    seen, original = [], trainer_mod.Loop.micro_step

    def micro_step(self, batch):
        seen.append(int(batch["input_ids"].sum()))
        return original(self, batch)

    monkeypatch.setattr(trainer_mod.Loop, "micro_step", micro_step)
    return seen


def kill_after(monkeypatch, step: int) -> None:
    """Simulate a kill right after optimizer step `step` (its checkpoint, if any, already written)."""
    original = trainer_mod.Loop.after_step

    def after_step(self, state, bar):
        original(self, state, bar)
        if state.step == step:
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(trainer_mod.Loop, "after_step", after_step)


@pytest.fixture(scope="module")
def uninterrupted(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run-a")
    with pytest.MonkeyPatch.context() as mp:
        seen = record_batches(mp)
        train(config(out, target, data))
    return out, seen


def test_loss_decreases_and_the_final_drafter_loads(uninterrupted, target):
    out, seen = uninterrupted
    rows = losses(out)
    assert [r[0] for r in rows] == list(range(1, 11))
    assert rows[-1][1] < 0.7 * rows[0][1]
    assert len(seen) == 20  # 10 steps x grad_accum 2
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "masked", "time"} <= line.keys()
    assert line["tokens_per_s"] > 0
    loaded = load_target(TargetConfig(path=str(target)))
    head = read_drafter(out / "final", target_info(loaded), loaded.model)
    assert torch.equal(head.proj.weight, weights(out)["proj.weight"])
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["kind"] == standin_head.KIND and meta["recipe"]["steps"] == 10 and meta["recipe"]["tokens"] > 0
    counts = load_token_counts(out / "final", loaded.model.config.vocab_size)  # of the answers, not the questions
    (anything,), (what,) = (loaded.tokenizer.encode(w, add_special_tokens=False) for w in (" Anything", "What"))
    assert counts[anything] >= 40 and counts[what] == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000008", "step-0000010"]
    mid_folder = out / "checkpoints" / "step-0000008" / "drafter"
    mid = read_drafter(mid_folder, target_info(loaded), loaded.model)
    assert json.loads((mid_folder / "config.json").read_text())["recipe"]["steps"] == 8
    assert not torch.equal(mid.proj.weight, head.proj.weight)  # a drafter as it stood at step 8


def test_resume_after_a_kill_continues_at_the_same_step_with_the_same_data(
    uninterrupted, target, data, tmp_path, monkeypatch, capsys
):
    ref_out, ref_seen = uninterrupted
    cfg = config(tmp_path, target, data)
    with monkeypatch.context() as mp:
        kill_after(mp, 7)  # checkpoints at 2, 4, 6 (2 kept); steps 1..7 logged
        first = record_batches(mp)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step")] != []
    assert losses(tmp_path)[-1][0] == 7
    with pytest.raises(ValueError, match="already holds checkpoints: pass resume=true"):
        train(cfg)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "epoch": 1.3, "lo')  # killed mid-write: a torn last line
    cfg.resume = True
    second = record_batches(monkeypatch)
    train(cfg)
    assert "resumed from" in capsys.readouterr().out
    assert first[:12] + second == ref_seen  # steps 1..6 ran twice: once before the kill, then from the checkpoint
    assert losses(tmp_path) == losses(ref_out)
    assert all(torch.equal(v, weights(ref_out)[k]) for k, v in weights(tmp_path).items())


def test_a_corrupt_checkpoint_is_named_and_the_previous_good_one_used(
    uninterrupted, target, data, tmp_path, monkeypatch, capsys
):
    ref_out, _ = uninterrupted
    cfg = config(tmp_path, target, data)
    with monkeypatch.context() as mp:
        kill_after(mp, 7)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    newest = tmp_path / "checkpoints" / "step-0000006"
    weights_file = newest / "drafter" / "model.safetensors"
    blob = weights_file.read_bytes()
    weights_file.write_bytes(blob[: len(blob) // 2])  # a half-written file
    cfg.resume = True
    train(cfg)
    out = capsys.readouterr().out
    assert f"checkpoint {newest} is corrupt" in out and "step-0000004 at step 4" in out
    assert losses(tmp_path) == losses(ref_out)
    assert all(torch.equal(v, weights(ref_out)[k]) for k, v in weights(tmp_path).items())


def test_all_checkpoints_corrupt_or_other_settings_are_clear_errors(target, data, tmp_path, monkeypatch):
    cfg = config(tmp_path, target, data, max_steps=4)
    with monkeypatch.context() as mp:
        kill_after(mp, 4)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    other = config(tmp_path, target, data, max_steps=4, batch_size=2)
    other.resume = True
    with pytest.raises(ValueError, match=r"made with other settings \(batch_size: 4 then, 2 now"):
        train(other)
    for ck in (tmp_path / "checkpoints").iterdir():
        (ck / "optimizer.pt").write_bytes(b"garbage")
    cfg.resume = True
    with pytest.raises(ValueError, match=r"no usable checkpoint: .*step-0000004 .*step-0000002"):
        train(cfg)


def test_resume_with_another_head_size_or_betas_is_refused_as_other_settings(target, data, tmp_path, monkeypatch):
    """Not "corrupt" with advice to delete good checkpoints; betas count; a fingerprint lacking a setting this
    version records is refused as an earlier version's, not with advice to restore an absent setting; with the
    fingerprint it was written with, the checkpoint resumes."""
    cfg = config(tmp_path, target, data, max_steps=4)
    with monkeypatch.context() as mp:
        kill_after(mp, 2)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    ck = tmp_path / "checkpoints" / "step-0000002"
    before = {p: p.stat().st_mtime_ns for p in ck.rglob("*")}
    resized = config(tmp_path, target, data, max_steps=4)
    resized.head.args, resized.resume = {"classes": 256}, True
    with pytest.raises(ValueError, match=r"made with other settings \(head: ") as e:
        train(resized)
    assert "corrupt" not in str(e.value) and "Delete" not in str(e.value)
    betas = config(tmp_path, target, data, max_steps=4, betas=[0.8, 0.99])
    betas.resume = True
    with pytest.raises(ValueError, match=r"made with other settings \(betas: \[0.9, 0.95\] then, \[0.8, 0.99\] now"):
        train(betas)
    assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")} == before

    trainer_json = ck / "trainer.json"
    written = trainer_json.read_text()
    meta = json.loads(written)
    head = {k: v for k, v in asdict(resized.head).items() if k != "draft"}  # the fingerprint leaves the shape out
    same_head = {**meta, "fingerprint": {**meta["fingerprint"], "head": json.loads(json.dumps(head))}}
    trainer_json.write_text(json.dumps(same_head))  # same settings, yet weights of another shape: other code
    with pytest.raises(ValueError, match=r"does not fit the head this run builds \(proj.\w+ has shape") as e:
        train(resized)
    assert "corrupt" not in str(e.value) and "Delete" not in str(e.value)

    del meta["fingerprint"]["betas"]  # a fingerprint without betas: refused, not taken as today's
    trainer_json.write_text(json.dumps(meta))
    cfg.resume = True
    with pytest.raises(ValueError, match=r"written by an earlier draftsmith, whose fingerprint lacks betas: it cannot"):
        train(cfg)
    trainer_json.write_text(written)
    train(cfg)
    assert json.loads((tmp_path / "final" / "config.json").read_text())["recipe"]["steps"] == 4


def record_padding(monkeypatch) -> list[tuple[int, int]]:
    """Each micro-batch's (padded, real) tokens, in training order."""
    seen, original = [], trainer_mod.Loop.micro_step

    def micro_step(self, batch):
        seen.append((batch["input_ids"].numel(), int(batch["lengths"].sum())))
        return original(self, batch)

    monkeypatch.setattr(trainer_mod.Loop, "micro_step", micro_step)
    return seen


@pytest.mark.parametrize("mode", ["online", "cached"])
def test_group_by_length_pads_less_and_a_resume_across_it_is_refused_naming_it(target, tmp_path, monkeypatch, mode):
    """Batches of like length from the same examples (online and from a feature cache), recorded in the resume
    fingerprint: a checkpoint made one way does not resume the other, whichever way round."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "home"))
    rows = [  # answers of 1 to 12 sentences: examples of many lengths
        {"conversations": [{"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": "One more. " * i}]}
        for i in [1 + (7 * j) % 12 for j in range(48)]
    ]
    (tmp_path / "spread.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spread, features = str(tmp_path / "spread.jsonl"), FeatureConfig(mode=mode)

    def run(out: str, **settings):
        cfg = config(tmp_path / out, target, spread, features=features, max_steps=None, grad_accum=1, **settings)
        cfg.data.max_length = 128
        return cfg

    with monkeypatch.context() as mp:
        shuffled = record_padding(mp)
        train(run("a", epochs=1, checkpoint_every=4))
    with monkeypatch.context() as mp:
        grouped = record_padding(mp)
        train(run("b", epochs=1, group_by_length=True))
    assert len(grouped) == len(shuffled) and sum(r for _, r in grouped) == sum(r for _, r in shuffled)
    assert sum(p for p, _ in grouped) < 0.9 * sum(p for p, _ in shuffled)
    for out, now in (("a", True), ("b", False)):
        cfg = run(out, epochs=2, group_by_length=now)
        cfg.resume = True
        with pytest.raises(ValueError, match=rf"other settings \(.*group_by_length: {not now} then, {now} now"):
            train(cfg)


def test_a_run_resumed_after_a_kill_in_the_final_write_keeps_its_last_tau(target, data, tmp_path, monkeypatch):
    taus = iter([{"tau": 1.5}, {"tau": 1.75}])
    monkeypatch.setattr(trainer_mod, "make_hook", lambda *a: lambda head, kind, weights=None: next(taus, {}))
    cfg = config(tmp_path, target, data, max_steps=4, eval_every=2)  # evals and checkpoints at steps 2 and 4
    save = trainer_mod.save_drafter

    def killed_writing_final(head, config, kind, info, recipe, folder, *rest, **kw):
        if Path(folder).name == "final":
            raise KeyboardInterrupt("simulated kill")
        return save(head, config, kind, info, recipe, folder, *rest, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(trainer_mod, "save_drafter", killed_writing_final)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    assert not (tmp_path / "final").exists()
    cfg.resume = True
    train(cfg)
    card = (tmp_path / "final" / "README.md").read_text()
    assert "mean acceptance length 1.75 (training eval)" in card


def test_feature_cache_is_built_once_reused_and_refused_for_another_target(
    uninterrupted, target, other_target, data, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    cached = FeatureConfig(mode="cached", dir=str(cache), shard_tokens=500)
    train(config(tmp_path / "a", target, data, features=cached))
    manifest = json.loads((cache / "manifest.json").read_text())
    loaded = load_target(TargetConfig(path=str(target)))
    assert manifest["target"] == loaded.target_id and manifest["layers"] == [1] and manifest["dtype"] == "bfloat16"
    assert len(manifest["shards"]) == len(list(cache.glob("shard-*"))) > 1 and manifest["examples"] > 30
    # close to online features (bf16 storage): same data order, nearly the same losses
    online = [r[1] for r in losses(uninterrupted[0])]
    assert [r[1] for r in losses(tmp_path / "a")] == pytest.approx(online, rel=0.02)

    def no_target_forward(*args, **kwargs):
        raise AssertionError("the target ran although the features are cached")

    monkeypatch.setattr(Transformer, "hidden_states", no_target_forward)
    train(config(tmp_path / "b", target, data, features=cached))
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    with pytest.raises(ValueError, match=rf"made for target {loaded.target_id}, but this run's target is other"):
        train(config(tmp_path / "c", other_target, data, features=cached))
    longer = config(tmp_path / "d", target, data, features=cached)
    longer.data.max_length = 80
    with pytest.raises(ValueError, match=r"made with other settings \(data differ"):
        train(longer)
    assert not (tmp_path / "c" / "final").exists() and not (tmp_path / "d" / "final").exists()


def test_an_interrupted_cache_build_keeps_its_finished_shards(target, data, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "home"))  # the default cache location, keyed
    cached = FeatureConfig(mode="cached", shard_tokens=500)
    original, before, after = features_mod.write_shard, [], []

    def killed_on_third(path, *args):
        if len(before) == 2:
            raise KeyboardInterrupt("simulated kill")
        before.append(path.name)
        return original(path, *args)

    monkeypatch.setattr(features_mod, "write_shard", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "a", target, data, features=cached, max_steps=2))
    (partial,) = (tmp_path / "home" / "features").glob("*.partial")
    assert sorted(p.name for p in partial.glob("shard-*")) == before
    monkeypatch.setattr(features_mod, "write_shard", lambda path, *a: after.append(path.name) or original(path, *a))
    train(config(tmp_path / "a2", target, data, features=cached, max_steps=2))
    (cache,) = (tmp_path / "home" / "features").iterdir()
    assert (cache / "manifest.json").is_file() and not cache.name.endswith(".partial")
    assert after and not set(before) & set(after)  # finished shards were not computed again

    # a head that needs fewer layers (EAGLE: none) is served by this cache: no second build, no target forward
    monkeypatch.setattr(Transformer, "hidden_states", lambda *a, **k: pytest.fail("the target ran again"))
    train(config(tmp_path / "b", target, data, head="eagle", features=cached, max_steps=2))
    assert list((tmp_path / "home" / "features").iterdir()) == [cache]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert "aux" not in features_mod.CachedFeatures(cache, manifest, ())[0]
    assert features_mod.CachedFeatures(cache, manifest, (1,))[0]["aux"].shape[-1] == 64


def test_cached_features_pick_the_layers_asked_for(tmp_path):
    from safetensors.torch import save_file

    aux = torch.arange(2 * 3 * 4, dtype=torch.float).view(2, 12)  # 2 tokens, layers (2, 5, 9), width 4
    base = {"input_ids": torch.tensor([7, 8]), "loss_mask": torch.ones(2, dtype=torch.uint8)}
    save_file({**base, "offsets": torch.tensor([0, 2]), "hidden": torch.zeros(2, 4), "aux": aux}, tmp_path / "s")
    manifest = {"layers": [2, 5, 9], "shards": [{"file": "s", "examples": 1}]}
    pick = features_mod.CachedFeatures(tmp_path, manifest, (9, 2))[0]["aux"]
    assert torch.equal(pick, torch.cat([aux[:, 8:12], aux[:, 0:4]], dim=1))
    assert torch.equal(features_mod.CachedFeatures(tmp_path, manifest)[0]["aux"], aux)
    with pytest.raises(ValueError):
        features_mod.CachedFeatures(tmp_path, manifest, (3,))


def test_acceptance_eval_runs_the_engine_with_the_current_drafter(target, data, tmp_path, capsys, monkeypatch):
    specs, build = [], acceptance_mod.build_engine
    spy = lambda t, spec, *a: specs.append(resolve_shape(spec)) or build(t, spec, *a)  # noqa: E731
    monkeypatch.setattr(acceptance_mod, "build_engine", spy)
    cfg = config(tmp_path / "eagle", target, data, head="eagle", max_steps=2, eval_every=2, eval_prompts=2)
    cfg.train.eval_max_new_tokens, cfg.head.draft = 8, DraftShape(num_tokens=1, topk=3)  # depth 1 x 3
    train(cfg)
    evals = [json.loads(x) for x in (tmp_path / "eagle" / "metrics.jsonl").read_text().splitlines() if "eval/tau" in x]
    assert len(evals) == 1 and evals[0]["step"] == 2 and evals[0]["eval/tau"] >= 1.0
    assert [(s.name, s.num_tokens, s.tree.topk) for s in specs] == [("eagle", 1, 3)]
    assert not [k for k in evals[0] if k.startswith("eval/accept_pos_") and k != "eval/accept_pos_1"]
    assert "training eval" in (tmp_path / "eagle" / "final" / "README.md").read_text()
    draft = json.loads((tmp_path / "eagle" / "final" / "config.json").read_text())["draft"]
    assert draft == {"num_tokens": 1, "topk": 3, "total_tokens": 0, "choices": None}  # the rest: eagle's default
    cfg = config(tmp_path / "standin", target, data, max_steps=2, eval_every=1, eval_prompts=2)
    train(cfg)
    assert f"acceptance eval skipped: serve has no proposer for {standin_head.KIND}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", [k.name for k in kinds.trained() if k.module.__module__.startswith("draftsmith.")])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_every_head_group_trains_through_the_trainer(kind, precision, target, data, tmp_path):
    """conf/head/<kind>.yaml builds its head on the target and its loss options fit train/loss_<kind>.py (also
    as train=quick runs on a CPU: the target in bf16, the head in fp32 under bf16 autocast)."""
    with initialize_config_module("draftsmith.conf", version_base=None):
        composed = compose("train", overrides=[f"out={tmp_path}", f"head={kind}"])
    cfg = config(
        tmp_path,
        target,
        data,
        max_steps=2,
        grad_accum=1,
        mixed_precision=precision,
        features=FeatureConfig(mode="cached", dir=str(tmp_path / "c")),
    )
    cfg.head = typed(composed, RunConfig).head
    if precision:
        cfg.target.dtype = "bfloat16"
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: precision is fixed once set
    try:
        train(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    rows = losses(tmp_path)
    assert [r[0] for r in rows] == [1, 2] and all(math.isfinite(r[1]) for r in rows)
    assert json.loads((tmp_path / "final" / "config.json").read_text())["kind"] == kind
    assert all(v.dtype == torch.float32 for v in weights(tmp_path).values() if v.is_floating_point())


def test_auto_precision_is_bf16_only_where_the_device_runs_it_natively():
    """train=quick and train=full say mixed_precision=auto: bf16 autocast on an AVX2-only CPU is far slower."""
    native = native_bf16("cuda" if torch.cuda.is_available() else "cpu")
    assert trainer_mod.resolve_precision("auto") == ("bf16" if native else "no")
    assert [trainer_mod.resolve_precision(p) for p in (None, "no", "bf16", "fp16")] == [None, "no", "bf16", "fp16"]
    with initialize_config_module("draftsmith.conf", version_base=None):
        for preset in ("quick", "full"):
            composed = compose("train", overrides=["out=x", f"train={preset}"])
            assert composed.train.mixed_precision == "auto" and composed.target.dtype == "auto"


def test_a_misspelt_loss_option_is_refused_before_any_work(target, data, tmp_path):
    features = FeatureConfig(mode="cached", dir=str(tmp_path / "c"))
    cfg = config(tmp_path / "run", target, data, max_steps=1, features=features)
    cfg.head = HeadConfig(kind="eagle3", loss={"ttt_step": 2})
    with pytest.raises(ValueError, match=r"head.loss.ttt_step is not an option of the eagle3 loss.*ttt_steps"):
        train(cfg)
    assert not (tmp_path / "c").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_quick_preset_shortens_eagle3_training_time_test_only():
    def loss_options(*overrides: str) -> dict:
        with initialize_config_module("draftsmith.conf", version_base=None):
            return dict(compose("train", overrides=["out=x", *overrides]).head.loss)

    assert loss_options("head=eagle3")["ttt_steps"] == 1  # conf/tuning/eagle3-quick.yaml: depth-1 drafts
    assert loss_options("head=eagle3", "train=full")["ttt_steps"] == 2  # conf/tuning/eagle3-full.yaml
    assert loss_options("head=eagle3", "head.loss.ttt_steps=5")["ttt_steps"] == 5
    assert "ttt_steps" not in loss_options("head=eagle")


def test_quick_preset_trains_one_medusa_head_for_depth_one_drafts():
    def composed(*overrides: str):
        with initialize_config_module("draftsmith.conf", version_base=None):
            return compose("train", overrides=["out=x", "head=medusa", *overrides])

    assert composed().head.num_heads == 1 and composed().train.epochs == 2  # conf/tuning/medusa-quick.yaml
    assert composed("train=full").head.num_heads == 4  # conf/head/medusa.yaml
    assert composed("head.num_heads=3").head.num_heads == 3


def test_presets_set_the_draft_shape_the_head_is_made_for():
    """The shape goes into the drafter folder (heads/drafter_folder.py): the main job's head is made for depth 1 x 3."""

    def draft(*overrides: str) -> dict:
        with initialize_config_module("draftsmith.conf", version_base=None):
            return asdict(typed(compose("train", overrides=["out=x", *overrides]), RunConfig).head.draft)

    assert draft("head=eagle3") == {"num_tokens": 1, "topk": 3, "total_tokens": 0, "choices": None}
    assert draft("head=eagle3", "train=full") == {"num_tokens": 2, "topk": 3, "total_tokens": 6, "choices": None}
    assert draft("head=medusa") == {"num_tokens": 1, "topk": None, "total_tokens": None, "choices": [[0], [1], [2]]}
    assert draft("head=eagle") == asdict(DraftShape()) == draft("head=draft_model")  # the kinds' defaults
    assert draft("head=eagle3", "head.draft.num_tokens=2")["num_tokens"] == 2


@pytest.mark.parametrize(
    "key, value", [(k, 0) for k in ("max_steps", "checkpoint_every", "log_every", "batch_size", "grad_accum")]
)
def test_bad_train_settings_are_refused_when_the_config_is_built(key, value):
    with pytest.raises(ValueError, match=rf"train.{key} must be >= 1.*got 0"):
        TrainConfig(**{key: value})


def test_a_bad_or_missing_setting_is_one_line_at_the_command_line(target, data, tmp_path):
    """Before the target loads or anything is written; no hydra traceback."""
    for args, message in (
        ([f"out={tmp_path / 'run'}", "train.max_steps=0"], "train.max_steps must be >= 1"),
        ([], "missing mandatory value: out; pass out="),
    ):
        r = run_command([sys.executable, "-m", "draftsmith.train", *cli_args(target, data), *args], tmp_path)
        assert r.returncode == 1 and r.stderr.strip().startswith(f"draftsmith-train: {message}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_hydra_multirun_gives_each_run_its_own_folder(target, data, tmp_path):
    out = tmp_path / "sweep"
    r = run_command(
        [sys.executable, "-m", "draftsmith.train", "-m", *cli_args(target, data), "train.max_steps=1,2", f"out={out}"],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for job, steps in (("0", 1), ("1", 2)):
        assert json.loads((out / job / "final" / "config.json").read_text())["recipe"]["steps"] == steps
        assert "max_steps: " + str(steps) in (out / job / "config.yaml").read_text()
    assert list((out / "0" / "wandb").glob("offline-run-*"))  # W&B offline by default
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_accelerate_launch_of_the_train_folder_from_the_repo_root(target, data, tmp_path):
    """The form users type: `accelerate launch train/ ...` runs the folder as a script, not the package."""
    out = tmp_path / "run"
    args = [*cli_args(target, data), "train.max_steps=1", "wandb.enabled=false", f"out={out}"]
    r = run_command([*ACCELERATE, "launch", "train/", *args], TESTS.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads((out / "final" / "config.json").read_text())["recipe"]["steps"] == 1


@pytest.mark.ddp
def test_two_process_cpu_ddp_through_accelerate_launch(target, data, tmp_path):
    """Both processes build the feature cache (alternate shards); then 2 processes x batch 2 see the examples
    1 process x batch 4 sees, step by step, and with gradients averaged over the processes the losses match
    (up to per-process vs. per-batch token weighting)."""
    out, cache = tmp_path / "ddp", tmp_path / "cache"
    launch = [*ACCELERATE, "launch", "--cpu", "--num_processes", "2"]
    args = [a for a in cli_args(target, data) if a != "train.features.mode=online"]
    args += ["train.max_steps=3", "train.checkpoint_every=2", "wandb.enabled=false"]
    args += [
        "train.lr=1e-2",
        "train.warmup_steps=10",
        "train.features.mode=cached",
        f"train.features.dir={cache}",
        "train.features.shard_tokens=200",
    ]
    r = run_command([*launch, "--main_process_port", "29517", "-m", "draftsmith.train", *args, f"out={out}"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["recipe"]["steps"] == 3 and meta["recipe"]["extra"]["processes"] == 2
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000003"]
    assert {p.name for p in (out / "checkpoints" / "step-0000003").iterdir()} >= {"rng-0.pt", "rng-1.pt"}
    assert len(json.loads((cache / "manifest.json").read_text())["shards"]) >= 4
    cached = FeatureConfig(mode="cached", dir=str(cache), shard_tokens=200)  # reused, not rebuilt
    single = config(
        tmp_path / "single", target, data, max_steps=3, grad_accum=1, lr=1e-2, warmup_steps=10, features=cached
    )
    single.data.max_conversations, single.data.max_length, single.data.heldout_fraction = 16, 48, 0.02
    train(single)
    assert [r[1] for r in losses(out)] == pytest.approx([r[1] for r in losses(tmp_path / "single")], rel=1e-3)


def test_loss_on_all_weighs_every_token_of_an_example_and_no_padding():
    """loss_on=all: the prompts' positions join the answers' in the loss (the target's distribution is known at every
    position), padding past an example's length stays out; the EAGLE-3 recipes train so, other kinds on answers."""
    answers = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.float)
    batch = {
        "input_ids": torch.arange(10).view(2, 5),
        "loss_mask": answers,
        "lengths": torch.tensor([5, 3]),
        "hidden": torch.zeros(2, 5, 4, dtype=torch.bfloat16),
    }
    kept = trainer_mod.feature_batch(batch, None, (), "cpu", "answers")
    assert torch.equal(kept.loss_mask, answers) and kept.hidden.dtype == torch.float32
    every = trainer_mod.feature_batch(batch, None, (), "cpu", "all")
    assert every.loss_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]

    def loss_on(*overrides: str) -> str:
        with initialize_config_module("draftsmith.conf", version_base=None):
            return compose("train", overrides=["out=x", *overrides]).train.loss_on

    assert loss_on("head=eagle3") == loss_on("head=eagle3", "train=full") == "all"  # conf/tuning/eagle3-*.yaml
    assert loss_on("head=peagle") == loss_on("head=medusa", "train=full") == "answers"
    assert loss_on("head=eagle3", "train.loss_on=answers") == "answers"
