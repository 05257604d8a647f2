"""The native library (``zoomstep.c``, ``rans.c``, both reading packed codes through
``bitfields.h``): built on first use, loaded once.

On a CPU a SeKV decode step's cost is the count of small tensor ops per layer, not their
arithmetic: scoring and picking the spans, placing new ones in the zoom pool, reading and
decoding their records, rotating their keys, the memory entries attention reads and the
trace come to some 300 ops per layer and token as torch code, each paying a call's overhead.
In C each step is one call (:mod:`.kernels`; figures: docs/design.md). The library is built
with the system's C compiler (``$CC``, else ``cc``) into ``$SEKV_HOME/native/``, once per
version of its sources, compiler and kind of CPU; without a compiler, or for tensors on a GPU,
the tensor code runs instead. Both make the same decisions and the same rows (the router's
scores agree to float rounding: their products sum in another order), as
``tests/test_native.py`` checks step by step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import SekvError
from ..paths import sekv_home

# the decode step's kernels and the offload tier's entropy coder (:mod:`sekv_core.store.entropy`)
SOURCES = (
    Path(__file__).parent / "zoomstep.c",
    Path(__file__).parent / "rans.c",
)
HEADERS = (Path(__file__).parent / "bitfields.h",)  # included by the sources: part of the key
# no fused multiply-adds (each product and sum rounded as torch rounds it); the vector width
# of this CPU where the compiler knows it (the library is kept per CPU), else the baseline's
FLAGS = ["-O3", "-fno-trapping-math", "-fPIC", "-shared", "-ffp-contract=off"]
NATIVE_ARCH = ["-march=native"]

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "sekv_select": (ctypes.c_int, [_P, _I, _I, _P, _I, ctypes.c_int, ctypes.c_float, _I, _P, _P]),
    "sekv_record": (None, [_P, _P, _P, _I, _I, _P, _P, _P, _P, _P]),
    "sekv_pairs": (_I, [_P, _P, _P, _I, _I, _I, _P, _P, _P, _P]),
    "sekv_place": (ctypes.c_int, [_I, _I, _I, _I, *[_P] * 5, _I, *[_P] * 4, _I, *[_P] * 4]),
    "sekv_activate": (None, [_P, _P, _I, _I, _I, _I, _P, _P, _P, ctypes.c_float]),
    "sekv_field_codes": (None, [_P, _I, _I, _I, _P, _P]),
    "sekv_tier_coefficients": (None, [_P, _I, _I, _I, _I, _P]),
    "sekv_sketch_scores": (
        ctypes.c_int,
        [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, ctypes.c_float, _I, _P, _P, _P],
    ),
    "sekv_gate_scores": (
        ctypes.c_int,
        [_P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _I, _I, *[_P] * 4, _I, _P, _P, ctypes.c_float, _P],
    ),
    "sekv_rotate": (ctypes.c_int, [_P, _P, _P, _I, _I, _I, _P]),
    "sekv_entries": (None, [*[_P] * 7, _I, _I, _I, _I, _P, _P, _P]),
    "sekv_attention_trace": (
        ctypes.c_int,
        [_P, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _I, _I, _P],
    ),
    "sekv_gather": (_I, [_I, _P, _P, _I, _I, *[_P] * 4, _I, _P, _I, _I, _P, _I, _I, *[_P] * 4]),
    "sekv_rans_histogram": (ctypes.c_int, [_P, *[_I] * 5, _P, _P]),
    "sekv_rans_encode_blocks": (_I, [_P, *[_I] * 5, *[_P] * 2, _I, _P, _I, _P]),
    "sekv_rans_decode_blocks": (ctypes.c_int, [_P, _P, *[_I] * 5, *[_P] * 2, _I, _P, _I, _P]),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or loaded (the tensor code runs)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        path = _built(compiler)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged library: built again, once
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(_built(compiler)))
    except (OSError, SekvError, subprocess.SubprocessError):
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _built(compiler: str) -> Path:
    """The library for these sources, compiler and CPU, compiled if not there yet (written under
    a temporary name and renamed: a concurrent build or an interrupted one never leaves a
    partial library under the final name)."""
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    parts = [*sources, compiler.encode(), " ".join(FLAGS).encode(), _cpu().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = sekv_home() / "native"
    path = folder / f"zoomstep-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.part")
    os.close(fd)
    try:
        for arch in (NATIVE_ARCH, []):  # a compiler without -march=native: the baseline
            command = [compiler, *FLAGS, *arch, "-o", tmp, *map(str, SOURCES), "-lm"]
            done = subprocess.run(command, capture_output=True, timeout=120)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpu() -> str:
    """What a library built for this CPU depends on: the architecture and its instruction set
    extensions (a home directory shared by machines keeps one library per kind of CPU)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels can take these tensors: on the CPU, contiguous, outside autograd."""
    return all(t.is_cpu and t.is_contiguous() and not t.requires_grad for t in tensors) and (
        library() is not None
    )
