#!/usr/bin/env bash
# Build native llama.cpp (llama-server, llama-batched-bench) from the llama-cpp-python sdist on PyPI,
# which carries the whole llama.cpp tree in vendor/llama.cpp. -DGGML_NATIVE=ON: compiled for this CPU,
# as a user building llama.cpp would. The build is cached outside the repository, keyed by the
# version and the CPU's flags; a second run prints the directory at once.
#   usage: benchmarks/peers/build_llama_cpp.sh   ->  prints the directory holding the binaries
set -euo pipefail
VERSION=0.3.36
CPU_KEY=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
ROOT=${BLOCKSERVE_PEERS_CACHE:-$HOME/.cache/blockserve-peers}/llama.cpp-$VERSION-$CPU_KEY
BIN=$ROOT/build/bin
if [[ -x $BIN/llama-server && -x $BIN/llama-batched-bench ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [[ ! -d $ROOT/src ]]; then
  # The sdist's address from PyPI's simple index (pip download would build its metadata first).
  URL=$(curl -sSf https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"#]*/llama_cpp_python-$VERSION.tar.gz" | head -1)
  mkdir -p "$ROOT/sdist" && curl -sSfL -o "$ROOT/sdist/src.tar.gz" "$URL"
  tar -xzf "$ROOT/sdist/src.tar.gz" -C "$ROOT"
  mv "$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/llama_cpp_python-$VERSION" "$ROOT/sdist"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$ROOT/build" --target llama-server llama-batched-bench llama-bench -j "$(nproc)" >&2
echo "$BIN"
