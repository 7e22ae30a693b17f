"""train.optimizer: AdamW over every trained parameter, or Muon (speculators' default) for the head's hidden
matrices with AdamW for the rest, as one optimizer the trainer, accelerate and checkpoints handle like AdamW."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import AdamW, Muon, Optimizer

from .config import TrainConfig

OUTER = ("lm_head", "embed")  # 2-D but not hidden: an output or input table, which Muon is not meant for


def make_optimizer(head: nn.Module, tc: TrainConfig) -> Optimizer:
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    adamw = dict(lr=tc.lr, betas=(tc.betas[0], tc.betas[1]), weight_decay=tc.weight_decay)
    if tc.optimizer == "adamw":
        return AdamW([p for _, p in named], **adamw)
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return MuonAdamW(hidden, rest, adamw)


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    return p.ndim == 2 and not any(part in name for part in OUTER)


class MuonAdamW(Optimizer):
    """Muon over `hidden`, AdamW over `rest`. Its param_groups are the two optimizers' own groups, so a scheduler
    that sets their lr sets both; Muon's update is scaled to AdamW's RMS (match_rms_adamw), so one lr serves both."""

    def __init__(self, hidden: list[nn.Parameter], rest: list[nn.Parameter], adamw: dict) -> None:
        if not hidden:
            raise ValueError("train.optimizer=muon found no hidden matrix to optimize: use train.optimizer=adamw")
        self.muon = Muon(hidden, lr=adamw["lr"], weight_decay=adamw["weight_decay"], adjust_lr_fn="match_rms_adamw")
        self.adamw = AdamW(rest, **adamw) if rest else None
        super().__init__([*hidden, *rest], {"lr": adamw["lr"]})
        self.param_groups = [g for o in self.parts() for g in o.param_groups]

    def parts(self) -> Iterable[Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @torch.no_grad()
    def step(self, closure=None):
        for o in self.parts():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts():
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw:
            self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [g for o in self.parts() for g in o.param_groups]  # loading made new group dicts
