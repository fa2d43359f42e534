"""Compile the Triton kernels for a CUDA target ahead of time, on a machine without a GPU.

    python tests/model/triton_aot_compile.py [--arch 90]

Triton's interpreter runs a kernel's Python on CPU tensors; it never compiles it, so a kernel it accepts can still
fail to compile for a GPU (a dot of fewer than 16 rows, a mix of types the backend refuses, a construct an older
Triton lacks). Here each kernel is launched as the engine launches it, on CPU tensors of the shapes of the models we
serve, with Triton's launch replaced by a recorder; each recorded specialization is then compiled to a cubin by
Triton's own code generator and the ptxas shipped in its wheel. No CUDA driver is needed. Prints one line per
compiled specialization and exits non-zero on the first that fails. Must run without TRITON_INTERPRET (the
interpreter replaces the kernels with objects the compiler cannot read).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler needs the kernels, not the interpreter's stand-ins"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from tokenloom.model import kv_quant, triton_attention, triton_kernels  # noqa: E402
from tokenloom.model.step_inputs import TRITON_BLOCK_N  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
         torch.uint8: "u8"}  # fmt: skip
# (query heads, KV heads, head size): SmolLM2-135M, Llama-3.1-8B, and a group that is not a power of two
SHAPES = [(9, 3, 64), (32, 8, 128), (12, 2, 64)]
STEPS = {  # (query tokens, context tokens) per sequence
    "decode": [(1, 40), (1, 300), (1, 7)],
    "prefill with a past": [(37, 37), (16, 200)],
    "mixed": [(1, 90), (20, 20), (1, 3), (5, 64)],
}


def record_launches(kernels: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """Replace each kernel's launch by one that keeps the kernel and its arguments."""
    launches: list[tuple[Any, dict[str, Any]]] = []
    for kernel in kernels:

        def run(*args: Any, grid: Any, warmup: bool, _kernel: Any = kernel, **kwargs: Any) -> None:
            launches.append((_kernel, dict(zip((p.name for p in _kernel.params), args, strict=False), **kwargs)))

        kernel.run = run
    return launches


def signature(kernel: Any, arguments: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's signature and constexprs for one launch: a tensor is a typed pointer, an int an i32 (or i64)."""
    types: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for param in kernel.params:
        value = arguments[param.name]
        if param.is_constexpr:
            types[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[param.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            types[param.name] = "i1"
        elif isinstance(value, int):
            types[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            assert isinstance(value, float), f"{param.name}: {type(value)}"
            types[param.name] = "fp32"
    return types, constants


def launch_as_the_engine_does(dtype: torch.dtype, block_size: int = 16) -> None:
    """Call the backend's entry points over every shape and step kind, on CPU tensors: a cache of the model's
    dtype, and (the SmolLM2 shape) each 8-bit format."""
    for num_heads, num_kv, head_dim in SHAPES:
        launch_over_the_cache(dtype, num_heads, num_kv, head_dim, block_size, None)
    for fmt in kv_quant.FORMATS.values():
        launch_over_the_cache(dtype, *SHAPES[0], block_size, fmt)


def launch_over_the_cache(
    dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, block_size: int, fmt: kv_quant.KVFormat | None
) -> None:
    """Each step kind's launches over one cache: the model's dtype (fmt None) or an 8-bit format."""
    for seqs in STEPS.values():
        blocks = sum(-(-ctx // block_size) for _, ctx in seqs)
        if fmt is None:
            cache_k = torch.zeros(blocks * block_size, num_kv * head_dim, dtype=dtype)
        else:
            cache_k = torch.zeros(blocks * block_size, fmt.row_bytes(num_kv, head_dim), dtype=torch.uint8)
        cache_v = torch.zeros_like(cache_k)
        tables = torch.zeros(len(seqs), max(-(-ctx // block_size) for _, ctx in seqs), dtype=torch.int32)
        loc, first = [0], 0
        for s, (q_len, ctx) in enumerate(seqs):
            count = -(-ctx // block_size)
            tables[s, :count] = torch.arange(first, first + count)
            first += count
            loc.append(loc[-1] + q_len)
        batch = triton_attention.FlatBatch(
            query_start_loc=torch.tensor(loc, dtype=torch.int32),
            context_lens=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(q for q, _ in seqs),
            max_context_len=max(ctx for _, ctx in seqs),
        )
        tokens = loc[-1]
        q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype)
        out = torch.empty_like(q)
        kv = torch.zeros(tokens, num_kv * head_dim, dtype=dtype)
        slots = torch.arange(tokens, dtype=torch.int64)
        if fmt is None:
            triton_attention.write_kv(cache_k, cache_v, kv, kv, slots)
        else:
            triton_attention.write_kv_codes(
                cache_k, cache_v, kv, kv, slots, fmt.kind, fmt.max_code, head_dim, block_size
            )
        splits = triton_attention.split_count(batch, num_kv, TRITON_BLOCK_N, target_programs=132 * 4)
        for num_splits in sorted({1, splits}):
            triton_attention.unified_attention(
                q, cache_k, cache_v, batch, block_size, head_dim**-0.5, out, num_splits=num_splits,
                kv_quant=0 if fmt is None else fmt.kind,
            )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: Hopper, H100/H200)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    kernels = [
        triton_kernels._attention_kernel,
        triton_kernels._combine_kernel,
        triton_kernels._write_kv_kernel,
        triton_kernels._write_kv_codes_kernel,
    ]
    launches = record_launches(kernels)
    for name in args.dtypes.split(","):
        launch_as_the_engine_does(getattr(torch, name))
    target = GPUTarget("cuda", args.arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": 4, "num_stages": 2}).__dict__
    seen: set[str] = set()
    for kernel, arguments in launches:
        types, constants = signature(kernel, arguments)
        key = f"{kernel.__name__} {sorted(types.items())} {sorted(constants.items())}"
        if key in seen:
            continue
        seen.add(key)
        source = triton.compiler.ASTSource(fn=kernel, signature=types, constexprs=constants)
        compiled = triton.compile(source, target=target, options=options)
        print(f"compiled {kernel.__name__} {constants} for sm_{args.arch}: {len(compiled.asm['cubin'])} bytes of cubin")
    print(f"{len(seen)} specializations compiled with Triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
