#!/usr/bin/env bash
# Build llama.cpp once, CPU only, into its own folder: from the source vendored in the llama-cpp-python sdist (PyPI),
# with the system's cmake and g++; no binaries are downloaded. Installs the tools the cross-checks run
# (llama-cli, llama-server, llama-speculative-simple, llama-quantize) into $LLAMACPP_DIR/bin and keeps the
# converter (convert_hf_to_gguf.py with its gguf-py) in $LLAMACPP_DIR/src. A step that fails says which one;
# draftsmith works without llama.cpp (its cross-checks say it is missing).
#   bash scripts/llamacpp_build.sh            # ~/.cache/draftsmith/llama.cpp; again: nothing to do
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DEST=${LLAMACPP_DIR:-${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}/llama.cpp}
TOOLS=(llama-cli llama-server llama-speculative-simple llama-quantize)
# llama.cpp's converter imports sentencepiece for a llama-architecture target, whatever its tokenizer
python -m pip install -q --disable-pip-version-check --no-deps sentencepiece==0.2.3 || echo "sentencepiece failed to install: llama.cpp's converter will not run" >&2
if [ -x "$DEST/bin/llama-speculative-simple" ]; then
  echo "llama.cpp is built in $DEST (delete it to rebuild)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { echo "== llama.cpp: $*" >&2; }
fail() {
  echo "llama.cpp build failed at: $1. draftsmith works without it; the llama.cpp cross-checks will say so." >&2
  [ -n "${2:-}" ] && tail -20 "$2" >&2
  exit 1
}
step "download the llama-cpp-python==$VERSION sdist (source only)"
python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" || fail "download"
step "unpack its vendored llama.cpp"
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" || fail "unpack"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || fail "unpack: no vendor/llama.cpp in the sdist"
step "configure (CPU only, native instructions)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >"$work/configure.log" 2>&1 || fail "configure" "$work/configure.log"
step "build ${TOOLS[*]} ($(nproc) jobs; several minutes)"
cmake --build "$work/build" -j "$(nproc)" --target "${TOOLS[@]}" >"$work/build.log" 2>&1 || fail "build" "$work/build.log"
step "install into $DEST"
partial="$DEST.partial"
rm -rf "$partial"
mkdir -p "$partial/bin" "$partial/src"
for t in "${TOOLS[@]}"; do cp "$work/build/bin/$t" "$partial/bin/"; done
cp -r "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$partial/src/"
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$partial/src/"
echo "llama-cpp-python==$VERSION vendored llama.cpp, $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo 'no git')" \
  >"$partial/VERSION"
rm -rf "$DEST"
mv "$partial" "$DEST"
echo "llama.cpp built: $DEST/bin (${TOOLS[*]})"
