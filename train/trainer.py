"""The training loop: accelerate (DDP / DeepSpeed / mixed precision / accumulation), AdamW or Muon, warmup and a
cosine or linear decay, grad clipping, atomic checkpoints with exact resume, metrics, acceptance evals, the final
drafter.

Data order is ours, not the DataLoader's: each epoch is a seeded permutation cut into batches, dealt
round-robin to the processes; resuming at step s skips exactly the batches before it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env, set_seed
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from draftsmith.heads.drafter_folder import Recipe, own_state, save_drafter
from draftsmith.heads.kinds import resolve
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.drafters import target_info
from draftsmith.serve.models.target import (
    LoadedTarget,
    TargetConfig,
    load_target,
    native_bf16,
    pick_device,
)

from . import checkpoint
from .acceptance import acceptance_hook, heldout_prompts
from .batch import FeatureBatch
from .checkpoint import OMITTED_AT_DEFAULT
from .config import RunConfig, TrainConfig
from .data import data_key
from .dataset import TrainingData, make_dataset, pad_id
from .features import collate, target_states
from .head import build_head, trained_kind
from .log import MetricsLog, Window
from .optimizer import make_optimizer
from .schedule import Schedule, warmup_decay


class LossModule(nn.Module):
    """head + its loss as one module, so DDP / DeepSpeed see every head method the loss calls."""

    def __init__(self, head: nn.Module, loss_fn, options: dict) -> None:
        super().__init__()
        self.head, self.loss_fn, self.options = head, loss_fn, options

    def forward(self, batch: FeatureBatch):
        return self.loss_fn(self.head, batch, **self.options)


def train(cfg: RunConfig) -> Path:
    """Train a drafter; returns OUT/final (a drafter folder)."""
    loop = setup(cfg)
    state = loop.restore()
    loop.run(state)
    return loop.finish(state)


def setup(cfg: RunConfig) -> Loop:
    """Accelerator, target, head, data (tokenized or cached features), optimizer and schedule, logs."""
    for name in cfg.imports:
        importlib.import_module(name)
    tc, out = cfg.train, Path(cfg.out)
    acc = make_accelerator(tc)
    say = tqdm.write if acc.is_main_process else (lambda *_: None)
    if not cfg.resume and checkpoint.checkpoints(out):
        raise ValueError(f"{out} already holds checkpoints: pass resume=true to continue, or pick another out")
    set_seed(tc.seed)
    loss_fn = loss_for(cfg.head.kind)
    check_loss_options(loss_fn, cfg.head.loss_options(), cfg.head.kind)  # before any data or features are made
    target = target_on_device(cfg.target, acc)
    head, head_cfg = build_head(cfg.head.kind, target, cfg.head)
    layers = trained_kind(cfg.head.kind).target_layers(head_cfg)
    dataset, data_info, stages = make_dataset(cfg, target, layers, acc, say)
    token_counts = dataset.token_counts(target.model.config.vocab_size)  # saved with the drafter
    set_vocab = getattr(head, "set_vocab", None)
    if set_vocab is not None:  # EAGLE-3's draft vocabulary: the most frequent answer tokens
        set_vocab(token_counts)
    head.to(acc.device)
    plan = Schedule.make(len(dataset), tc, acc.num_processes)
    say(f"{len(dataset)} examples, {plan.steps_per_epoch} steps per epoch, {plan.total_steps} steps; {data_info}")

    if acc.distributed_type == DistributedType.DEEPSPEED:
        if tc.optimizer == "muon":  # ZeRO shards each matrix, and Muon orthogonalizes whole ones
            raise ValueError("train.optimizer=muon runs under DDP or one process, not DeepSpeed: use adamw there")
        keep_borrowed_out(head)
        fill_deepspeed_config(acc.state.deepspeed_plugin.deepspeed_config, tc)
    model = LossModule(head, loss_fn, cfg.head.loss_options())
    optimizer = make_optimizer(head, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay(tc, plan.total_steps))
    model, optimizer = acc.prepare(model, optimizer)
    fingerprint = make_fingerprint(cfg, target, acc.num_processes, len(dataset), zero_stage(acc))
    hook = make_hook(cfg, target, head_cfg, say) if acc.is_main_process and tc.eval_every else None
    parts = (cfg, acc, say, model, head, head_cfg, optimizer, scheduler, target, layers, dataset, plan, fingerprint)
    return Loop(*parts, hook, token_counts, data_info, stages)


BARRIER_TIMEOUT = timedelta(hours=4)


def make_accelerator(tc: TrainConfig) -> Accelerator:
    """On a CPU machine, processes started by torchrun join via gloo. accelerate runs DeepSpeed only with
    cpu=False, and then picks no backend when there is no GPU: name gloo (DeepSpeed's CPU accelerator uses it).
    The other ranks wait at a barrier while rank 0 regenerates answers through vLLM or caches features, which can
    outlast torch's 10/30-minute collective timeouts: a barrier may wait BARRIER_TIMEOUT."""
    cpu = not torch.cuda.is_available()
    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    if cpu and deepspeed:
        skip_shm_comm_build()
    backend = "gloo" if cpu and deepspeed else "nccl"  # nccl: accelerate's default, which it then picks itself
    return Accelerator(
        cpu=cpu and not deepspeed,
        mixed_precision=resolve_precision(tc.mixed_precision),
        gradient_accumulation_steps=tc.grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=BARRIER_TIMEOUT)],
    )


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when it starts (g++ and ninja, about a
    CPU-minute, once per machine) that only its inference path calls: ZeRO training reduces through gloo.
    Marked unbuildable (DeepSpeed keeps this one dict of compatible ops), no compiler is needed."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def keep_borrowed_out(head: nn.Module) -> None:
    """The frozen target modules a head borrows (its shared_prefixes: embedding, lm_head) become plain
    attributes, out of the module tree DeepSpeed takes over: it would cast them to bf16 and, under ZeRO-3, shard
    them, and they are the target's own (features and evals run it on the main process alone)."""
    for prefix in getattr(head, "shared_prefixes", ()):
        name = prefix.rstrip(".")
        module = head._modules.get(name)
        if module is not None and not any(p.requires_grad for p in module.parameters()):
            object.__setattr__(head, name, head._modules.pop(name))


def fill_deepspeed_config(ds: dict, tc: TrainConfig) -> None:
    """The DeepSpeed json's "auto" values accelerate cannot know: the batch comes from our own loader, and
    accelerate would clip at 1.0 (DeepSpeed clips inside its step; clip_grad_norm_ only reads the norm)."""
    ds["train_micro_batch_size_per_gpu"] = tc.batch_size
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = tc.max_grad_norm


def zero_stage(acc: Accelerator) -> int | None:
    if acc.distributed_type != DistributedType.DEEPSPEED:
        return None
    return acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)


def engine_state(acc: Accelerator) -> Accelerator | None:
    """Under DeepSpeed the optimizer is sharded (ZeRO): checkpoints go through accelerate's save_state."""
    return acc if acc.distributed_type == DistributedType.DEEPSPEED else None


def resolve_precision(name: str | None) -> str | None:
    if name != "auto":
        return name
    return "bf16" if native_bf16(pick_device("auto")) else "no"


def target_on_device(cfg: TargetConfig, acc: Accelerator) -> LoadedTarget:
    device = str(acc.device) if cfg.device == "auto" else cfg.device  # each process on the device accelerate gave it
    return load_target(replace(cfg, device=device), offline=True)


def loss_for(kind: str):
    """The kind's registered loss (heads/kinds.py)."""
    found = trained_kind(kind)
    if not found.loss:
        raise ValueError(f'head kind {kind!r} registers no loss: give its Kind a loss="module:function"')
    return resolve(found.loss)


def check_loss_options(loss_fn, options: dict, kind: str) -> None:
    """A loss is called as loss_fn(head, batch, **head.loss): refuse a key it does not take."""
    params = list(inspect.signature(loss_fn).parameters.values())[2:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(
            f"head.loss.{unknown[0]} is not an option of the {kind} loss ({loss_fn.__module__}.{loss_fn.__name__}); "
            f"it takes: {', '.join(names) or 'none'}. Fix the spelling or drop the key"
        )


def make_hook(cfg: RunConfig, target: LoadedTarget, head_cfg, say):
    tc = cfg.train
    prompts = heldout_prompts(cfg.data, target.tokenizer, tc.eval_prompts, cfg.data.max_length)
    if not prompts:
        say("acceptance eval off: no held-out prompt fits (raise data.heldout_fraction)")
        return None
    return acceptance_hook(target, head_cfg, prompts, tc.eval_max_new_tokens, say, cfg.head.draft)


def make_fingerprint(cfg: RunConfig, target: LoadedTarget, world: int, examples: int, zero: int | None = None) -> dict:
    """What must not change between a checkpoint and its resume (it fixes the data order and schedule; under
    DeepSpeed the ZeRO stage fixes how the optimizer state was saved, None without it); head.draft (what the
    drafter is recorded for) is left out."""
    tc = cfg.train
    head = {k: v for k, v in asdict(cfg.head).items() if k != "draft"}
    return json.loads(
        json.dumps(
            {
                "target": target.target_id,
                "head": head,
                "data": data_key(cfg.data),
                "features": tc.features.mode,
                "examples": examples,
                "processes": world,
                **{k: getattr(tc, k) for k in ("epochs", "max_steps", "batch_size", "grad_accum", "seed")},
                **{k: getattr(tc, k) for k in ("lr", "betas", "warmup_steps", "min_lr_ratio", "weight_decay")},
                "loss_on": tc.loss_on,
                "deepspeed_zero_stage": zero,
                **{k: getattr(tc, k) for k, v in OMITTED_AT_DEFAULT.items() if getattr(tc, k) != v},
            }
        )
    )


def head_settings(fingerprint: dict) -> dict:
    """The settings of a run that shape its head, whatever its data (the resume fingerprint without the data and its
    size; the processes stay, as they multiply the batch): a drafter folder records them, and heads of one curve
    must share them."""
    drop = ("target", "data", "examples", "features", "deepspeed_zero_stage")
    return {k: v for k, v in fingerprint.items() if k not in drop}


def stages_line(stages: dict) -> str:
    """`stages: regenerate 300 rows in 312 s (0.96/s); features 151000 tokens in 98 s (1540.82/s); steps 525 steps
    in 410 s (1.28/s)`: where the run's time went, over its pieces (a stage it found cached is left out)."""
    units = {"regenerate": "rows", "features": "tokens", "steps": "steps"}
    parts = []
    for stage, unit in units.items():
        if (done := stages.get(stage)) and unit in done:
            n, s = done[unit], max(done["seconds"], 1e-9)
            parts.append(f"{stage} {n} {unit} in {s:.0f} s ({n / s:.2f}/s)")
    return "stages: " + "; ".join(parts)


def feature_batch(batch: dict, model: Transformer, layers: tuple, device, loss_on: str = "answers") -> FeatureBatch:
    """A collated batch -> FeatureBatch on `device`: cached states cast to float32, or the target run now.
    loss_on=all weighs every token of each example, not only its answers."""
    ids, mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
    if loss_on == "all":
        mask = (torch.arange(ids.shape[1], device=device) < batch["lengths"].to(device)[:, None]).to(mask.dtype)
    if "hidden" in batch:
        hidden, aux = batch["hidden"], batch.get("aux")
    else:
        hidden, aux = target_states(model, ids, layers)
    return FeatureBatch(
        ids, mask, hidden.to(device, torch.float32), aux.to(device, torch.float32) if aux is not None else None
    )


@dataclass
class Loop:
    """Runs the plan from a state: micro-batches, optimizer steps, logs, evals, checkpoints."""

    cfg: RunConfig
    acc: Accelerator
    say: Callable[[str], None]
    model: nn.Module  # the prepared LossModule
    head: nn.Module
    head_cfg: Any  # what save_drafter writes
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    target: LoadedTarget
    layers: tuple[int, ...]
    dataset: TrainingData
    plan: Schedule
    fingerprint: dict
    hook: Callable[[nn.Module, str, dict | None], dict] | None  # (head, kind, weights): acceptance_hook's run
    token_counts: Tensor  # of the training answers, saved with the drafter (serve-time draft vocabularies)
    data_info: str = ""  # what the examples are: counts, who wrote the answers, what was skipped (the card says it)
    stages: dict = field(default_factory=dict)  # regeneration and features as this run measured them (make_dataset)
    log: MetricsLog | None = None
    last_eval: dict = field(default_factory=dict)
    window: Window = field(default_factory=lambda: Window())

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def restore(self) -> checkpoint.State:
        """The newest good checkpoint's state (resume=true) or step 0; opens metrics.jsonl and W&B."""
        cfg, acc = self.cfg, self.acc
        state = checkpoint.State(0, 0)
        if cfg.resume:
            args = (self.head, self.optimizer, self.scheduler, self.fingerprint, acc.process_index, self.say)
            loaded = checkpoint.load_latest(self.out, *args, engine=engine_state(acc))
            if loaded is None:
                self.say(f"resume=true but {self.out}/checkpoints holds none: starting at step 0")
            elif loaded.tau:  # kept for the final drafter's card, should no eval run after the resume
                self.last_eval = {"tau": loaded.tau}
            state = loaded or state
        state.stages = {**state.stages, **self.stages}  # what a first piece measured, unless this one measured it
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            tags = [cfg.head.kind, self.target.target_id.split("@")[0], cfg.train.name]
            run_config = OmegaConf.to_container(OmegaConf.structured(cfg))
            assert isinstance(run_config, dict), "a structured config is a mapping"
            self.log = MetricsLog(self.out, state.step, cfg.wandb, run_config, "-".join(tags), tags, state.wandb_id)
            state.wandb_id = self.log.wandb_id
        return state

    def full_state(self) -> dict[str, Tensor] | None:
        """The head's own weights in fp32 when DeepSpeed holds them: its module has bf16/fp16 copies (ZeRO-3: a
        shard each) and the fp32 masters lie sharded in the optimizer. Gathering them is collective: every process
        calls this. None elsewhere: the head holds its weights."""
        if self.acc.distributed_type != DistributedType.DEEPSPEED:
            return None
        from deepspeed.utils import safe_get_full_fp32_param

        state = own_state(self.head)
        for name, p in self.head.named_parameters():  # one order on every process: each gather is a collective
            full = safe_get_full_fp32_param(p) if name in state else None
            if full is not None:  # None: not in the optimizer (frozen), held whole
                state[name] = full
        return state

    def write_drafter(self, state: checkpoint.State, folder: Path, weights: dict | None = None) -> Path:
        """The head as it stands as a drafter folder, with the recipe so far and the last acceptance eval.
        weights: full_state() under DeepSpeed."""
        cfg, tc = self.cfg, self.cfg.train
        tau = self.last_eval.get("tau")
        measured = {"mean_acceptance_length": tau, "source": "training eval"} if tau else {}
        recipe = Recipe(
            data=f"{cfg.data.source}{' (regenerated)' if cfg.data.regenerated else ''} "
            f"({len(self.dataset)} examples, max_length {cfg.data.max_length})",
            steps=state.step,
            tokens=state.tokens,
            extra={
                "train": tc.name,
                "features": tc.features.mode,
                "processes": self.acc.num_processes,
                "data_info": self.data_info,
                "examples": len(self.dataset),
                "answer_tokens": int(self.token_counts.sum()),
                "stages": {**state.stages, "steps": {"steps": state.step, "seconds": round(state.seconds, 3)}},
                "training": head_settings(self.fingerprint),
            },
            acceptance=measured,
        )
        info = target_info(self.target)
        args = (self.head, self.head_cfg, cfg.head.kind, info, recipe, folder, self.token_counts, weights)
        return save_drafter(*args, draft=cfg.head.draft)

    def finish(self, state: checkpoint.State) -> Path:
        """Write OUT/final (main process)."""
        weights = self.full_state()
        if self.acc.is_main_process:
            final = self.write_drafter(state, self.out / "final", weights)
            self.say(f"drafter written to {final}")
            self.say(stages_line({**state.stages, "steps": {"steps": state.step, "seconds": state.seconds}}))
            assert self.log is not None, "restore() made it on the main process"
            self.log.close()
        self.acc.wait_for_everyone()
        self.acc.end_training()
        return self.out / "final"

    def loader(self, epoch: int, skip: int) -> DataLoader:
        lengths = self.dataset.lengths() if self.cfg.train.group_by_length else None
        batches = self.plan.batches(len(self.dataset), epoch, self.acc.process_index, self.acc.num_processes, lengths)
        return DataLoader(
            self.dataset,
            batch_sampler=batches[skip:],
            collate_fn=partial(collate, pad_id=pad_id(self.target.tokenizer)),
            num_workers=self.cfg.train.num_workers,
            generator=torch.Generator(),  # leaves the global RNG (restored on resume) alone
        )

    def run(self, state: checkpoint.State) -> None:
        plan, tc, main = self.plan, self.cfg.train, self.acc.is_main_process
        bar = tqdm(total=plan.total_steps, initial=state.step, desc="train", unit="step", disable=not main)
        self.model.train()
        clock = time.perf_counter()
        while state.step < plan.total_steps:
            epoch, done = divmod(state.step, plan.steps_per_epoch)
            for batch in self.loader(epoch, done * plan.grad_accum):
                self.micro_step(batch)
                if not self.acc.sync_gradients:
                    continue
                state.step += 1
                state.tokens += self.window.end_step(self.acc)
                state.seconds += time.perf_counter() - clock
                clock = time.perf_counter()
                bar.update()
                self.after_step(state, bar)
                if state.step >= plan.total_steps:
                    break
        bar.close()
        if tc.eval_every and state.step % tc.eval_every:
            self.evaluate(state.step)

    def micro_step(self, batch: dict) -> None:
        fb = feature_batch(batch, self.target.model, self.layers, self.acc.device, self.cfg.train.loss_on)
        with self.acc.accumulate(self.model):
            loss, logs = self.model(fb)
            self.acc.backward(loss)
            if self.acc.sync_gradients:
                norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
                self.window.grad_norm = float(norm) if norm is not None else float("nan")
            self.optimizer.step()
            self.optimizer.zero_grad()
        if self.acc.sync_gradients:
            self.scheduler.step()
        self.window.add(loss.item(), logs, int(batch["lengths"].sum()), float(fb.loss_mask.sum()))

    def after_step(self, state: checkpoint.State, bar) -> None:
        tc, step = self.cfg.train, state.step
        if step % tc.log_every == 0 or step == self.plan.total_steps:
            lr = float(self.scheduler.get_last_lr()[0])
            row = self.window.flush(self.acc, step, step / self.plan.steps_per_epoch, lr)
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            if self.log:
                self.log.log(row)
        paused = time.perf_counter()  # evals and checkpoints do not count against tokens/s
        if tc.eval_every and step % tc.eval_every == 0:
            self.evaluate(step)
        if step % tc.checkpoint_every == 0 or step == self.plan.total_steps:
            acc = self.acc
            write = partial(self.write_drafter, state, weights=self.full_state())
            args = (self.optimizer, self.scheduler, self.fingerprint, acc.process_index, acc.wait_for_everyone)
            checkpoint.save(self.out, state, write, *args, tc.keep_checkpoints, engine_state(acc))
        self.window.started += time.perf_counter() - paused

    def evaluate(self, step: int) -> None:
        """Every process calls this (DeepSpeed gathers the weights); the main one evaluates while the others wait
        at the next checkpoint barrier or the end."""
        weights = self.full_state()
        if self.hook is None:
            return
        self.head.eval()
        try:
            result = self.hook(self.head, self.cfg.head.kind, weights)
        except Exception as e:  # an eval must not end a long run: say why and carry on
            self.say(f"acceptance eval at step {step} failed: {type(e).__name__}: {e}")
            result = {}
        self.head.train()
        if result:
            self.last_eval = result
            pos = ", ".join(f"{v:.2f}" for k, v in result.items() if k.startswith("accept_pos"))
            self.say(f"step {step}: tau {result['tau']:.3f}, acceptance per position [{pos}]")
            if self.log:
                self.log.log({"step": step, **{f"eval/{k}": v for k, v in result.items()}})
