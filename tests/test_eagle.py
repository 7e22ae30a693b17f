"""EAGLE-1/2 and EAGLE-3 on tiny random Llama targets (fp32, CPU): the heads (shapes, training-time test vs
drafting, save/load, vocab map), their losses (shifts, training), and the proposer in the engine: greedy output
identical to plain decoding for chains and trees, prefix-cache hits restoring the drafter's KV, seeded sampling,
and a statistical check that speculative sampling keeps the target's distribution."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

import draftsmith.conf
from draftsmith.cpu_kernels import native
from draftsmith.cpu_kernels.packed import can_pack
from draftsmith.eval.methods import spec_label
from draftsmith.heads.draft_vocab import build_vocab_map
from draftsmith.heads.drafter_folder import TOKEN_COUNTS, Recipe, frequent_ids, read_drafter, save_drafter
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.head_base import EagleConfig
from draftsmith.runtime.kv_cache import KVCache
from draftsmith.runtime.llama import ModelConfig
from draftsmith.serve.build import make_proposer, resolve_shape
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.prefix_cache import PrefixCache
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.engine.tree import TreeConfig
from draftsmith.serve.models.loader import fp32_arithmetic, load_model
from draftsmith.serve.models.target import LoadedTarget
from draftsmith.serve.proposers import base
from draftsmith.serve.proposers.hybrid import HybridProposer
from draftsmith.serve.proposers.propose_eagle import EagleProposer
from draftsmith.serve.proposers.propose_ngram import NgramConfig, NgramProposer
from draftsmith.serve.spec import SpecConfig
from draftsmith.train.loss_eagle import eagle_loss
from draftsmith.train.loss_eagle3 import eagle3_loss
from draftsmith.train.trainer import loss_for
from helpers import (
    DEVICES,
    PROMPTS,
    SMALL,
    SMALL_PROMPT,
    TARGET_ID,
    check_metrics,
    eagle_head,
    exact_joint,
    greedy_continuations,
    head_features,
    joint_pvalues,
    kv_prefix,
    left_out_four_steps_in_five,
    perturbed,
    same_kv,
    spy_budgets,
    tiny_info,
)

KINDS = {"eagle": (EagleConfig, EagleHead), "eagle3": (Eagle3Config, Eagle3Head)}
GREEDY = SamplingParams()
MAX_NEW, MAX_SEQ, ALPHA = 24, 128, 1e-4
VLLM_EAGLE3_KEYS = {
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir("llama"), torch.float32, "cpu")


# ---------------------------------------------------------------- heads


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes(kind, target):
    head = eagle_head(kind, target)
    c = target.config
    ids = torch.randint(0, c.vocab_size, (2, 7))
    batch = head_features(target, head, ids, torch.ones(2, 7))
    feature = head.target_features(batch.hidden, batch.aux)
    out = head(feature, ids, torch.arange(1, 8))
    assert feature.shape == out.shape == (2, 7, c.hidden_size)
    vocab = c.vocab_size if kind == "eagle" else head.config.draft_vocab_size
    assert head.logits(out).shape == (2, 7, vocab)
    assert not head.embed_tokens.weight.requires_grad  # borrowed from the target, frozen
    if kind == "eagle3":
        assert batch.aux.shape == (2, 7, 3 * c.hidden_size) and head.fc.in_features == 3 * c.hidden_size
        steps = head.unroll(feature, ids, 3)
        assert len(steps) == 3 and all(s.shape == out.shape for s in steps)
        assert torch.allclose(steps[0], out, atol=1e-5)  # step 0 of training-time test is the plain forward


def test_config_defaults():
    smol = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
    )
    cfg = Eagle3Config.from_target(smol)
    assert cfg.target_layers == (2, 15, 27) and cfg.draft_vocab_size == 8192
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta) == (576, 64, 3, 100000.0)
    assert Eagle3Config.from_target(ModelConfig(vocab_size=100, num_hidden_layers=3)).draft_vocab_size == 100
    assert Eagle3Config.from_target(smol, target_layers=[1, 2]).target_layers == (1, 2)
    with pytest.raises(ValueError, match="distinct, ascending"):
        Eagle3Config.from_target(smol, target_layers=(5, 2))
    with pytest.raises(ValueError, match="exceed"):
        Eagle3Config.from_target(smol, target_layers=(2, 31))
    assert EagleConfig.from_target(smol).vocab_size == 49152


EAGLE31 = {"norm_before_fc": True, "norm_output": True}


@pytest.mark.parametrize(
    "norms",
    [{}, EAGLE31, {"norm_before_residual": True}, {"qk_norm": True}],
    ids=["eagle3", "eagle3.1", "normed-residual", "qwen3-layer"],
)
def test_eagle3_training_time_test_is_what_drafting_sees(norms, target):
    """Step j of unroll at index i equals drafting depth j+1 with the KV cache: the real pairs 0..i in slots
    1..i+1 (the proposer's layout), then the head's own outputs fed back with the next tokens (normed first
    under norm_output, as vLLM feeds them)."""
    head = eagle_head("eagle3", target, **norms)
    c, m, steps = head.config, 9, 3
    feature = torch.randn(1, m, c.hidden_size)
    toks = torch.randint(0, c.vocab_size, (1, m))
    with torch.no_grad():
        outs = head.unroll(feature, toks, steps)
        for i in (0, 4, m - 2):
            cache = KVCache.allocate(1, c.num_key_value_heads, c.head_dim, 32, torch.float32, "cpu")
            mask = torch.ones(i + 1, i + 2, dtype=torch.bool).tril(1)
            mask[:, 0] = False
            h = head(feature[:, : i + 1], toks[:, : i + 1], torch.arange(1, i + 2), cache, 1, mask)[:, -1:]
            assert torch.allclose(h[0, 0], outs[0][0, i], atol=1e-5)
            for j in range(1, steps):
                slot = i + 1 + j
                tok = toks[:, i + j : i + j + 1] if i + j < m else torch.zeros(1, 1, dtype=torch.long)
                visible = torch.ones(1, slot + 1, dtype=torch.bool)
                visible[:, 0] = False
                h = head(h, tok, torch.tensor([slot]), cache, slot, visible)
                assert torch.allclose(h[0, 0], outs[j][0, i], atol=1e-5), (i, j)


def test_eagle31_norms_change_what_the_head_reads_and_feeds_back(target):
    plain, normed = eagle_head("eagle3", target), eagle_head("eagle3", target, **EAGLE31)
    assert not hasattr(plain, "input_norm") and normed.input_norm.weight.shape == (3 * target.config.hidden_size,)
    normed.load_state_dict(plain.state_dict(), strict=False)  # the same weights but input_norm
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    batch = head_features(target, plain, ids, torch.ones(1, 6))
    with torch.no_grad():
        normed.input_norm.weight.fill_(2.0)
        f_plain, f_normed = (
            plain.target_features(batch.hidden, batch.aux),
            normed.target_features(batch.hidden, batch.aux),
        )
        assert not torch.allclose(f_plain, f_normed)
        rms = batch.aux.pow(2).mean(-1, keepdim=True).add(normed.config.rms_norm_eps).rsqrt()
        assert torch.allclose(f_normed, plain.fc(2.0 * batch.aux * rms), atol=1e-5)
        out_plain, out_normed = plain(f_plain, ids, torch.arange(1, 7)), normed(f_plain, ids, torch.arange(1, 7))
        assert torch.allclose(out_normed, plain.norm(out_plain), atol=1e-5)  # fed back normed
        assert torch.allclose(normed.logits(out_normed), plain.logits(out_plain), atol=1e-5)  # the same tokens


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind, target, tmp_path):
    head = eagle_head(kind, target)
    if kind == "eagle3":
        head.set_vocab(torch.randint(0, 1000, (target.config.vocab_size,)))
    folder = save_drafter(head, head.config, kind, tiny_info(target), Recipe(data="random", steps=1), tmp_path / kind)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    if kind == "eagle":
        assert "fc.bias" in keys and "layers.0.self_attn.q_proj.weight" in keys
        assert not any(k.startswith(("embed_tokens", "lm_head", "layers.0.input_layernorm")) for k in keys)
    else:
        assert keys == VLLM_EAGLE3_KEYS  # what vLLM / SGLang load, nothing borrowed from the target
    loaded = read_drafter(folder, tiny_info(target), target)
    assert loaded.config == head.config and isinstance(loaded, KINDS[kind][1])
    ids = torch.randint(0, target.config.vocab_size, (2, 6))
    batch = head_features(target, head, ids, torch.ones(2, 6))
    with torch.no_grad():
        a = head.logits(head(head.target_features(batch.hidden, batch.aux), ids, torch.arange(1, 7)))
        b = loaded.logits(loaded(loaded.target_features(batch.hidden, batch.aux), ids, torch.arange(1, 7)))
    assert torch.equal(a, b)
    if kind == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert loaded.embed_tokens is target.model.embed_tokens  # borrowed, not copied
    bare = read_drafter(folder, tiny_info(target))  # no target: frozen placeholders of the right shape
    assert bare.embed_tokens.weight.shape == target.model.embed_tokens.weight.shape


@pytest.mark.parametrize("kind", KINDS)
def test_load_refuses_another_target(kind, target, tmp_path):
    head = eagle_head(kind, target)
    folder = save_drafter(head, head.config, kind, tiny_info(target), Recipe(), tmp_path / kind)
    h, v = target.config.hidden_size, target.config.vocab_size
    cases = [
        (
            tiny_info(target, id="big@11111111", hidden_size=2 * h),
            rf"{TARGET_ID} with hidden_size={h}.*big@11111111 has hidden_size={2 * h}",
        ),
        (
            tiny_info(target, id="wide@22222222", vocab_size=v + 1),
            rf"{TARGET_ID} with vocab_size={v}.*wide@22222222 has vocab_size={v + 1}",
        ),
        (tiny_info(target, id="other@33333333"), rf"made for target {TARGET_ID}, not other@33333333"),
    ]
    for other, message in cases:
        with pytest.raises(ValueError, match=message):
            read_drafter(folder, other, target)


def test_build_vocab_map():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (40,), generator=g)
    counts[[3, 7, 11]] = 1000  # certainly kept
    counts[[0, 1, 2]] = 0
    d2t, t2d = build_vocab_map(counts, 10)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.shape == (40,)
    assert int(t2d.sum()) == 10 == d2t.numel()
    ids = torch.arange(10) + d2t  # draft id -> target id
    assert torch.all(t2d[ids]) and torch.all(ids[1:] > ids[:-1])  # sorted by id, a bijection onto t2d
    assert {3, 7, 11} <= set(ids.tolist()) and not {0, 1, 2} & set(ids.tolist())
    assert counts[ids].min() >= counts[~t2d].max()  # the most frequent are kept
    tied = torch.tensor([1, 5, 5, 5, 0])
    assert (torch.arange(2) + build_vocab_map(tied, 2)[0]).tolist() == [1, 2]  # ties: the lower id
    d2t, t2d = build_vocab_map(counts, 40)
    assert torch.all(d2t == 0) and torch.all(t2d)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, 41)


# ---------------------------------------------------------------- losses


def test_eagle3_init_from_target(target):
    head = eagle_head("eagle3", target, draft_vocab_size=16, init="target")
    counts = torch.zeros(target.config.vocab_size)
    counts[torch.arange(40, 56)] = 1.0
    head.set_vocab(counts)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[40:56])
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    scratch = eagle_head("eagle3", target, draft_vocab_size=16)
    scratch.set_vocab(counts)
    assert not torch.equal(scratch.lm_head.weight, target.lm_head.weight[40:56])
    with pytest.raises(ValueError, match="eagle3 init must be one of scratch, target, layer"):
        eagle_head("eagle3", target, init="copy")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q and k norms
def test_eagle3_init_from_the_target_layer_computes_it(tiny_llama_dir, model_type):
    """init=layer: the head starts as the target's layer that reads the last tap, over that tap alone (the other
    taps and the token are read through weights at zero), then the target's final norm and lm_head rows."""
    target = load_model(tiny_llama_dir(model_type), torch.float32, "cpu")
    qk_norm = target.config.qk_norm
    head = eagle_head("eagle3", target, draft_vocab_size=16, init="layer", qk_norm=qk_norm)
    head.set_vocab(torch.rand(target.config.vocab_size))
    h, n, tap = target.config.hidden_size, 7, head.config.target_layers[-1]
    aux = torch.randn(1, n, len(head.config.target_layers) * h)
    tokens, positions = torch.randint(0, target.config.vocab_size, (1, n)), torch.arange(n)
    out = head(head.target_features(None, aux), tokens, positions)
    cos, sin = head.rope(positions, aux.dtype)
    expected = target.model.layers[tap](aux[..., -h:], cos, sin, None, None, 0, None)
    torch.testing.assert_close(out, expected)
    lens = target.lm_head(target.model.norm(expected))[..., head.vocab_ids]
    torch.testing.assert_close(head.logits(out), lens)
    other = head(head.target_features(None, aux.roll(1, -1)), tokens.roll(1, -1), positions)
    assert not torch.allclose(other, out)  # it reads the last tap: a shifted one changes what it computes
    with pytest.raises(ValueError, match=r"sized as the target's \(intermediate_size differ\).*head.init=scratch"):
        eagle_head("eagle3", target, init="layer", intermediate_size=8)
    with pytest.raises(ValueError, match="norm_before_fc and norm_before_residual change"):
        eagle_head("eagle3", target, init="layer", norm_before_fc=True)
    if qk_norm:  # a head drawn without the target's q and k norms (as EAGLE-3's formats have it) still starts
        plain = eagle_head("eagle3", target, init="layer")
        assert torch.equal(plain.midlayer.mlp.up_proj.weight, target.model.layers[tap].mlp.up_proj.weight)
    n = target.config.num_hidden_layers  # a last tap of the target's output: its last layer is copied
    last = eagle_head("eagle3", target, init="layer", target_layers=[0, n])
    assert torch.equal(last.midlayer.mlp.down_proj.weight, target.model.layers[n - 1].mlp.down_proj.weight)


def test_eagle_loss_shifts(target):
    """Weight only on token t: the pair (feature t-2, token t-1) predicts it, against hidden[t-1]."""
    head = eagle_head("eagle", target)
    n, t = 10, 6
    ids = torch.randint(0, target.config.vocab_size, (1, n))
    mask = torch.zeros(1, n)
    mask[0, t] = 1
    base = head_features(target, head, ids, mask)
    for soft in (True, False):
        loss = eagle_loss(head, base, soft=soft)[0]
        for name, pos, changes in (
            ("hidden", t, False),
            ("hidden", t - 1, True),
            ("input_ids", t - 1, True),
            ("input_ids", t + 1, False),
            ("input_ids", t, not soft),
        ):
            b = perturbed(base, name, pos)
            assert (eagle_loss(head, b, soft=soft)[0] != loss) == changes, (soft, name, pos)


def test_eagle3_loss_shifts(target):
    """Weight only on token t: step j predicts it from pair t-2-j's target feature, against hidden[t-1]."""
    head = eagle_head("eagle3", target)
    n, t = 10, 6
    ids = torch.randint(0, target.config.vocab_size, (1, n))
    mask = torch.zeros(1, n)
    mask[0, t] = 1
    base = head_features(target, head, ids, mask)
    loss, logs = eagle3_loss(head, base, ttt_steps=3)
    assert set(logs) == {"loss", "acc_0", "acc_1", "acc_2", "accept_0", "accept_1", "accept_2"}
    for name, pos, changes in (
        ("hidden", t, False),
        ("hidden", t - 1, True),
        ("aux", t - 1, False),
        ("aux", t - 2, True),
        ("aux", t - 4, True),
        ("input_ids", t, False),
        ("input_ids", t - 1, True),
    ):
        assert (eagle3_loss(head, perturbed(base, name, pos), ttt_steps=3)[0] != loss) == changes, (name, pos)


def test_eagle3_trains_the_first_draft_after_the_prompt(target, smollm2_dir):
    """At serve time the target answers a prompt's first token itself and the head's first draft is the second,
    read from the last prompt token's feature (a loss mask off by one, as SpecForge's once was, leaves that row out).
    A real chat's loss mask (SmolLM2's template) weighs that token, and its row reads the last prompt token's
    features."""
    from transformers import AutoTokenizer

    from draftsmith.serve.shared.conversations import Conversation
    from draftsmith.train.chat import encode

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    chat = [{"role": "user", "content": "Name two colours."}, {"role": "assistant", "content": "Red and blue."}]
    ex = encode(tok, Conversation("c", chat), 64)
    first = ex.loss_mask.index(1)  # the answer's first token: the target's own, from the prompt's prefill
    assert tok.decode(ex.input_ids[first:]).startswith("Red")
    mask = torch.zeros(1, len(ex.input_ids))
    mask[0, first + 1] = ex.loss_mask[first + 1]  # the first draft's token, weighted as the real mask weighs it
    head = eagle_head("eagle3", target)
    ids = torch.tensor([ex.input_ids]) % target.config.vocab_size
    base = head_features(target, head, ids, mask)
    loss = eagle3_loss(head, base, ttt_steps=1)[0]
    assert loss > 0
    assert eagle3_loss(head, perturbed(base, "aux", first - 1), ttt_steps=1)[0] != loss  # the last prompt token's
    assert eagle3_loss(head, perturbed(base, "aux", first), ttt_steps=1)[0] == loss  # a later feature: not this row


def test_eagle3_loss_masks_tokens_outside_the_draft_vocabulary_and_adds_feature_noise(target):
    head = eagle_head("eagle3", target, draft_vocab_size=target.config.vocab_size // 2)
    outside = int((~head.t2d).nonzero()[0])
    ids = torch.randint(0, target.config.vocab_size, (1, 10))
    ids[0, 6] = outside
    mask = torch.zeros(1, 10)
    mask[0, 6] = 1  # the only weighted token: one the head cannot draft
    batch = head_features(target, head, ids, mask)
    assert eagle3_loss(head, batch, ttt_steps=2)[0] > 0
    assert eagle3_loss(head, batch, ttt_steps=2, mask_outside_vocab=True)[0] == 0
    mask[0, 7] = 1
    batch = head_features(target, head, ids, mask)
    kept = eagle3_loss(head, batch, ttt_steps=1, mask_outside_vocab=True)[0]
    mask[0, 6] = 0
    assert torch.allclose(kept, eagle3_loss(head, head_features(target, head, ids, mask), ttt_steps=1)[0])
    exact = eagle3_loss(head, batch, ttt_steps=1)[0]
    assert eagle3_loss(head, batch, ttt_steps=1, feature_noise=0.0)[0] == exact
    assert eagle3_loss(head, batch, ttt_steps=1, feature_noise=0.5)[0] != exact


def test_eagle3_target_temperature_sharpens_toward_the_top_token(target):
    """T=1 is the target's distribution (the default); T=0 its top token alone (plain CE on the argmax); 0.5 is
    neither; a negative T is refused."""
    head = eagle_head("eagle3", target)
    ids = torch.randint(0, target.config.vocab_size, (2, 12))
    batch = head_features(target, head, ids, torch.ones(2, 12))
    loss_at = {t: eagle3_loss(head, batch, ttt_steps=1, target_temperature=t)[0].item() for t in (1.0, 0.5, 0.0)}
    assert loss_at[1.0] == eagle3_loss(head, batch, ttt_steps=1)[0].item()
    with torch.no_grad():
        logits = head.logits(
            head.unroll(head.target_features(batch.hidden[:, :11], batch.aux[:, :11]), ids[:, 1:], 1)[0]
        )
        top = (batch.hidden[:, 1:] @ head.target_lm_head.weight[head.vocab_ids].T).argmax(-1)
    hard = torch.nn.functional.cross_entropy(logits[:, :10].flatten(0, 1).float(), top[:, :10].flatten())
    assert loss_at[0.0] == pytest.approx(hard.item(), rel=1e-4)
    assert len(set(loss_at.values())) == 3
    with pytest.raises(ValueError, match="target_temperature"):
        eagle3_loss(head, batch, ttt_steps=1, target_temperature=-1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_decreases_and_target_stays_frozen(kind, target):
    head = eagle_head(kind, target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (4, 24), generator=g)
    mask = (torch.arange(24) >= 4).float().expand(4, 24).clone()
    batch = head_features(target, head, ids, mask)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainable = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3)
    options = {"ttt_steps": 3} if kind == "eagle3" else {}
    losses = []
    for _ in range(30):
        loss, logs = loss_for(kind)(head, batch, **options)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(logs)
    assert losses[-1]["loss"] < losses[0]["loss"] - 0.2, losses  # soft CE has the target's entropy as floor
    acc = "acc_0" if kind == "eagle3" else "acc"
    assert losses[-1][acc] > losses[0][acc] + 0.2
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert head.embed_tokens.weight.grad is None


# ---------------------------------------------------------------- the proposer in the engine


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, max_seq_len=MAX_SEQ)
    return {tuple(p): engine.generate(p, MAX_NEW, GREEDY) for p in PROMPTS}


@pytest.fixture(scope="module")
def trained(target, plain):
    """Heads trained briefly on the target's own greedy continuations (of the test prompts, and a few random
    ones), so drafts get accepted and rejected and every accept path runs."""
    ids, mask = greedy_continuations(target, plain, MAX_SEQ)
    heads = {}
    for kind, steps in (("eagle", 120), ("eagle3", 60)):
        head = eagle_head(kind, target)
        batch = head_features(target, head, ids, mask)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(steps):
            loss = loss_for(kind)(head, batch, **({"ttt_steps": 2} if kind == "eagle3" else {}))[0]
            opt.zero_grad()
            loss.backward()
            opt.step()
        heads[kind] = head.eval().requires_grad_(False)
    return heads


TREES = [("eagle", 1, 0), ("eagle", 3, 8), ("eagle3", 1, 0), ("eagle3", 4, 10)]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_head_window_reads_the_prompts_last_tokens_and_drafts_as_it_would_cold(kind, target, trained):
    """spec.head_window: the head's prefill runs over the prompt's last `window` slots alone, and it drafts from those
    and what it generates. Through the prefix cache, a request whose window starts before that of the request that
    stored its prefix fills the slots that one left out (and trusts none an older request left behind), so it drafts
    as it would on a cold engine; every output is plain decoding's."""
    window = 8
    other, long = PROMPTS[3], PROMPTS[2] + PROMPTS[1]  # 20 and 32 tokens, no block in common
    short = long[:22]  # a 20-token hit of long's blocks; its window starts at slot 14, long's at 24, other's at 12

    def proposer() -> EagleProposer:
        made = EagleProposer(trained[kind], kind, 4, TreeConfig(1, 0), window=window)
        extend = made.extend
        made.extend = lambda tokens: (ran.append((made.cached, tokens.numel())), extend(tokens))[1]
        return made

    def cold(prompt):
        engine = Engine(target, proposer(), max_seq_len=MAX_SEQ)
        out = engine.generate(prompt, 12, GREEDY)
        return out, engine.proposer.cache.read(len(prompt) - window, len(prompt))

    ran: list[tuple[int, int]] = []
    plain = Engine(target, max_seq_len=MAX_SEQ)
    engine = Engine(target, proposer(), prefix_cache=PrefixCache(block_size=4), max_seq_len=MAX_SEQ)
    for prompt in (other, long):
        ran.clear()
        assert engine.generate(prompt, 12, GREEDY).output_ids == plain.generate(prompt, 12, GREEDY).output_ids
        assert ran[0] == (len(prompt) - window, len(prompt) + 1)  # the prefill: the window and the first new token
    want, want_kv = cold(short)
    ran.clear()
    got = engine.generate(short, 12, GREEDY)
    assert got.metrics.prefix_hit_tokens == 20 and ran[0] == (14, 23)  # slots 14-19 restored empty, filled here
    assert got.output_ids == want.output_ids == plain.generate(short, 12, GREEDY).output_ids
    assert same_kv(engine.proposer.cache.read(len(short) - window, len(short)), want_kv)
    assert got.metrics.accepted_per_position == want.metrics.accepted_per_position and got.metrics.accepted_tokens


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_request_the_head_sits_out_leaves_its_slots_for_a_later_one(kind, target, trained):
    """A head the draft policy benches keeps the target's features at prefill and runs nothing more. The prefix cache
    then holds a prompt whose head slots are empty: a later request that hits it fills them and drafts as it would
    cold; and a draft asked of the benched head anyway first runs what it left, drafting as an eager prefill would."""
    long, short = PROMPTS[2] + PROMPTS[1], (PROMPTS[2] + PROMPTS[1])[:22]  # a 20-token hit of long's blocks

    def cold(prompt):
        return Engine(target, EagleProposer(trained[kind], kind, 4), max_seq_len=MAX_SEQ).generate(prompt, 12, GREEDY)

    proposer = EagleProposer(trained[kind], kind, 4)
    engine = Engine(target, proposer, prefix_cache=PrefixCache(block_size=4), max_seq_len=MAX_SEQ)
    ran: list[tuple[int, int]] = []
    extend, prefill = proposer.extend, proposer.prefill
    proposer.extend = lambda tokens: (ran.append((proposer.cached, tokens.numel())), extend(tokens))[1]

    def sitting_out(tokens, start, out):  # benched as the policy benches it (no policy here: every step drafts)
        proposer.benched = True
        prefill(tokens, start, out)
        assert not ran  # nothing ran at prefill

    proposer.prefill = sitting_out
    sat_out = engine.generate(long, 12, GREEDY)
    assert ran[0] == (1, len(long) + 1)  # the first draft ran the prompt's slots
    want = cold(long)
    assert sat_out.output_ids == want.output_ids
    assert sat_out.metrics.accepted_per_position == want.metrics.accepted_per_position
    proposer.prefill = prefill  # the engine, without a policy, attaches it again
    ran.clear()
    got, want = engine.generate(short, 12, GREEDY), cold(short)
    assert got.metrics.prefix_hit_tokens == 20 and ran[0] == (1, len(short) + 1)  # the restored slots were empty
    assert got.output_ids == want.output_ids
    assert got.metrics.accepted_per_position == want.metrics.accepted_per_position and got.metrics.accepted_tokens


@pytest.mark.parametrize("kind,topk,total", TREES)
def test_greedy_output_equals_plain(kind, topk, total, target, plain, trained):
    proposer = EagleProposer(trained[kind], kind, 4, TreeConfig(topk, total))
    paths = []
    accept = proposer.accept
    proposer.accept = lambda tokens, tree, path, out: (paths.append(path), accept(tokens, tree, path, out))
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted = passes = 0
    for p in PROMPTS:
        ref = plain[tuple(p)]
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == ref.output_ids, (kind, topk, p)
        m = out.metrics
        assert m.drafts == m.target_forward_passes and m.draft_tokens <= m.drafts * proposer.max_tree_size
        assert sum(m.accepted_per_position) == m.accepted_tokens and len(m.accepted_per_position) <= 4
        accepted += m.accepted_tokens
        passes += m.target_forward_passes
    assert accepted > 0 and passes < sum(r.metrics.target_forward_passes for r in plain.values())
    if topk == 1:
        assert proposer.max_tree_size == 4
    else:
        assert proposer.max_tree_size == total
        assert any(path != list(range(len(path))) for path in paths)  # a branch other than the first was taken


HYBRIDS = [("eagle3", 2, 6, "merge"), ("eagle", 1, 0, "merge"), ("eagle3", 2, 6, "prefer")]


@pytest.mark.parametrize("kind,topk,total,policy", HYBRIDS)
def test_hybrid_with_ngram_is_lossless_and_takes_lookup_paths(kind, topk, total, policy, target, plain, trained):
    drafter = EagleProposer(trained[kind], kind, 3, TreeConfig(topk, total))
    proposer = HybridProposer(drafter, NgramProposer(NgramConfig(5, 1, 3)), policy)
    assert proposer.name == f"{kind}_ngram" and proposer.max_tree_size == drafter.max_tree_size + 5
    own, lookup = [], []  # per step: the drafter's own node count (0: it did not draft); a lookup node accepted?
    propose, hybrid_propose, accept = drafter.propose, proposer.propose, proposer.accept
    drafter.propose = lambda tokens, sp, budget: own.append(len(t := propose(tokens, sp, budget))) or t
    proposer.propose = lambda tokens, sp, budget: own.append(0) or hybrid_propose(tokens, sp, budget)
    proposer.accept = lambda tokens, tree, path, out: (
        lookup.append(len(path) > 0 and any(i >= own[-1] for i in path)),
        accept(tokens, tree, path, out),
    )
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    for p in PROMPTS:
        out = engine.generate(p + p, MAX_NEW, GREEDY)  # a repeated prompt: the lookup finds matches
        ref = Engine(target, max_seq_len=MAX_SEQ).generate(p + p, MAX_NEW, GREEDY)
        assert out.output_ids == ref.output_ids, (kind, p)
        assert out.metrics.draft_tokens <= out.metrics.drafts * proposer.max_tree_size
    assert proposer.merged > 0 and any(lookup)
    if policy == "prefer":  # a step drafts with the lookup or the head, never both
        assert own.count(0) >= proposer.merged


@pytest.mark.parametrize("kind,topk,total,ngram", [("eagle", 1, 0, 0), ("eagle3", 3, 8, 0), ("eagle3", 2, 6, 4)])
def test_drafts_never_reach_past_max_new_tokens(kind, topk, total, ngram, target, plain, trained):
    """Near the end of a request the tree is only as deep as the tokens still allowed; output stays plain
    decoding's and the metrics count at most the cut bonus token beyond what was emitted."""
    proposer = EagleProposer(trained[kind], kind, 4, TreeConfig(topk, total))
    if ngram:
        proposer = HybridProposer(proposer, NgramProposer(NgramConfig(ngram, 1, 3)), "merge")
    calls = spy_budgets(proposer)
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    p = PROMPTS[3]
    ref = plain[tuple(p)].output_ids
    for n in range(1, 9):
        out = engine.generate(p, n, GREEDY)
        assert out.output_ids == ref[:n], (kind, n)
        check_metrics(out.metrics, out.output_ids, proposer.max_tree_size)
    assert all(depth <= budget for _, budget, depth in calls)
    assert any(0 < depth == budget < 4 for _, budget, depth in calls)


def test_hybrid_refuses_chain_drafters_and_unknown_policies(target):
    with pytest.raises(ValueError, match=r"pairs n-gram lookup with drafters that rebuild their state .* not ngram"):
        HybridProposer(NgramProposer(NgramConfig()), NgramProposer(NgramConfig()))
    head = EagleProposer(eagle_head("eagle3", target), "eagle3")
    with pytest.raises(ValueError, match="spec.ngram_policy must be one of prefer, merge"):
        HybridProposer(head, NgramProposer(NgramConfig()), "both")


def test_restricted_vocab_keeps_those_logits(target):
    head = eagle_head("eagle", target)
    ids = torch.tensor([3, 17, 40, 99])
    feature = torch.randn(5, target.config.hidden_size)
    full = head.logits(feature)
    head.restrict_vocab(ids)
    assert torch.equal(head.vocab_ids, ids) and head.lm_head.out_features == 4
    torch.testing.assert_close(head.logits(feature), full[:, ids])
    assert target.lm_head.out_features == target.config.vocab_size  # the target's own lm_head is untouched


@pytest.mark.parametrize("topk", [1, 3])
def test_restricted_vocab_drafts_only_those_tokens_and_stays_lossless(topk, target, plain, trained):
    head = eagle_head("eagle", target)
    head.load_state_dict(trained["eagle"].state_dict())
    answers = torch.tensor([t for r in plain.values() for t in r.output_ids])
    ids = frequent_ids(torch.bincount(answers, minlength=target.config.vocab_size), 24)
    head.restrict_vocab(ids)
    proposer = EagleProposer(head, "eagle", 3, TreeConfig(topk, 0))
    drafted, propose = [], proposer.propose
    proposer.propose = lambda tokens, sp, budget: drafted.append(propose(tokens, sp, budget)) or drafted[-1]
    engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
    accepted = 0
    for p in PROMPTS:
        out = engine.generate(p, MAX_NEW, GREEDY)
        assert out.output_ids == plain[tuple(p)].output_ids, (topk, p)
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and torch.isin(torch.cat([t.tokens for t in drafted]), ids).all()


def test_untrained_head_is_lossless_too(target, plain):
    for kind in KINDS:
        engine = Engine(target, EagleProposer(eagle_head(kind, target, seed=5).eval(), kind, 3, TreeConfig(2, 5)))
        for p in PROMPTS[:2]:
            assert engine.generate(p, MAX_NEW, GREEDY).output_ids == plain[tuple(p)].output_ids


@pytest.mark.parametrize("kind,topk,total", [("eagle3", 3, 8), ("eagle", 1, 0)])
def test_prefix_cache_hit_restores_drafter_kv(kind, topk, total, target, trained):
    a = PROMPTS[1] + PROMPTS[0][:2]  # 14 tokens: a hit covers 3 blocks of 4
    b = a[:8] + [100, 101, 102, 103, 104, 105]  # shares a's first 2 blocks
    c = PROMPTS[2]

    def proposer():
        return EagleProposer(trained[kind], kind, 4, TreeConfig(topk, total))

    def cold(prompt):
        engine = Engine(target, proposer(), max_seq_len=MAX_SEQ)
        out = engine.generate(prompt, 12, GREEDY)
        return out, kv_prefix(engine, len(prompt)), engine.proposer.cache.read(1, len(prompt))

    pc = PrefixCache(block_size=4)
    engine = Engine(target, proposer(), prefix_cache=pc, max_seq_len=MAX_SEQ)
    engine.generate(a, 12, GREEDY)
    accepted = 0
    for prompt, hit in ((c, 0), (a, 12), (c, 16), (b, 8)):
        ref, ref_target_kv, ref_drafter_kv = cold(prompt)
        out = engine.generate(prompt, 12, GREEDY)
        assert out.metrics.prefix_hit_tokens == hit
        assert out.output_ids == ref.output_ids
        assert same_kv(kv_prefix(engine, len(prompt)), ref_target_kv)
        drafter_kv = engine.proposer.cache.read(1, len(prompt))
        assert same_kv(drafter_kv, ref_drafter_kv)
        assert out.metrics.accepted_per_position == ref.metrics.accepted_per_position  # it drafts as it would cold
        accepted += out.metrics.accepted_tokens
    assert accepted > 0 and pc.hit_tokens == 12 + 16 + 8


@pytest.mark.parametrize("kind,topk,total", TREES)
def test_sampling_is_deterministic_given_a_seed(kind, topk, total, target, trained):
    engine = Engine(target, EagleProposer(trained[kind], kind, 4, TreeConfig(topk, total)), max_seq_len=MAX_SEQ)
    runs = [
        engine.generate(PROMPTS[3], 20, SamplingParams(temperature=1.0, seed=seed)).output_ids
        for seed in (3, None, 3, 4)
    ]
    assert runs[0] == runs[2] and runs[0] != runs[3]


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_runs_on_the_models_device(device, tiny_llama_dir):
    """A sampled chain (topk 1) and a top-k tree at T > 0 on the model's device, with the request's
    generator there: seeded runs repeat, and drafts were verified."""
    tgt = load_model(tiny_llama_dir("llama"), torch.float32, device)
    for topk in (1, 2):
        head = eagle_head("eagle3", tgt, seed=5).to(device).eval()
        engine = Engine(tgt, EagleProposer(head, "eagle3", 3, TreeConfig(topk, 0)), max_seq_len=MAX_SEQ)
        runs = [engine.generate(PROMPTS[3], 12, SamplingParams(temperature=1.0, seed=s)) for s in (3, 3)]
        assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 12
        assert runs[0].metrics.drafts == runs[0].metrics.target_forward_passes > 0


@pytest.fixture(scope="module")
def small(tiny_llama_dir):
    """Vocabulary-8 target; joint[a, b, c]: the exact plain-sampling distribution of 3 tokens after SMALL_PROMPT."""
    tgt = load_model(tiny_llama_dir("llama", **SMALL), torch.float32, "cpu")

    joint = exact_joint(tgt, SMALL_PROMPT, SamplingParams(temperature=1.0))
    return tgt, joint


# a sampled chain (draft probs), a top-k tree (one-hot drafts), that tree with an n-gram chain merged in, the
# sampled chain or the lookup's chain
# (and an EAGLE-1 sampled chain restricted to a serve-time draft vocabulary)
SAMPLED = [("eagle3", 1, 0, ""), ("eagle3", 2, 0, ""), ("eagle3", 2, 2, "merge"), ("eagle3", 1, 2, "prefer")]


@pytest.mark.parametrize("kind,topk,ngram,policy", [*SAMPLED, ("eagle", 1, 0, "")])
def test_speculative_sampling_matches_plain_distribution(kind, topk, ngram, policy, small):
    tgt, joint = small
    counts = torch.tensor([9, 1, 8, 7, 0, 6, 5, 4])  # 2 target tokens the drafter cannot propose
    if kind == "eagle3":
        head = eagle_head("eagle3", tgt, seed=3, draft_vocab_size=6)
        head.set_vocab(counts)
    else:
        head = eagle_head("eagle", tgt, seed=3)
        head.restrict_vocab(frequent_ids(counts, 6))
    proposer = EagleProposer(head.eval(), kind, 2, TreeConfig(topk, 0))
    if ngram:
        proposer = HybridProposer(proposer, NgramProposer(NgramConfig(ngram, 1, 2)), policy)
    engine = Engine(tgt, proposer, max_seq_len=16)
    draws, accepted = [], 0
    for i in range(1500):
        out = engine.generate(SMALL_PROMPT, 3, SamplingParams(temperature=1.0, seed=20_000 + i))
        draws.append(out.output_ids)
        accepted += out.metrics.accepted_tokens
    assert 0.1 * len(draws) < accepted  # drafts get accepted (and rejected): both branches ran
    x = torch.tensor(draws)
    pvalues = joint_pvalues(x, joint)
    assert min(pvalues) > ALPHA, pvalues
    assert not ngram or proposer.merged > 0


# ---------------------------------------------------------------- building from the spec config


def test_spec_config_builds_eagle_proposers(target, plain, tmp_path, tiny_llama_dir):
    loaded = LoadedTarget(target, None, TARGET_ID)
    folders = {}
    for kind in KINDS:
        head = eagle_head(kind, target)
        folders[kind] = save_drafter(head, head.config, kind, tiny_info(target), Recipe(), tmp_path / kind)
    yaml = OmegaConf.load(draftsmith.conf.__path__[0] + "/spec/eagle3.yaml")
    spec = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(SpecConfig), yaml, {"drafter": str(folders["eagle3"]), "tree": {"topk": 2}}
        )
    )
    assert spec.tree == TreeConfig(2, None) and spec.num_tokens is None and spec.name == "eagle3"
    spec = resolve_shape(spec)  # the rest from the folder: saved without a shape, so the kind's default
    assert (spec.num_tokens, spec.tree) == (5, TreeConfig(2, 12))
    bf16_kernels = can_pack(torch.empty(0, dtype=torch.bfloat16))
    for dtype in ("auto", "float32", *(["bfloat16"] if bf16_kernels else [])):
        proposer = make_proposer(replace(spec, draft_dtype=dtype), loaded)
        assert isinstance(proposer, EagleProposer) and proposer.target_layers == (0, 1, 2)
        assert proposer.head.embed_tokens is target.model.embed_tokens
        # auto: an fp32 target's drafts in bf16, on the kernels (bf16 values in fp32) or on oneDNN's bf16 kernels
        bf16_auto = fp32_arithmetic(torch.bfloat16, "cpu") or (bf16_kernels and not native.usable())
        bf16 = dtype == "bfloat16" or (dtype == "auto" and bf16_auto)
        fc = proposer.head.fc.weight  # a bf16 drafter where the kernels run: bf16 values computed in fp32
        assert fc.dtype == (torch.bfloat16 if bf16 and not fp32_arithmetic(torch.bfloat16, "cpu") else torch.float32)
        assert not bf16 or torch.equal(fc.float(), fc.bfloat16().float())
        assert target.model.embed_tokens.weight.dtype == torch.float32  # the borrowed embedding is not cast
        engine = Engine(target, proposer, max_seq_len=MAX_SEQ)
        assert engine.generate(PROMPTS[0], MAX_NEW, GREEDY).output_ids == plain[tuple(PROMPTS[0])].output_ids
    if fp32_arithmetic(torch.bfloat16, "cpu"):  # a bf16 target on the kernels: auto drafts as it runs, in bf16 values
        narrowed = load_model(tiny_llama_dir("llama"), torch.bfloat16, "cpu")
        head = make_proposer(spec, LoadedTarget(narrowed, None, TARGET_ID)).head
        assert head.fc.weight.dtype == torch.float32 and torch.equal(head.fc.weight, head.fc.weight.bfloat16().float())
        saved = make_proposer(replace(spec, draft_dtype="float32"), loaded).head.fc.weight
        assert not torch.equal(head.fc.weight, saved) and head.fc.current().dtype == torch.bfloat16  # bf16 panels
    chain = make_proposer(SpecConfig("eagle", 3, drafter=str(folders["eagle"])), loaded)
    assert chain.max_tree_size == 3 and chain.target_layers == ()
    assert "tree=TreeConfig(topk=2, total_tokens=12)" in repr(spec)  # the prefix-cache salt sees the tree too
    with pytest.raises(ValueError, match="is a eagle drafter; spec=eagle3 needs a eagle3 drafter"):
        make_proposer(SpecConfig("eagle3", drafter=str(folders["eagle"])), loaded)
    with pytest.raises(ValueError, match=f"made for target {TARGET_ID}, not other@"):
        make_proposer(SpecConfig("eagle", drafter=str(folders["eagle"])), LoadedTarget(target, None, "other@1"))
    hybrid = make_proposer(SpecConfig("eagle", 3, drafter=str(folders["eagle"]), ngram_tokens=4), loaded)
    assert isinstance(hybrid, HybridProposer) and hybrid.max_tree_size == 3 + 4
    assert spec_label(SpecConfig("eagle", drafter="x", ngram_tokens=4)) == "eagle_ngram"
    counts = torch.arange(target.config.vocab_size) % 7
    head = eagle_head("eagle", target)
    counted = save_drafter(head, head.config, "eagle", tiny_info(target), Recipe(), tmp_path / "c", counts)
    narrow = make_proposer(SpecConfig("eagle", 3, drafter=str(counted), draft_vocab=10), loaded)
    assert torch.equal(narrow.vocab_ids, frequent_ids(counts, 10)) and narrow.head.lm_head.out_features == 10
    with pytest.raises(FileNotFoundError, match="holds no token counts .* or draft over the full vocabulary"):
        make_proposer(SpecConfig("eagle", 3, drafter=str(folders["eagle"]), draft_vocab=10), loaded)
    (counted / TOKEN_COUNTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="token_counts.safetensors is corrupt"):
        make_proposer(SpecConfig("eagle", 3, drafter=str(counted), draft_vocab=10), loaded)
    with pytest.raises(
        ValueError, match="applies to spec=draft_model, eagle and medusa, not eagle3. an eagle3 head has its own"
    ):
        SpecConfig("eagle3", drafter="x", draft_vocab=8)
    with pytest.raises(ValueError, match="spec.draft_vocab must be >= 0"):
        SpecConfig("eagle", drafter="x", draft_vocab=-1)
    with pytest.raises(ValueError, match="spec.draft_dtype must be auto, float32, bfloat16 or float16"):
        SpecConfig("eagle", drafter="x", draft_dtype="fp8")
    with pytest.raises(ValueError, match="spec.ngram_tokens must be >= 0"):
        SpecConfig("eagle", drafter="x", ngram_tokens=-1)
    with pytest.raises(ValueError, match="spec.head_window must be >= 0"):
        SpecConfig("eagle3", drafter="x", head_window=-8)
    with pytest.raises(ValueError, match="spec=eagle3 needs spec.drafter=DIR"):
        SpecConfig("eagle3")
    with pytest.raises(ValueError, match="topk must be >= 1"):
        TreeConfig(0)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_head_left_out_of_many_steps_keeps_a_bounded_backlog(kind, target, plain, trained, monkeypatch):
    """Steps the head does not draft keep only the target's hidden rows (no logits), made features at its next draft
    or once BACKLOG tokens pile up; output stays plain decoding's and the head still drafts and gets accepted."""
    monkeypatch.setattr(base, "BACKLOG", 6)
    engine = Engine(target, EagleProposer(trained[kind], kind, 3), max_seq_len=MAX_SEQ)
    accepted, backlog = left_out_four_steps_in_five(engine, plain, PROMPTS, MAX_NEW)
    assert accepted > 0 and max(backlog) <= 6 + 4  # projected once past the bound (a step adds at most 4 rows)
