"""The README.md model card of an export: target, drafter, recipe, measured acceptance, serve commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .export import Source

EXPORT_MARK = "Exported by draftsmith from"  # in every export's README.md: overwrite=true replaces only such folders

METHODS = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa", "draft_model": "draft_model", "peagle": "eagle3"}
SGLANG_ALGORITHMS = {"eagle3": "EAGLE3", "eagle": "EAGLE", "draft_model": "STANDALONE"}
NOT_SERVED = {
    ("eagle3", "tgi"): "TGI does not load EAGLE-3 drafters; use this folder with vLLM or SGLang.",
    ("eagle", "tgi"): "TGI does not load EAGLE drafters; use vLLM or SGLang.",
    ("medusa", "sglang"): "SGLang does not serve Medusa heads; use vLLM (format=vllm) or TGI (format=tgi).",
    ("draft_model", "tgi"): "TGI does not speculate with a draft model (Medusa, MLP speculator and n-gram only).",
    ("peagle", "sglang"): "SGLang does not load P-EAGLE (parallel drafting) checkpoints; use vLLM.",
    ("peagle", "tgi"): "TGI does not load P-EAGLE drafters; use vLLM.",
}


def num_tokens(src: Source) -> int:
    if src.kind == "peagle":
        return src.head.config.num_depths
    return src.head.config.num_heads if src.kind == "medusa" else 5 if src.kind == "eagle3" else 4


def vllm_command(src: Source, out: Path) -> str:
    spec = {"method": METHODS[src.kind], "model": str(out), "num_speculative_tokens": num_tokens(src)}
    if src.kind == "peagle":  # vLLM drafts all tokens from one forward: eagle3 with parallel drafting
        spec["parallel_drafting"] = True
    return f"vllm serve {src.target_dir.resolve()} --speculative-config '{json.dumps(spec)}'"


def sglang_command(src: Source, out: Path, token_map: str | None = None) -> str:
    k = num_tokens(src)
    flag = f" --speculative-token-map {out}/{token_map}" if token_map else ""
    return (
        f"python -m sglang.launch_server --model-path {src.target_dir.resolve()} "
        f"--speculative-algorithm {SGLANG_ALGORITHMS[src.kind]} --speculative-draft-model-path {out} "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}{flag}"
    )


def tgi_command(src: Source, out: Path) -> str:
    return f"text-generation-launcher --model-id {out} --speculate {num_tokens(src)}"


def hf_snippet(src: Source, out: Path) -> str:
    return (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'target = AutoModelForCausalLM.from_pretrained("{src.target_dir.resolve()}")\n'
        f'draft = AutoModelForCausalLM.from_pretrained("{out}")\n'
        f'tok = AutoTokenizer.from_pretrained("{out}")\n'
        'ids = tok("Hello", return_tensors="pt").input_ids\n'
        "print(tok.decode(target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=64)[0]))"
    )


def serve_section(src: Source, fmt: str, out: Path, token_map: str | None = None) -> str:
    """The commands for every engine this export (or its sibling format) serves with; token_map: the file name
    of the export's SGLang token map, if it has one."""
    lines = []
    for engine in ("vllm", "sglang", "tgi", "hf"):
        if (src.kind, engine) in NOT_SERVED:
            lines.append(f"**{engine}**: {NOT_SERVED[src.kind, engine]}\n")
        elif engine == "vllm" and fmt in ("vllm", "hf"):
            lines.append(f"**vLLM**:\n\n```bash\n{vllm_command(src, out)}\n```\n")
        elif engine == "sglang" and (fmt == "sglang" or src.kind in ("eagle3", "draft_model")):
            lines.append(f"**SGLang**:\n\n```bash\n{sglang_command(src, out, token_map)}\n```\n")
        elif engine == "tgi" and fmt == "tgi":
            base = "`base_model_name_or_path` in config.json names the target; point it at the target's hub id"
            lines.append(f"**TGI** ({base} when serving elsewhere):\n\n```bash\n{tgi_command(src, out)}\n```\n")
        elif engine == "hf" and fmt == "hf":
            lines.append(f"**HF transformers** (assisted generation):\n\n```python\n{hf_snippet(src, out)}\n```\n")
        elif engine in ("vllm", "sglang", "tgi"):
            lines.append(f"**{engine}**: export with `format={engine}` for this engine.\n")
    return "\n".join(lines)


def measured(recipe: dict) -> str:
    acc = recipe.get("acceptance") or {}
    if "mean_acceptance_length" not in acc:
        return "Acceptance not measured yet: run `draftsmith-eval` with the drafter folder."
    text = f"Measured by draftsmith: mean acceptance length tau = {acc['mean_acceptance_length']:.2f}"
    if "speedup" in acc:
        text += f", speedup {acc['speedup']:.2f}x"
    return text + f" (from {acc.get('source', 'an unnamed eval')})."


def model_card(src: Source, fmt: str, dtype: str, out: Path, token_map: str | None = None) -> str:
    meta, recipe = src.meta, src.meta.get("recipe", {})
    sizes = ", ".join(f"{k}={v}" for k, v in meta["config"].items() if k != "model")
    return (
        f"# {src.kind} drafter for `{meta['target']['id']}` ({fmt} format)\n\n"
        f"{EXPORT_MARK} `{src.folder.resolve()}` in {dtype}, safetensors.\n\n"
        f"- target: `{meta['target']['id']}` at `{src.target_dir.resolve()}` (the drafter fits only this "
        "target: same config.json)\n"
        f"- drafter: {src.kind} ({sizes})\n"
        f"- recipe: data {recipe.get('data') or 'n/a'}, {recipe.get('steps', 0)} steps, "
        f"{recipe.get('tokens', 0)} tokens {recipe.get('extra') or ''}\n\n"
        f"{measured(recipe)}\n\n"
        f"## Serve\n\n{serve_section(src, fmt, out, token_map)}\n"
        f"Re-check this folder: `draftsmith-export drafter={src.folder.resolve()} format={fmt} out={out} "
        f"target.path={src.target_dir.resolve()} check=true`\n"
    )
