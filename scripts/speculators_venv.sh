#!/usr/bin/env bash
# speculators (vLLM's drafter trainer, PyPI `speculators`) in a virtual environment of its own: it pins
# transformers <= 5.19 where draftsmith runs a newer one. The peer of benchmarks/speculators_peer.py. Made once at
# $SPECULATORS_VENV, default ~/.cache/draftsmith/speculators-venv; a second call finds it and returns.
# torch comes first and pinned, as in setup.sh. speculators' own requirements name torchvision and torchaudio,
# which would pull a CUDA torch and which its trainer never imports, so its requirements are installed by hand.
set -euo pipefail
VENV=${SPECULATORS_VENV:-$HOME/.cache/draftsmith/speculators-venv}
if "$VENV/bin/python" -c "import speculators.train.trainer" 2>/dev/null; then
  exit 0
fi
echo "installing speculators 0.9.0 into $VENV (once, a few minutes)"
python -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps speculators==0.9.0
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0" > "$CONSTRAINT"
"${PIP[@]}" -c "$CONSTRAINT" hs-connectors==0.9.0 aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub \
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" \
  "pydantic-settings>=2.0.0" rich safetensors "tqdm>=4.66.3,<=4.70.1" "transformers>=5.0.0,<=5.19.0" "typer>=0.12.0"
"$VENV/bin/python" -c "import speculators.train.trainer"
