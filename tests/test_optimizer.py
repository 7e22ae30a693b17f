"""train.optimizer and train.schedule: Muon for an EAGLE-3 head's hidden matrices with AdamW for the rest, as one
optimizer that trains, checkpoints and resumes exactly; the linear and cosine decays."""

import pytest
import torch
import torch.optim._muon as muon_impl

from draftsmith.serve.models.loader import load_model
from draftsmith.serve.models.target import native_bf16
from draftsmith.train.config import TrainConfig
from draftsmith.train.loss_eagle3 import eagle3_loss
from draftsmith.train.optimizer import (
    MuonAdamW,
    hidden_matrices,
    make_optimizer,
    newton_schulz_fp32,
    orthogonalized_in_fp32,
)
from draftsmith.train.schedule import warmup_decay
from helpers import eagle_head, head_features, tiny_head


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def batch(target):
    head = eagle_head("eagle3", target)
    ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return head_features(target, head, ids, torch.ones(2, 12))


def steps(head, optimizer, scheduler, batch, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = eagle3_loss(head, batch, ttt_steps=2)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def fresh(target, tc: TrainConfig):
    head = eagle_head("eagle3", target)
    optimizer = make_optimizer(head, tc)
    return head, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay(tc, 8))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(target):
    head = eagle_head("eagle3", target)
    optimizer = make_optimizer(head, TrainConfig(optimizer="muon"))
    assert isinstance(optimizer, MuonAdamW)
    named = {n: p for n, p in head.named_parameters() if p.requires_grad}
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    hidden = sorted(n for n, p in named.items() if id(p) in muon)
    assert "fc.weight" in hidden and "midlayer.self_attn.q_proj.weight" in hidden
    assert all(named[n].ndim == 2 for n in hidden) and "lm_head.weight" not in hidden
    assert len(muon) + sum(len(g["params"]) for g in optimizer.adamw.param_groups) == len(named)  # each param once


@pytest.mark.parametrize("kind", ["eagle", "medusa", "draft_model", "dflash", "dspark"])
def test_every_kind_splits_its_output_heads_and_tables_from_its_hidden_matrices(target, kind):
    head, _ = tiny_head(kind, target)
    hidden = hidden_matrices(head)
    named = {n: p for n, p in head.named_parameters() if p.requires_grad}
    to_muon = sorted(n for n, p in named.items() if id(p) in hidden)
    assert not any("head" in n or "embed" in n for n in to_muon), to_muon  # lm_head(s), markov / confidence heads
    assert to_muon and isinstance(make_optimizer(head, TrainConfig(optimizer="muon")), MuonAdamW)


def test_a_head_of_output_tables_alone_is_refused_for_muon():
    with pytest.raises(ValueError, match="no hidden matrix.*train.optimizer=adamw"):
        make_optimizer(torch.nn.ModuleDict({"lm_head": torch.nn.Linear(4, 8)}), TrainConfig(optimizer="muon"))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_each_optimizer_trains_and_resumes_exactly(target, batch, name):
    tc = TrainConfig(optimizer=name, lr=3e-3, warmup_steps=1, schedule="linear")
    head, optimizer, scheduler = fresh(target, tc)
    losses = steps(head, optimizer, scheduler, batch, 4)
    assert losses[-1] < losses[0]
    again, opt2, sched2 = fresh(target, tc)
    steps(again, opt2, sched2, batch, 2)
    saved = (again.state_dict(), opt2.state_dict(), sched2.state_dict())
    resumed, opt3, sched3 = fresh(target, tc)
    resumed.load_state_dict(saved[0])
    opt3.load_state_dict(saved[1])
    sched3.load_state_dict(saved[2])
    steps(resumed, opt3, sched3, batch, 2)
    for (n, a), b in zip(head.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert [g["lr"] for g in opt3.param_groups] == [g["lr"] for g in optimizer.param_groups]  # the schedule too


def test_the_schedules_warm_up_then_decay_to_min_lr_ratio():
    linear = warmup_decay(TrainConfig(warmup_steps=2, schedule="linear", min_lr_ratio=0.1), 12)
    cosine = warmup_decay(TrainConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), 12)
    assert [linear(0), linear(1)] == [cosine(0), cosine(1)] == [0.5, 1.0]
    assert linear(7) == pytest.approx(0.55) and cosine(7) == pytest.approx(0.55)  # both halfway at mid-decay
    assert linear(4) < cosine(4) and linear(12) == cosine(12) == pytest.approx(0.1)


def test_unknown_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="train.optimizer must be adamw or muon"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="train.schedule cosine or linear"):
        TrainConfig(schedule="step")


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_the_fp32_iteration_is_torchs_newton_schulz_at_fp32_precision(shape):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coefficients = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
    in_bf16 = muon_impl._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7).float()
    in_fp32 = newton_schulz_fp32(grad, coefficients, 5, 1e-7)
    assert in_fp32.dtype == torch.float32 and in_fp32.shape == grad.shape
    assert (in_fp32 - in_bf16).norm() / in_bf16.norm() < 0.02  # bf16's rounding, not another iteration
    singular = torch.linalg.svdvals(in_fp32)
    assert 0.5 < singular.min() and singular.max() < 1.5  # orthogonalized, as Muon's iteration leaves it


def test_muon_orthogonalizes_in_fp32_only_inside_its_step_where_bf16_is_emulated(target, batch):
    head, optimizer, _ = fresh(target, TrainConfig(optimizer="muon"))
    assert optimizer.fp32_orthogonalize == (not native_bf16("cpu"))
    seen = []
    torch_iteration = muon_impl._zeropower_via_newtonschulz
    optimizer.fp32_orthogonalize = True
    with orthogonalized_in_fp32(True):
        seen.append(muon_impl._zeropower_via_newtonschulz)
    assert seen == [newton_schulz_fp32] and muon_impl._zeropower_via_newtonschulz is torch_iteration
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    eagle3_loss(head, batch, ttt_steps=2)[0].backward()
    optimizer.step()
    assert muon_impl._zeropower_via_newtonschulz is torch_iteration
    assert not torch.equal(before["fc.weight"], head.fc.weight)  # the Muon matrices moved
