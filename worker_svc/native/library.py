"""Compiles decode.c with this machine's C compiler, once per source and CPU, and loads it.

The library is built at first use rather than shipped: `-march=native` makes it fit the CPU it
runs on (AVX-512 VNNI where there is, AVX2 elsewhere), and a C file builds in about a second.
It goes into batchwire's cache folder (~/.cache/batchwire/native), keyed by the source, the
flags and the CPU's feature flags; a worker that finds it there only loads it. It links OpenMP
by the soname torch's own libgomp already holds in the process, so the two share one runtime
and one set of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from batchwire.common.model_files import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi"]


class QMat(ctypes.Structure):
    """decode.c's qmat: one quantized matrix."""

    _fields_ = [("bits", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("qkv", QMat), ("o", QMat), ("gate_up", QMat),
                ("down", QMat), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int32) for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "num_layers",
            "block_size", "num_blocks", "cache_bf16", "max_rows", "max_seq_len")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos_sin", ctypes.c_void_p),
        ("layers", ctypes.POINTER(Layer)), ("final_norm", ctypes.c_void_p), ("lm_head", QMat),
    ]


def cache_dir() -> Path:
    """batchwire's cache folder (common/model_files.cache_root), or a fresh temporary one where
    that cannot be written (each start then builds its own)."""
    folder = Path(cache_root()) / "native"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="batchwire-native-"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled decode library, or None (with the reason logged) where it cannot be built.
    march: the compiler's -march; tests build "haswell" (AVX2) and "x86-64" (the portable
    loop) too, so that every form of the products is checked on any x86 machine."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("native CPU decode off: no C compiler (cc, gcc or $CC) on PATH")
        return None
    # decode.c and the parts it includes (*.h beside it): any edit rebuilds.
    source = b"".join(path.read_bytes() for path in [SOURCE, *sorted(SOURCE.parent.glob("*.h"))])
    flags = [*FLAGS, f"-march={march}"]
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_flags().encode() +
                         compiler.encode()).hexdigest()[:16]
    target = cache_dir() / f"decode-{key}.so"
    if not target.exists():
        # Built beside the target and renamed into place: workers starting together never load
        # a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            logger.warning("native CPU decode off: %s failed to build %s:\n%s", compiler,
                           SOURCE.name, done.stderr[-2000:])
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    lib.bw_decode.restype = ctypes.c_int
    lib.bw_decode.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int]
    lib.bw_lm_head.restype = ctypes.c_int
    lib.bw_lm_head.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.bw_matvec.restype = ctypes.c_int
    lib.bw_matvec.argtypes = [ctypes.POINTER(QMat), ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.bw_products.restype = ctypes.c_char_p
    lib.bw_attend.restype = ctypes.c_int
    lib.bw_attend.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int]
    lib.bw_attention_floats.restype = ctypes.c_int64
    lib.bw_attention_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int]
    lib.bw_add_norm.restype = ctypes.c_int
    lib.bw_add_norm.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int]
    lib.bw_attend_qkv.restype = ctypes.c_int
    lib.bw_attend_qkv.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_int]
    lib.bw_attend_qkv_floats.restype = ctypes.c_int64
    lib.bw_attend_qkv_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int]
    lib.bw_silu_mul.restype = ctypes.c_int
    lib.bw_silu_mul.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.bw_head_logits.restype = ctypes.c_int
    lib.bw_head_logits.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.bw_scratch_floats.restype = ctypes.c_int64
    lib.bw_scratch_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int]
    return lib
