"""The CPU's KV cache on 2 MiB pages, where Linux's transparent huge pages allow it.

Decode attention reads each context's blocks wherever the block pool put them: 12 KiB of one block, then another
block elsewhere in a cache of gigabytes. On 4 KiB pages a block spans three pages and most of them miss the TLB; on
2 MiB pages a step's blocks fit in far fewer entries. On a 2-core Xeon the float32 decode kernel read 30 layers of
scattered blocks ~6% faster from huge pages (benchmarks/RESULTS.md). PyTorch's CPU allocator asks for them only under
THP_MEM_ALLOC_ENABLE, read once when torch loads (too late for a library to set), and most kernels give huge pages
only to memory advised for them (THP "madvise"): so the cache asks for them itself, by madvise before first touch.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str:
    """The kernel's THP mode: "always", "madvise" or "never" (also where the machine has no such setting)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


def zeros_on_huge_pages(rows: int, row: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(rows, row), on the CPU in memory advised for huge pages before its first touch (a 2 MiB-aligned
    view into an allocation 2 MiB larger, whose untouched slack costs no memory); elsewhere plain torch.zeros."""
    if device.type != "cpu" or not sys.platform.startswith("linux") or transparent_huge_pages() == "never":
        return torch.zeros(rows, row, dtype=dtype, device=device)
    element = torch.empty(0, dtype=dtype).element_size()
    numel = rows * row
    base = torch.empty(numel + HUGE_PAGE // element, dtype=dtype)
    skip = (-base.data_ptr() % HUGE_PAGE) // element  # the allocator's 64-byte alignment: whole elements
    tensor = base[skip : skip + numel]
    advise_huge_pages(tensor.data_ptr(), numel * element)
    return tensor.zero_().view(rows, row)


def advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + length), address 2 MiB-aligned; False if the kernel refused
    (advice only: the memory works the same on small pages)."""
    assert address % HUGE_PAGE == 0, "huge pages start on a 2 MiB boundary"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
