"""On a GPU: the decode/verify step replayed from CUDA graphs gives the eager engine's tokens and cache.

Skipped without CUDA; tests/test_engine.py checks the same static-shape logic eagerly on CPU.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.loader import load_model
from draftsmith.serve.proposers.propose_draft_model import DraftChainConfig, DraftModelProposer
from draftsmith.serve.proposers.propose_eagle import EagleProposer
from draftsmith.serve.proposers.propose_layerskip import layerskip_model
from draftsmith.serve.proposers.propose_medusa import MedusaProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from helpers import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MAX_NEW, MAX_SEQ = 32, 160


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cuda")


def proposer(name, target):
    if name == "ngram":
        return NgramProposer(NgramConfig(num_tokens=4))
    if name == "layerskip":
        return DraftModelProposer(layerskip_model(target, 1), DraftChainConfig(3))
    torch.manual_seed(0)  # the same random head for the eager and the graphs engine
    if name == "eagle3-tree":  # the target's aux layers come out of the captured graph; tree masks
        head = Eagle3Head(Eagle3Config.from_target(target.config), target).to(target.device).eval()
        return EagleProposer(head, "eagle3", 3, TreeConfig(topk=2, total_tokens=5))
    if name == "medusa":  # a static 2-level tree from the final hidden state the graph returns
        c = target.config
        heads = MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, num_heads=2), target).to(target.device)
        return MedusaProposer(heads.eval(), [[0], [1], [0, 0], [0, 1]], 2)
    return None


@pytest.mark.parametrize("name", [None, "ngram", "layerskip", "eagle3-tree", "medusa"])
def test_graphs_equal_eager(name, target):
    eager = Engine(target, proposer(name, target), max_seq_len=MAX_SEQ, cuda_graphs="off")
    graphs = Engine(target, proposer(name, target), max_seq_len=MAX_SEQ, cuda_graphs="graphs")
    for p in PROMPTS:
        want = eager.generate(p, MAX_NEW, SamplingParams())
        got = graphs.generate(p, MAX_NEW, SamplingParams())
        assert got.output_ids == want.output_ids, (name, p)
        n = len(p) + MAX_NEW - 1
        for a, b in zip(eager.cache.k + eager.cache.v, graphs.cache.k + graphs.cache.v, strict=True):
            torch.testing.assert_close(a[:, :, :n], b[:, :, :n])
    assert graphs.static.mode == "graphs" and graphs.static.graphs  # captured, not fallen back
    assert 1 in graphs.static.graphs


def test_auto_uses_graphs_on_cuda(target):
    assert Engine(target, max_seq_len=MAX_SEQ).static.mode == "graphs"
