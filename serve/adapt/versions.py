"""The adaptation workspace on disk, as server and trainer share it (docs/serving.md, Online adaptation):

    capture/        the captured requests (store.py)
    versions/       v0000 (the drafter served first), v0001, ...: drafter folders; LATEST names the newest
    live.json       the version serving, the one before it, the ones rolled back, each one's live tau
    verdicts/       vNNNN.json: the trainer's paired judgment of a live version against the one it replaced
    adapt.json      what the trainer is started with
    trainer.jsonl   the trainer's rounds

A version is published by renaming a finished folder into versions/, then replacing LATEST; a reader that goes by
LATEST never sees a half-written version. Its version.json names its parent: a version descended from one rolled
back (its line) is never served nor trained from.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from draftsmith.files import temp_folder_beside, write_file_atomic, write_text_atomic
from draftsmith.serve.http.client import SALT_BYTES, new_salt

VERSION = re.compile(r"v(\d{4,})")


def version_name(n: int) -> str:
    return f"v{n:04d}"


def version_number(name: str) -> int:
    m = VERSION.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a head version name (v0000, v0001, ...)")
    return int(m.group(1))


def read_json(path: Path) -> dict | None:
    """A JSON object the other side writes atomically; None when it is absent or unreadable (not written yet)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


log = logging.getLogger("draftsmith.serve.adapt")


def salt_fingerprint(salt: bytes) -> str:
    """Names a salt without giving it away: which salt a capture store's client ids were made under."""
    return hmac.new(salt, b"draftsmith client ids", hashlib.sha256).hexdigest()[:16]


def write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass
class Workspace:
    root: Path

    @property
    def capture(self) -> Path:
        return self.root / "capture"

    @property
    def versions(self) -> Path:
        return self.root / "versions"

    @property
    def latest_file(self) -> Path:
        return self.versions / "LATEST"

    @property
    def live_file(self) -> Path:
        return self.root / "live.json"

    @property
    def adapt_file(self) -> Path:
        return self.root / "adapt.json"

    @property
    def trainer_log(self) -> Path:
        return self.root / "trainer.jsonl"

    @property
    def salt_file(self) -> Path:
        return self.root / "client_salt"

    def keep_private(self) -> None:
        """The workspace is its owner's alone (0700): its captures hold clients' prompts and answers, and the
        capture manifest their digests."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.root.stat().st_mode & 0o077:
            log.warning("%s was open to others: made the owner's alone (0700)", self.root)
            os.chmod(self.root, 0o700)

    def client_salt(self) -> bytes:
        """The secret the server keys client ids with (serve/http/client.py): made once, readable by its owner only,
        so a capture's ids are the same across restarts and mean nothing without it."""
        path = self.salt_file
        self.keep_private()
        if path.is_symlink():
            raise ValueError(f"{path} is a link; the adaptation workspace keeps its own salt there: remove the link")
        if path.is_file() and path.stat().st_size == SALT_BYTES:
            if path.stat().st_mode & 0o077:
                log.warning("%s was readable by others: made the owner's alone (0600)", path)
                os.chmod(path, 0o600)
            return path.read_bytes()
        if path.exists():
            log.warning("%s is not a %d-byte salt: a new one (earlier client ids no longer match)", path, SALT_BYTES)
        write_file_atomic(path, lambda tmp: write_secret(tmp, new_salt()))
        return path.read_bytes()

    def folder(self, version: str) -> Path:
        return self.versions / version

    def manifest(self) -> dict | None:
        return read_json(self.capture / "manifest.json")

    @property
    def verdicts(self) -> Path:
        return self.root / "verdicts"

    def live_version(self) -> str:
        """The version a trainer goes on from: the newest one, from LATEST (the server swaps it in at its next
        request) or live.json's "live" down, that neither was rolled back nor descends from one that was; else v0000.
        A version trained before its parent was rolled back is passed over with its parent."""
        live = read_json(self.live_file) or {}
        rejected = [r for r in live.get("rejected") or [] if isinstance(r, str)]
        named = [n for n in (self.latest(), live.get("live")) if isinstance(n, str) and VERSION.fullmatch(n)]
        for n in range(max((version_number(x) for x in named), default=0), 0, -1):
            name = version_name(n)
            if (self.folder(name) / "config.json").is_file() and not self.tainted(name, rejected):
                return name
        return version_name(0)

    def parent(self, version: str) -> str | None:
        """The version it was trained from (its version.json); None for v0000 and a version placed by hand."""
        parent = (read_json(self.folder(version) / "version.json") or {}).get("parent")
        return version_name(parent) if isinstance(parent, int) and 0 <= parent < version_number(version) else None

    def tainted(self, version: str, rejected: list[str]) -> bool:
        """Whether `version` or any version it descends from was rolled back, or its line cannot be read to the root
        (a version folder gone, a version.json unreadable or naming no valid parent): a line that cannot be checked
        is not served."""
        name: str | None = version
        while name is not None:  # parents are strictly older: the walk ends
            if name in rejected or not self.line_readable(name):
                return True
            name = self.parent(name)
        return False

    def line_readable(self, version: str) -> bool:
        """Its folder is there, and its version.json, if any (one placed by hand has none), names a valid parent."""
        folder = self.folder(version)
        if not folder.is_dir():
            return False
        if not (folder / "version.json").exists():
            return True
        parent = (read_json(folder / "version.json") or {}).get("parent", "unreadable")
        return version == version_name(0) or isinstance(parent, int) and 0 <= parent < version_number(version)

    def next_version(self) -> int:
        """One past the highest complete version (one renamed into place before LATEST moved counts too)."""
        numbers = [int(m.group(1)) for p in self.versions.iterdir() if (m := VERSION.fullmatch(p.name))]
        return max(numbers, default=0) + 1

    def clean_partials(self) -> list[str]:
        """Delete what a killed trainer left half-written: .vNNNN.partial folders and their temp folders."""
        removed = [p.name for p in self.versions.iterdir() if p.name.startswith(".") and ".partial" in p.name]
        for name in removed:
            shutil.rmtree(self.versions / name, ignore_errors=True)
        return removed

    def append_journal(self, row: dict) -> None:
        with self.trainer_log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def latest(self) -> str | None:
        """The newest published version, or None before any."""
        try:
            name = self.latest_file.read_text().strip()
        except OSError:
            return None
        return name if VERSION.fullmatch(name) and (self.folder(name) / "config.json").is_file() else None

    def publish(self, version: str) -> None:
        """Point LATEST at a version already renamed into place."""
        write_text_atomic(self.latest_file, version + "\n")

    def start(self, drafter: Path, draft: dict | None = None) -> None:
        """A fresh workspace: the drafter served first becomes v0000, recording `draft`, the shape the server
        drafts (its versions inherit it: the trainer judges that shape). One already started is carried on."""
        first = self.folder(version_name(0))
        if self.latest() is not None:
            if weights_digest(drafter) != weights_digest(first):
                raise ValueError(
                    f"adaptation.dir={self.root} was started with another drafter than spec.drafter={drafter} (its "
                    f"v0000 differs): point adaptation.dir elsewhere, or serve spec.drafter={first} to carry it on"
                )
            return
        if not first.is_dir():
            with temp_folder_beside(first, mode=0o755) as tmp:
                shutil.copytree(drafter, tmp, dirs_exist_ok=True)
                if draft is not None:
                    meta = json.loads((tmp / "config.json").read_text())
                    (tmp / "config.json").write_text(json.dumps(meta | {"draft": draft}, indent=2) + "\n")
                tmp.rename(first)
        self.publish(first.name)


def weights_digest(folder: Path) -> str:
    """What identifies a drafter folder's weights: a hash of model.safetensors."""
    h = hashlib.sha256()
    with open(folder / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class LiveRecord:
    """What live.json holds: the version serving, the one it replaced, the ones rolled back, live tau of each."""

    live: str
    previous: str | None = None
    rejected: list[str] = field(default_factory=list)
    tau: dict[str, dict] = field(default_factory=dict)  # version -> requests, accepted, drafts, tau

    def write(self, ws: Workspace) -> None:
        write_text_atomic(ws.live_file, json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def read(ws: Workspace) -> LiveRecord | None:
        """None before the server first wrote it; one it cannot read is an error, not a fresh start (its record
        of rolled-back versions would be lost)."""
        if not ws.live_file.exists():
            return None
        try:
            data = json.loads(ws.live_file.read_text())
            known = {f.name for f in fields(LiveRecord)}
            return LiveRecord(**{k: v for k, v in data.items() if k in known})
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{ws.live_file} is unreadable ({e}): fix it, or delete it to serve v0000 again with no versions "
                "rolled back"
            ) from e
