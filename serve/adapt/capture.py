"""CaptureObserver: what a finished request leaves for the trainer, read from the forwards the engine ran anyway.

The engine hands an observer the target's outputs of the prefill (the prompt rows it ran: none for the part the
prefix cache restored) and of each step (the rows of the tokens it verified and kept). Row i is the token at
position i, so those pieces tile the sequence from the first row run to the last token verified; the last token,
never verified, and prompt rows restored from the prefix cache have no forward and are left zero (`have` 0).
No target forward runs for capture.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.observer import Observer

STORAGE_DTYPE = torch.bfloat16  # what the trainer's feature cache stores (train/features.py)


@dataclass
class Captured:
    """One request as the trainer reads it: the feature cache's tensors for one example, plus `have`."""

    input_ids: Tensor  # int32 [n]: prompt, then answer
    loss_mask: Tensor  # uint8 [n]: 1 on the answer
    hidden: Tensor  # bf16 [n, H]: the target's final normed hidden state per position
    aux: Tensor  # bf16 [n, k*H]: the inputs of the drafter's target layers
    have: Tensor  # uint8 [n]: 1 where a forward ran the row
    meta: dict[str, str]  # the version that served, the client, the prompt's digest, accepted, drafts, time

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


class CaptureObserver(Observer):
    wants_outputs = True

    def __init__(
        self, prompt_ids: list[int], version: str, done: Callable[[Captured], None], client: str = "local"
    ) -> None:
        self.prompt_ids, self.version, self.done, self.client = prompt_ids, version, done, client
        self.pieces: list[tuple[int, Tensor, Tensor]] = []  # (first position, hidden rows, aux rows)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        self.keep(tokens, out)

    def accept(self, tokens: Tensor, path: list[int], out: ForwardOut) -> None:
        self.keep(tokens, out)

    def keep(self, tokens: Tensor, out: ForwardOut) -> None:
        """The rows are the tokens just before the new pending one (tokens[-1]); copies, as a static step's
        outputs are overwritten by the next one."""
        rows = out.hidden.shape[0]
        aux = torch.cat(out.aux, dim=-1) if out.aux else out.hidden.new_zeros(rows, 0)
        first = tokens.numel() - 1 - rows
        self.pieces.append((first, to_storage(out.hidden), to_storage(aux)))

    def finish(self, generation: Generation) -> None:
        if generation.output_ids and self.pieces:
            self.done(self.assemble(generation))

    def assemble(self, g: Generation) -> Captured:
        ids = self.prompt_ids + g.output_ids
        n = len(ids)
        _, h0, a0 = self.pieces[0]
        hidden, aux = h0.new_zeros(n, h0.shape[1]), a0.new_zeros(n, a0.shape[1])
        have = torch.zeros(n, dtype=torch.uint8)
        for first, h, a in self.pieces:
            rows = max(0, min(h.shape[0], n - first))  # a last step may run past max_tokens: those rows go
            hidden[first : first + rows], aux[first : first + rows] = h[:rows], a[:rows]
            have[first : first + rows] = 1
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[len(self.prompt_ids) :] = 1
        m = g.metrics
        meta = {"version": self.version, "client": self.client, "prompt": prompt_digest(self.prompt_ids)}
        meta |= {"accepted": str(m.accepted_tokens), "drafts": str(m.drafts)}
        meta["time"] = f"{time.time():.3f}"
        return Captured(torch.tensor(ids, dtype=torch.int32), mask, hidden, aux, have, meta)


def to_storage(t: Tensor) -> Tensor:
    return t.detach().to("cpu", STORAGE_DTYPE, copy=True)


def prompt_digest(prompt_ids: list[int]) -> str:
    """What makes two requests the same prompt: identical prompts count once in the store and in judging."""
    return hashlib.sha256(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]
