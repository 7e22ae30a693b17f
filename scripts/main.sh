#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), end to end:
#   1. train an EAGLE-3 head with train=quick: the target re-answers ShareGPT's conversations itself, sampled at
#      temperature 0.7, top-p 0.8, through vLLM (the venv scripts/setup.sh makes; draftsmith's own decoder where vLLM is missing, said in one line), 8 answers
#      checked against draftsmith's own fp32 greedy decoding; its features cached once; then the head's steps
#   2. evaluate it against plain decoding, n-gram lookup and the two merged (eagle3_ngram) on MT-bench, twice over
#      (repeats=2: the intervals cover prompts and repeats, and the repeat spread is the run's noise control)
#   3. the rag suite with the prefix cache x speculation 2x2 study
#   4. export the head for vLLM / SGLang (validated after writing)
#   5. print the headline numbers and where the reports are
# Everything lands in runs/main (MAIN_OUT=DIR moves it). A second run reuses what the first made: the
# converted target, the feature cache, the trained head (FRESH=1 retrains), and redoes evals and export.
# Extra arguments go to both evals, e.g. `bash scripts/main.sh limit=16 max_new_tokens=128`.
# MAIN_TARGET (default target=smollm2-135m), MAIN_TRAIN_ARGS and MAIN_RAG_ARGS (space-separated overrides)
# point the same pipeline elsewhere: CI runs it on a tiny random target (tests/test_main_job.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}"
OUT="${MAIN_OUT:-runs/main}"
HEAD="$OUT/eagle3"
TARGET="${MAIN_TARGET:-target=smollm2-135m}"
read -r -a TRAIN_ARGS <<< "${MAIN_TRAIN_ARGS:-}"
read -r -a RAG_ARGS <<< "${MAIN_RAG_ARGS:-}"
# The evals and the export draft the shape the head folder records: train=quick makes an eagle3 head for depth 1,
# its 3 best tokens side by side (conf/tuning/eagle3-quick.yaml). Deeper levels cost a head forward each and a quick
# head's 2nd and 3rd positions rarely accept (docs/benchmarks.md, Draft shape and depth). The evals run every method
# under the draft policy (spec.verify=policy, docs/evaluation.md): each step drafts the lookup, the head or nothing,
# whichever its acceptance so far and this machine's costs say emits the most per second, and verifies the part of
# the draft that pays for its rows
began=$(date +%s)
stage() { echo; echo "== [$(( ($(date +%s) - began) / 60 )) min] $*"; }
# an eval killed part-way continues from its records.jsonl; a finished one is run again
resume() { python -c "import sys; from draftsmith.eval.journal import unfinished; from pathlib import Path
print('resume=' + str(unfinished(Path(sys.argv[1]))).lower())" "$1"; }

stage "1/4 regenerate the answers with the target (vLLM, or draftsmith's own decoder on a CPU without native bf16) and train an EAGLE-3 head on them (train=quick) -> $HEAD"
if [ "${FRESH:-0}" = 1 ]; then rm -rf "$HEAD"; fi
if [ -f "$HEAD/final/model.safetensors" ]; then
  echo "reusing $HEAD/final (FRESH=1 retrains)"
elif [ -d "$HEAD/checkpoints" ]; then
  draftsmith-train "$TARGET" head=eagle3 train=quick out="$HEAD" resume=true "${TRAIN_ARGS[@]}"
else
  draftsmith-train "$TARGET" head=eagle3 train=quick out="$HEAD" "${TRAIN_ARGS[@]}"
fi

stage "2/4 MT-bench: plain vs EAGLE-3, n-gram, and EAGLE-3 with n-gram lookup -> $OUT/mt_bench"
draftsmith-eval "$TARGET" spec=eagle3 spec.drafter="$HEAD/final" spec.verify=policy \
  'methods=[ngram,eagle3_ngram]' methods.ngram.verify=policy \
  methods.eagle3_ngram.drafter="$HEAD/final" methods.eagle3_ngram.verify=policy \
  suite=mt_bench limit=8 max_new_tokens=64 repeats=2 out="$OUT/mt_bench" "$(resume "$OUT/mt_bench")" "$@"

stage "3/4 rag: prefix cache x EAGLE-3, the 2x2 study -> $OUT/rag"
draftsmith-eval "$TARGET" spec=eagle3 spec.drafter="$HEAD/final" spec.verify=policy suite=rag study=prefix_x_spec \
  limit=6 max_new_tokens=64 out="$OUT/rag" "$(resume "$OUT/rag")" "${RAG_ARGS[@]}" "$@"

stage "4/4 export for vLLM and SGLang -> $OUT/export-vllm"
draftsmith-export "$TARGET" drafter="$HEAD/final" format=vllm out="$OUT/export-vllm" overwrite=true

stage "done"
draftsmith-headline "$OUT"
