"""The README.md model card of an export: target, drafter, recipe, measured acceptance, serve commands."""

from __future__ import annotations

import json
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING

from draftsmith.heads.drafter_folder import shape_text
from draftsmith.serve.export.base import sglang_misses
from draftsmith.serve.export.card_concurrency import concurrency_section

if TYPE_CHECKING:
    from draftsmith.serve.export.base import Format, Source
    from draftsmith.serve.export.vllm_sweep import Sweep

EXPORT_MARK = "Exported by draftsmith from"  # in every export's README.md: overwrite=true replaces only such folders
ENGINES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "llamacpp": "llama.cpp"}
LLAMACPP_CONVERT = "python ~/.cache/draftsmith/llama.cpp/src/convert_hf_to_gguf.py"  # scripts/llamacpp_build.sh


def vllm_k(src: Source, f: Format) -> int | None:
    return f.vllm_depth(src) if f.vllm_depth else src.shape.num_tokens


def vllm_command(src: Source, out: Path, f: Format, options: tuple = ()) -> str:
    spec = {"method": f.vllm, "model": str(out), "num_speculative_tokens": vllm_k(src, f)}
    spec |= dict(f.vllm_options + options)
    return f"vllm serve {src.target_dir.resolve()} --speculative-config '{json.dumps(spec)}'"


def vllm_text(src: Source, out: Path, f: Format) -> str:
    """f.vllm_alone: the folder names its target and method (speculators), so `vllm serve OUT` serves it too;
    given the target as the model, vLLM needs the method (and options) spelled out (without it, it takes the folder
    for a draft model). Then each of f.vllm_variants, with what it is for."""
    command = f"```bash\n{vllm_command(src, out, f)}\n```\n"
    variants = "".join(
        f"\n{what}:\n\n```bash\n{vllm_command(src, out, f, options)}\n```\n" for what, options in f.vllm_variants
    )
    if not f.vllm_alone:
        return f"**vLLM**:\n\n{command}{variants}"
    return (
        "**vLLM** (the folder names its target in `speculators_config.verifier.name_or_path`: point that at the "
        f"target's hub id when serving elsewhere):\n\n```bash\nvllm serve {out}\n```\n\n"
        f'or, naming the target yourself (keep `"method": "{f.vllm}"`):\n\n{command}{variants}'
    )


def sglang_command(src: Source, out: Path, algorithm: str, token_map: str | None = None) -> str:
    """The drafter's shape: depth, children per node, and the verified tree's tokens (its nodes + the root)."""
    shape = src.shape
    flag = f" --speculative-token-map {out}/{token_map}" if token_map else ""
    return (
        f"python -m sglang.launch_server --model-path {src.target_dir.resolve()} "
        f"--speculative-algorithm {algorithm} --speculative-draft-model-path {out} "
        f"--speculative-num-steps {shape.num_tokens} --speculative-eagle-topk {shape.topk} "
        f"--speculative-num-draft-tokens {shape.draft_tokens() + 1}{flag}"
    )


def tgi_command(src: Source, out: Path) -> str:
    return f"text-generation-launcher --model-id {out} --speculate {src.shape.num_tokens}"


def llamacpp_text(src: Source, out: Path, f: Format) -> str:
    """llama-server and llama-speculative-simple drafting with the head beside the target's GGUF (llama.cpp runs
    the target from a GGUF, never from the HF folder); how to make an f32 GGUF of the same weights."""
    target = quote(str(src.target_gguf.resolve())) if src.target_gguf else "TARGET.gguf"
    depth = f.llamacpp_depth(src) if f.llamacpp_depth else src.shape.num_tokens
    flags = f"-m {target} -md {quote(f'{out}/{f.weights}')} --spec-type {f.llamacpp} --spec-draft-n-max {depth}"
    return (
        f"**llama.cpp** (the target as the GGUF the head was exported against; `bash scripts/llamacpp_build.sh` "
        f"builds llama.cpp from source into `~/.cache/draftsmith/llama.cpp/bin`):\n\n```bash\nllama-server {flags}\n"
        f'llama-speculative-simple {flags} --temp 0 -n 64 -p "Hello"\n```\n\n'
        "On a CPU with AMX add `--no-repack`: the vendored llama.cpp (0.3.36) crashes in its AMX kernels on "
        "quantized weights (a Q4_1 target) with repacking on. The same target in float32, converted from the "
        f"weights draftsmith ran (what makes greedy outputs match draftsmith's): `{LLAMACPP_CONVERT} "
        f"{quote(str(src.target_dir.resolve()))} --outtype f32 --outfile target-f32.gguf`, then `-m target-f32.gguf`.\n"
        + (f"\n{f.llamacpp_note}\n" if f.llamacpp_note else "")
    )


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
    """The commands for every engine this export serves with; for the others, the format of this kind that they
    load, or that none does. token_map: the file name of the export's SGLang token map, if it has one."""
    formats = src.formats
    f, lines = formats[fmt], []
    for engine, title in ENGINES.items():
        others = [name for name, g in formats.items() if getattr(g, engine)]
        if engine == "vllm" and f.vllm:
            lines.append(vllm_text(src, out, f))
        elif engine == "sglang" and f.sglang and (missing := sglang_misses(src)):
            lines.append(f"**SGLang**: its EAGLE-3 layer computes none of {', '.join(missing)}: not served there.\n")
        elif engine == "sglang" and f.sglang:
            lines.append(f"**SGLang**:\n\n```bash\n{sglang_command(src, out, f.sglang, token_map)}\n```\n")
        elif engine == "llamacpp" and f.llamacpp:
            lines.append(llamacpp_text(src, out, f))
        elif engine == "tgi" and f.tgi:
            base = "`base_model_name_or_path` in config.json names the target; point it at the target's hub id"
            lines.append(f"**TGI** ({base} when serving elsewhere):\n\n```bash\n{tgi_command(src, out)}\n```\n")
        elif others:
            lines.append(f"**{engine}**: export with `format={others[0]}` for this engine.\n")
        else:
            can = " or ".join(f"format={name}" for name in formats)
            lines.append(f"**{engine}**: {title} does not serve {src.kind} drafters; {can} serves other engines.\n")
    if f.hf:
        lines.append(f"**HF transformers** (assisted generation):\n\n```python\n{hf_snippet(src, out)}\n```\n")
    return "\n".join(lines)


def measured(recipe: dict) -> str:
    acc = recipe.get("acceptance") or {}
    if "mean_acceptance_length" not in acc:
        return "Acceptance not measured yet: run `draftsmith-eval` with the drafter folder."
    text = f"Measured by draftsmith: mean acceptance length tau = {acc['mean_acceptance_length']:.2f}"
    if "speedup" in acc:
        text += f", speedup {acc['speedup']:.2f}x"
    return text + f" (from {acc.get('source', 'an unnamed eval')})."


def container(weights: str) -> str:
    return "GGUF" if weights.endswith(".gguf") else "safetensors"


def concurrency_text(src: Source, fmt: str, out: Path, sweep: Sweep | None) -> str:
    """For a format vLLM serves: the draft length per concurrency a sweep measured, or that none was."""
    f = src.formats[fmt]
    if not f.vllm:
        return ""
    return concurrency_section(sweep, vllm_k(src, f), out, lambda options: vllm_command(src, out, f, options)) + "\n"


def export_card(
    src: Source, fmt: str, dtype: str, out: Path, token_map: str | None = None, sweep: Sweep | None = None
) -> str:
    """sweep: a measured draft-length sweep through vLLM, recommended from in its own section."""
    meta, recipe = src.meta, src.meta.get("recipe", {})
    sizes = ", ".join(f"{k}={v}" for k, v in meta["config"].items() if k != "model")
    return (
        f"# {src.kind} drafter for `{meta['target']['id']}` ({fmt} format)\n\n"
        f"{EXPORT_MARK} `{src.folder.resolve()}` in {dtype}, {container(src.formats[fmt].weights)}.\n\n"
        f"- target: `{meta['target']['id']}` at `{src.target_dir.resolve()}` (the drafter fits only this "
        "target: same config.json)\n"
        f"- drafter: {src.kind} ({sizes}), made to draft {shape_text(src.shape)}: the commands below ask for that\n"
        f"- recipe: data {recipe.get('data') or 'n/a'}, {recipe.get('steps', 0)} steps, "
        f"{recipe.get('tokens', 0)} tokens {recipe.get('extra') or ''}\n\n"
        f"{measured(recipe)}\n\n"
        f"## Serve\n\n{serve_section(src, fmt, out, token_map)}\n"
        f"{concurrency_text(src, fmt, out, sweep)}"
        f"Re-check this folder: `draftsmith-export drafter={quote(str(src.folder.resolve()))} format={fmt} "
        f"out={quote(str(out))} target.path={quote(str(src.target_dir.resolve()))}{gguf_flag(src, fmt)} check=true`\n"
    )


def gguf_flag(src: Source, fmt: str) -> str:
    """The target GGUF the validator compares a GGUF export's tokenizer with; re-checked against the HF folder."""
    return (
        f" gguf_target={quote(str(src.target_gguf.resolve()))}" if src.formats[fmt].llamacpp and src.target_gguf else ""
    )
