"""llama.cpp as a peer engine: a llama-server kept up for a run, one greedy request at a time, with what each
verification step accepted (its LLAMA_TRACE log: "accepted a/n draft tokens", one line per step).

Built by scripts/llamacpp_build.sh into ~/.cache/draftsmith/llama.cpp (bin/ and the converter in src/). Used by
the engines' cross-check (engines_crosscheck.py) and benchmarks/bench_engine.py's peer table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.eval.cross_engine import recount
from draftsmith.serve.engine.metrics import Metrics

from .processes import free_port

HOME = Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache/draftsmith/llama.cpp"))
# one line per verification step; a checkpoint restore logs its own line, then the replayed step logs again
STEP = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens(?! \(restore checkpoint\))")


def missing_build() -> str:
    """Why llama.cpp cannot run here ("" when it can)."""
    server = HOME / "bin" / "llama-server"
    if server.is_file():
        return ""
    return f"llama.cpp is not built ({server} is missing): run bash scripts/llamacpp_build.sh (about 10 minutes)"


def convert(folder: Path, out: Path, outtype: str = "f32", target_dir: Path | None = None) -> Path:
    """llama.cpp's own converter on an HF folder (or, with target_dir, a format=vllm head export), written beside
    `out` and renamed into place."""
    partial = out.with_suffix(".partial")
    env = os.environ | {"PYTHONPATH": str(HOME / "src" / "gguf-py")}
    cmd = [sys.executable, str(HOME / "src" / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype]
    cmd += ["--target-model-dir", str(target_dir)] if target_dir else []
    done = subprocess.run([*cmd, "--outfile", str(partial)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{done.stderr[-2000:]}")
    partial.rename(out)
    return out


def converted_target(target_dir: Path, name: str, outtype: str = "f32") -> Path:
    """The target's GGUF in `outtype` from the same HF weights draftsmith runs, made once and kept beside the
    build."""
    out = HOME / "targets" / f"{name}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(target_dir, out, outtype)
    return out


def same_tensors(ours: Path, theirs: Path) -> str:
    """Whether two GGUF files hold the same tensors, bit for bit, named alike, and the same architecture keys
    (what llama.cpp's graph reads: layers, sizes, rope); what differs where they do not."""
    from draftsmith.serve.export.gguf_file import plain, read_gguf

    meta_a, a = read_gguf(ours)
    meta_b, b = read_gguf(theirs)
    arch = meta_a["general.architecture"].value
    ka, kb = ({k: v for k, v in plain(m).items() if k.startswith(f"{arch}.")} for m in (meta_a, meta_b))
    found = [
        f"{k}: ours {ka.get(k)}, theirs {kb.get(k)}" for k in sorted(ka.keys() | kb.keys()) if ka.get(k) != kb.get(k)
    ]
    if a.keys() != b.keys():
        found.append(f"tensors only ours {sorted(a.keys() - b.keys())}, only theirs {sorted(b.keys() - a.keys())}")
    differ = sorted(k for k in a.keys() & b.keys() if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    if differ:
        found.append(f"{len(differ)} tensors differ: {differ}")
    return "; ".join(found) or f"{len(a)} tensors and every {arch}.* key identical"


def repack_flags() -> list[str]:
    """--no-repack on an AMX CPU: the vendored llama.cpp's AMX kernels (ggml_backend_amx_mul_mat) crash on the
    shipped Q4_1 GGUF there (SIGSEGV on the first matmul; found with gdb). Elsewhere repacking stays on."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return ["--no-repack"] if "amx_tile" in flags else []


@dataclass
class Reply:
    tokens: list[int]
    steps: list[tuple[int, int]]  # (accepted, drafted) per verification step
    prompt_s: float
    decode_s: float

    def metrics(self) -> Metrics:
        """llama.cpp logs only the steps with a draft; with --spec-draft-p-min 0 a head drafts at every step but
        the last (when one token is left), so no step without a draft sits between them."""
        return recount(self.steps, len(self.tokens), self.prompt_s, self.prompt_s + self.decode_s)


class LlamaServer:
    """llama-server with the target's GGUF, and a draft GGUF (`spec`: its --spec-type) when `draft` is given, on a
    free port; threads as draftsmith's engine has them (all cores)."""

    def __init__(self, target: Path, log: Path, draft: Path | None = None, spec: str = "", k: int = 3) -> None:
        threads, self.port, self.log = os.cpu_count() or 1, free_port(), log
        flags = f"--port {self.port} -c 4096 -np 1 -t {threads} -tb {threads} --no-warmup"
        cmd = [str(HOME / "bin" / "llama-server"), "-m", str(target), *flags.split(), *repack_flags()]
        if draft is not None:  # p-min 0: always a full chain of k, as the other engines draft
            more = f"--spec-type {spec} --spec-draft-n-max {k} -td {threads} --spec-draft-p-min 0"
            cmd += ["-md", str(draft), *more.split()]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"LLAMA_TRACE": "1"})
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not come up in {timeout_s:.0f} s; see {self.log}")

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def generate(self, ids: list[int], max_new: int) -> Reply:
        """Greedy: temperature 0 and top-k 1; no prompt cache, so every request prefills as the others do."""
        before = self.log.stat().st_size
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "cache_prompt": False}
        body |= {"return_tokens": True, "seed": 0}
        url, headers = f"http://127.0.0.1:{self.port}/completion", {"Content-Type": "application/json"}
        req = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        time.sleep(0.05)  # the server logs the last step's line just before it answers; let it reach the file
        with open(self.log, "rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace")
        steps = [(int(a), int(n)) for a, n in STEP.findall(text)]
        t = out["timings"]
        return Reply(list(out["tokens"]), steps, t["prompt_ms"] / 1000, t["predicted_ms"] / 1000)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
