"""`speculators train` on a CPU, run by the speculators venv's Python (scripts/speculators_venv.sh).

speculators 0.9 places tensors with `.to(local_rank)` (an int: cuda:N), autocasts on "cuda" when no accelerator
is found, loads checkpoints onto `get_current_device()` ("cuda:0" without one), and its step timer synchronizes the
accelerator, which raises without one. This runner points those at the CPU and otherwise runs speculators' own CLI
unchanged. On a CPU without bf16 kernels (AVX2 only) it also runs Muon's Newton-Schulz iteration in fp32:
torch.optim.Muon casts it to bf16, which such a CPU emulates: about 20 s per optimizer step of an EAGLE-3 head,
where a GPU or a CPU with bf16 kernels takes milliseconds. The iteration is the same otherwise.

    $SPECULATORS_VENV/bin/python benchmarks/speculators_cpu.py STEPS_FILE train --speculator-type eagle3 ...

STEPS_FILE receives one line per optimizer step, the step's end as seconds since the start (time.perf_counter),
so a probe run tells the trainer's seconds per step on this machine.
"""

from __future__ import annotations

import sys
import time


def point_at_cpu() -> None:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import speculators.utils.util as util
    import torch

    util.get_current_device = checkpointer.get_current_device = lambda: "cpu"
    trainer.get_local_rank = lambda: "cpu"  # only ever used as a .to() target
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda device=None: None  # nothing asynchronous to wait for on a CPU


def native_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return any(f in flags for f in ("avx512_bf16", "amx_bf16", "avx_ne_convert"))  # as oneDNN's bf16 kernels need


def newton_schulz_in_fp32() -> None:
    import torch
    import torch.optim._muon as muon

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        tall = grad.size(0) > grad.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    muon._zeropower_via_newtonschulz = zeropower


def record_steps(path: str) -> None:
    import speculators.train.trainer as trainer

    step = trainer.Trainer._schedulers_step
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def timed(self) -> None:
        step(self)
        out.write(f"{time.perf_counter():.4f}\n")

    trainer.Trainer._schedulers_step = timed


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    steps_file = sys.argv.pop(1)
    point_at_cpu()
    if not native_bf16():
        newton_schulz_in_fp32()
    record_steps(steps_file)
    from speculators.__main__ import app

    sys.exit(app())


if __name__ == "__main__":
    main()
