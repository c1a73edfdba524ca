"""Native CPU kernels (csrc/): paged decode attention, fused layer ops, matmuls over GGUF
quantized weights, a Llama decode stack and the state layers' decode recurrences, compiled on
first use for the machine they run on.

All of them are one extension module (csrc/module.cpp binds kernels.h's entry points), so one
kernel may call another's directly. The build needs a C++ compiler and ninja
(torch.utils.cpp_extension); ninja compiles the sources side by side (~50 s on 2 cores, once)
and the module is cached under torch's extension directory (TORCH_EXTENSIONS_DIR), keyed by the
sources and the CPU's instruction sets, since it is compiled with -march=native, and shared by
every checkout and virtual environment with those sources. Without a
compiler, or with BLOCKSERVE_NATIVE_KERNELS=0, the getters return None and callers use their
PyTorch path (same results up to float rounding, slower). BLOCKSERVE_NATIVE_ISA=avx2 makes every
getter return the -mno-avx512f build: the engine then runs the code a CPU without AVX-512 (a Zen 3)
runs, which is how that path is measured end to end on an AVX-512 machine (benchmarks/peers).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from blockserve.cached_directory import cached_directory

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV = "BLOCKSERVE_NATIVE_KERNELS"
ISA_ENV = "BLOCKSERVE_NATIVE_ISA"  # native (default) | avx2
# The module's translation units: the bindings, then one file per kernel (kernels.h, decode_stack.h).
SOURCES = ("module.cpp", "fused_ops.cpp", "paged_decode.cpp", "quantized_matmul.cpp", "decode_stack.cpp", "argmax.cpp",
           "sample.cpp", "paged_decode_quantized.cpp", "half_matmul.cpp", "gguf_blocks.cpp", "gguf_blocks_int8.cpp",
           "mxfp4.cpp", "moe_experts.cpp", "state_recurrence.cpp")
AVX2_ONLY = ("-mno-avx512f",)  # the build a CPU without AVX-512 gets (how tests cover it on one with it)


def why_not_native() -> str | None:
    """Why native kernels will not be built here (disabled, no compiler or no ninja), or None."""
    disabled = _disabled()
    if disabled is not None:
        return disabled
    for tool in (os.environ.get("CXX", "c++"), "ninja"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


class PagedDecodeKernel:
    """csrc/paged_decode.cpp: `kernel(out, q, k_cache, v_cache, block_table, key_start, seq_lens,
    scale)` writes the decodes' attention into out; `reads(...)` says which inputs it takes."""

    def __init__(self, module):
        self._module = module

    def __call__(self, *args, sinks: torch.Tensor | None = None) -> None:
        """`sinks` [Hq] float32: each query head's logit in the softmax's denominator (GPT-OSS)."""
        if sinks is None:
            self._module.paged_decode_attention(*args)
        else:
            self._module.paged_decode_attention_sinks(*args, sinks)

    def rotary_decode(self, *args) -> None:
        """`(out, qkv, cos, sin, k_cache, v_cache, slot_mapping, block_table, key_start, seq_lens,
        num_heads, scale)`: a decode-only step's rotary, cache write and attention in one call
        (attention/rotary_decode.py)."""
        self._module.rotary_decode_attention(*args)

    def reads(self, q_dtype: torch.dtype, cache_dtype: torch.dtype, head_size: int,
              v_cache_dtype: torch.dtype | None = None) -> bool:
        """float32 queries over a float32 or a quantized (int8, float8_e4m3fn, uint8 for the rotated 4-bit
        form: csrc/paged_decode_quantized.cpp) cache always; over float16 / bfloat16 caches where an
        intrinsics path (AVX-512, or AVX2 + FMA + F16C) is compiled in and the head size is 64, 128 or 256.
        A V cache of its own dtype (`v_cache_dtype`): one-byte keys over 4-bit values only."""
        if q_dtype != torch.float32:
            return False
        if v_cache_dtype is not None and v_cache_dtype != cache_dtype:
            return cache_dtype in (torch.int8, torch.float8_e4m3fn) and v_cache_dtype == torch.uint8
        if cache_dtype in (torch.float32, torch.int8, torch.float8_e4m3fn, torch.uint8):
            return True
        return cache_dtype in (torch.float16, torch.bfloat16) and self._module.reads_16bit(head_size)


def paged_decode_kernel(without_avx512: bool = False) -> PagedDecodeKernel | None:
    """The decode kernel of csrc/paged_decode.cpp, or None when native kernels are disabled or
    cannot be built. without_avx512: compiled with -mno-avx512f, the AVX2 path a CPU without
    AVX-512 gets (how tests cover it on an AVX-512 machine)."""
    module = _native(AVX2_ONLY if without_avx512 else ())
    return None if module is None else PagedDecodeKernel(module)


def fused_ops():
    """The native module, for csrc/fused_ops.cpp's add_rms_norm_, rotary_ and silu_and_mul (and
    csrc/decode_stack.h's DecodeStack), or None when native kernels are disabled or cannot be built."""
    return _native()


def quantized_matmul_ops(without_avx512: bool = False):
    """The native module, for csrc/quantized_matmul.cpp's quantized_matmul, quantized_matmul_int8,
    quantized_matmul_int16 and simd_lanes, or None when native kernels are disabled or cannot be
    built. without_avx512: compiled with -mno-avx512f, the AVX2 path a CPU without AVX-512 gets (how
    tests cover it on an AVX-512 machine)."""
    return _native(AVX2_ONLY if without_avx512 else ())


def half_matmul_ops(without_avx512: bool = False):
    """The native module, for csrc/half_matmul.cpp's half_matmul and half_matmul_lanes, or None when
    native kernels are disabled or cannot be built. without_avx512: the -mno-avx512f build (the
    AVX2 + F16C path a CPU without AVX-512 gets)."""
    return _native(AVX2_ONLY if without_avx512 else ())


def mxfp4_ops(without_avx512: bool = False):
    """The native module, for csrc/mxfp4.cpp's mxfp4_matmul, or None when native kernels are disabled
    or cannot be built. without_avx512: the -mno-avx512f build (the AVX2 path)."""
    return _native(AVX2_ONLY if without_avx512 else ())


def state_recurrence_ops(without_avx512: bool = False):
    """The native module, for csrc/state_recurrence.cpp's delta_rule_rows and ssd_rows, or None when
    native kernels are disabled or cannot be built. without_avx512: the -mno-avx512f build (the AVX2 path)."""
    return _native(AVX2_ONLY if without_avx512 else ())


def _disabled() -> str | None:
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return f"disabled by {DISABLE_ENV}"
    return None


def _isa_flags() -> tuple[str, ...]:
    isa = os.environ.get(ISA_ENV, "native").lower()
    if isa not in ("native", "avx2"):
        raise ValueError(f"{ISA_ENV}={isa!r}: choose native or avx2")
    return AVX2_ONLY if isa == "avx2" else ()


def _native(flags: tuple[str, ...] = ()):
    # The switches are read on every call, so kernels can be turned off at any time; the compiler and
    # ninja only matter until the module is built (not looked up on PATH per call: decode steps
    # ask for their kernels every step).
    flags = flags or _isa_flags()
    reason = _disabled() if flags in _built else why_not_native()
    if reason is not None:
        _say_once(f"native kernels not used ({reason}): the PyTorch paths run instead (slower)")
        return None
    if flags not in _built:
        with _build_lock:  # one build at a time; a caller arriving meanwhile waits and reuses it
            if flags not in _built:
                _built[flags] = _load(flags)
    return _built[flags]


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


# -fopenmp: at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h); without the flag a kernel's
# parallel_for runs on one thread whatever torch's thread count. The OpenMP runtime it links is the
# libgomp.so.1 torch has already loaded (one thread pool, torch's settings).
_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math", "-fopenmp")

_built: dict[tuple[str, ...], object] = {}  # flags -> the loaded module, or None where the build failed
_build_lock = threading.Lock()


def _load(flags: tuple[str, ...]):
    """csrc/'s module compiled (with `flags` after the usual ones) and loaded, or None (the reason
    is logged)."""
    logger.info("loading the native kernels (compiled on their first use on this machine, ~50 s)")
    name = f"blockserve_kernels_{_build_key(flags)}"
    built = _already_built(name)
    if built is not None:
        return built
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        sources = _shared_sources(Path(get_default_build_root()) / f"{name}-src")
        return load(name=name, sources=[str(sources / s) for s in SOURCES],
                    extra_cflags=[*_CFLAGS, *flags], extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(sources)], verbose=False)
    except Exception as error:  # a failed build must not stop the engine: fall back, say why
        logger.warning("building the native kernels failed (%s): using the PyTorch paths", error)
        return None


def _already_built(name: str):
    """The module `name` imported straight from where torch.utils.cpp_extension.load leaves its
    build (TORCH_EXTENSIONS_DIR, else torch's cache directory / py<version>_<accelerator>), or None
    where no finished build is there (no file, or the build's lock held). The name holds the
    build key, so a file there was built from these sources; importing cpp_extension imports
    setuptools (~0.3 s of a start) and load() then runs ninja to find nothing to do."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        version = torch.version
        accelerator = (f"rocm{version.hip.replace('.', '')}" if version.hip else
                       f"cu{version.cuda.replace('.', '')}" if version.cuda else "cpu")
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{accelerator}")
    build = Path(root) / name
    library = build / f"{name}.so"
    if not library.is_file() or (build / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:  # load() rebuilds it
        logger.warning("the native kernels' build %s did not load (%s): rebuilding", library, error)
        return None
    return module


def _shared_sources(target: Path) -> Path:
    """csrc/ copied (once) to `target`, a path named by the build key: every checkout and virtual
    environment with these sources then gives ninja the same commands, so they share one build
    rather than each compiling (~50 s) and keeping its own."""
    def copy(out: Path) -> None:
        for name in _source_names():
            shutil.copy2(_CSRC / name, out / name)

    return cached_directory(target, copy)


def _source_names() -> tuple[str, ...]:
    """The files of csrc/ a build reads: the compiled sources, then the headers."""
    return (*SOURCES, *sorted(p.name for p in _CSRC.glob("*.h")))


def build_key() -> str:
    """The identity of the build the getters load by default (sources, ISA flags, CPU flags, torch):
    what a result measured on these kernels (models/row_crossover.py) is valid for."""
    return _build_key(_isa_flags())


def _build_key(extra_flags: tuple[str, ...]) -> str:
    """Sources, flags, CPU identity and torch's version: a cached build is reused only where it
    was compiled for."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    identity = b"".join((_CSRC / name).read_bytes() for name in _source_names())
    identity += platform.machine().encode() + flags.encode() + " ".join((*_CFLAGS, *extra_flags)).encode()
    identity += f"{torch.__version__} {torch.version.git_version}".encode()
    return hashlib.sha256(identity).hexdigest()[:12]
