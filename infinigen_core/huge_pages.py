"""Transparent huge pages for the host tensors that attention reads by slot (the KV pool's layers).

    keys = torch.empty(shape)      # not yet written: the kernel has backed none of it
    advise_huge_pages(keys)        # its whole 2 MB pages may now be backed by huge pages
    keys[:, :keep].copy_(old)      # the first write faults them in

A sparse layer reads a tenth of a 32k layer's rows, each a few hundred bytes to a kilobyte, scattered over
tens of megabytes: with 4 KB pages nearly every row is a page whose address translation misses the TLB, and
the walk, not the bytes, sets the pace (docs/BENCHMARKS.md: the CPU kernel's sparse attention at Gemma 3's
32k shapes took half the time with the pool on huge pages). Linux backs memory with huge pages only where
asked (`madvise`, the usual setting of /sys/kernel/mm/transparent_hugepage/enabled) or everywhere
(`always`); asking must come before the first write, as pages already backed stay small. Elsewhere (another
system, THP off) the advice does nothing and nothing else changes. Only the layers read by slot are advised
(KVPool's `huge_page_layers`): a sliding-window layer reads its last window, rows side by side, and with the
kernel's usual `defrag` setting (`madvise`) the first write of advised memory can wait while the kernel
assembles 2 MB pages: a fresh process's first restore of a 32k Gemma 3 chat took 2.2-3.2 s with every layer
advised, 1.0-1.5 s with its 3 global layers only (docs/BENCHMARKS.md, "Resume at 32k on a quiet machine").
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux or where it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask Linux to back the whole 2 MB pages inside a host tensor's memory with huge pages; call it before the
    tensor is first written. Returns the bytes advised: 0 for a tensor too small to hold a whole huge page, off
    the CPU, or where the advice was refused or cannot be given."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return 0
    return last - first if madvise(first, last - first, _MADV_HUGEPAGE) == 0 else 0
