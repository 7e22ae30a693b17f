#!/usr/bin/env bash
# The GPU check, for a session lent the nvidia-h200 machine: the CUDA tests, then eval/gpu_bench.py
# (python -m draftsmith.eval.gpu_bench) on random-weight SmolLM2-135M (bf16, fp32) and Llama-3.1-8B (bf16) shapes.
# Runs on the machine as it is: its python3 (3.12, torch 2.11 CUDA, transformers 5.17), no registry, no
# install of draftsmith (a shim package of symlinks to this checkout), the missing pure-Python wheels
# carried in .whl/. Budgets: the tests at most 120 s, the benchmark at most 300 s (it starts no section past
# 230 s and writes its files after every section); how long a whole check takes: docs/benchmarks.md, Figures behind design choices.
#
# Once, here, before the call:   bash scripts/gpu_wheels.sh        # fills .whl/ (~0.5 MB, ignored)
# Then ONE device call (the device tool sets $OUT; everything comes back from there):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Back in $OUT (4 files): gpu_check.log (all output), pytest.xml, gpu_bench.json, gpu_bench.md.
# Without $OUT (e.g. the CPU rehearsal) they go to runs/gpu_check. The rehearsal, on a CPU machine, in a venv
# holding only the GPU image's packages at its versions (made here from local files: /opt/pypi, /opt/wheels):
#   python3 -m venv /tmp/rehearse && /tmp/rehearse/bin/pip install --index-url file:///opt/pypi/simple \
#     --extra-index-url file:///opt/pypi-more/simple --find-links /opt/wheels torch==2.13.0 transformers==5.17.0 \
#     huggingface-hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 accelerate==1.15.0 sentencepiece==0.2.2 \
#     matplotlib numpy pyyaml tqdm pytest requests jinja2
#   PIP_NO_INDEX=1 PATH=/tmp/rehearse/bin:$PATH bash scripts/gpu_check.sh --device cpu
# Exit status: 0 when every stage passed, else the number of failed stages (each named at the end).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then
  DEVICE=${2:-}
  shift 2 || true
fi
case $DEVICE in
  cuda | cpu) ;;
  *) echo "gpu_check: --device must be cuda or cpu, got '$DEVICE'" >&2 && exit 2 ;;
esac
OUT=${OUT:-$REPO/runs/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/draftsmith-gpu-check}
PY=${PYTHON:-python3}
exec > >(tee "$OUT/gpu_check.log") 2>&1
TEE=$!
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline PIP_NO_INDEX=1 PYTHONDONTWRITEBYTECODE=1
export TQDM_MININTERVAL=10 # progress bars, but a short log
FAILED=()

stage() { # stage NAME SECONDS CMD...: run CMD (a command under a time limit, or a function), record a failure, go on
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [ "$limit" = - ]; then echo "=== $name ==="; else echo "=== $name (limit ${limit}s) ==="; fi
  if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi
  rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start))s ==="
  [ "$rc" -eq 0 ] || FAILED+=("$name rc=$rc")
}

setup() { # draftsmith as a shim package of symlinks into the checkout; the carried wheels into $WORK/site
  rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/shim/draftsmith" "$WORK/cwd" || return 1
  for f in "$REPO"/draftsmith/*.py; do ln -s "$f" "$WORK/shim/draftsmith/$(basename "$f")"; done
  for pkg in cpu_kernels runtime heads serve train eval peers conf; do ln -s "$REPO/$pkg" "$WORK/shim/draftsmith/$pkg"; done
  ls "$REPO"/.whl/*.whl >/dev/null || { echo "no wheels in $REPO/.whl: run scripts/gpu_wheels.sh and carry .whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$REPO"/.whl/*.whl
}

environment() { # what the machine is; that draftsmith imports from this checkout, with what the CLIs need
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$PY" - "$REPO" "$DEVICE" <<'EOF'
import importlib, os, platform, sys
import torch, transformers
repo, device = sys.argv[1], sys.argv[2]
print(f"python {platform.python_version()} at {sys.executable}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"transformers {transformers.__version__}; cuda available: {torch.cuda.is_available()}")
if device == "cuda":
    assert torch.cuda.is_available(), "no CUDA device"
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), f"{torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB")
for name in ("draftsmith.serve.engine.engine", "draftsmith.serve.__main__", "draftsmith.eval.__main__", "hydra", "gguf"):
    mod = importlib.import_module(name)
    print(f"import {name}: {mod.__file__}")
import draftsmith.serve
where = os.path.realpath(draftsmith.serve.__file__)
assert where.startswith(repo + "/"), f"draftsmith.serve imports from {where}, not from the checkout {repo}"
print(f"draftsmith.serve resolves to {where}")
EOF
}

main() {
  echo "gpu_check: device $DEVICE, repo $REPO, out $OUT, $(date -u +%FT%TZ)"
  echo "checkout $(du -sh "$REPO" | cut -f1), of which .whl $(du -sh "$REPO/.whl" 2>/dev/null | cut -f1)"
  stage setup - setup
  export PYTHONPATH="$WORK/site:$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
  cd "$WORK/cwd" || return 1 # not the checkout: its draftsmith/ (only __init__.py) would hide the shim
  stage environment - environment
  # the CUDA tests: graphs vs eager (whole file), and whatever in test_verify/test_engine names cuda or a device
  stage pytest 120 "$PY" -m pytest -q -p no:cacheprovider -rsx --junitxml "$OUT/pytest.xml" -k "cuda or device" \
    "$REPO/tests/test_cuda_graphs.py" "$REPO/tests/test_verify.py" "$REPO/tests/test_engine.py"
  if [ "$DEVICE" = cuda ]; then
    stage gpu_bench 300 "$PY" -m draftsmith.eval.gpu_bench --device cuda --budget-s 230 --out "$OUT" "$@"
  else
    stage gpu_bench 1800 "$PY" -m draftsmith.eval.gpu_bench --device cpu --out "$OUT" "$@"
  fi
  echo "gpu_check: ${#FAILED[@]} failed stage(s): ${FAILED[*]:-none}; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  return "${#FAILED[@]}"
}

# one line, read before anything runs (editing this file mid-run cannot derail it); the log is complete on exit
main "$@"; rc=$?; exec >&- 2>&-; wait "$TEE"; exit $rc
