"""An optional compiled kernel for decode attention on CPU, reading K and V straight from the paged cache.

Plain PyTorch must copy each context out of its scattered blocks before it can multiply (a gather), so decode
attention reads the context three times: to copy it, to write the copy, to use it. This kernel reads it once.
It is a few dozen lines of C built with the system compiler on first use (about a second) and kept in the
tokenloom cache; without a compiler, or on any device but the CPU, or with TOKENLOOM_CPU_KERNEL=0, the engine
uses the plain PyTorch path in attention.py, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenloom.model.gguf_convert import cache_root

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One (request, KV head) pair: the query heads sharing that KV head read its K and V once, block by block.
   HD is the head size when known at compile time (then the dot products unroll fully), else 0. */
static inline void attend_one(
    const float *qs, const float *k_cache, const float *v_cache, const int64_t *table, int64_t ctx,
    int64_t group, int64_t row, int64_t head_dim, int64_t kv_offset, int64_t block_size, float scale,
    float *out, const int HD)
{
    const int64_t hd = HD ? HD : head_dim;
    float *scores = (float *)malloc(sizeof(float) * group * ctx);
    float *acc = (float *)calloc(group * hd, sizeof(float));
    float maxes[64];
    for (int64_t g = 0; g < group; ++g) maxes[g] = -INFINITY;
    for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const float *k_block = k_cache + table[b] * block_size * row + kv_offset;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *k = k_block + j * row;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = qs + g * hd;
                float dot = 0.0f;
                for (int64_t d = 0; d < hd; ++d) dot += qg[d] * k[d];
                dot *= scale;
                scores[g * ctx + t0 + j] = dot;
                maxes[g] = dot > maxes[g] ? dot : maxes[g];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * ctx;
        float sum = 0.0f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = expf(s[t] - maxes[g]); sum += s[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
    }
    for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const float *v_block = v_cache + table[b] * block_size * row + kv_offset;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *v = v_block + j * row;
            for (int64_t g = 0; g < group; ++g) {
                const float w = scores[g * ctx + t0 + j];
                float *a = acc + g * hd;
                for (int64_t d = 0; d < hd; ++d) a[d] += w * v[d];
            }
        }
    }
    for (int64_t i = 0; i < group * hd; ++i) out[i] = acc[i];
    free(scores);
    free(acc);
}

/* One query row per request, at the end of its context of ctx_lens[i] tokens; work is split over
   (request, KV head) pairs. */
void paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
    int64_t max_blocks, const int64_t *ctx_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t work = 0; work < num_seqs * num_kv_heads; ++work) {
        const int64_t seq = work / num_kv_heads, kv_head = work % num_kv_heads;
        const int64_t first_head = seq * num_heads + kv_head * group;
        const float *qs = q + first_head * head_dim;
        float *o = out + first_head * head_dim;
        const int64_t *table = block_tables + seq * max_blocks;
        const int64_t kv_offset = kv_head * head_dim;
        const int64_t ctx = ctx_lens[seq];
        if (head_dim == 64)
            attend_one(qs, k_cache, v_cache, table, ctx, group, row, 64, kv_offset, block_size, scale, o, 64);
        else if (head_dim == 128)
            attend_one(qs, k_cache, v_cache, table, ctx, group, row, 128, kv_offset, block_size, scale, o, 128);
        else
            attend_one(qs, k_cache, v_cache, table, ctx, group, row, head_dim, kv_offset, block_size, scale, o, 0);
    }
}
"""

# -march=native: the kernel is built on the machine that runs it. -lm last: vectorised expf lives in libmvec.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-lm"]

_library: ctypes.CDLL | None = None
_tried = False


def kernel_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_KERNEL", "1") != "0"


def load_kernel() -> ctypes.CDLL | None:
    """Builds (once per source version) and loads the kernel; None if it cannot be had here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if not kernel_enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found; decode attention uses the plain PyTorch path")
        return None
    digest = hashlib.sha256((SOURCE + compiler + " ".join(FLAGS)).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{digest}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("could not build the CPU attention kernel (%s); using the plain PyTorch path", error)
        return None
    function = library.paged_decode_attention_f32
    function.restype = None
    function.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64, ctypes.c_void_p]
        + [ctypes.c_int64] * 5
        + [
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    )
    _library = library
    return library


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "kernel.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS[:-1], str(source), FLAGS[-1], "-o", str(built)], check=True, capture_output=True
        )
        os.replace(built, target)


def usable_for(device: torch.device, dtype: torch.dtype, group_size: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and group_size <= 64 and load_kernel() is not None


def paged_decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [D, heads, d] contiguous float32; block_tables: [D, max_blocks]; context_lens: [D]. Returns [D, heads, d]."""
    library = load_kernel()
    assert library is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    library.paged_decode_attention_f32(
        q.data_ptr(),
        cache_k.data_ptr(),
        cache_v.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        num_seqs,
        num_heads,
        cache_k.shape[1] // head_dim,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
