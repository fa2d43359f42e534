"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

The model knows nothing of requests: it takes a flat batch of tokens, their positions, the KV cache and the
attention metadata, and returns hidden states. Logits are computed only for the rows the caller samples.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.attention import AttentionMetadata, paged_attention, write_kv
from tokenloom.model.config import ModelConfig
from tokenloom.model.forward_context import layer_attention
from tokenloom.model.parallel import SINGLE, TensorParallelGroup
from tokenloom.model.prepack import PackedLinear, linear_weight_bytes, prepack_linears, small_batch_copies_pay
from tokenloom.model.quantization import quantize_linears
from tokenloom.model.reductions import row_topk_indices
from tokenloom.model.rotary import RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]
REFINED_TOP_K = 8  # bf16 logits recomputed in float32 per sampled row (see CausalLM.compute_logits)
# The plain path: cos and sin of this step's positions. The C++ path: the positions and the whole float32 tables.
Rope = tuple[torch.Tensor, ...]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused:  # over the last dimension, as F.rms_norm: the op takes rows
            return torch.ops.tokenloom.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a sublayer's output joins the residual stream, normed for the next.

        The stream is float32 whatever x's dtype; the normed output is in x's dtype, for the next matmul.
        """
        if fused:
            torch.ops.tokenloom.fused_add_rms_norm(x, residual, self.weight, self.eps)  # both in place
            return x, residual
        residual = residual + x
        if residual.dtype == x.dtype:
            return self(residual), residual
        # As transformers' RMSNorm does it: normalise in float32, round, then scale.
        return self.weight * F.rms_norm(residual, (residual.shape[-1],), eps=self.eps).to(x.dtype), residual


class Attention(nn.Module):
    """cfg is this rank's shard under tensor parallelism: its heads and KV heads only (parallel.py)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.layer_index, self.tp = layer_index, tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v are one matmul: fewer, larger GEMMs are what a CPU runs fastest.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, rope: Rope, hidden, kv_cache: KVCache | None, meta: AttentionMetadata | None) -> torch.Tensor:
        """meta None: the compiled graph, which reaches the cache through the layer_attention operator."""
        num_tokens = hidden.shape[0]
        fused = meta is not None and meta.use_cpu_kernel
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, fused), self.k_norm(k, fused)
        if not fused:
            q, k = apply_rotary(q, k, *rope)
        if meta is None:  # the compiled graph: attention and the cache write are one opaque operator
            out = layer_attention(q, k.reshape(num_tokens, self.kv_size), v, self.layer_index, self.scale)
        else:
            assert kv_cache is not None, "the eager step passes each layer its cache"
            if fused:  # in place on views into the qkv output, and k and v into their cache slots: no copies
                positions, cos, sin = rope
                kind = 0 if meta.kv_format is None else meta.kv_format.kind
                torch.ops.tokenloom.rotary_embedding_and_cache(
                    q, k, v, positions, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, kind, meta.block_size
                )
            else:
                write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping, meta, self.head_dim)
            out = paged_attention(q, k.reshape(num_tokens, self.kv_size), v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gated", False):  # packed or int8: the projection applies silu(gate) * up itself
            return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))
        if fused:
            return self.tp.all_reduce(self.down_proj(torch.ops.tokenloom.silu_and_mul(self.gate_up_proj(x))))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, tp)

    def forward(
        self, rope: Rope, hidden, residual: torch.Tensor, kv_cache: KVCache | None, meta: AttentionMetadata | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out: the residual add is fused into the next norm, as vLLM does."""
        fused = meta is not None and meta.use_cpu_kernel
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, fused)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, fused)
        return self.mlp(hidden, fused), residual


# Fused [gate; up] projections: their packed and int8 kernels may return silu(gate) * up themselves.
GATED_PROJECTIONS = frozenset({"gate_up_proj"})


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, tp: TensorParallelGroup = SINGLE) -> None:
        """cfg is the whole model's; under tensor parallelism each layer holds tp's shard of it."""
        super().__init__()
        self.config = cfg.shard(tp.world_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.config, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self, input_ids, positions, kv_caches: list[KVCache] | None = None, meta: AttentionMetadata | None = None
    ) -> torch.Tensor:
        """Eager with the cache and metadata given; without them, as traced for the compiled step (compiled.py),
        where the attention operator finds both in the forward context and the compiler fuses the small ops."""
        hidden = self.embed_tokens(input_ids)
        # The C++ op indexes the whole float32 tables by position itself; else this step's rows, looked up once.
        rope: Rope
        if meta is not None and meta.use_cpu_kernel:
            rope = (positions, *self.rotary.float32_tables())
        else:
            rope = self.rotary.tables(positions, hidden.dtype)
        # The residual stream is kept in float32: in bfloat16, 30 layers of rounded adds cost top-1 agreement.
        residual = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, None if kv_caches is None else kv_caches[i], meta)
        return residual + hidden  # the final stream, float32; compute_logits norms the rows that are sampled

    def compute_logits(self, stream: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of the final residual stream (what forward returns).

        In float32 this is the final norm and the LM head. In bfloat16 the head's matmul rounds logits to a grid
        of 0.125 near 25, coarser than the gap between a model's top two tokens at many positions; so the logits
        of each row's best REFINED_TOP_K candidates are computed again in float32, from the float32 normed row.
        """
        normed = F.rms_norm(stream, (stream.shape[-1],), self.norm.weight.float(), self.norm.eps)
        head_weight = self._head_weight()
        if head_weight.dtype == torch.float32:
            return F.linear(normed, head_weight)
        rounded = normed.to(head_weight.dtype)
        logits = (F.linear(rounded, head_weight) if self.lm_head is None else self.lm_head(rounded)).float()
        top = row_topk_indices(logits, REFINED_TOP_K)
        exact = torch.einsum("rh,rkh->rk", normed, head_weight[top].float())
        return logits.scatter_(1, top, exact)

    def _head_weight(self) -> torch.Tensor:
        """The LM head's weight as a plain tensor, also once the head itself is prepacked."""
        plain = getattr(self, "_plain_head_weight", None)
        if plain is not None:
            return plain
        return self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self.embed_tokens.weight

    def prepack_weights(self, layers: bool = True) -> None:
        """Every linear's weight (or the LM head's alone) into oneDNN's layout, once (see prepack.py); a tied LM
        head gets its own copy."""
        self._plain_head_weight = self._head_weight().detach()  # kept plain: the top logits are refined from it
        head_bytes = self._plain_head_weight.numel() * self._plain_head_weight.element_size()
        small = small_batch_copies_pay(head_bytes + (linear_weight_bytes(self.layers) if layers else 0))
        if layers:
            prepack_linears(self.layers, gated=GATED_PROJECTIONS, small_batch=small)
        # A tied embedding stays, for lookups.
        self.lm_head = PackedLinear(self._plain_head_weight, None, small_batch=small, amx_kernel=False)

    def quantize_weights(
        self,
        method: str,
        hessians: dict[str, torch.Tensor] | None = None,
        codes: dict[str, torch.Tensor] | None = None,
    ) -> int:
        """Every decoder layer's linear to its 8-bit form (quantization.py says what stays in the model's dtype);
        hessians, keyed by a linear's name under `layers` (gptq.recording_input_hessians(model.layers)), make GPTQ
        round its int8 codes; codes, keyed the same, are an earlier load's (gptq_cache.py)."""
        return quantize_linears(self.layers, method, gated=GATED_PROJECTIONS, hessians=hessians, codes=codes)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads tensors named as in a Hugging Face checkpoint, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, part, parts = _fused_target(name)
            if target is None:
                _copy_into(params, name, tensor)
                loaded.add(name)
                continue
            group = pending.setdefault(target, {})
            group[part] = tensor
            if len(group) == len(parts):
                _copy_into(params, target, torch.cat([group[p] for p in parts], dim=0))
                loaded.add(target)
                del pending[target]
        missing = set(params) - loaded
        if missing or pending:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")


_FUSED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}


def _fused_target(name: str) -> tuple[str | None, str, tuple[str, ...]]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, members = _FUSED[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), part, members
    return None, "", ()


def _copy_into(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
