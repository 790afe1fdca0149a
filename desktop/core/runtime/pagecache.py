"""Is the model file in the OS page cache? llama.cpp mmaps weights, so a 'fast' T1 can hide a slow first request
when the cache is cold. We record residency with each cold start and let the user drop it where permitted."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

_PAGE = mmap.PAGESIZE


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file() and p.suffix in {".safetensors", ".bin", ".gguf", ".pt"}]
    return [path] if path.is_file() else []


def resident_fraction(path: Path) -> float | None:
    """Fraction of the model's bytes resident in the page cache (Linux mincore); None where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name or not hasattr(os, "posix_fadvise"):
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = resident = 0
    for file in _files(path):
        size = file.stat().st_size
        if size == 0:
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vec) != 0:
                    return None
                resident += sum(1 for b in vec if b & 1) * _PAGE
                total += pages * _PAGE
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
    return min(1.0, resident / total) if total else None


def drop(path: Path) -> bool:
    """Ask the kernel to evict the model's clean pages (no root needed); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True
