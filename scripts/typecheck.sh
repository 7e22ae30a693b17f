#!/usr/bin/env bash
# Type-checks the draftsmith package with mypy; its settings are pyproject's [tool.mypy]. Extra arguments go to mypy.
# The subpackages live in top-level folders (pyproject's package-dir) that mypy cannot map to draftsmith.*, and the
# editable install's import hook is invisible to it: a tree of links under build/, draftsmith/X -> X, gives it the
# installed layout, and its paths are printed back as the repository's own (heads/x.py, not draftsmith/heads/x.py).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=$root/build/typecheck
mkdir -p "$tree/draftsmith"
for f in "$root"/draftsmith/*.py; do ln -sfn "$f" "$tree/draftsmith/$(basename "$f")"; done
for d in cpu_kernels runtime heads serve train eval peers conf; do ln -sfn "$root/$d" "$tree/draftsmith/$d"; done
cd "$tree"
MYPYPATH=$tree mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p draftsmith "$@" \
  | sed -E 's#^draftsmith/(cpu_kernels|runtime|heads|serve|train|eval|peers|conf)/#\1/#'
