"""Native CPU attention kernels (csrc/), compiled on first use for the machine they run on.

The build needs a C++ compiler and ninja (torch.utils.cpp_extension); it takes ~25 s once and is
cached under torch's extension directory (TORCH_EXTENSIONS_DIR), keyed by the source and the
CPU's instruction sets, since it is compiled with -march=native. Without a compiler, or with
BLOCKSERVE_NATIVE_KERNELS=0, `paged_decode_kernel()` returns None and the backends use their
pure-PyTorch path (same results, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
DISABLE_ENV = "BLOCKSERVE_NATIVE_KERNELS"


def why_not_native() -> str | None:
    """Why native kernels will not be built here (disabled, no compiler or no ninja), or None."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return f"disabled by {DISABLE_ENV}"
    for tool in (os.environ.get("CXX", "c++"), "ninja"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


@functools.cache
def paged_decode_kernel() -> Callable | None:
    """`fn(out, q, k_cache, v_cache, block_table, key_start, seq_lens, scale)` from
    csrc/paged_decode.cpp, or None when native kernels are disabled or cannot be built (the
    reason is logged once)."""
    reason = why_not_native()
    if reason is not None:
        logger.warning("native kernels not built (%s): paged decode attention uses the PyTorch path (slower)",
                       reason)
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"blockserve_paged_decode_{_build_key()}", sources=[str(_SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fassociative-math",
                                    "-fno-signed-zeros", "-fno-trapping-math"],
                      verbose=False)
    except Exception as error:  # a failed build must not stop the engine: fall back, say why
        logger.warning("building the native paged decode kernel failed (%s): using the PyTorch path", error)
        return None
    return module.paged_decode_attention


def _build_key() -> str:
    """Source and CPU identity: a cached build is reused only where it was compiled for."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    identity = _SOURCE.read_bytes() + platform.machine().encode() + flags.encode()
    return hashlib.sha256(identity).hexdigest()[:12]
