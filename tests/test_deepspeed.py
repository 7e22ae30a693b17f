"""DeepSpeed for real: 2 CPU processes through `accelerate launch --use_deepspeed` (DeepSpeed's CPU accelerator,
gloo), a few EAGLE-3 steps on a tiny target with the shipped ZeRO-2 / ZeRO-3 configs, checkpoints, a resume that
continues at the same step, and drafter folders holding the fp32 weights gathered from the shards."""

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.serve.models.target import TargetConfig
from draftsmith.serve.shared.wandb_run import WandbConfig
from draftsmith.train.config import RunConfig, TrainConfig
from draftsmith.train.data import DataConfig
from draftsmith.train.features import FeatureConfig
from draftsmith.train.head import HeadConfig
from draftsmith.train.trainer import train
from helpers import build_tiny_chat_target

CONF = Path(__file__).parents[1] / "conf" / "deepspeed"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
}
STEPS, MAX_GRAD_NORM = 3, 0.5

pytestmark = [
    pytest.mark.ddp,
    pytest.mark.skipif(
        find_spec("deepspeed") is None, reason="deepspeed is not installed: pip install -e '.[deepspeed]'"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator: with CUDA the trainer takes the GPU"
    ),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def target(smollm2_dir, tmp_path_factory):
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-target"), smollm2_dir)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    rows = []
    for i in range(24):
        turns = [
            {"from": "human", "value": f"What is {i} plus {i}?"},
            {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. Anything else?"},
        ]
        rows.append({"id": f"sum-{i}", "conversations": turns})
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def ds_config(tmp_path: Path, name: str) -> Path:
    """The shipped config; for ZeRO-3 with every parameter sharded (the tiny head's are all under the shipped
    persistence threshold, which would keep them whole on every process)."""
    cfg = json.loads((CONF / f"{name}.json").read_text())
    if cfg["zero_optimization"]["stage"] == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(config: Path, out: Path, port: int, target, data, precision: str, *extra: str):
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--use_deepspeed"]
    cmd += ["--deepspeed_config_file", str(config), "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--main_process_port", str(port), "-m", "draftsmith.train", f"out={out}"]
    cmd += [f"target.path={target}", "target.dtype=float32", f"data.source={data}", "data.max_length=48"]
    cmd += ["data.heldout_fraction=0.2", "data.regenerated=false"]  # as the single-process run it is compared with
    cmd += ["head=eagle3", "head.draft_vocab_size=256", "head.loss.ttt_steps=2", "train.features.mode=online"]
    cmd += [f"train.max_steps={STEPS}", "train.batch_size=2", "train.checkpoint_every=2", "train.log_every=1"]
    cmd += ["train.lr=1e-2", "train.warmup_steps=10", f"train.max_grad_norm={MAX_GRAD_NORM}"]
    cmd += [f"train.mixed_precision={precision}", "train.eval_prompts=1", "train.eval_max_new_tokens=8"]
    cmd += ["wandb.enabled=false", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=out.parent, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in rows(out) if "loss" in r]


def weights(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def single_process(out: Path, target, data, batch_size: int, resume: bool = False) -> RunConfig:
    """The launched runs' settings (train=quick where they do not set them) in this process, no DeepSpeed."""
    tc = TrainConfig(max_steps=STEPS, batch_size=batch_size, lr=1e-2, warmup_steps=10, max_grad_norm=MAX_GRAD_NORM)
    tc.log_every, tc.checkpoint_every, tc.mixed_precision, tc.features = 1, 2, "no", FeatureConfig(mode="online")
    tc.loss_on = "all"  # conf/tuning/eagle3-quick.yaml, as init="layer" below
    head = HeadConfig(kind="eagle3", draft_vocab_size=256, init="layer", loss={"ttt_steps": 2, "decay": 0.8})
    data_cfg = DataConfig(source=data, max_conversations=2000, max_length=48, heldout_fraction=0.2)
    target_cfg = TargetConfig(path=str(target), dtype="float32")
    return RunConfig(str(out), target_cfg, head, data_cfg, tc, WandbConfig(enabled=False), resume=resume)


@pytest.mark.parametrize(
    ("name", "precision", "port"),
    [("zero2", "no", 29561), ("zero3", "bf16", 29562)],  # bf16: the module holds bf16 copies, fp32 in the optimizer
)
def test_deepspeed_zero_trains_checkpoints_resumes_and_writes_the_full_drafter(
    name, precision, port, target, data, tmp_path
):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config, out = ds_config(tmp_path, name), tmp_path / "a"
    out.mkdir()
    launch(config, out, port, target, data, precision)
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 3] and "eval/tau" in rows(out)[-1]  # the final eval ran
    last = out / "checkpoints" / "step-0000003"
    engine = last / "engine" / "pytorch_model"
    assert len(list(engine.glob("*optim_states.pt"))) == 2  # the optimizer state, one shard per process
    model_states = sorted(engine.glob("*model_states.pt"))[0]
    ds = torch.load(model_states, map_location="cpu", weights_only=True)["ds_config"]
    assert ds["zero_optimization"]["stage"] == int(name[-1]) and ds["bf16"]["enabled"] == (precision == "bf16")
    assert ds["gradient_clipping"] == MAX_GRAD_NORM and ds["train_micro_batch_size_per_gpu"] == 2
    # the drafter folders hold the fp32 weights DeepSpeed's own tool rebuilds from the shards
    rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(last / "engine"))  # unpickles: files this test wrote
    full = {k.removeprefix("head."): v for k, v in rebuilt.items()}
    drafter = weights(last / "drafter")
    assert drafter["fc.weight"].dtype == torch.float32 and drafter["fc.weight"].shape == (64, 3 * 64)
    assert same(drafter, full) and same(weights(out / "final"), drafter)
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["recipe"]["steps"] == STEPS and meta["recipe"]["extra"]["processes"] == 2

    resumed = tmp_path / "b"  # as if killed after step 3's optimizer step, before its checkpoint
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("step-0000003", "final"))
    r = launch(config, resumed, port, target, data, precision, "resume=true")
    assert f"resumed from {resumed}/checkpoints/step-0000002 at step 2" in r.stdout
    assert losses(resumed) == losses(out)
    assert same(weights(resumed / "final"), weights(out / "final"))  # the optimizer state came back too

    if name == "zero2":  # fp32: 2 processes x batch 2 under ZeRO-2 train as 1 process x batch 4 without DeepSpeed
        train(single_process(tmp_path / "single", target, data, batch_size=4))
        assert [r[1] for r in losses(out)] == pytest.approx([r[1] for r in losses(tmp_path / "single")], rel=1e-3)
        with pytest.raises(ValueError, match=r"deepspeed_zero_stage: 2 then, None now"):
            train(single_process(out, target, data, batch_size=2, resume=True))
