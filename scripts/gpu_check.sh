#!/usr/bin/env bash
# The GPU check, for a session lent a CUDA machine (one command, ~5 minutes on an H200): the tests that
# exercise CUDA (CUDA graphs vs eager, the engine, runner parity) and the engine benchmark in bf16 with
# the decode/verify step replayed from CUDA graphs. Needs a CUDA build of torch==2.13.0 on that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -q tests/test_cuda_graphs.py tests/test_engine.py tests/test_model_parity.py
python scripts/bench_engine.py --device cuda --sections hf,ngram,prefix --repeats 2 --out "${OUT:-runs}/bench_engine_cuda.json"
