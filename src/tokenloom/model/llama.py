"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

The model knows nothing of requests: it takes a flat batch of tokens, their positions, the KV cache and the
attention metadata, and returns hidden states. Logits are computed only for the rows the caller samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model import cpu_kernel
from tokenloom.model.attention import AttentionMetadata, paged_attention, write_kv
from tokenloom.model.config import ModelConfig
from tokenloom.model.forward_context import layer_attention
from tokenloom.model.head_rows import RowsEmbedding, WeightRows
from tokenloom.model.parallel import SINGLE, TensorParallelGroup
from tokenloom.model.prepack import PackedLinear, linear_weight_bytes, prepack_linears, small_batch_copies_pay
from tokenloom.model.quantization import Int8Linear, int8_head, quantize_linears
from tokenloom.model.reductions import row_topk_indices
from tokenloom.model.rotary import RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]
REFINED_TOP_K = 8  # bf16 logits recomputed in float32 per sampled row (see CausalLM.compute_logits)
Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin of this step's positions (the plain path)
Linear = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a sublayer's output joins the residual stream, normed for the next.

        The stream is float32 whatever x's dtype; the normed output is in x's dtype, for the next matmul.
        """
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
        """meta None: the compiled graph, which reaches the cache through the layer_attention operator. (The C++
        operators' step does not come here: OperatorLayer.forward.)"""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        if meta is None:  # the compiled graph: attention and the cache write are one opaque operator
            out = layer_attention(q, k.reshape(num_tokens, self.kv_size), v, self.layer_index, self.scale)
        else:
            assert kv_cache is not None, "the eager step passes each layer its cache"
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping, meta, self.head_dim)
            out = paged_attention(q, k.reshape(num_tokens, self.kv_size), v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gated", False):  # packed or int8: the projection applies silu(gate) * up itself
            return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))
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
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


def _call_of(linear: nn.Module) -> Linear:
    """How the operator step calls a linear with 2-D rows of unit stride: a plain nn.Linear through the module, so
    hooks on it still run (GPTQ records its inputs that way); a packed or quantized one, which nothing hooks,
    straight to its forward for rows where it has one."""
    if type(linear) is nn.Linear:
        return linear
    return getattr(linear, "rows_forward", linear.forward)


@dataclass(frozen=True, slots=True)
class OperatorLayer:
    """One decoder layer as the C++ operators' step runs it (cpu_kernel.py): the same computation as DecoderLayer,
    its weights and linears gathered once, so that a step calls the operators with no module dispatch between them.
    At batch 1 that dispatch was ~3 of a 12 ms forward on our 2-core CPUs (benchmarks/RESULTS.md)."""

    input_norm: torch.Tensor
    qkv_proj: Linear
    q_norm: torch.Tensor | None  # Qwen3's per-head norms
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up_proj: Linear
    gated: bool  # the projection returns silu(gate) * up itself
    down_proj: Linear
    tp: TensorParallelGroup
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> OperatorLayer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            input_norm=layer.input_layernorm.weight, qkv_proj=_call_of(attn.qkv_proj),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            o_proj=_call_of(attn.o_proj), post_norm=layer.post_attention_layernorm.weight,
            gate_up_proj=_call_of(mlp.gate_up_proj), gated=getattr(mlp.gate_up_proj, "gated", False),
            down_proj=_call_of(mlp.down_proj), tp=attn.tp, eps=layer.input_layernorm.eps,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
        )  # fmt: skip

    def forward(
        self, hidden, residual: torch.Tensor, positions, cos, sin, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """DecoderLayer.forward on the operators: hidden in and out, the float32 residual stream added to in place."""
        ops = torch.ops.tokenloom
        num_tokens, q_size, kv_size = hidden.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ops.fused_add_rms_norm(hidden, residual, self.input_norm, self.eps)  # both in place
        q, k, v = self.qkv_proj(hidden).split_with_sizes([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view(q.shape)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view(k.shape)
        # In place on views into the qkv output, and k and v into their cache slots: no copies.
        kind = 0 if meta.kv_format is None else meta.kv_format.kind
        ops.rotary_embedding_and_cache(
            q, k, v, positions, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, kind, meta.block_size
        )
        out = paged_attention(q, k.reshape(num_tokens, kv_size), v, kv_cache[0], kv_cache[1], meta, self.scale)
        hidden = self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, q_size)))
        ops.fused_add_rms_norm(hidden, residual, self.post_norm, self.eps)
        hidden = self.gate_up_proj(hidden)
        return self.tp.all_reduce(self.down_proj(hidden if self.gated else ops.silu_and_mul(hidden)))


# Fused [gate; up] projections: their packed and int8 kernels may return silu(gate) * up themselves.
GATED_PROJECTIONS = frozenset({"gate_up_proj"})


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, tp: TensorParallelGroup = SINGLE) -> None:
        """cfg is the whole model's; under tensor parallelism each layer holds tp's shard of it."""
        super().__init__()
        self.config = cfg.shard(tp.world_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)
        # Or, once a CPU holds the table's values in another form, a RowsEmbedding of it (head_rows.py).
        self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.config, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A classifier's checkpoint (*ForSequenceClassification) has no LM head: the one token its requests sample and
        # drop comes from the embedding, as a tied head's.
        untied = not cfg.tie_word_embeddings and not cfg.num_labels
        self.lm_head: nn.Module | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied else None
        self._plain_head_weight: torch.Tensor | None = None  # kept beside a head in another form (prepack_weights)
        self._head_held_once = False  # no plain weight beside the head's form (hold_head_once)
        # Its classification head: num_labels logits of the final norm's last row (prompt_outputs.py).
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        self._operator_layers: list[OperatorLayer] | None = None
        self._int8_head: Int8Linear | None = None  # an int8 model's approximate logits (quantize_weights)
        # Packed or int8 projections that apply silu(gate) * up themselves; none where LoRA adds to gate and up.
        self.gated_projections = GATED_PROJECTIONS
        # Rank 0 alone computes logits and samples (parallel_runner.py): the other ranks make no copies of the head.
        self.computes_logits = tp.rank == 0
        self.gguf_file: Path | None = None  # the GGUF its weights came from (loader.py), for --quantization gguf

    def forward(
        self, input_ids, positions, kv_caches: list[KVCache] | None = None, meta: AttentionMetadata | None = None
    ) -> torch.Tensor:
        """Eager with the cache and metadata given; without them, as traced for the compiled step (compiled.py),
        where the attention operator finds both in the forward context and the compiler fuses the small ops."""
        hidden = self.embed_tokens(input_ids)
        # The residual stream is kept in float32: in bfloat16, 30 layers of rounded adds cost top-1 agreement.
        residual = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        if meta is not None and meta.use_cpu_kernel:
            assert kv_caches is not None, "the C++ operators' step reads and writes the cache"
            # The C++ op indexes the whole float32 tables by position itself.
            cos, sin = self.rotary.float32_tables()
            for operators, kv_cache in zip(self.operator_layers(), kv_caches, strict=True):
                hidden = operators.forward(hidden, residual, positions, cos, sin, kv_cache, meta)
            return residual + hidden
        rope = self.rotary.tables(positions, hidden.dtype)  # this step's rows, looked up once
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, None if kv_caches is None else kv_caches[i], meta)
        return residual + hidden  # the final stream, float32; compute_logits norms the rows that are sampled

    def operator_layers_changed(self) -> None:
        """The layers' linears were replaced (prepacked, quantized, wrapped): gather them again on next use."""
        self._operator_layers = None

    def operator_layers(self) -> list[OperatorLayer]:
        """The layers as the C++ operators' step runs them, gathered on first use; prepack_weights and
        quantize_weights, which replace the linears, gather them again."""
        if self._operator_layers is None:
            self._operator_layers = [OperatorLayer.of(cast(DecoderLayer, layer)) for layer in self.layers]
        return self._operator_layers

    def compute_logits(self, stream: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of the final residual stream (what forward returns).

        In float32 this is the final norm and the LM head. In bfloat16 the head's matmul rounds logits to a grid
        of 0.125 near 25, coarser than the gap between a model's top two tokens at many positions; so the logits
        of each row's best REFINED_TOP_K candidates are computed again in float32, from the float32 normed row.
        With int8 weights every logit comes from the head's int8 copy (quantization.int8_head), refined the same way.
        """
        cpu_operators = stream.device.type == "cpu" and cpu_kernel.has_row_topk()  # every build has both used here
        if cpu_operators:
            normed = torch.ops.tokenloom.rms_norm(stream, self.norm.weight, self.norm.eps)
        else:
            normed = F.rms_norm(stream, (stream.shape[-1],), self.norm.weight.float(), self.norm.eps)
        if self._head_held_once:  # float32 logits from the head's own form
            assert self.lm_head is not None
            return self.lm_head(normed)
        head_weight = self.head_weight()
        if self._int8_head is not None:  # int8 weights: the int8 head's logits, their best candidates refined below
            logits = self._int8_head.rows_forward(normed.to(head_weight.dtype), out_dtype=torch.float32)
        elif head_weight.dtype == torch.float32:
            return F.linear(normed, head_weight) if self.lm_head is None else self.lm_head(normed)
        else:
            rounded = normed.to(head_weight.dtype)
            logits = (F.linear(rounded, head_weight) if self.lm_head is None else self.lm_head(rounded)).float()
        if cpu_operators:  # one operator for the five below
            torch.ops.tokenloom.refine_top_logits(logits, normed, head_weight, REFINED_TOP_K)
            return logits
        top = row_topk_indices(logits, REFINED_TOP_K)
        exact = torch.einsum("rh,rkh->rk", normed, head_weight[top].float())
        return logits.scatter_(1, top, exact)

    def token_logits(self, normed: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits of a few tokens for rows already through the final norm (float32): the head's rows for
        them, exact whatever the head's dtype or packing."""
        return F.linear(normed, self.head_rows(torch.tensor(token_ids, device=normed.device)))

    @property
    def head_is_embedding(self) -> bool:
        """Whether the LM head's weight is the embedding's table: tied, or a classifier's (no LM head of its own)."""
        return self.config.tie_word_embeddings or bool(self.config.num_labels)

    def head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's weight's rows for these tokens, float32, exact whatever form the head is held in."""
        if self._head_held_once:
            return cast(WeightRows, self.lm_head).weight_rows(token_ids)
        return self.head_weight()[token_ids].float()

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight as a plain tensor, also once the head itself is prepacked (where a plain copy is
        kept: not after hold_head_once)."""
        assert not self._head_held_once, "the head keeps no plain weight: head_rows reads its rows"
        if self._plain_head_weight is not None:
            return self._plain_head_weight
        return self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self.embedding_table()

    def embedding_table(self) -> torch.Tensor:
        """The embedding's table as loaded: not once its lookups read another form of it (embed_from)."""
        assert isinstance(self.embed_tokens, nn.Embedding), "the embedding's table is held in another form"
        return self.embed_tokens.weight

    def prepack_weights(self, layers: bool = True) -> None:
        """Every linear's weight (or the LM head's alone) into oneDNN's layout or ours, once (see prepack.py), where
        this rank computes logits the LM head's too: held once where our float32 layout gives its rows back
        (hold_head_once), else with its plain weight kept beside it."""
        # A served head (serve_head) keeps its own form, an int8 model's logits come from its int8 head: no copy.
        plain_head = self.lm_head is None or isinstance(self.lm_head, nn.Linear)
        packs_head = self._int8_head is None and self.computes_logits and plain_head
        head = None if self._head_held_once or not self.computes_logits else self.head_weight()
        head_bytes = 0 if head is None else head.numel() * head.element_size()
        small = small_batch_copies_pay(head_bytes + (linear_weight_bytes(self.layers) if layers else 0))
        if layers:
            prepack_linears(self.layers, gated=self.gated_projections, small_batch=small)
            self._operator_layers = None
        if not packs_head:
            return
        self._plain_head_weight = self.head_weight().detach()  # kept plain: the top logits are refined from it
        self.lm_head = PackedLinear(self._plain_head_weight, None, small_batch=small, amx_kernel=False)
        if self.lm_head.gives_weight_rows:
            self.hold_head_once()

    def serve_head(self, head: nn.Module) -> None:
        """The logits from `head`, a form of the LM head's weight (a GGUF's own blocks: gguf_linear.py), which
        prepack_weights then leaves; in float32 the head is held once (hold_head_once), else its plain weight is
        kept for the refinement of bf16 logits."""
        self._plain_head_weight = self.head_weight().detach()
        self.lm_head = head
        if self._plain_head_weight.dtype == torch.float32:
            self.hold_head_once()

    def hold_head_once(self) -> None:
        """Drops the plain weight kept beside the LM head, whose form gives its rows back exactly (head_rows.py) and
        its logits in float32; a tied embedding then looks its tokens up in that form."""
        assert self._plain_head_weight is not None and self._plain_head_weight.dtype == torch.float32
        assert hasattr(self.lm_head, "weight_rows"), "the head's form gives its rows back"
        if self.head_is_embedding:
            self.embed_from(cast(nn.Module, self.lm_head))
        self._plain_head_weight = None
        self._head_held_once = True

    def embed_from(self, source: nn.Module) -> None:
        """The embedding's lookups from `source`, another form of its table with weight_rows (head_rows.py)."""
        self.embed_tokens = RowsEmbedding(source, self.embedding_table().dtype)

    def quantize_weights(
        self,
        method: str,
        hessians: dict[str, torch.Tensor] | None = None,
        codes: dict[str, torch.Tensor] | None = None,
    ) -> int:
        """Every decoder layer's linear to its 8-bit form (quantization.py says what stays in the model's dtype);
        hessians, keyed by a linear's name under `layers` (gptq.recording_input_hessians(model.layers)), make GPTQ
        round its int8 codes; codes, keyed the same, are an earlier load's (gptq_cache.py)."""
        self._operator_layers = None
        self._int8_head = int8_head(self.head_weight(), method) if self.computes_logits else None
        return quantize_linears(self.layers, method, gated=self.gated_projections, hessians=hessians, codes=codes)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads tensors named as in a Hugging Face checkpoint, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, part, parts = fused_target(name)
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


def fused_target(name: str) -> tuple[str | None, str, tuple[str, ...]]:
    """A checkpoint's name for a member of a projection the model fuses -> the fused name, the member and all the
    members in the fused order; (None, "", ()) for any other name."""
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
