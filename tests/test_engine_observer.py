"""The engine's Observer hook (serve/engine/observer.py): it sees the output as it is made, stops a request, reads
the target outputs the engine ran anyway, and changes nothing the engine computes."""

from __future__ import annotations

import pytest
import torch

from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.observer import Observer, Observers
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import PROMPTS

GREEDY = SamplingParams()
MAX_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(Observer):
    """Keeps what it is told; stops the request once it has seen `stop_after` tokens."""

    def __init__(self, wants_outputs: bool = False, stop_after: int | None = None) -> None:
        self.wants_outputs = wants_outputs
        self.stop_after = stop_after
        self.emitted: list[list[int]] = []
        self.rows = 0  # target output rows seen (prefill + verified)
        self.starts: list[int] = []
        self.finished = None

    def prefill(self, tokens, start, out):
        self.starts.append(start)
        self.rows += out.hidden.shape[0]
        assert out.hidden.shape[0] == len(tokens) - 1 - start

    def accept(self, tokens, path, out):
        self.rows += out.hidden.shape[0]
        assert out.hidden.shape[0] == len(path) + 1 and out.logits.shape[0] == len(path) + 1

    def emit(self, new_ids):
        self.emitted.append(new_ids)
        return self.stop_after is None or sum(map(len, self.emitted)) < self.stop_after

    def finish(self, generation):
        self.finished = generation


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


def engines(target):
    return {
        "ar": Engine(target, max_seq_len=128),
        "ngram": Engine(target, NgramProposer(NgramConfig(num_tokens=3)), max_seq_len=128),
    }


@pytest.mark.parametrize("name", ["ar", "ngram"])
def test_observer_sees_the_output_as_made_and_changes_nothing(name, target):
    engine = engines(target)[name]
    for prompt in PROMPTS:
        ref = engine.generate(prompt, MAX_NEW, GREEDY)
        rec = Recorder(wants_outputs=True)
        out = engine.generate(prompt, MAX_NEW, GREEDY, rec)
        assert out.output_ids == ref.output_ids and out.finished_by == ref.finished_by
        assert [t for step in rec.emitted for t in step] == out.output_ids
        assert len(rec.emitted) == 1 + out.metrics.target_forward_passes  # the prefill, then one per step
        assert rec.finished is out
        # every token run by the target once: the prompt, then each verified token (the last new one is pending;
        # a speculative step's accepted tokens may reach past max_new_tokens, verified though cut from the output)
        ran = len(prompt) + out.metrics.new_tokens - 1
        assert rec.rows == ran if name == "ar" else rec.rows >= ran


def test_an_observer_stops_the_request(target):
    engine = engines(target)["ngram"]
    ref = engine.generate(PROMPTS[3], MAX_NEW, GREEDY)
    rec = Recorder(stop_after=5)
    out = engine.generate(PROMPTS[3], MAX_NEW, GREEDY, rec)
    assert out.finished_by == "stopped" and 5 <= len(out.output_ids) < MAX_NEW
    assert out.output_ids == ref.output_ids[: len(out.output_ids)]
    again = engine.generate(PROMPTS[3], MAX_NEW, GREEDY)  # the next request runs whole
    assert again.output_ids == ref.output_ids


def test_observers_fan_out_and_any_stops(target):
    engine = engines(target)["ar"]
    a, b = Recorder(wants_outputs=True), Recorder(stop_after=3)
    out = engine.generate(PROMPTS[0], MAX_NEW, GREEDY, Observers(a, b))
    assert out.finished_by == "stopped" and len(out.output_ids) == 3
    assert a.emitted == b.emitted and a.finished is b.finished is out and a.rows > 0 and b.rows == 0


def test_observer_is_told_the_prefix_cache_hit(target):
    engine = Engine(target, prefix_cache=PrefixCache(), max_seq_len=128)
    prompt = list(range(40))
    engine.generate(prompt, 4, GREEDY)
    rec = Recorder(wants_outputs=True)
    engine.generate(prompt + [1, 2, 3], 4, GREEDY, rec)
    assert rec.starts == [32]  # two 16-token blocks came from the cache: the forward ran the rest
