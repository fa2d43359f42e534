"""Paged attention in plain PyTorch: the same code runs on CPU and CUDA.

Each layer's cache is two tensors of shape [num_blocks * block_size, kv_heads * head_dim]; a token's K (or V)
lives in one row, its *slot*, and a request's block table says which blocks hold its context. A step first
writes the K and V of every new token into its slot, then lets each query read its context. Because all writes
of a layer happen before any read, a request may read blocks another request computes in the same step.

Reading a context gathers whole blocks (one contiguous copy per block, far cheaper than per-slot indexing).
Attention runs per KV head as batched matmuls over strided views, so grouped-query heads never copy K or V:

    queries of the heads sharing KV head i   [.., group, d]  @  K[:, i*d:(i+1)*d]^T   ->  scores [.., group, ctx]

With the Triton backend (triton_attention.py) the whole flat batch is one launch per layer instead, reading K and V
in place through the block tables, and the cache write is one launch for K and V.

Decode queries (one new token each) go to the C++ operator in cpu_kernel.py where it can be had, which reads
each context in place; otherwise they are attended a group at a time, each group over its contexts padded to the
longest. A prefill chunk goes to torch's scaled_dot_product_attention (its fused CPU kernel): causal with no mask
when the chunk is its whole context; with a past, on the CPU where it pays, the past (no mask) and the chunk (causal)
attended apart and merged by their log-sum-exps, else with a boolean mask of the chunk's rows over its context. Where
our AVX-512 prefill operator is in use (csrc/prefill_attention.cpp, float32 and bf16), it takes every chunk instead,
and those with a past in one call a layer that reads the pasts in place (paged_prefill_attention): gathering each
chunk's past out of the cache, per layer, cost a beam search of 32 beams more time than the attention itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenloom.model import cpu_kernel, kv_quant, triton_attention
from tokenloom.model.kv_quant import KVFormat
from tokenloom.model.platform import cpu_has_amx
from tokenloom.model.triton_attention import FlatBatch


@dataclass
class PrefillSegment:
    """Queries [q_start, q_start + q_len) of the flat batch, the last q_len tokens of a context of ctx_len."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor | None  # [num_blocks] long; None when the chunk is its whole context
    # [q_len, ctx_len] bool, True where a query may attend (causal: the queries are the context's last q_len), for
    # chunks with a past attended in one masked call; None: causal, a past attended apart from the chunk
    # (attends_apart says which).
    mask: torch.Tensor | None


@dataclass
class PagedPrefills:
    """The step's prefill chunks that have a past, for the C++ operator that reads K and V in the paged cache."""

    segments: torch.Tensor  # [S, 3] long: first row, rows, context length
    tables: torch.Tensor  # [S, max_blocks] long, each chunk's blocks, padded with block 0
    key_units: torch.Tensor  # [S, max key blocks] long: the packed unit each block of 32 keys reads (-1: none)
    unit_sources: torch.Tensor  # [U, 2] long: the chunk and key block each unit is packed from


@dataclass
class DecodeGroup:
    """Decode queries of similar context length, attended together over contexts padded to the longest."""

    row_start: int
    num_rows: int
    block_tables: torch.Tensor  # [num_rows, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [num_rows] long
    bias: torch.Tensor | None  # [num_rows, 1, max_ctx]: 0 inside each context, -inf past it; for the plain path


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache, and which context each query reads.

    The flat batch holds the decode tokens first, in groups of similar context length, then the prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long
    block_size: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    paged_prefills: PagedPrefills | None = None  # chunks with a past, in one operator call (prefill_op, 16-bit cache)
    workspace: GatherWorkspace = field(default_factory=lambda: GatherWorkspace())
    use_cpu_kernel: bool = False  # the C++ operators (cpu_kernel.py): decode attention, norms, rotary, SiLU
    prefill_op: bool = False  # prefill attention through the C++ operator (csrc/prefill_attention.cpp)
    # The Triton backend's view of the whole batch (triton_attention.py); set, it replaces decodes and prefills.
    flat: FlatBatch | None = None
    num_splits: int = 1  # split-K shares for the Triton kernel (few long decodes)
    kv_format: KVFormat | None = None  # an 8-bit cache (kv_quant.py); None: the cache holds the model's dtype


def write_kv(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    meta: AttentionMetadata | None = None,
    head_dim: int = 0,
):
    """This step's K and V ([T, kv_heads, d] or [T, kv_heads * d]) into their slots; quantized into an 8-bit cache,
    which needs head_dim."""
    if meta is not None and meta.kv_format is not None:
        assert head_dim > 0, "an 8-bit cache quantizes per head"
        fmt = meta.kv_format
        if meta.flat is not None:  # both caches in one launch, padded rows (slot -1) skipped
            triton_attention.write_kv_codes(
                cache_k, cache_v, k, v, slots, fmt.kind, fmt.max_code, head_dim, meta.block_size
            )
            return
        kv_quant.write(cache_k, k, slots, fmt, head_dim, meta.block_size)
        kv_quant.write(cache_v, v, slots, fmt, head_dim, meta.block_size)
        return
    if meta is not None and meta.flat is not None:  # both caches in one launch
        triton_attention.write_kv(cache_k, cache_v, k, v, slots)
        return
    cache_k.index_copy_(0, slots, k.reshape(k.shape[0], -1))
    cache_v.index_copy_(0, slots, v.reshape(v.shape[0], -1))


BACKENDS = ("torch", "cpu", "triton")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention backend a config's choice means on this device; ValueError for one that cannot run here."""
    if name == "auto":
        if device.type == "cuda" and triton_attention.available(device):
            return "triton"
        return "cpu" if cpu_kernel.usable_for(device, dtype) else "torch"
    if name == "cpu" and not cpu_kernel.usable_for(device, dtype):
        raise ValueError(
            f"--attention-backend cpu runs our C++ operators, which need a CPU device and float32 or bfloat16 "
            f"(here: {device.type}, {dtype}) and a C++ toolchain to build them"
        )
    if name == "triton" and not triton_attention.available(device):
        where = "Triton is not installed" if not triton_attention.has_triton() else f"the device is {device.type}"
        raise ValueError(
            f"--attention-backend triton needs Triton on a CUDA device, or CPU tensors under TRITON_INTERPRET=1 "
            f"(set before start); {where}"
        )
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; the backends: auto, {', '.join(BACKENDS)}")
    return name


class GatherWorkspace:
    """Reusable buffers for gathered K and V.

    A fresh tensor per layer would be tens of megabytes at large batches, mapped and page-faulted in anew each
    time; measured here, reusing one buffer made decode attention at 64 sequences 3x faster.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [rows, width] view of the buffer kept under name, grown (by a quarter more) when too small."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < rows * width or buffer.dtype != dtype:
            buffer = torch.empty(rows * width * 5 // 4, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[: rows * width].view(rows, width)

    def gather(self, name: str, cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """[..., num_blocks] block ids -> [..., num_blocks * block_size, row] rows of the cache."""
        row = cache.shape[1]
        out = self.buffer(name, block_tables.numel(), block_size * row, cache.dtype, cache.device)
        torch.index_select(cache.view(-1, block_size * row), 0, block_tables.reshape(-1), out=out)
        return out.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, row)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads * d] (this step's, already in the cache). Returns [T, heads, d]."""
    out = torch.empty_like(q)
    if meta.flat is not None:
        kv_quant_kind = 0 if meta.kv_format is None else meta.kv_format.kind
        return triton_attention.unified_attention(
            q, cache_k, cache_v, meta.flat, meta.block_size, scale, out, num_splits=meta.num_splits,
            kv_quant=kv_quant_kind,
        )  # fmt: skip
    ws, block_size, fmt = meta.workspace, meta.block_size, meta.kv_format
    paged = meta.paged_prefills
    if meta.use_cpu_kernel and not meta.prefills and paged is None and len(meta.decodes) == 1:  # a decode step
        return _decode_step_on_operator(q, cache_k, cache_v, meta, scale, out)
    head_dim = q.shape[-1]

    def gathered(name: str, cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        rows = ws.gather(name, cache, tables, block_size)
        if fmt is not None:  # whole blocks, head by head inside (kv_quant.py), before they are cut to length
            rows = kv_quant.dequantize_blocks(rows, fmt, head_dim, block_size, q.dtype)
        return rows[..., :length, :]

    for group in meta.decodes:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        if meta.use_cpu_kernel:
            cpu_kernel.paged_decode_attention(
                q[rows], cache_k, cache_v, group.block_tables, group.context_lens, block_size, scale, out[rows],
                kv_kind=0 if fmt is None else fmt.kind,
            )  # fmt: skip
            continue
        assert group.bias is not None, "the plain path masks each decode group's padding"
        max_ctx = group.bias.shape[-1]
        group_k = gathered("k", cache_k, group.block_tables, max_ctx)
        group_v = gathered("v", cache_v, group.block_tables, max_ctx)
        out[rows] = _decode_attention(q[rows], group_k, group_v, group.bias, scale)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        seg_k, seg_v = _prefill_context(seg, k, v, cache_k, cache_v, meta, gathered, head_dim)
        if meta.prefill_op:
            torch.ops.tokenloom.prefill_attention(q[rows], seg_k, seg_v, scale, out[rows])
        else:
            out[rows] = _prefill_attention(q[rows], seg_k, seg_v, seg, scale)
    if paged is not None:  # no gather of the pasts: the operator reads them where they lie
        units = (paged.key_units, paged.unit_sources)
        torch.ops.tokenloom.paged_prefill_attention(q, cache_k, cache_v, paged.segments, paged.tables, *units,
                                                    block_size, scale, out)  # fmt: skip
    return out


def _prefill_context(
    seg: PrefillSegment,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    meta: AttentionMetadata,
    gathered: Callable[[str, torch.Tensor, torch.Tensor, int], torch.Tensor],
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's whole context, K and V, contiguous: this step's rows, or its past out of the cache with them."""
    if seg.block_table is None:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        return k[rows], v[rows]
    fmt = meta.kv_format
    if fmt is None or not meta.use_cpu_kernel:
        table, length = seg.block_table, seg.ctx_len
        return gathered("k", cache_k, table, length), gathered("v", cache_v, table, length)
    # An 8-bit cache on the C++ operators: the past's codes decoded in one pass each.
    width, ws = k.shape[-1], meta.workspace
    seg_k = ws.buffer("k", seg.ctx_len, width, k.dtype, k.device)
    seg_v = ws.buffer("v", seg.ctx_len, width, k.dtype, k.device)
    for cache, past in ((cache_k, seg_k), (cache_v, seg_v)):
        cpu_kernel.dequantize_past(cache, seg.block_table, seg.ctx_len, head_dim, fmt.kind, meta.block_size, past)
    return seg_k, seg_v


def _decode_step_on_operator(q, cache_k, cache_v, meta: AttentionMetadata, scale: float, out) -> torch.Tensor:
    """A step of decode rows in one group, on the C++ operator: one call over every row, straight to the operator."""
    group = meta.decodes[0]
    assert group.row_start == 0 and group.num_rows == q.shape[0], "a lone decode group holds every row"
    kv_kind = 0 if meta.kv_format is None else meta.kv_format.kind
    return cpu_kernel.paged_decode_attention(
        q, cache_k, cache_v, group.block_tables, group.context_lens, meta.block_size, scale, out, kv_kind
    )


def _decode_attention(q, k, v, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [D, heads, d]; k, v: [D, ctx, kv_heads * d]; bias: [D, 1, ctx]."""
    head_dim = q.shape[-1]
    num_kv_heads = k.shape[-1] // head_dim
    out = torch.empty_like(q)
    for heads, cols in _kv_heads(num_kv_heads, q.shape[1] // num_kv_heads, head_dim):
        scores = torch.baddbmm(bias, q[:, heads], k[:, :, cols].transpose(1, 2), alpha=scale)
        out[:, heads] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :, cols])
    return out


def _prefill_attention(q, k, v, seg: PrefillSegment, scale: float) -> torch.Tensor:
    """q: [n, heads, d] at the end of a context; k, v: [ctx_len, kv_heads * d]."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-1] // head_dim
    query = q.transpose(0, 1).unsqueeze(0)
    keys, values = (x.view(-1, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0) for x in (k, v))
    if seg.mask is None and seg.ctx_len > seg.q_len:  # a past given no mask: attended apart (attends_apart)
        return _past_and_chunk(query, keys, values, seg.ctx_len - seg.q_len, scale)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # fmt: skip
    return out[0].transpose(0, 1)


# From how many (query, key) pairs a chunk with a past is attended apart from it on the CPU (_past_and_chunk): below,
# the two calls and the merge cost more than the masked blocks one call multiplies (benchmarks/past_and_chunk.py,
# float32 and bf16: 512 queries after 512 keys 1.08x and 0.97x, 256 after 2,048 1.13x and 1.01x, 40 after 1,500 0.94x
# and 0.93x; 1,024 after 1,024 1.32x and 1.21x).
APART_FROM_PAIRS = {torch.float32: 1 << 19}


def attends_apart(q_len: int, ctx_len: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a chunk of q_len queries at the end of a context of ctx_len is attended apart from its past
    (_past_and_chunk: on the CPU, where that pays) rather than in one call with the causal mask; the step's inputs
    ask once a step and give such a chunk no mask."""
    pairs = q_len * ctx_len
    return device.type == "cpu" and ctx_len > q_len and pairs >= APART_FROM_PAIRS.get(dtype, 1 << 21)


def _past_and_chunk(query, keys, values, past: int, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries after `past` keys, on the CPU: the past seen whole (no mask) and the
    chunk's own keys causally, each by torch's fused CPU kernel, merged by their log-sum-exps. One call with the mask
    multiplied every masked block too: 2,048 queries after 2,048 keys took it 1.4-1.5x the time (benchmarks/RESULTS.md).
    [1, heads, n, d] queries over [1, kv_heads, ctx, d] keys and values (grouped heads read them as they are)."""
    assert query.device.type == "cpu", "torch's CPU flash kernel: other devices take the mask"
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seen, seen_lse = flash(query, keys[:, :, :past], values[:, :, :past], 0.0, False, scale=scale)
    own, own_lse = flash(query, keys[:, :, past:], values[:, :, past:], 0.0, True, scale=scale)
    # seen x e^a + own x e^b over e^a + e^b = seen + (own - seen) x sigmoid(b - a): three passes, in place.
    own_share = torch.sigmoid(own_lse - seen_lse).unsqueeze(-1)
    seen = seen.float()
    return own.float().sub_(seen).mul_(own_share).add_(seen).to(query.dtype)


def _kv_heads(num_kv_heads: int, group: int, head_dim: int):
    """For each KV head: the slice of query heads that share it, and its columns in a cache row."""
    for i in range(num_kv_heads):
        yield slice(i * group, (i + 1) * group), slice(i * head_dim, (i + 1) * head_dim)


def uses_prefill_op(backend: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Prefill attention through our AVX-512 operator. In float32 wherever it is built: torch's fused kernel took
    1.1-5.5x its time (benchmarks/prefill_attention_f32.py). In bf16 where the CPU has AMX only when the operator
    multiplies on its tiles too: torch's fused attention (its tiles) beat the AVX-512 BF16 one at every prompt shape
    measured, 1.2-3.2x, and the operator's tiles beat torch (benchmarks/prefill_attention_amx.py)."""
    if backend != "cpu" or head_dim not in (64, 128) or not cpu_kernel.has_prefill_op(dtype):
        return False
    return dtype == torch.float32 or not cpu_has_amx() or cpu_kernel.prefill_op_uses_amx()
