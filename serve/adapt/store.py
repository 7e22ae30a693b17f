"""CaptureStore: captured requests on disk, in the trainer's feature-cache format, bounded, oldest out first.

One request per safetensors shard (train/features.py's tensors for one example, plus the `have` row mask), written
atomically, then manifest.json rewritten atomically: a reader sees whole shards only. A writer thread does the
disk work so serving never waits on it; when its queue is full a request is dropped, not waited for. Past the cap
the oldest shards are deleted. A write that fails (a full disk) stops capture and says why, once; serving goes on.

So that no client fills the training data: a prompt already stored is not stored again (identical prompts count
once, whoever sent them), and each client keeps at most `client_cap` requests, its own oldest going first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.files import write_file_atomic, write_text_atomic
from draftsmith.serve.adapt.capture import Captured

log = logging.getLogger("draftsmith.serve.capture")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def shard_name(seq: int) -> str:
    return f"shard-{seq:08d}.safetensors"


class CaptureStore:
    def __init__(
        self,
        folder: Path,
        target_id: str,
        layers: tuple[int, ...],
        cap_bytes: int,
        queue_size: int = 64,
        client_cap: int | None = None,
        client_ids: str = "",
    ):
        """client_ids: the fingerprint of the salt its client ids are keyed with (serve/http/client.py); shards a
        previous run wrote under another are dropped, as their ids name the same clients differently."""
        self.folder, self.cap_bytes, self.client_cap = Path(folder), cap_bytes, client_cap
        self.client_ids = client_ids
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key = {"format_version": FORMAT_VERSION, "target": target_id, "layers": list(layers)}
        self.key |= {"dtype": "bfloat16", "source": "capture"}
        self.shards: list[dict] = []
        self.seq, self.evicted, self.dropped, self.duplicates = 0, 0, 0, 0
        self.stopped: str | None = None
        self.resume()
        self.pending: queue.Queue[Captured | None] = queue.Queue(queue_size)
        self.thread = threading.Thread(target=self.run, name="draftsmith-capture", daemon=True)
        self.thread.start()

    @property
    def bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    def resume(self) -> None:
        """Carry on a store a previous run left: its shards that are still there, its numbering."""
        try:
            made = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            return
        if made.get("key", {}).get("target") != self.key["target"] or made["key"]["layers"] != self.key["layers"]:
            raise ValueError(
                f"the capture store {self.folder} holds another target's or drafter's features "
                f"({made.get('key')}); point adaptation.dir elsewhere or delete {self.folder}"
            )
        self.shards = [s for s in made.get("shards", []) if (self.folder / s["file"]).is_file()]
        if self.shards and made.get("client_ids", "") != self.client_ids:
            for s in self.shards:
                (self.folder / s["file"]).unlink(missing_ok=True)
            log.warning("dropped %d captured requests: their client ids were made under another salt", len(self.shards))
            self.shards = []
        self.seq = made.get("capture", {}).get("next_seq", 0)
        self.evicted = made.get("capture", {}).get("evicted", 0)
        self.duplicates = made.get("capture", {}).get("duplicates", 0)

    def add(self, captured: Captured) -> None:
        """From the engine thread: queue the request for the writer; never blocks."""
        if self.stopped is not None:
            return
        try:
            self.pending.put_nowait(captured)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 30) -> None:
        """Write what is queued, then stop the writer."""
        self.pending.put(None)
        self.thread.join(timeout)

    def run(self) -> None:
        while (captured := self.pending.get()) is not None:
            if self.stopped is None:
                self.write(captured)
            self.pending.task_done()
        self.pending.task_done()

    def write(self, c: Captured) -> None:
        path = self.folder / shard_name(self.seq)
        try:
            if self.holds(c.meta.get("prompt")):
                self.duplicates += 1  # not stored again: one client repeating itself does not fill the store
            else:
                self.write_shard(c, path)
            self.write_manifest()
        except OSError as e:  # a full disk, a folder gone: capture stops, serving does not
            self.stopped = f"{type(e).__name__}: {e}"
            log.warning("capture stopped, serving goes on: writing %s failed (%s); free space and restart", path, e)
            with contextlib.suppress(OSError):
                self.write_manifest()  # says it stopped, where the disk still takes it

    def holds(self, prompt: str | None) -> bool:
        return prompt is not None and any(s.get("prompt") == prompt for s in self.shards)

    def write_shard(self, c: Captured, path: Path) -> None:
        seq = self.seq
        tensors = {"input_ids": c.input_ids, "loss_mask": c.loss_mask, "hidden": c.hidden, "aux": c.aux}
        tensors |= {"have": c.have, "offsets": torch.tensor([0, c.tokens])}
        write_file_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={**c.meta, "seq": str(seq)}))
        self.seq = seq + 1
        shard = {"file": path.name, "examples": 1, "seq": seq, "bytes": path.stat().st_size}
        shard |= {key: c.meta[key] for key in ("version", "client", "prompt") if key in c.meta}
        self.shards.append(shard | {"tokens": c.tokens, "masked_tokens": int(c.loss_mask.sum())})
        self.evict_client(c.meta.get("client"))
        self.evict()

    def write_manifest(self) -> None:
        write_text_atomic(self.folder / MANIFEST, json.dumps(self.manifest(), indent=1) + "\n")

    def evict(self) -> None:
        while len(self.shards) > 1 and self.bytes > self.cap_bytes:
            self.remove(self.oldest_of_heaviest())

    def oldest_of_heaviest(self) -> dict:
        """Past the byte cap, the client holding the most bytes gives up its oldest request: one client's long requests
        push out its own, not everyone else's (a lone client: simply the oldest)."""
        held: Counter[str | None] = Counter()
        for shard in self.shards:
            held[shard.get("client")] += shard["bytes"]
        heaviest = max(held, key=lambda client: held[client])
        return next(s for s in self.shards if s.get("client") == heaviest)

    def evict_client(self, client: str | None) -> None:
        """A client past its cap loses its own oldest requests, never another client's."""
        if self.client_cap is None or client is None:
            return
        own = [s for s in self.shards if s.get("client") == client]
        for old in own[: max(0, len(own) - self.client_cap)]:
            self.remove(old)

    def remove(self, shard: dict) -> None:
        self.shards.remove(shard)
        (self.folder / shard["file"]).unlink(missing_ok=True)
        self.evicted += 1

    def manifest(self) -> dict:
        capture: dict[str, int | str | None] = {
            "bytes": self.bytes,
            "cap_bytes": self.cap_bytes,
            "next_seq": self.seq,
            "evicted": self.evicted,
        }
        capture |= {"dropped": self.dropped, "duplicates": self.duplicates, "stopped": self.stopped}
        return {
            "key": self.key,
            "target": self.key["target"],
            "layers": self.key["layers"],
            "dtype": self.key["dtype"],
            "examples": len(self.shards),
            "tokens": sum(s.get("tokens", 0) for s in self.shards),
            "masked_tokens": sum(s.get("masked_tokens", 0) for s in self.shards),
            "shards": self.shards,
            "capture": capture,
            "client_ids": self.client_ids,
        }
