"""train.optimizer: AdamW over every trained parameter, or Muon (speculators' default) for the head's hidden
matrices with AdamW for the rest, as one optimizer the trainer, accelerate and checkpoints handle like AdamW."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.optim._muon as muon_impl
from torch import Tensor, nn
from torch.optim import AdamW, Muon, Optimizer

from draftsmith.serve.models.target import native_bf16

from .config import TrainConfig


def make_optimizer(head: nn.Module, tc: TrainConfig) -> Optimizer:
    params = [p for p in head.parameters() if p.requires_grad]
    betas = (tc.betas[0], tc.betas[1])
    if tc.optimizer == "adamw":
        return AdamW(params, lr=tc.lr, betas=betas, weight_decay=tc.weight_decay)
    hidden = hidden_matrices(head)
    muon = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    if not muon:
        raise ValueError("train.optimizer=muon found no hidden matrix in this head: use train.optimizer=adamw")
    # update scaled to AdamW's RMS (match_rms_adamw), so one lr serves both
    matrices = Muon(muon, lr=tc.lr, weight_decay=tc.weight_decay, adjust_lr_fn="match_rms_adamw")
    adamw = AdamW(rest, lr=tc.lr, betas=betas, weight_decay=tc.weight_decay) if rest else None
    return MuonAdamW(matrices, adamw, fp32_orthogonalize=not native_bf16(str(muon[0].device)))


def hidden_matrices(head: nn.Module) -> set[int]:
    """The ids of the weights of the head's Linear layers, except those of its output heads and tables (a module path
    naming a head or an embedding: lm_head, Medusa's heads, DSpark's markov and confidence heads): Muon is meant for
    hidden matrices, not for what maps to or from a vocabulary."""
    found = set()
    for name, module in head.named_modules():
        outer = any("head" in part or "embed" in part for part in name.split("."))
        if isinstance(module, nn.Linear) and not outer and module.weight.requires_grad:
            found.add(id(module.weight))
    return found


class MuonAdamW(Optimizer):
    """Muon over the hidden matrices, AdamW (where any parameter is left) over the rest. Its param_groups are the two
    optimizers' own groups, so a scheduler that sets their lr sets both."""

    def __init__(self, muon: Muon, adamw: AdamW | None, fp32_orthogonalize: bool = False) -> None:
        self.muon, self.adamw, self.fp32_orthogonalize = muon, adamw, fp32_orthogonalize
        super().__init__([p for o in self.parts() for g in o.param_groups for p in g["params"]], muon.defaults)
        self.param_groups = [g for o in self.parts() for g in o.param_groups]

    def parts(self) -> Iterable[Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @torch.no_grad()
    def step(self, closure=None):
        with orthogonalized_in_fp32(self.fp32_orthogonalize):
            self.muon.step()
        if self.adamw:
            self.adamw.step()

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


@contextmanager
def orthogonalized_in_fp32(on: bool) -> Iterator[None]:
    """torch.optim.Muon runs its Newton-Schulz iteration in bf16, which a device without bf16 kernels (an AVX2-only
    CPU) emulates: the optimizer step of an EAGLE-3 head then takes seconds instead of milliseconds. With `on`, the
    steps inside run the same iteration in fp32."""
    if not on:
        yield
        return
    bf16_iteration = muon_impl._zeropower_via_newtonschulz
    muon_impl._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        yield
    finally:
        muon_impl._zeropower_via_newtonschulz = bf16_iteration


def newton_schulz_fp32(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (an approximate orthogonalization of grad), in fp32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
