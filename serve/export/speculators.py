"""vLLM's native drafter format, the one the `speculators` package (PyPI) defines, for EAGLE-3 heads.

config.json: `speculators_model_type`, `speculators_config` (algorithm, proposal methods, the verifier = the target),
`transformer_layer_config` (the head's one Llama layer), `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`
and `norm_before_residual`; model.safetensors: `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (the names of
speculators' Eagle3DraftModel; vLLM maps them onto its Eagle3LlamaForCausalLM). vLLM given the folder alone
(`vllm serve OUT`) reads the verifier and the method from it.

The tensors are the `format=vllm` export's with `midlayer.` spelled `layers.0.`, so validation renames them back
and reuses that format's table and forward (serve/export/checks.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.serve.export.base import Export, Format, Source
from draftsmith.serve.export.checks import Probe, Shapes, head_config_problems
from draftsmith.serve.export.export_eagle3 import EAGLE31_KEYS, eagle3_pairs, eagle3_shapes, eagle3_vllm

SCHEMA_VERSION = "0.9.0"  # the speculators release whose classes these keys follow
LAYER, FLAT_LAYER = "layers.0.", "midlayer."

# The fields of the speculators 0.9.0 classes a config.json of type eagle3 holds (config.py: SpeculatorModelConfig,
# SpeculatorsConfig, VerifierConfig; models/eagle3/config.py: Eagle3SpeculatorConfig; proposals/greedy.py:
# GreedyTokenProposalConfig), plus the PretrainedConfig keys written here. tests/fixtures has a full example.
TOP_KEYS = frozenset(
    {
        "architectures",
        "speculators_model_type",
        "speculators_version",
        "speculators_config",
        "transformer_layer_config",
        "draft_vocab_size",
        "norm_before_residual",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
        "embed_requires_grad",
        "tie_word_embeddings",
        "torch_dtype",
    }
)
SPECULATORS_CONFIG_KEYS = frozenset({"algorithm", "proposal_methods", "default_proposal_method", "verifier"})
VERIFIER_KEYS = frozenset({"name_or_path", "architectures"})
GREEDY_KEYS = frozenset({"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"})
# variants of the EAGLE-3 layer draftsmith's Eagle3Head does not compute: each key -> the value it runs (written
# here; serve/export/external_heads.py refuses a folder that sets another). norm_before_residual is one of the head's
# own switches (EAGLE31_KEYS), always written: vLLM reads a speculators folder without it as true, speculators as false.
PLAIN = {"fc_norm": False}


def speculators_name(name: str, layer: str = LAYER) -> str:
    """format=vllm's tensor name in a layout whose head layer is `layer`."""
    return layer + name.removeprefix(FLAT_LAYER) if name.startswith(FLAT_LAYER) else name


def flat_name(name: str, layer: str = LAYER) -> str:
    return FLAT_LAYER + name.removeprefix(layer) if name.startswith(layer) else name


# ---------------------------------------------------------------- the exporter


def eagle3_speculators(src: Source[Eagle3Head]) -> Export:
    """The format=vllm export's tensors under speculators' names, with a speculators config.json."""
    flat = eagle3_vllm(src)
    state = {speculators_name(k): v for k, v in flat.tensors["model.safetensors"].items()}
    config = speculators_config(src, layer_config(flat.config)) | {"tie_word_embeddings": False}
    return Export(config, {"model.safetensors": state})


def layer_config(flat_config: dict) -> dict:
    """transformer_layer_config: the one-layer Llama config of format=vllm without the EAGLE-3 keys (vLLM sets
    the architecture itself from model_type)."""
    eagle3_keys = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")
    return {k: v for k, v in flat_config.items() if k not in eagle3_keys}


def speculators_config(
    src: Source[Eagle3Head], layer: dict, model_type: str = "eagle3", architecture: str = "Eagle3DraftModel"
) -> dict:
    """The speculators config.json keys an EAGLE-3-shaped head of `model_type` shares (eagle3, peagle: each adds
    its own); layer is its transformer_layer_config."""
    greedy = {"proposal_type": "greedy", "speculative_tokens": src.shape.num_tokens, "verifier_accept_k": 1}
    return {
        "architectures": [architecture],  # speculators' class for these weights; vLLM picks its own
        "speculators_model_type": model_type,
        "speculators_version": SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [greedy | {"accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier(src),
        },
        "transformer_layer_config": layer,
        **eagle3_values(src, model_type),
    }


def eagle3_values(src: Source[Eagle3Head], model_type: str = "eagle3") -> dict:
    """The top-level keys whose values the head fixes (written, and checked by equality)."""
    c = src.head.config
    return {
        "speculators_model_type": model_type,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.target_layers),
        **PLAIN,
        **{k: getattr(c, k) for k in EAGLE31_KEYS},
    }


def verifier(src: Source[Eagle3Head]) -> dict:
    return {"name_or_path": str(src.target_dir.resolve()), "architectures": src.target_hf.get("architectures") or []}


# ---------------------------------------------------------------- the validator's pieces


def layer_of(config: dict) -> dict:
    layer = config.get("transformer_layer_config")
    return layer if isinstance(layer, dict) else {}


def speculators_shapes(src: Source[Eagle3Head], config: dict) -> Shapes:
    """format=vllm's table under speculators' names; attention_bias from transformer_layer_config."""
    return {speculators_name(k): s for k, s in eagle3_shapes(src, layer_of(config)).items()}


def speculators_pairs(src: Source[Eagle3Head], p: Probe[Eagle3Head]) -> dict[str, tuple]:
    """vLLM's EAGLE-3 forward on the tensors renamed back, with the layer config."""
    config = layer_of(p.config) | {k: p.config.get(k) for k in EAGLE31_KEYS}  # the switches sit at the top
    return eagle3_pairs(src, replace(p, w={flat_name(k): v for k, v in p.w.items()}, config=config))


def speculators_problems(
    src: Source[Eagle3Head], folder: Path, config: dict, model_type: str = "eagle3", keys: frozenset = TOP_KEYS
) -> list[str]:
    """Every key one speculators defines for `model_type`; its speculators_config and transformer_layer_config."""
    problems = unknown(config, keys, "config.json")
    return problems + spec_problems(src, config.get("speculators_config"), model_type) + layer_problems(src, config)


def unknown(keys, known: frozenset, where: str) -> list[str]:
    return [f"{where} has {k!r}, which speculators does not define" for k in sorted(set(keys) - known)]


def spec_problems(src: Source[Eagle3Head], spec, algorithm: str = "eagle3") -> list[str]:
    """speculators_config: `algorithm`, a greedy chain, the verifier = this target (what vLLM loads as the model)."""
    if not isinstance(spec, dict):
        return ["config.json has no speculators_config object"]
    problems = unknown(spec, SPECULATORS_CONFIG_KEYS, "speculators_config")
    methods = spec.get("proposal_methods")
    if not (isinstance(methods, list) and methods and isinstance(methods[0], dict)):
        return problems + ["speculators_config.proposal_methods must list at least one method"]
    first = methods[0]
    problems += unknown(first, GREEDY_KEYS, "proposal_methods[0]")
    if first.get("proposal_type") != "greedy" or spec.get("default_proposal_method") != "greedy":
        problems.append("speculators_config: the proposal method must be greedy, and the default one")
    if not isinstance(first.get("speculative_tokens"), int) or first["speculative_tokens"] < 1:
        problems.append("proposal_methods[0].speculative_tokens must be an integer >= 1 (vLLM's chain length)")
    if spec.get("algorithm") != algorithm:
        problems.append(f"speculators_config.algorithm={spec.get('algorithm')!r}, expected {algorithm!r}")
    found = spec.get("verifier")
    problems += unknown(found if isinstance(found, dict) else {}, VERIFIER_KEYS, "speculators_config.verifier")
    if found != verifier(src):
        problems.append(f"speculators_config.verifier={found!r}, expected the target {verifier(src)!r}")
    return problems


def layer_problems(src: Source[Eagle3Head], config: dict) -> list[str]:
    """transformer_layer_config: a one-layer Llama of the drafter's sizes, the target's rope and positions."""
    layer = layer_of(config)
    if not layer:
        return ["config.json has no transformer_layer_config object"]
    c = src.head.config
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    want = {k: getattr(c, k) for k in sizes} | {"vocab_size": c.vocab_size, "model_type": "llama"}
    want |= {"num_hidden_layers": 1, "hidden_act": "silu", "mlp_bias": False}
    problems = [
        f"transformer_layer_config {k}={layer.get(k, '<missing>')!r}, expected {v!r}"
        for k, v in want.items()
        if layer.get(k) != v
    ]
    rope = [p.removeprefix("config.json ") for p in head_config_problems(src, Path(), layer)]
    return problems + [f"transformer_layer_config: {p}" for p in rope]


# vLLM's native format, as the speculators package defines it (speculators.py); vLLM serves the folder alone
SPECULATORS = Format(
    export=eagle3_speculators,
    shapes=speculators_shapes,
    config=eagle3_values,
    forward=speculators_pairs,
    problems=speculators_problems,
    vllm="eagle3",
    vllm_alone=True,
)
