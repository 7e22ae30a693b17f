"""What several test modules share, as plain code (their shared fixtures are in conftest.py; no test module imports
another, test_layering checks): tiny random HF models of each supported family, the engine's checks and
distribution tests, export's tiny target and drafters, and the configs and command lines the CLI tests run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

if TYPE_CHECKING:
    from draftsmith.eval.runner import EvalConfig
    from draftsmith.heads.drafter_folder import TargetInfo
    from draftsmith.serve.engine.engine import Engine
    from draftsmith.serve.proposers.base import Proposer
    from draftsmith.serve.shared.conversations import Conversation

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# The keys results.json's "spec" (and each entry of "methods") always holds.
SPEC_KEYS = (
    "method",
    "tokens_per_s",
    "speedup",
    "mean_acceptance_length",
    "acceptance_rate_per_position",
    "draft_acceptance_rate",
    "target_forward_passes",
    "mean_verify_rows",
    "verify_rows",
    "draft_ms_per_step",
    "ttft_ms",
    "tpot_ms",
    "new_tokens",
)


# tests that must hold on whatever device is present: the CUDA case runs on a machine that has one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def build_tiny(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random `model_type` model (safetensors) into folder and return it."""
    cfg = CONFIGS[model_type](**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is small; widen it so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def build_tiny_chat_target(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random llama with a real tokenizer (SmolLM2's) and its chat template: CLI tests run on it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    build_tiny(
        folder,
        "llama",
        seed,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=1024,
        **overrides,
    )
    tokenizer.save_pretrained(folder)
    return Path(folder)


def truncated_copy(src: Path, folder: Path, num_layers: int) -> Path:
    """An HF folder holding src's first num_layers layers (a real small draft LM sharing the tokenizer)."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(folder)
    return Path(folder)


def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 12, 20)]
    return rand + [[5, 6, 7, 8] * 5, [1, 2, 3] * 6 + [1]]  # repeated patterns: n-gram lookup finds drafts


PROMPTS = tiny_prompts()  # token prompts for the tiny (vocab 128) models


def exact_joint(target, prompt: list[int], sp) -> torch.Tensor:
    """joint[a, b, c] = q(a) q(b | a) q(c | a, b): the exact plain-sampling distribution of the first three
    tokens after prompt, from the target's own logits (a tiny vocabulary keeps this small)."""
    from draftsmith.serve.engine.sampling import probs_from_logits

    def q(seq: list[int]) -> torch.Tensor:
        logits = target(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)), 0).logits[-1]
        return probs_from_logits(logits, sp).double()

    vocab = target.config.vocab_size
    with torch.inference_mode():
        q1 = q(prompt)
        joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
        for a in range(vocab):
            q2 = q(prompt + [a])
            for b in range(vocab):
                joint[a, b] = q1[a] * q2[b] * q(prompt + [a, b])
    return joint


TARGET_ID = "tiny@00000000"


def tiny_info(model, **changes):
    """The TargetInfo a drafter made for the tiny `model` records (fields overridden by `changes`)."""
    from draftsmith.heads.drafter_folder import TargetInfo

    c = model.config
    fields = dict(id=TARGET_ID, hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_layers=c.num_hidden_layers)
    return TargetInfo(**{**fields, **changes})


def head_features(target, head, ids: torch.Tensor, mask: torch.Tensor):
    """A training batch for `head`: the target's last hidden states and the inputs of the layers it reads (None
    for a head that reads none, EAGLE-1/2)."""
    from draftsmith.train.batch import FeatureBatch

    with torch.no_grad():
        hidden, aux = target.hidden_states(ids, head.target_layers)
    return FeatureBatch(ids, mask, hidden, torch.cat(aux, dim=-1) if aux else None)


def perturbed(batch, name: str, pos: int):
    """batch with field `name` changed at position pos (a token moved by one id, a feature by 0.5)."""
    from draftsmith.train.batch import FeatureBatch

    fields = dict(vars(batch))
    x = fields[name].clone()
    x[:, pos] = (x[:, pos] + 1) % 128 if name == "input_ids" else x[:, pos] + 0.5
    fields[name] = x
    return FeatureBatch(**fields)


def greedy_continuations(target, plain: dict, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, n] and loss mask, right-padded: PROMPTS with their greedy continuations (plain: prompt -> output)
    and three random prompts with 32 greedy tokens each; what the engine tests briefly train a head on, so its
    drafts get accepted and rejected."""
    from draftsmith.serve.engine.engine import Engine
    from draftsmith.serve.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    seqs = [p + plain[tuple(p)].output_ids for p in PROMPTS]
    engine = Engine(target, max_seq_len=max_seq_len)
    for _ in range(3):
        p = torch.randint(0, 128, (8,), generator=g).tolist()
        seqs.append(p + engine.generate(p, 32, SamplingParams()).output_ids)
    n = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
    mask = torch.tensor([[1.0] * len(s) + [0.0] * (n - len(s)) for s in seqs])
    return ids, mask


# ---------------------------------------------------------------- the engine's checks (test_engine and the drafters')


def assert_same_bits(got, want, what: str) -> None:
    """Rows of got and want carry identical bits (the batch-invariant runner's claim); names the rows that differ."""
    differ = (got != want).flatten(1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"{what}: rows {differ} differ"


def assert_same_kv(a, b, slots: slice) -> None:
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        assert torch.equal(x[:, :, slots], y[:, :, slots])


def node_path(nodes, parents, i: int) -> list[int]:
    """The tokens from a draft tree's root child down to node i."""
    path = []
    while i >= 0:
        path.insert(0, int(nodes[i]))
        i = int(parents[i])
    return path


def kv_prefix(engine: Engine, n: int) -> list[torch.Tensor]:
    return [t[:, :, :n].clone() for t in (*engine.cache.k, *engine.cache.v)]


def same_kv(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-5) -> bool:
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


def check_metrics(m, out: list[int], k: int) -> None:
    """Counters that must add up for any run that stopped on length."""
    assert m.new_tokens == len(out)
    app = m.accepted_per_position
    assert sum(app) == m.accepted_tokens <= m.draft_tokens
    assert all(a >= b for a, b in zip(app, app[1:], strict=False)), app
    assert len(app) <= k and (not app or app[0] <= m.drafts)
    assert m.drafts <= m.target_forward_passes
    if m.drafts:
        assert m.mean_acceptance_length == pytest.approx(1 + m.accepted_tokens / m.drafts)
    else:
        assert m.mean_acceptance_length == 1.0 and m.accepted_tokens == 0
    # the prefill emits 1 token, each step its accepted tokens + 1; only the last step's bonus may be cut
    emitted = 1 + m.target_forward_passes + m.accepted_tokens
    assert m.new_tokens <= emitted <= m.new_tokens + 1


def spy_budgets(proposer: Proposer) -> list[tuple[int, int, int]]:
    """Per propose call: (tokens so far, budget given, deepest node drafted)."""
    calls, propose = [], proposer.propose

    def spy(tokens, sp, budget):
        tree = propose(tokens, sp, budget)
        calls.append((tokens.numel(), budget, int(tree.depths.max()) if len(tree) else 0))
        return tree

    proposer.propose = spy
    return calls


def pooled_chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; the rarest cells are pooled into one until every cell expects >= 5.

    Under H0 (speculative sampling draws exactly from the target's distribution) the counts are
    Multinomial(N, probs), and so are the pooled counts; X^2 over the pooled cells is ~ chi^2(cells - 1)
    once every expected count is >= 5. The p-value is the regularised upper incomplete gamma
    Q(df / 2, X^2 / 2); requiring p > ALPHA fails a correct engine with probability ~ALPHA per statistic
    (and the seeds are fixed). A cell the target gives probability 0 must never be hit at all.
    """
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "sampled a token the target gives probability 0"
    expected = counts.sum() * probs
    order = expected.argsort()
    pooled = 0
    while pooled < len(order) and (expected[order[:pooled]].sum() < 5 or expected[order[pooled]] < 5):
        pooled += 1
    rare, rest = order[:pooled], order[pooled:]
    obs = torch.cat([counts[rest], counts[rare].sum().view(1)])
    exp = torch.cat([expected[rest], expected[rare].sum().view(1)])
    assert len(obs) > 2 and exp.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def joint_pvalues(x: torch.Tensor, joint: torch.Tensor) -> tuple[float, float, float]:
    """x [n, 3]: draws of three tokens over a vocabulary of 8; joint [8, 8, 8] their exact distribution. The
    p-values of the first pair, the second pair, and the triple."""
    return (
        pooled_chi2_pvalue(x[:, 0] * 8 + x[:, 1], joint.sum(2).flatten()),
        pooled_chi2_pvalue(x[:, 1] * 8 + x[:, 2], joint.sum(0).flatten()),
        pooled_chi2_pvalue(x[:, 0] * 64 + x[:, 1] * 8 + x[:, 2], joint.flatten()),
    )


# a vocabulary-8 target (tiny_llama_dir("llama", **SMALL)): the sampling tests' exact distributions stay small
SMALL = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
SMALL_PROMPT = [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- export: a tiny target and a drafter of each kind

H, FF, Q, KV, V, DRAFT_V = 64, 128, 64, 32, 128, 48  # TINY's sizes: 4 heads and 2 kv heads of 16


def layer_shapes(p: str, in_dim: int, bias: bool = False) -> dict:
    s = {f"{p}.self_attn.q_proj.weight": (Q, in_dim), f"{p}.self_attn.k_proj.weight": (KV, in_dim)}
    s |= {f"{p}.self_attn.v_proj.weight": (KV, in_dim), f"{p}.self_attn.o_proj.weight": (H, Q)}
    s |= {
        f"{p}.mlp.gate_proj.weight": (FF, H),
        f"{p}.mlp.up_proj.weight": (FF, H),
        f"{p}.mlp.down_proj.weight": (H, FF),
    }
    s[f"{p}.post_attention_layernorm.weight"] = (H,)
    if bias:
        s |= {f"{p}.self_attn.{n}_proj.bias": (d,) for n, d in {"q": Q, "k": KV, "v": KV, "o": H}.items()}
    return s


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t127"): the HF export copies it."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(folder)


def dflash_layer_keys(i: int) -> dict:
    p, d = f"layers.{i}", H // 4
    s = {f"{p}.self_attn.q_proj.weight": (Q, H), f"{p}.self_attn.k_proj.weight": (KV, H)}
    s |= {f"{p}.self_attn.v_proj.weight": (KV, H), f"{p}.self_attn.o_proj.weight": (H, Q)}
    s |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
    s |= {f"{p}.mlp.gate_proj.weight": (FF, H), f"{p}.mlp.up_proj.weight": (FF, H)}
    s |= {f"{p}.mlp.down_proj.weight": (H, FF)}
    return s | {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,)}


# what vLLM's DFlash (and DSpark) backbone loads for a tiny head of 2 layers over 3 target layers
DFLASH_KEYS = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
DFLASH_KEYS |= {k: v for i in range(2) for k, v in dflash_layer_keys(i).items()}
DFLASH_VOCAB_KEYS = {"lm_head.weight": (DRAFT_V, H), "d2t": (DRAFT_V,), "t2d": (V,)}


def validation_failure(drafter: Path, fmt: str, out: Path, tcfg) -> str:
    """The message of validate's refusal of the export at out (it must refuse)."""
    from draftsmith.serve.export.base import ExportError
    from draftsmith.serve.export.pipeline import validate

    with pytest.raises(ExportError, match="fails validation") as e:
        validate(drafter, fmt, out, tcfg)
    return str(e.value)


def set_config(out: Path, **changes) -> None:
    """An export's config.json with changes at its top level."""
    edit_json(out / "config.json", lambda config: config.update(changes))


def tiny_head(kind: str, target, **fields):
    """(head, its config) of `kind` for the tiny target, as draftsmith-train builds it; fields: a DSpark config's
    own settings."""
    from draftsmith.heads.dflash import DFlashConfig, DFlashHead
    from draftsmith.heads.draft_model import DraftModel, DraftModelConfig
    from draftsmith.heads.dspark import DSparkConfig, DSparkHead
    from draftsmith.heads.eagle import EagleHead
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.heads.head_base import EagleConfig
    from draftsmith.heads.medusa import MedusaConfig, MedusaHeads

    c = target.config
    if kind == "eagle3":
        head = Eagle3Head(Eagle3Config.from_target(c, draft_vocab_size=DRAFT_V), target)
        head.set_vocab(torch.rand(V))  # a draft vocabulary that is not the first DRAFT_V ids
    elif kind == "dflash":
        head = DFlashHead(DFlashConfig.from_target(c, num_layers=2, draft_vocab_size=DRAFT_V), target)
        head.set_vocab(torch.rand(V))
    elif kind == "dspark":
        fields = {"num_layers": 2, "draft_vocab_size": DRAFT_V, "markov_rank": 8} | fields
        head = DSparkHead(DSparkConfig.from_target(c, **fields), target)
        head.set_vocab(torch.rand(V))
    elif kind == "eagle":
        head = EagleHead(EagleConfig.from_target(c), target)
    elif kind == "medusa":
        head = MedusaHeads(MedusaConfig(H, V, num_heads=3, num_layers=1), target)
    else:
        head = DraftModel(DraftModelConfig(num_layers=2), target)
        return head, head.draft_config
    return head, head.config


def save_tiny(kind: str, target, info: TargetInfo, folder: Path, **fields) -> Path:
    """A saved drafter folder of `kind` for the tiny target, its weights nudged off their initial values."""
    from draftsmith.heads.drafter_folder import Recipe, save_drafter

    torch.manual_seed(1)
    head, cfg = tiny_head(kind, target, **fields)
    with torch.no_grad():  # trained-looking weights: no zero blocks, a visible fc bias
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return save_drafter(head, cfg, kind, info, Recipe(data="tiny", acceptance={"mean_acceptance_length": 2.5}), folder)


EXPORTED = {kind: (kind, {}) for kind in ("eagle3", "eagle", "medusa", "draft_model")}


def export_drafters(target_dir: Path, root: Path, made: dict[str, tuple[str, dict]] = EXPORTED) -> tuple:
    """In root: a copy of the tiny target_dir with a tokenizer, and a saved drafter folder for it per entry of
    `made` (name -> its kind and config fields; by default one per kind). Returns the target's TargetConfig, the
    drafter folders by name, and the loaded target."""
    from draftsmith.heads.drafter_folder import TargetInfo
    from draftsmith.serve.models.loader import load_model
    from draftsmith.serve.models.target import TargetConfig, target_id

    tdir = root / "target"
    shutil.copytree(target_dir, tdir)
    save_tiny_tokenizer(tdir)
    tcfg = TargetConfig(path=str(tdir))
    target = load_model(tdir)
    info = TargetInfo(target_id(tcfg, tdir), H, V, 3)
    drafters = {name: save_tiny(kind, target, info, root / name, **fields) for name, (kind, fields) in made.items()}
    return tcfg, drafters, target


def leftovers(parent: Path) -> list[str]:
    """The hidden (dot) names left in parent: an atomic write's temporary folders."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def edit_weights(out: Path, fmt: str, change) -> None:
    """Rewrite an export's weights file after change(tensors) edits the dict in place."""
    path = out / ("medusa_lm_head.safetensors" if fmt == "tgi" else "model.safetensors")
    tensors = load_file(str(path))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def rename(old: str, new: str):
    """An edit for edit_weights: the tensor `old` renamed `new`."""
    return lambda t: t.__setitem__(new, t.pop(old))


def flip_ten(key: str):
    """Ten small weights (5th percentile) sign-flipped: at these tiny sizes a change of the output by ~1e-3."""

    def change(t):
        flat = t[key].view(-1)
        idx = flat.float().abs().argsort()[flat.numel() // 20 :][:10]
        flat[idx] = -flat[idx]

    return change


def scale(key: str, factor: float):
    """An edit for edit_weights: tensor `key` times factor, in its own dtype."""
    return lambda t: t.__setitem__(key, (t[key].float() * factor).to(t[key].dtype))


def edit_json(path: Path, change) -> None:
    """Rewrite a JSON file after change(data) edits it in place."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- heads, configs and command lines


def eagle_head(kind: str, target, seed: int = 0, **overrides):
    """An EAGLE-1/2 ("eagle") or EAGLE-3 ("eagle3") head for target, its weights drawn after manual_seed(seed)."""
    from draftsmith.heads.eagle import EagleHead
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.heads.head_base import EagleConfig

    torch.manual_seed(seed)
    config_cls, head_cls = {"eagle": (EagleConfig, EagleHead), "eagle3": (Eagle3Config, Eagle3Head)}[kind]
    return head_cls(config_cls.from_target(target.config, **overrides), target)


def eval_config(target, out, *overrides: str) -> EvalConfig:
    """The same config the CLI gets (hydra groups spec, methods, suite), W&B off."""
    from hydra import compose, initialize_config_module

    from draftsmith.eval.runner import EvalConfig
    from draftsmith.serve.shared.cli import typed

    with initialize_config_module("draftsmith.conf", version_base=None):
        cfg = compose("eval", [f"target.path={target}", f"out={out}", "wandb.enabled=false", *overrides])
    return typed(cfg, EvalConfig)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def command_line(
    target_dir: Path, tmp_path: Path, convs: list[Conversation], backend: str, max_new_tokens: int = 6
) -> tuple[list[str], Path]:
    """draftsmith-regenerate's overrides over `convs` written as a source file, and the answers file it names
    (max_new_tokens: 6, test_regenerate's NEW, unless given)."""
    source, out = tmp_path / "chats.jsonl", tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    overrides = [f"target.path={target_dir}", f"data.source={source}", "data.heldout_fraction=0"]
    overrides += [f"data.regenerate.max_new_tokens={max_new_tokens}", f"data.regenerate.out={out}"]
    overrides += [f"data.regenerate.backend={backend}"]
    return overrides, out


TESTS = Path(__file__).parent
# the command lines the tests run: offline, one intra-op thread, tests/ importable (imports=[standin_head])
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
}


def run_command(args: list[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a command line in ENV, its output captured as text."""
    return subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def cli_args(target, data) -> list[str]:
    """draftsmith.train's overrides: a short online run of tests/standin_head.py's head on target and data."""
    import standin_head

    return [
        f"target.path={target}",
        "target.dtype=float32",  # train=quick runs the target in bf16; these runs compare with fp32 ones
        f"data.source={data}",
        "data.max_conversations=16",
        "data.max_length=48",
        f"head.kind={standin_head.KIND}",
        "~head.loss",
        "head.init=null",  # eagle3's tuning (composed by default) starts its head from the target's layer
        "train.loss_on=answers",  # eagle3's tuning (composed by default) trains every position; the dataclass does not
        "imports=[standin_head]",
        "train.features.mode=online",
        "train.batch_size=2",
        "train.log_every=1",
        "data.regenerated=false",  # as test_trainer's config(), which these runs are compared with (test_regenerate*)
    ]


def sum_chats(folder: Path) -> str:
    """48 two-turn ShareGPT chats about sums, written to folder/chats.jsonl: the trainer tests' data."""
    rows = []
    for i in range(48):
        turns = [
            {"from": "human", "value": f"What is {i} plus {i}?"},
            {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. Anything else?"},
            {"from": "human", "value": "Say it in words."},
            {"from": "gpt", "value": f"The sum of {i} and {i} equals {2 * i}."},
        ]
        rows.append({"id": f"sum-{i}", "conversations": turns})
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def save_tiny_gguf(
    target_dir: Path,
    path: Path,
    seed: int | None = None,
    tokens: list[str] | None = None,
    layers: int = 3,
    eos: int = 2,
) -> Path:
    """A GGUF of the tiny target as llama.cpp's converter lays one out, with what format=gguf checks: sizes, the
    tokenizer's tokens, the token embedding (seed: another random embedding, i.e. another model)."""
    import gguf

    from draftsmith.serve.export.gguf_target import hf_embedding, hf_vocab

    embed = hf_embedding(target_dir)
    if seed is not None:
        embed = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed)) * embed.std()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(H)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens or hf_vocab(target_dir))
    w.add_token_types([1] * V)
    w.add_eos_token_id(eos)
    w.add_tensor("token_embd.weight", embed.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def edit_gguf(path: Path, change) -> None:
    """Rewrite a GGUF export after change(metadata, tensors) edits its typed metadata and tensors in place."""
    from draftsmith.serve.export.gguf_file import read_gguf, write_gguf

    meta, tensors = read_gguf(path)
    change(meta, tensors)
    arch = meta.pop("general.architecture").value
    dtype = next(t.dtype for t in tensors.values() if t.dim() == 2)
    write_gguf(path, arch, meta, tensors, dtype)


def four_steps(model, cache=None, taps: tuple[int, ...] = ()) -> tuple[list, object]:
    """A prefill, a decode, a chain verify and a tree verify through a target (48-token vocabulary range 0..127);
    their forward outputs and the cache they wrote."""
    from draftsmith.serve.engine.tree import DraftTree, causal_mask

    tokens = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(0))
    cache = cache or model.new_cache(64)
    tree = DraftTree(torch.zeros(5, dtype=torch.long), torch.tensor([-1, -1, 0, 1, 2]))
    calls = [
        (tokens[:30], torch.arange(30), 0, causal_mask(0, 30, "cpu")),
        (tokens[30:31], torch.tensor([30]), 30, None),
        (tokens[31:35], torch.arange(31, 35), 31, causal_mask(31, 4, "cpu")),
        (tokens[35:41], tree.positions(35), 35, tree.attention_mask(35)),
    ]
    with torch.inference_mode():
        return [model(t, p, cache, s, m, target_layers=taps) for t, p, s, m in calls], cache


# each one-call road's gate, and what it answers when switched off
GATES = {"decoder_stack": ("steps", False), "decoder_layer": ("step_plan", None), "eagle3_draft": ("plan", None)}


@contextlib.contextmanager
def without(*roads) -> Iterator[None]:
    """The given one-call roads switched off: cpu_kernels/decoder_stack.py (a target's step then runs module by module,
    on the kernels each module takes), cpu_kernels/decoder_layer.py (each layer's modules one by one) and
    cpu_kernels/eagle3_draft.py (an EAGLE-3 head's draft forward module by module)."""
    with contextlib.ExitStack() as stack:
        for road in roads:
            gate, answer = GATES[road.__name__.rsplit(".", 1)[-1]]
            stack.enter_context(mock.patch.object(road, gate, lambda *args, answer=answer: answer))
        yield


def exactly(code: str, w: torch.Tensor) -> torch.Tensor:
    """w rounded so that the panel format `code` ("bf16", "q8", "q4"; cpu_kernels/panel_codes.py) holds it exactly."""
    from draftsmith.cpu_kernels import panel_codes

    return w.bfloat16().float() if code == "bf16" else panel_codes.quantized(w, code)


def left_out_four_steps_in_five(engine, plain: dict, prompts, max_new: int) -> tuple[int, list[int]]:
    """Greedy runs whose drafter drafts one step in five, as the draft policy or a lookup may leave it: each output is
    plain decoding's. Returns the tokens accepted and, per step, the target-output rows the drafter holds untaken."""
    from draftsmith.serve.engine.sampling import SamplingParams
    from draftsmith.serve.engine.tree import DraftTree
    from draftsmith.serve.proposers.slots import SlotProposer

    proposer = engine.proposer
    propose, accept, steps, waiting = proposer.propose, proposer.accept, [0], []

    def one_in_five(tokens, sp, budget):
        steps[0] += 1
        return propose(tokens, sp, budget) if steps[0] % 5 == 0 else DraftTree.empty()

    def watched(*args):
        accept(*args)
        if isinstance(proposer, SlotProposer):
            waiting.append(sum(out.hidden.shape[0] for out in proposer.waiting))
        else:  # EAGLE: (first token, hidden rows, tapped layers)
            waiting.append(sum(h.shape[0] for _, h, _ in proposer.unstored))

    proposer.propose, proposer.accept = one_in_five, watched
    accepted = 0
    for p in prompts:
        out = engine.generate(p, max_new, SamplingParams())
        assert out.output_ids == plain[tuple(p)].output_ids
        accepted += out.metrics.accepted_tokens
    return accepted, waiting
