"""A run's training examples: tokenized conversations (online features) or a feature cache, built once
by all processes together and reused after."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from accelerate import Accelerator
from torch.utils.data import Dataset

from draftsmith.serve.build import Loaded
from draftsmith.serve.conversations import load_conversations

from .chat import encode_all
from .distill import distill, distill_path
from .features import (
    MANIFEST,
    CachedFeatures,
    ExampleDataset,
    build_cache,
    cache_folder,
    cache_key,
    check_manifest,
    find_serving_cache,
)

if TYPE_CHECKING:
    from .trainer import RunConfig


def make_examples(cfg: RunConfig, target: Loaded, acc: Accelerator, say) -> tuple[list, str]:
    data = cfg.data
    convs, skipped = load_conversations(data.source, data.heldout_fraction, limit=data.max_conversations)
    if data.self_distill:  # the target's own answers (generated once, then reused from the file)
        path = distill_path(data, target, cfg.target.cache_dir)
        say(f"self-distillation: {target.target_id}'s answers to {len(convs)} conversations, in {path}")
        args = (acc.process_index, acc.num_processes, acc.wait_for_everyone)
        convs = distill(convs, target, data.distill, path, data.max_length, skipped, *args)
    examples = encode_all(target.tokenizer, convs, data.max_length, skipped)
    info = f"{len(examples)} conversations used{', answers by the target' if data.self_distill else ''}, "
    info += f"skipped: {skipped}"
    say(info)
    return examples, info


def make_dataset(cfg: RunConfig, target: Loaded, layers: tuple, acc: Accelerator, say) -> tuple[Dataset, str]:
    """Tokenized examples (online features) or a feature cache, built once by all processes together."""
    fc, tok = cfg.train.features, target.tokenizer
    if fc.mode == "online":
        examples, info = make_examples(cfg, target, acc, say)
        return ExampleDataset(examples), info
    computed_in = str(target.model.dtype).removeprefix("torch.")
    key = cache_key(target.target_id, cfg.data, layers, fc.dtype, tok.chat_template or "", computed_in)
    folder = cache_folder(fc, key, cfg.target.cache_dir)
    if not fc.dir:
        folder = find_serving_cache(folder, key)
    if not (folder / MANIFEST).is_file():
        if folder.is_dir() and any(folder.iterdir()):
            raise ValueError(f"features.dir={folder} is a non-empty folder without {MANIFEST}: not a feature cache")
        examples, info = make_examples(cfg, target, acc, say)
        say(f"building the feature cache {folder}")
        began = time.perf_counter()
        build_cache(
            folder,
            key,
            examples,
            target.model,
            fc,
            pad_id(tok),
            {"data_info": info},
            acc.process_index,
            acc.num_processes,
            acc.wait_for_everyone,
        )
        tokens = sum(len(e.input_ids) for e in examples)
        say(f"features of {tokens} tokens in {time.perf_counter() - began:.0f} s")
    manifest = check_manifest(folder, key)
    say(f"feature cache {folder}: {manifest['examples']} examples, {manifest['tokens']} tokens")
    return CachedFeatures(folder, manifest, layers), manifest.get("data_info", "")


def pad_id(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if t is not None:
            return t
    return 0
