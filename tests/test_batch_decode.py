"""The own batched decoder's slots: each row steps at its own position and gets the logits its batch-1 forward
gives; a later turn prefills only past what the slot holds; one slot runs in half precision too; the nucleus drawn
from equals the full sort's, and a rounding-level change does not change a draw."""

import pytest
import torch

from draftsmith.serve.engine.sampling import SamplingParams, nucleus, pick_rows
from draftsmith.serve.models.loader import load_model
from draftsmith.train.batch_decode import Slots, Turns, answer_in_slots

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir())


def alone(model, ids: list[int]) -> torch.Tensor:
    """The logits after ids by a batch-1 forward of them all."""
    with torch.inference_mode():
        positions = torch.arange(len(ids))
        return model(torch.tensor(ids), positions, model.new_cache(64), 0, None, slice(-1, None)).logits[-1]


def test_each_row_steps_at_its_own_position_as_it_would_alone(model):
    prompts = [[5, 9, 13], [7, 3, 3, 8, 21, 4, 2], [11]]
    slots = Slots(model, 4, 64)  # a fourth slot left empty
    first = [slots.prefill(i, p) for i, p in enumerate(prompts)]
    for p, logits in zip(prompts, first, strict=True):
        torch.testing.assert_close(logits, alone(model, p), rtol=1e-4, atol=1e-4)
    nxt = [int(x.argmax()) for x in first]
    rows = slots.step([*nxt, 0], [0, 1, 2])
    for p, tok, logits in zip(prompts, nxt, rows, strict=True):
        torch.testing.assert_close(logits, alone(model, [*p, tok]), rtol=1e-4, atol=1e-4)
    assert slots.held[:3] == [[*p, t] for p, t in zip(prompts, nxt, strict=True)] and slots.held[3] == []


def test_a_row_left_out_of_a_step_keeps_what_it_holds(model):
    slots = Slots(model, 2, 64)
    slots.prefill(0, [5, 9, 13])
    slots.prefill(1, [7, 3])
    slots.step([4, 6], [0])  # row 1's turn just began: it does not step
    assert slots.held == [[5, 9, 13, 4], [7, 3]]
    (logits,) = slots.step([1, 6], [1])
    torch.testing.assert_close(logits, alone(model, [7, 3, 6]), rtol=1e-4, atol=1e-4)


def test_a_later_turn_prefills_only_past_what_the_slot_holds(model, monkeypatch):
    slots = Slots(model, 1, 64)
    slots.prefill(0, [5, 9, 13, 2])
    ran = []
    forward = type(model).forward
    monkeypatch.setattr(
        type(model), "forward", lambda self, ids, *a, **k: ran.append(len(ids)) or forward(self, ids, *a, **k)
    )
    logits = slots.prefill(0, [5, 9, 13, 2, 8, 8, 1])
    assert ran == [3]
    torch.testing.assert_close(logits, alone(model, [5, 9, 13, 2, 8, 8, 1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spread", [0.3, 4.0], ids=["flat: past the first tokens", "peaked: within them"])
def test_the_nucleus_is_the_full_sorts(spread):
    torch.manual_seed(0)
    probs = (torch.randn(5, 3000) * spread).softmax(-1)
    for top_p in (0.1, 0.8, 0.95):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        full = torch.zeros_like(probs).scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        torch.testing.assert_close(nucleus(probs, top_p), full / full.sum(-1, keepdim=True))


def test_rows_draw_from_what_sampling_keeps_with_their_own_generators():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    sp = SamplingParams(temperature=0.7, top_p=0.5)
    draws = [pick_rows(logits, sp, [torch.Generator().manual_seed(s) for s in (1, 2, 3)]) for _ in range(2)]
    assert draws[0] == draws[1]  # each row's generator decides its draw
    kept = nucleus((logits / 0.7).softmax(-1), 0.5) > 0
    many = [pick_rows(logits, sp, [torch.Generator().manual_seed(s)] * 3) for s in range(40)]
    assert all(kept[r, tok] for row in many for r, tok in enumerate(row))
    assert pick_rows(logits, SamplingParams(), [None] * 3) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_chat_left_decodes_in_half_precision_on_cpu(tiny_llama_dir, dtype):
    """regenerate loads the target offline (decode=False): bf16/fp16 stay half precision on CPU. With one chat to answer
    (one conversation, or a resume with one left) the decoder has one slot, and a [1, 1] slot tensor reaches
    layers_forward's batch-invariant branch, which asserts start is an int."""
    model = load_model(tiny_llama_dir(), dtype=dtype, decode=False)
    turns = Turns(budget=lambda prompt: 3, seed=lambda chat: 0, after=lambda chat, out: None)
    done = [c for chats, _ in answer_in_slots(model, [("c", [5, 9, 13])], 4, 32, SamplingParams(), (), turns)
            for c in chats]  # fmt: skip
    assert done == ["c"]


def test_a_rounding_level_change_does_not_change_a_top_p_draw():
    """Batched steps' logits differ from one batch composition to another by float rounding (row 0's max abs diff
    1.7e-6 between 2 and 7 slots on the tiny chat target), so a resume, or another batch_size, must not turn that
    into another draw. pick_rows draws over tokens in probability order: near-tied tokens swap places and the same
    generator draws the other one (the old pick drew in vocabulary order, where such a change almost never shows)."""
    logits = torch.full((1, 1000), -20.0)
    logits[0, :10] = 1.0  # ten near-tied tokens, all well inside the nucleus
    logits[0, 10:20] = -1.0 - 0.1 * torch.arange(10)  # where it ends: no ties
    g = torch.Generator().manual_seed(0)
    a = logits.clone()
    a[0, :10] += torch.randn(10, generator=g) * 1e-6
    b = logits.clone()
    b[0, :10] += torch.randn(10, generator=g) * 1e-6
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    draw = lambda x, s: pick_rows(x, sp, [torch.Generator().manual_seed(s)])
    flips = sum(draw(a, s) != draw(b, s) for s in range(200))
    assert flips <= 2, f"{flips} of 200 seeds draw another token after a 1e-6 change"
