"""The CPU's KV cache in memory advised for transparent huge pages (model/huge_pages.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model import huge_pages

needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or huge_pages.transparent_huge_pages() == "never",
    reason="the kernel gives no transparent huge pages here",
)


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address`, from /proc/self/smaps ("hg": advised for huge pages)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_cache_is_zeroed_aligned_and_advised_for_huge_pages(dtype):
    cache = huge_pages.zeros_on_huge_pages(3000, 193, dtype, torch.device("cpu"))  # an odd row: 2.2 MB or more
    assert cache.shape == (3000, 193) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    assert cache.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(cache.data_ptr())
    cache.fill_(7)  # the whole view is the caller's: writable to its end
    assert int(cache[-1, -1]) == 7


def test_without_huge_pages_the_cache_is_plain_zeros(monkeypatch):
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "never")
    advised = []
    monkeypatch.setattr(huge_pages, "advise_huge_pages", lambda *args: advised.append(args))
    cache = huge_pages.zeros_on_huge_pages(10, 64, torch.float32, torch.device("cpu"))
    assert cache.shape == (10, 64) and not cache.any()
    assert advised == []


def test_the_thp_mode_is_read_from_the_bracketed_choice(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    setting.write_text("always [madvise] never\n")
    assert huge_pages.transparent_huge_pages() == "madvise"
    setting.write_text("[always] madvise never\n")
    assert huge_pages.transparent_huge_pages() == "always"
    setting.unlink()
    assert huge_pages.transparent_huge_pages() == "never"


@needs_thp
def test_the_engine_allocates_every_layers_cache_on_huge_pages(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), num_kv_blocks=4096, dtype="float32"))
    caches = engine.core.runner.kv_caches
    assert caches and all("hg" in vm_flags(t.data_ptr()) for pair in caches for t in pair)
