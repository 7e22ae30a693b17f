"""Observer: what watches one request run through the engine without drafting.

The engine tells it what it tells the proposer (the prefill's and each step's target outputs, when `wants_outputs`),
hands it each step's new output tokens (`emit`; returning False stops the request there), and the finished
Generation. A server streams with it; traffic capture reads the target's features of the request from it, taken
from the forwards the engine ran anyway.
"""

from __future__ import annotations

from torch import Tensor

from draftsmith.runtime.llama import ForwardOut
from draftsmith.serve.engine.generation import Generation


class Observer:
    wants_outputs = False  # True: prefill() and accept() get the target's outputs (else they are not called)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        """tokens: prompt + first new token; slots [0, start) came from the prefix cache (no forward ran them);
        out: the target's outputs for tokens[start:-1] (logits of the last row only)."""

    def accept(self, tokens: Tensor, path: list[int], out: ForwardOut) -> None:
        """A step verified the old pending token and kept draft nodes `path`; tokens ends with the next pending
        token; out: the target's outputs for the verified tokens (old pending token, then the path)."""

    def emit(self, new_ids: list[int]) -> bool:
        """Output tokens this step added (cut at max_new_tokens and after an EOS). False stops the request."""
        return True

    def finish(self, generation: Generation) -> None:
        """The request ended (its Generation: output ids, metrics, why it finished)."""


class Observers(Observer):
    """Several observers as one: each told everything, the request stopped when any asks."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers
        self.wants_outputs = any(o.wants_outputs for o in observers)

    def prefill(self, tokens: Tensor, start: int, out: ForwardOut) -> None:
        for o in self.observers:
            if o.wants_outputs:
                o.prefill(tokens, start, out)

    def accept(self, tokens: Tensor, path: list[int], out: ForwardOut) -> None:
        for o in self.observers:
            if o.wants_outputs:
                o.accept(tokens, path, out)

    def emit(self, new_ids: list[int]) -> bool:
        return all([o.emit(new_ids) for o in self.observers])  # a list: every observer sees the tokens

    def finish(self, generation: Generation) -> None:
        for o in self.observers:
            o.finish(generation)
