"""Validate an export: reload it, check config.json, key names, shapes and dtypes against the format's table
(built from the drafter's own config, not from the exporter), then run the format's forward, written here in
plain torch from the exported tensors, against the drafter's forward on random inputs.

The functions here are the built-in formats' validator pieces; serve/export/formats.py puts each format's together.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from draftsmith.heads.drafter import TOKEN_COUNTS, own_state
from draftsmith.heads.llama import ModelConfig, rope_inv_freq
from draftsmith.serve.export.exporters import TOKEN_MAP, ExportError, Format, Source, format_for

Shapes = dict[str, tuple[int, ...]]
# max |diff| / max |drafter|: both forwards run the same rounded weights in float32, so only the order of the
# float32 operations differs (a clean export: ~3e-7). Ten sign-flipped weights or a norm scaled by 1.003 are far more.
TOLERANCE = 1e-5
EAGLE31_KEYS = ("norm_before_fc", "norm_output")  # Eagle3Config's EAGLE-3.1 switches, as vLLM's config.json names them


# ---------------------------------------------------------------- the table: keys and shapes per format


def attn_shapes(p: str, in_dim: int, c, bias: bool) -> Shapes:
    q, kv, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    s = {f"{p}.q_proj.weight": (q, in_dim), f"{p}.k_proj.weight": (kv, in_dim), f"{p}.v_proj.weight": (kv, in_dim)}
    s[f"{p}.o_proj.weight"] = (h, q)
    if bias:
        s |= {f"{p}.q_proj.bias": (q,), f"{p}.k_proj.bias": (kv,), f"{p}.v_proj.bias": (kv,), f"{p}.o_proj.bias": (h,)}
    return s


def mlp_shapes(p: str, c) -> Shapes:
    h, i = c.hidden_size, c.intermediate_size
    return {f"{p}.gate_proj.weight": (i, h), f"{p}.up_proj.weight": (i, h), f"{p}.down_proj.weight": (h, i)}


def eagle3_shapes(src: Source, config: dict) -> Shapes:
    return eagle3_table(src.head.config, bool(config.get("attention_bias")))


def eagle3_table(c, bias: bool) -> Shapes:
    """An EAGLE-3 head of config c in the LlamaForCausalLMEagle3 names (also what serve/export/foreign.py reads)."""
    h = c.hidden_size
    s = {"fc.weight": (h, len(c.target_layers) * h), **attn_shapes("midlayer.self_attn", 2 * h, c, bias)}
    s |= mlp_shapes("midlayer.mlp", c)
    s |= {f"midlayer.{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    s |= {"norm.weight": (h,), "lm_head.weight": (c.draft_vocab_size, h)}
    if c.draft_vocab_size < c.vocab_size:
        s |= {"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    if getattr(c, "norm_before_fc", False):
        s["input_norm.weight"] = (len(c.target_layers) * h,)
    return s


def eagle_shapes(src: Source, config: dict, fc_bias: bool = False) -> Shapes:
    c, bias = src.head.config, bool(config.get("attention_bias"))
    h = c.hidden_size
    s = {"fc.weight": (h, 2 * h), **attn_shapes("layers.0.self_attn", h, c, bias), **mlp_shapes("layers.0.mlp", c)}
    s["layers.0.post_attention_layernorm.weight"] = (h,)
    return s | ({"fc.bias": (h,)} if fc_bias else {})


def medusa_names(tgi: bool, c) -> tuple[str, str]:
    """Format strings for head h's block l and its lm_head: FasterDecoding's (TGI) or vLLM's."""
    if tgi:
        return "{h}.{l}.linear", "{h}." + str(c.num_layers)
    return "blocks.{h}.layers.{l}", "lm_heads.{h}"


def medusa_shapes(src: Source, config: dict, tgi: bool = False) -> Shapes:
    c = src.head.config
    block, head = medusa_names(tgi, c)
    s = {}
    for h in range(c.num_heads):
        for layer in range(c.num_layers):
            s |= {f"{block.format(h=h, l=layer)}.weight": (c.hidden_size, c.hidden_size)}
            s |= {f"{block.format(h=h, l=layer)}.bias": (c.hidden_size,)}
        s[f"{head.format(h=h)}.weight"] = (c.vocab_size, c.hidden_size)
    return s


def hf_llama_shapes(m: ModelConfig) -> Shapes:
    h = m.hidden_size
    s = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}"
        s |= attn_shapes(f"{p}.self_attn", h, m, False) | mlp_shapes(f"{p}.mlp", m)
        s |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        if m.attention_bias:  # Qwen2: q/k/v only
            s |= {f"{p}.self_attn.{n}_proj.bias": (s[f"{p}.self_attn.{n}_proj.weight"][0],) for n in "qkv"}
        if m.qk_norm:
            s |= {f"{p}.self_attn.q_norm.weight": (m.head_dim,), f"{p}.self_attn.k_norm.weight": (m.head_dim,)}
    return s if m.tie_word_embeddings else s | {"lm_head.weight": (m.vocab_size, h)}


def draft_model_shapes(src: Source, config: dict) -> Shapes:
    return hf_llama_shapes(src.head.config)


# ---------------------------------------------------------------- config.json per format: keys the engines read,
# with the values the drafter implies (checked for equality)


def sizes_config(c) -> dict:
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: getattr(c, k) for k in sizes} | {"vocab_size": c.vocab_size}


def eagle_config(src: Source, arch: str = "EagleLlamaForCausalLM") -> dict:
    return sizes_config(src.head.config) | {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1}


def eagle3_config(src: Source) -> dict:
    """What vLLM reads: the layer ids in eagle_config; the EAGLE-3.1 switches that are on, at the top (and
    norm_before_fc in eagle_config too, where vLLM looks first)."""
    c = src.head.config
    ids = {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True}
    on = {k: True for k in EAGLE31_KEYS if getattr(c, k, False)}
    want = eagle_config(src, "LlamaForCausalLMEagle3") | on
    ids |= {k: v for k, v in on.items() if k == "norm_before_fc"}
    return want | {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size, "eagle_config": ids}


def medusa_vllm_config(src: Source) -> dict:
    c = src.head.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True,
    }


def medusa_tgi_config(src: Source) -> dict:
    return {"medusa_num_heads": src.head.config.num_heads, "medusa_num_layers": src.head.config.num_layers}


def draft_model_config(src: Source) -> dict:
    c = src.head.config
    return sizes_config(c) | {"model_type": src.target_hf["model_type"], "num_hidden_layers": c.num_hidden_layers}


def config_problems(src: Source, f: Format, folder: Path, config: dict) -> list[str]:
    problems = [
        f"config.json {k}={config.get(k, '<missing>')!r}, expected {v!r}"
        for k, v in f.config(src).items()
        if config.get(k) != v
    ]
    return problems + f.problems(src, folder, config)


def tgi_problems(src: Source, folder: Path, config: dict) -> list[str]:
    problems = []
    if "architectures" in config:
        problems.append("config.json has `architectures`: TGI then takes the folder for a full model")
    if not config.get("base_model_name_or_path"):
        problems.append("config.json has no base_model_name_or_path: TGI loads the target from it")
    return problems


def tokenizer_problems(src: Source, folder: Path, config: dict) -> list[str]:
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return []
    return ["no tokenizer files (tokenizer.json / tokenizer.model)"]


def head_config_problems(src: Source, folder: Path, config: dict) -> list[str]:
    """EAGLE heads run beside the target: its positions and its rope."""
    problems = []
    need = src.target_hf.get("max_position_embeddings", 0)
    if config.get("max_position_embeddings", 0) < need:
        problems.append(
            f"config.json max_position_embeddings={config.get('max_position_embeddings')} < target's {need}"
        )
    try:
        ours, theirs = ModelConfig.from_hf(config), ModelConfig.from_hf(src.target_hf)
        if not torch.equal(rope_inv_freq(ours), rope_inv_freq(theirs)):
            problems.append("config.json rope settings differ from the target's")
    except (KeyError, ValueError) as e:
        problems.append(f"config.json does not parse as a Llama config: {e}")
    return problems


# ---------------------------------------------------------------- reloading


def read_export(folder: Path, f: Format) -> tuple[dict, dict[str, Tensor]]:
    path, weights = folder / "config.json", folder / f.weights
    for f in (path, weights, folder / "README.md"):
        if not f.is_file():
            raise ExportError(f"export {folder} is incomplete: {f.name} is missing")
    try:
        return json.loads(path.read_text()), load_file(str(weights))
    except (json.JSONDecodeError, SafetensorError, OSError) as e:
        raise ExportError(f"export {folder} is corrupt: {e}") from e


def tensor_problems(tensors: dict[str, Tensor], want: Shapes) -> list[str]:
    missing, unexpected = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    problems = [f"missing key {k} {want[k]}" for k in missing] + [f"unexpected key {k}" for k in unexpected]
    problems += [
        f"{k} has shape {tuple(tensors[k].shape)}, expected {want[k]}"
        for k in sorted(want.keys() & tensors.keys())
        if tuple(tensors[k].shape) != want[k]
    ]
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) > 1:
        problems.append(f"mixed floating dtypes {sorted(map(str, floats))}")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t is {tensors['d2t'].dtype}, expected torch.int64 offsets")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        problems.append(f"t2d is {tensors['t2d'].dtype}, expected torch.bool")
    return problems


# ---------------------------------------------------------------- the formats' forwards, from exported tensors


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(x: Tensor, w: dict[str, Tensor], p: str, cfg: ModelConfig, positions: Tensor) -> Tensor:
    """Causal GQA self-attention over x [n, in_dim] at `positions`, HF rotate-half rope."""
    n, heads, kv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    freqs = positions.float()[:, None] * rope_inv_freq(cfg)[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q = rotate(linear(x, w, f"{p}.q_proj").view(n, heads, d).transpose(0, 1), cos, sin)
    k = rotate(linear(x, w, f"{p}.k_proj").view(n, kv, d).transpose(0, 1), cos, sin)
    v = linear(x, w, f"{p}.v_proj").view(n, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
    return linear(out, w, f"{p}.o_proj")


def mlp(x: Tensor, w: dict[str, Tensor], p: str) -> Tensor:
    return linear(F.silu(linear(x, w, f"{p}.gate_proj")) * linear(x, w, f"{p}.up_proj"), w, f"{p}.down_proj")


def eagle3_forward(
    w, cfg: ModelConfig, embeds: Tensor, aux: Tensor, positions: Tensor, norms: dict | None = None
) -> tuple[Tensor, ...]:
    """vLLM's Eagle3LlamaForCausalLM: feature = fc(aux) (aux normed first under norm_before_fc); [norm(embed);
    norm(feature)] -> attention, residual = feature; returns the feature fed back (normed under norm_output),
    logits over the draft vocabulary and each draft id's target id."""
    norms, eps = norms or {}, cfg.rms_norm_eps
    if norms.get("norm_before_fc"):
        aux = rms(aux, w["input_norm.weight"], eps)
    h = eagle3_layer(w, "midlayer", cfg, embeds, linear(aux, w, "fc"), positions)
    normed = rms(h, w["norm.weight"], eps)
    logits, vd = linear(normed, w, "lm_head"), w["lm_head.weight"].shape[0]
    ids = torch.arange(vd) + w.get("d2t", torch.zeros(vd, dtype=torch.long))
    return normed if norms.get("norm_output") else h, logits, ids


def eagle3_layer(w, p: str, cfg: ModelConfig, embeds: Tensor, feat: Tensor, positions: Tensor) -> Tensor:
    """The EAGLE-3 layer `p`: [norm(embed); hidden_norm(feature)] -> attention, residual = feature; then the MLP."""
    eps = cfg.rms_norm_eps
    x = torch.cat(
        [rms(embeds, w[f"{p}.input_layernorm.weight"], eps), rms(feat, w[f"{p}.hidden_norm.weight"], eps)], -1
    )
    h = feat + attention(x, w, f"{p}.self_attn", cfg, positions)
    return h + mlp(rms(h, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")


def eagle_forward(w, cfg: ModelConfig, embeds: Tensor, feature: Tensor, positions: Tensor, lm_head: Tensor):
    """EAGLE-1: x = fc([embed; feature]) (+ bias where the format has one); one layer without input norm,
    no final norm; the target's lm_head gives the logits."""
    x = linear(torch.cat([embeds, feature], -1), w, "fc")
    h = x + attention(x, w, "layers.0.self_attn", cfg, positions)
    h = h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"], cfg.rms_norm_eps), w, "layers.0.mlp")
    return h, h @ lm_head.T


def medusa_forward(w, tgi: bool, c, hidden: Tensor) -> Tensor:
    """[K, n, V]: head h = its blocks x + silu(W x + b), then its own lm_head."""
    block, head = medusa_names(tgi, c)
    out = []
    for h in range(c.num_heads):
        x = hidden
        for layer in range(c.num_layers):
            x = x + F.silu(linear(x, w, block.format(h=h, l=layer)))
        out.append(linear(x, w, head.format(h=h)))
    return torch.stack(out)


# ---------------------------------------------------------------- comparing with the drafter's own forward


def rounded_head(src: Source, dtype: torch.dtype):
    """A float32 copy of the drafter whose parameters carry the export's rounding (buffers such as the rope
    tables stay float32), so only the format, not the dtype, can make the two forwards differ."""
    head = copy.deepcopy(src.head).float()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(dtype).float())
    return head


@dataclass
class Probe:
    """What both forwards see: the drafter carrying the export's rounding, the exported tensors in float32, random
    inputs."""

    head: nn.Module
    w: dict[str, Tensor]
    config: dict
    folder: Path
    g: torch.Generator
    tokens: Tensor
    positions: Tensor


def forward_pairs(src: Source, f: Format, folder: Path, w: dict[str, Tensor], config: dict) -> dict[str, tuple]:
    """name -> (export's output, drafter's output) on the same random inputs."""
    dtype = next(t.dtype for t in w.values() if t.is_floating_point())
    w = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    g, n = torch.Generator().manual_seed(0), 6
    tokens = torch.randint(0, src.head.config.vocab_size, (n,), generator=g)
    with torch.no_grad():
        return f.forward(src, Probe(rounded_head(src, dtype), w, config, folder, g, tokens, torch.arange(3, 3 + n)))


def medusa_pairs(src: Source, p: Probe, tgi: bool = False) -> dict[str, tuple]:
    c = src.head.config
    hidden = torch.randn(p.tokens.numel(), c.hidden_size, generator=p.g)
    return {"logits": (medusa_forward(p.w, tgi, c, hidden), p.head(hidden))}


def draft_model_pairs(src: Source, p: Probe) -> dict[str, tuple]:
    head = p.head
    return {"logits": (hf_logits(p.folder, p.tokens), head.lm_head(head.hidden_states(p.tokens[None])[0])[0])}


def eagle3_pairs(src: Source, p: Probe) -> dict[str, tuple]:
    c, head, n = src.head.config, p.head, p.tokens.numel()
    aux = torch.randn(n, len(c.target_layers) * c.hidden_size, generator=p.g)
    embeds, cfg = head.embed_tokens(p.tokens), ModelConfig.from_hf(p.config)
    norms = {k: bool(p.config.get(k) or (p.config.get("eagle_config") or {}).get(k)) for k in EAGLE31_KEYS}
    h, logits, ids = eagle3_forward(p.w, cfg, embeds, aux, p.positions, norms)
    mine = head(head.target_features(None, aux[None]), p.tokens[None], p.positions)[0]
    pairs = {"feature": (h, mine), "logits": (logits, head.logits(mine)), "target ids": (ids, head.vocab_ids)}
    return pairs | t2d_pair(p.w, head)


def eagle_pairs(src: Source, p: Probe) -> dict[str, tuple]:
    c, head, w = src.head.config, p.head, p.w
    feature = torch.randn(p.tokens.numel(), c.hidden_size, generator=p.g)
    if bias_moved(w):  # the exact product: the rounding of the exported one is checked apart
        own = head.state_dict()
        w = w | {k: v.float() for k, v in moved_bias(w, own, w["layers.0.self_attn.o_proj.bias"]).items()}
    embeds, cfg = head.embed_tokens(p.tokens), ModelConfig.from_hf(p.config)
    h, logits = eagle_forward(w, cfg, embeds, feature, p.positions, head.lm_head.weight)
    mine = head(feature[None], p.tokens[None], p.positions)[0]
    return {"feature": (h, mine), "logits": (logits, head.logits(mine))}


def moved_bias(state: dict[str, Tensor], own: dict[str, Tensor], b: Tensor) -> dict[str, Tensor]:
    """EAGLE for vLLM moves fc's bias b into the attention (o_proj's bias is b): q/k/v biases W b + their own, in
    float64, W from `state`, the own biases from `own`."""
    out = {}
    for p in "qkv":
        name = f"layers.0.self_attn.{p}_proj"
        w = state[f"{name}.weight"].double()
        out[f"{name}.bias"] = own.get(f"{name}.bias", torch.zeros(w.shape[0])).double() + w @ b.double()
    return out


def bias_moved(w: dict[str, Tensor]) -> bool:
    return "fc.bias" not in w and "layers.0.self_attn.o_proj.bias" in w


def moved_bias_problems(src: Source, w: dict[str, Tensor], dtype: torch.dtype) -> list[str]:
    """Each moved bias must be the drafter's own float32 product rounded to the export dtype: the one rounding
    the forward comparison cannot see (it puts the exact product in its place)."""
    state = own_state(src.head)
    want = moved_bias(state, state, state["fc.bias"]) if bias_moved(w) else {}
    return [
        f"{k} is not q/k/v_proj.weight @ fc.bias (+ its own bias) of the drafter, rounded to {dtype}"
        for k, v in want.items()
        if not torch.equal(w[k], v.float().to(dtype))
    ]


def t2d_pair(w: dict[str, Tensor], head) -> dict[str, tuple]:
    if "t2d" not in w:
        return {}
    kept = torch.zeros_like(w["t2d"])
    kept[head.vocab_ids] = True
    return {"t2d": (w["t2d"], kept)}


def hf_logits(folder: Path, tokens: Tensor) -> Tensor:
    """What the HF engines see: transformers' own model class for the folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def mismatch(a: Tensor, b: Tensor) -> float:
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else 1.0
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def token_map_problems(folder: Path, src: Source, f: Format) -> list[str]:
    """SGLang's token map: there when the card passes it; distinct int64 target ids, as torch.load(weights_only=True)
    reads them; for an EAGLE drafter with training counts, the ids those counts give."""
    path = folder / TOKEN_MAP
    if not path.is_file():
        named = "--speculative-token-map" in (folder / "README.md").read_text()
        return [f"{TOKEN_MAP} is missing, but README.md passes it to --speculative-token-map"] if named else []
    try:
        ids = torch.load(path, weights_only=True)
    except Exception as e:  # whatever makes it unreadable is the problem to report
        return [f"{TOKEN_MAP} does not load with torch.load(weights_only=True): {e}"]
    vocab_size = src.head.config.vocab_size
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        return [f"{TOKEN_MAP} must hold a 1-D int64 tensor of token ids"]
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != ids.numel():
        return [f"{TOKEN_MAP} must hold distinct token ids in [0, {vocab_size})"]
    want = f.token_map(src) if f.token_map else None
    if want is not None and not torch.equal(ids, want):
        return [f"{TOKEN_MAP} is not the {want.numel()} most frequent ids of the drafter's {TOKEN_COUNTS}: re-export"]
    return []


def check_export(folder: Path, src: Source, fmt: str) -> None:
    """Raise ExportError listing every problem with the export at `folder` in format `fmt`."""
    f = format_for(src.kind, fmt)
    config, tensors = read_export(folder, f)
    problems = config_problems(src, f, folder, config) + tensor_problems(tensors, f.shapes(src, config))
    problems += token_map_problems(folder, src, f)
    if not problems:  # the forward needs every tensor in place
        dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
        problems += f.tensor_checks(src, tensors, dtype)
        for name, (theirs, mine) in forward_pairs(src, f, folder, tensors, config).items():
            err = mismatch(theirs, mine)
            if err > TOLERANCE:
                problems.append(f"{fmt} forward differs from the drafter's: {name} off by {err:.2e} (relative)")
    if problems:
        raise ExportError(f"export {folder} ({src.kind} -> {fmt}) fails validation:\n  - " + "\n  - ".join(problems))
