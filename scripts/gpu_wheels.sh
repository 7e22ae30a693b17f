#!/usr/bin/env bash
# Fills .whl/ (ignored) with the pure-Python wheels scripts/gpu_check.sh installs on the lent GPU machine,
# which reaches no registry. Its image already holds torch 2.11, transformers 5.17, accelerate, safetensors,
# tokenizers, huggingface-hub, numpy, pyyaml, tqdm, requests, matplotlib, pytest
# (/work/.library/device/KINDS.md); what draftsmith imports beyond that is pinned here, one version each:
#   hydra-core, omegaconf, antlr4-python3-runtime: the hydra apps (serve/eval/train __main__, tests' compose)
#   gguf: transformers' GGUF reader (target conversion)
# Not carried: wandb (eval/wandb_log imports it lazily, only with logging on) and datasets (train/ only);
# neither is on the GPU check's path. antlr4-python3-runtime 4.9.3 exists only as an sdist: it is built
# here into a py3-none-any wheel. Every wheel is py3-none-any, so one set serves Python 3.11 and 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0)
SDISTS=(antlr4-python3-runtime==4.9.3)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
  --platform any -d .whl "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl "${SDISTS[@]}"
rm -f .whl/*.tar.gz
bad=$(find .whl -type f ! -name '*-py3-none-any.whl' ! -name '*-py2.py3-none-any.whl')
if [ -n "$bad" ]; then
  echo "gpu_wheels: not pure-Python (the GPU has Python 3.12, the rehearsal 3.11): $bad" >&2
  exit 1
fi
ls -1 .whl
du -sh .whl
