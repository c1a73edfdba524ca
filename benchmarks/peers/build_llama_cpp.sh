#!/usr/bin/env bash
# Build native llama.cpp (llama-server, llama-batched-bench, llama-bench, llama-quantize, and
# llama-lookup / llama-speculative for benchmarks/spec_decode_lookup.py) from the llama-cpp-python sdist on PyPI,
# which carries the whole llama.cpp tree in vendor/llama.cpp. -DGGML_NATIVE=ON: compiled for this CPU,
# as a user building llama.cpp would. The build is cached outside the repository, keyed by the
# version and the CPU's flags; a second run prints the directory at once.
# With the argument `avx2` it builds for AVX2 + FMA + F16C only (no AVX-512), the code a Zen 3 user
# runs, so the AVX2 paths of both engines can be measured side by side on an AVX-512 machine.
# Named targets build only those (benchmarks/spec_decode_lookup.py needs llama-lookup alone).
#   usage: benchmarks/peers/build_llama_cpp.sh [native|avx2] [TARGET...]  ->  prints the directory holding the binaries
set -euo pipefail
VERSION=0.3.36
ISA=${1:-native}
shift $(( $# > 0 ? 1 : 0 ))
case $ISA in
  native) BUILD=build; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD=build-avx2; ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                                     -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "usage: $0 [native|avx2]" >&2; exit 2 ;;
esac
CPU_KEY=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
ROOT=${BLOCKSERVE_PEERS_CACHE:-$HOME/.cache/blockserve-peers}/llama.cpp-$VERSION-$CPU_KEY
BIN=$ROOT/$BUILD/bin
TARGETS=("$@")
(( ${#TARGETS[@]} )) || TARGETS=(llama-server llama-batched-bench llama-bench llama-quantize llama-lookup llama-speculative)
for target in "${TARGETS[@]}"; do
  case $target in llama-*) ;; *) echo "not a llama.cpp target: $target" >&2; exit 2 ;; esac
done
built=1
for target in "${TARGETS[@]}"; do [[ -x $BIN/$target ]] || built=0; done
if (( built )); then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [[ ! -d $ROOT/src ]]; then
  # The sdist's address from PyPI's simple index (pip download would build its metadata first).
  URL=$(curl -sSf https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"#]*/llama_cpp_python-$VERSION.tar.gz" | head -1)
  mkdir -p "$ROOT/sdist" && curl -sSfL -o "$ROOT/sdist/src.tar.gz" "$URL"
  tar -xzf "$ROOT/sdist/src.tar.gz" -C "$ROOT"
  mv "$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/llama_cpp_python-$VERSION" "$ROOT/sdist"
fi
cmake -S "$ROOT/src" -B "$ROOT/$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$ROOT/$BUILD" --target "${TARGETS[@]}" -j "$(nproc)" >&2
echo "$BIN"
