// Fused element-wise steps of a decoder layer, for CPU, in float32 and bfloat16 (math in float32):
// tokenloom::rms_norm, tokenloom::fused_add_rms_norm, tokenloom::rotary_embedding_and_cache and
// tokenloom::silu_and_mul.
//
// Each replaces three to six small torch ops. On a 2-core CPU a decode step's tensors are tiny (64 rows of 576),
// so these ops do their work on the calling thread below a size where a second thread pays off, and above it
// share their rows through work_sharing.h (no wait for a sleeping OpenMP worker).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16_vec.h"
#include "int8_epilogue.h"
#include "kv_codes.h"
#include "work_sharing.h"

namespace {

// Below this many elements an op runs on the calling thread: ringing a helper costs more than it saves.
constexpr int64_t kParallelElements = 1 << 17;

inline float load(const float* p) { return *p; }
inline float load(const c10::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(p->x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = static_cast<c10::BFloat16>(v); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 values as float32, and back (bf16 rounded to nearest even, as c10::BFloat16 rounds).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
using tokenloom::store16;  // bf16_vec.h: rounded to nearest even with or without AVX-512 BF16
#elif defined(__AVX2__) && defined(__FMA__)
// 8 values as float32 (the AVX2 paths of the int8 activations' rotation and quantization).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// The ops take float32 or bfloat16 (checked before this is reached).
template <typename F>
void dispatch(at::ScalarType type, const F& body) {
  if (type == at::kFloat) {
    body(float{});
  } else {
    body(c10::BFloat16{});
  }
}

// Rows in chunks of about kParallelElements, shared between threads through work_sharing.h.
template <typename F>
void for_rows(int64_t rows, int64_t row_elements, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kParallelElements / std::max<int64_t>(row_elements, 1));
  tokenloom::WorkSharing::instance().run((rows + grain - 1) / grain, [&](int64_t chunk) {
    for (int64_t r = chunk * grain, end = std::min(rows, r + grain); r < end; ++r) body(r);
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expects [rows, cols] with contiguous rows");
}

template <typename T, typename W>
void norm_row(const T* in, const W* w, T* out, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(in + i);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) store(out + i, load(in + i) * inv * load(w + i));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  // The weight in either dtype: the logits' float32 rows are normed by the model's bf16 weight (llama.compute_logits).
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: weight must be [cols], contiguous, float32 or bfloat16");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    dispatch(weight.scalar_type(), [&](auto weight_tag) {
      using weight_t = decltype(weight_tag);
      const weight_t* w = weight.const_data_ptr<weight_t>();
      for_rows(x.size(0), n, [&](int64_t r) { norm_row(in + r * stride, w, o + r * n, n, static_cast<float>(eps)); });
    });
  });
  return out;
}

// residual += x; x = rms_norm(residual) * weight, in place, as a decoder layer hands its output on. The residual
// stream may be float32 under bfloat16 activations: it then loses nothing to rounding across the layers.
template <typename T, typename R>
void add_norm_rows(T* xs, R* res, const T* w, int64_t rows, int64_t n, float eps) {
  for_rows(rows, n, [&](int64_t r) {
    T* xr = xs + r * n;
    R* rr = res + r * n;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      store(rr + i, load(xr + i) + load(rr + i));
      const float v = load(rr + i);  // as stored: the residual stream keeps its own dtype
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) store(xr + i, load(rr + i) * inv * load(w + i));
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "fused_add_rms_norm: x and residual must be contiguous and of one shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat,
              "fused_add_rms_norm: the residual must be float32 or of x's dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "fused_add_rms_norm: weight must be [cols], contiguous, of x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  const float e = static_cast<float>(eps);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xs = x.mutable_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    if (residual.scalar_type() == at::kFloat) {
      add_norm_rows(xs, residual.mutable_data_ptr<float>(), w, rows, n, e);
    } else {
      add_norm_rows(xs, residual.mutable_data_ptr<scalar_t>(), w, rows, n, e);
    }
  });
}

// Rotate-half rotary embedding, in place on q [T, heads, d] and k [T, kv_heads, d] (views into the fused qkv
// output: rows may be strided, heads and dims contiguous), then this step's rotated k and its v [T, kv_heads * d]
// stored into their cache slots: one pass over each token's rows instead of a rotary op and two index copies.
// cos and sin: [max_len, d] float32 tables; cache_k and cache_v: [num_slots, kv_heads * d], contiguous, or with
// kv_kind > 0 an 8-bit cache (kv_codes.h): uint8 [num_slots, kv_heads * (d + 4)] in blocks of block_size slots laid
// out head by head, each head quantized as it is stored.
void rotary_embedding_and_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                                const at::Tensor& cos, const at::Tensor& sin, at::Tensor& cache_k, at::Tensor& cache_v,
                                const at::Tensor& slots, int64_t kv_kind, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_embedding_and_cache: q [T, heads, d] and k [T, kv_heads, d]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "rotary_embedding_and_cache: q and k must share a dtype, float32 or bfloat16");
  const int64_t tokens = q.size(0), d = q.size(2), row = k.size(1) * d;
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d,
              "rotary_embedding_and_cache: heads and dims must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rotary_embedding_and_cache: cos and sin must be contiguous float32 [max_len, d]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == tokens,
              "rotary_embedding_and_cache: positions must be int64 [T]");
  TORCH_CHECK(d % 2 == 0, "rotary_embedding_and_cache: the head size must be even");
  TORCH_CHECK(v.dim() == 2 && v.size(0) == tokens && v.size(1) == row && v.stride(1) == 1 &&
                  v.scalar_type() == k.scalar_type(),
              "rotary_embedding_and_cache: v must be [T, kv_heads * d] of k's dtype, its rows contiguous");
  TORCH_CHECK(kv_kind == tokenloom::kPlain || tokenloom::is_kv_kind(kv_kind),
              "rotary_embedding_and_cache: kv_kind must be 0, 1, 2 or 3");
  const bool coded = kv_kind != tokenloom::kPlain;
  const int64_t cache_row = coded ? k.size(1) * (d + 4) : row;
  const at::ScalarType cache_type = coded ? at::kByte : k.scalar_type();
  TORCH_CHECK(!coded || (block_size > 0 && cache_k.size(0) % block_size == 0),
              "rotary_embedding_and_cache: an 8-bit cache needs its block_size, which must divide its slots");
  TORCH_CHECK(cache_k.dim() == 2 && cache_k.size(1) == cache_row && cache_k.is_contiguous() &&
                  cache_v.sizes() == cache_k.sizes() && cache_v.is_contiguous() &&
                  cache_k.scalar_type() == cache_type && cache_v.scalar_type() == cache_type,
              coded ? "rotary_embedding_and_cache: an 8-bit cache must be contiguous uint8 [num_slots, kv_heads * (d + 4)]"
                    : "rotary_embedding_and_cache: the caches must be contiguous [num_slots, kv_heads * d] of k's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == tokens,
              "rotary_embedding_and_cache: slots must be int64 [T]");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t max_len = cos.size(0), num_slots = cache_k.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_len, "rotary_embedding_and_cache: position ", pos[t], " out of range");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_embedding_and_cache: slot ", slot[t], " out of range");
  }
  const int64_t half = d / 2, q_heads = q.size(1), k_heads = k.size(1);
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.mutable_data_ptr<scalar_t>();
    scalar_t* kp = k.mutable_data_ptr<scalar_t>();
    const scalar_t* vp = v.const_data_ptr<scalar_t>();
    auto* ck = static_cast<uint8_t*>(cache_k.data_ptr());
    auto* cv = static_cast<uint8_t*>(cache_v.data_ptr());
    const int64_t slot_bytes = coded ? cache_row : row * static_cast<int64_t>(sizeof(scalar_t));
    const float* cp = cos.const_data_ptr<float>();
    const float* sp = sin.const_data_ptr<float>();
    auto rotate = [&](scalar_t* x, const float* c, const float* s) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(x + i), x2 = load(x + i + half);
        store(x + i, x1 * c[i] - x2 * s[i]);
        store(x + i + half, x2 * c[i + half] + x1 * s[i + half]);
      }
    };
    for_rows(tokens, (q_heads + 3 * k_heads) * d, [&](int64_t t) {
      const float* c = cp + pos[t] * d;
      const float* s = sp + pos[t] * d;
      for (int64_t h = 0; h < q_heads; ++h) rotate(qp + t * q.stride(0) + h * d, c, s);
      scalar_t* kt = kp + t * k.stride(0);
      for (int64_t h = 0; h < k_heads; ++h) rotate(kt + h * d, c, s);
      if (coded) {
        const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
        for (int64_t h = 0; h < k_heads; ++h) {
          const int64_t at = tokenloom::entry_offset(block, h, offset, k_heads, block_size, d);
          tokenloom::quantize_head(kv_kind, kt + h * d, d, ck + at);
          tokenloom::quantize_head(kv_kind, vp + t * v.stride(0) + h * d, d, cv + at);
        }
      } else {
        std::memcpy(ck + slot[t] * slot_bytes, kt, slot_bytes);
        std::memcpy(cv + slot[t] * slot_bytes, vp + t * v.stride(0), slot_bytes);
      }
    });
  });
}

// An 8-bit cache's first `length` slots along block_table, decoded into out [length, kv_heads * d] (float32 or
// bfloat16): a prefill chunk's past, which the plain path gathers as whole blocks and decodes in several torch passes
// (kv_quant.dequantize_blocks: 0.4-2.6 ms for one of K or V over a 4,000-token past, one layer, on a Zen 4; this
// 0.12 ms, a bf16 cache's gather 0.04 ms). The same values bit for bit: code times scale in float32, then rounded.
void dequantize_past(const at::Tensor& cache, const at::Tensor& block_table, int64_t length, int64_t head_dim,
                     int64_t kv_kind, int64_t block_size, at::Tensor& out) {
  TORCH_CHECK(tokenloom::is_kv_kind(kv_kind), "dequantize_past: kv_kind must be 1, 2 or 3 (an 8-bit cache)");
  TORCH_CHECK(head_dim > 0 && head_dim <= 1024 && block_size > 0, "dequantize_past: head_dim and block_size");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 2 && cache.is_contiguous() &&
                  cache.size(1) % (head_dim + 4) == 0 && cache.size(0) % block_size == 0,
              "dequantize_past: the cache must be contiguous uint8 [num_slots, kv_heads * (d + 4)] in whole blocks");
  const int64_t heads = cache.size(1) / (head_dim + 4), num_blocks = cache.size(0) / block_size;
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "dequantize_past: block_table must be contiguous int64 [blocks]");
  TORCH_CHECK(length >= 0 && length <= block_table.size(0) * block_size,
              "dequantize_past: length exceeds the table's blocks");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == length && out.size(1) == heads * head_dim && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_past: out must be contiguous float32 or bfloat16 [length, kv_heads * d]");
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  const int64_t used = (length + block_size - 1) / block_size;
  for (int64_t b = 0; b < used; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "dequantize_past: block id ", table[b], " out of range");
  }
  const uint8_t* codes = cache.const_data_ptr<uint8_t>();
  dispatch(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    tokenloom::with_kv_kind(kv_kind, [&]<int64_t Kind>() {
      for_rows(length, heads * head_dim, [&](int64_t t) {
        float values[1024];
        const int64_t block = table[t / block_size], offset = t % block_size;
        for (int64_t h = 0; h < heads; ++h) {
          const uint8_t* entry = codes + tokenloom::entry_offset(block, h, offset, heads, block_size, head_dim);
          tokenloom::decode_codes<Kind>(entry, tokenloom::read_scale(entry + head_dim), values, head_dim);
          scalar_t* row = o + t * heads * head_dim + h * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) store(row + i, values[i]);
        }
      });
    });
  });
}

// x: [T, 2 * I] as gate then up -> silu(gate) * up: [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even (gate and up)");
  const int64_t inner = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({x.size(0), inner}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for_rows(x.size(0), x.size(1), [&](int64_t r) {
      const scalar_t* gate = in + r * stride;
      const scalar_t* up = gate + inner;
      scalar_t* dst = o + r * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const float g = load(gate + i);
        // Clamped: real models have gate outliers far below -88, where e^-g overflows float32.
        store(dst + i, g / (1.0f + std::exp(std::min(-g, 80.0f))) * load(up + i));
      }
    });
  });
  return out;
}

// Per-token int8 activations for the int8 linears (--quantization int8, quantization.py): x [M, K] -> codes int8
// [M, K] and scales float32 [M, 1], scale = a row's largest |x| times 1 / 127, code = x times 1 / scale rounded to
// nearest even (as kv_codes.h quantizes KV heads). With signs (float32 [K], each +-1; K a multiple of 64), each row
// is first rotated: every 64 inputs times their signs, then through the orthonormal 64-point Walsh-Hadamard
// transform (H / 8), the rotation the weight was multiplied by at load time (quantization.py says why).
constexpr int64_t kRotationBlock = 64;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One butterfly stage of the Walsh-Hadamard transform inside a vector: lane i becomes x[i ^ H] +- x[i] (minus where
// bit H of i is set).
template <int H>
struct Butterfly {
  struct Lanes {
    alignas(64) int32_t partner[16];
    alignas(64) float sign[16];
  };
  static constexpr Lanes make() {
    Lanes lanes{};
    for (int i = 0; i < 16; ++i) {
      lanes.partner[i] = i ^ H;
      lanes.sign[i] = (i & H) ? -1.0f : 1.0f;
    }
    return lanes;
  }
  static constexpr Lanes kLanes = make();
  static __m512 apply(__m512 v) {
    const __m512i partner = _mm512_load_si512(kLanes.partner);
    return _mm512_fmadd_ps(v, _mm512_load_ps(kLanes.sign), _mm512_permutexvar_ps(partner, v));
  }
};

// 64 floats (4 vectors) -> their transform times 1 / 8.
inline void hadamard64(__m512 (&v)[4]) {
  for (auto& x : v) x = Butterfly<8>::apply(Butterfly<4>::apply(Butterfly<2>::apply(Butterfly<1>::apply(x))));
  for (int pair = 0; pair < 4; pair += 2) {  // h = 16: vectors 0-1 and 2-3
    const __m512 a = v[pair], b = v[pair + 1];
    v[pair] = _mm512_add_ps(a, b);
    v[pair + 1] = _mm512_sub_ps(a, b);
  }
  for (int i = 0; i < 2; ++i) {  // h = 32: vectors 0-2 and 1-3
    const __m512 a = v[i], b = v[i + 2];
    v[i] = _mm512_mul_ps(_mm512_add_ps(a, b), _mm512_set1_ps(0.125f));
    v[i + 2] = _mm512_mul_ps(_mm512_sub_ps(a, b), _mm512_set1_ps(0.125f));
  }
}

// One 64-input block of x times its signs through the transform, in registers.
template <typename scalar_t>
inline void rotate_block(const scalar_t* x, const float* signs, __m512 (&v)[4]) {
  for (int j = 0; j < 4; ++j) v[j] = _mm512_mul_ps(load16(x + 16 * j), _mm512_loadu_ps(signs + 16 * j));
  hadamard64(v);
}

// 16 values times inv as int8 codes, rounded to nearest even (|v| x inv <= 127 by the caller's scale), each xor
// flip (-128: the code + 128 as an unsigned byte, what the VNNI kernel multiplies; 0: the code).
inline void store_codes16(__m512 v, __m512 inv, int8_t* codes, __m128i flip) {
  const __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_xor_si128(q, flip));
}
#elif defined(__AVX2__) && defined(__FMA__)
// Stages 1, 2 and 4 inside an 8-float vector, as the AVX-512 Butterfly: lane i becomes x[i ^ H] +- x[i].
inline __m256 butterflies_in_vector(__m256 v) {
  v = _mm256_fmadd_ps(v, _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), _mm256_permute_ps(v, 0b10110001));
  v = _mm256_fmadd_ps(v, _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1), _mm256_permute_ps(v, 0b01001110));
  return _mm256_fmadd_ps(v, _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1), _mm256_permute2f128_ps(v, v, 1));
}

// 64 floats (8 vectors) -> their transform times 1 / 8.
inline void hadamard64(__m256 (&v)[8]) {
  for (auto& x : v) x = butterflies_in_vector(x);
  for (int h = 1; h < 8; h <<= 1) {  // stages 8, 16, 32: vector j with vector j + h
    for (int j = 0; j < 8; ++j) {
      if (j & h) continue;
      const __m256 a = v[j], b = v[j + h];
      v[j] = _mm256_add_ps(a, b);
      v[j + h] = _mm256_sub_ps(a, b);
    }
  }
  for (auto& x : v) x = _mm256_mul_ps(x, _mm256_set1_ps(0.125f));
}

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

// A row of x times its signs through the transform, 64 inputs at a time, into `to`; returns its largest |value|.
template <typename scalar_t>
float rotate_row(const scalar_t* x, const float* signs, int64_t n, float* to) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 most = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kRotationBlock) {
    __m512 v[4];
    rotate_block(x + i, signs + i, v);
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(to + i + 16 * j, v[j]);
      most = _mm512_max_ps(most, _mm512_abs_ps(v[j]));
    }
  }
  return _mm512_reduce_max_ps(most);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 most = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kRotationBlock) {
    __m256 v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_mul_ps(load8(x + i + 8 * j), _mm256_loadu_ps(signs + i + 8 * j));
    hadamard64(v);
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_ps(to + i + 8 * j, v[j]);
      most = _mm256_max_ps(most, abs8(v[j]));
    }
  }
  return reduce_max8(most);
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < n; i += kRotationBlock) {
    float* block = to + i;
    for (int j = 0; j < kRotationBlock; ++j) block[j] = load(x + i + j) * signs[i + j];
    for (int h = 1; h < kRotationBlock; h <<= 1) {
      for (int j = 0; j < kRotationBlock; ++j) {
        if ((j & h) == 0) {
          const float a = block[j], b = block[j + h];
          block[j] = a + b;
          block[j + h] = a - b;
        }
      }
    }
    for (int j = 0; j < kRotationBlock; ++j) amax = std::max(amax, std::fabs(block[j] *= 0.125f));
  }
  return amax;
#endif
}

template <typename scalar_t>
float row_amax(const scalar_t* x, int64_t n) {
  float amax = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 most = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) most = _mm512_max_ps(most, _mm512_abs_ps(load16(x + i)));
  amax = _mm512_reduce_max_ps(most);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 most = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) most = _mm256_max_ps(most, abs8(load8(x + i)));
  amax = reduce_max8(most);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(load(x + i)));
  return amax;
}

// Codes of a row of x (float32 or bfloat16) times inv, rounded to nearest even; |x| * inv <= 127, so no clamp.
// Each xor flip: -128 stores code + 128 as an unsigned byte (the VNNI kernel's operand), 0 the code.
template <typename scalar_t>
void quantize_row(const scalar_t* x, float inv, int64_t n, int8_t* codes, int8_t flip = 0) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 v_inv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) store_codes16(load16(x + i), v_inv, codes + i, _mm_set1_epi8(flip));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 v_inv = _mm256_set1_ps(inv);
  for (; i + 32 <= n; i += 32) {  // rounded to nearest even (the default rounding), packed 32 to a vector
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i + 8 * j), v_inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_xor_si256(ordered, _mm256_set1_epi8(flip)));
  }
#endif
  for (; i < n; ++i) {
    const auto code = static_cast<int8_t>(std::nearbyint(std::clamp(load(x + i) * inv, -127.0f, 127.0f)));
    codes[i] = static_cast<int8_t>(code ^ flip);
  }
}

// The same into 16-bit codes, |x| * inv <= max_code <= 32767.
template <typename scalar_t>
void quantize_row(const scalar_t* x, float inv, int64_t n, int16_t* codes) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 v_inv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), v_inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtsepi32_epi16(q));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 v_inv = _mm256_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i), v_inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i + 8), v_inv));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0b11011000);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), words);
  }
#endif
  const float most = 32767.0f;
  for (; i < n; ++i) codes[i] = static_cast<int16_t>(std::nearbyint(std::clamp(load(x + i) * inv, -most, most)));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A row of x times its signs through the transform, each 64-input block quantized to int8 with its own scale (its
// largest |value| x inv_max) straight from the registers: the same codes and scales as rotate_row, then row_amax and
// quantize_row per block, in one pass (grouped codes at 2,048 rows took 1.5x one scale a row's time in two).
template <typename scalar_t>
void rotate_and_quantize_blocks(const scalar_t* x, const float* signs, int64_t n, float inv_max, int8_t* codes,
                                float* scales, int8_t flip) {
  for (int64_t i = 0; i < n; i += kRotationBlock) {
    __m512 v[4];
    rotate_block(x + i, signs + i, v);
    __m512 most = _mm512_abs_ps(v[0]);
    for (int j = 1; j < 4; ++j) most = _mm512_max_ps(most, _mm512_abs_ps(v[j]));
    const float amax = _mm512_reduce_max_ps(most);
    const float scale = amax > 0.0f ? amax * inv_max : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / scale);
    for (int j = 0; j < 4; ++j) store_codes16(v[j], inv, codes + i + 16 * j, _mm_set1_epi8(flip));
    scales[i / kRotationBlock] = scale;
  }
}
#endif

// quantize_rows_int8 and quantize_rows_int16: one row's scale is its largest |x| (rotated, with signs) over the
// largest code, then codes as quantize_row makes them; with a group, one scale per group of a row's inputs.
// Shifted (int8 only): each code + 128 as an unsigned byte, what the VNNI kernel multiplies (vpdpbusd takes unsigned
// bytes), so that it need not shift them in a pass of its own.
template <typename code_t>
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const std::optional<at::Tensor>& signs,
                                                 int64_t max_code, const char* name, int64_t group = 0,
                                                 bool shifted = false) {
  check_rows(x, name);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* sg = nullptr;
  if (signs.has_value()) {
    TORCH_CHECK(signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->numel() == n &&
                    n % kRotationBlock == 0,
                name, ": signs must be float32 [K] with K a multiple of 64");
    sg = signs->const_data_ptr<float>();
  }
  TORCH_CHECK(group >= 0 && (group == 0 || n % group == 0), name, ": a group must divide the row");
  TORCH_CHECK(sg == nullptr || group % kRotationBlock == 0, name, ": a rotated row's groups are whole 64-blocks");
  const int64_t width = group == 0 ? n : group, groups = n / width;
  const float inv_max = 1.0f / static_cast<float>(max_code);
  TORCH_CHECK(!shifted || (std::is_same_v<code_t, int8_t>), name, ": only int8 codes are shifted");
  const auto code_type = shifted ? at::kByte : c10::CppTypeToScalarType<code_t>::value;
  const int8_t flip = shifted ? -128 : 0;
  at::Tensor codes = at::empty({rows, n}, x.options().dtype(code_type));
  at::Tensor scales = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  code_t* c = static_cast<code_t*>(codes.mutable_data_ptr());  // int8 codes stored as uint8 when shifted
  float* sc = scales.mutable_data_ptr<float>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t r) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<code_t, int8_t>) {
        if (sg != nullptr && width == kRotationBlock) {
          rotate_and_quantize_blocks(in + r * stride, sg, n, inv_max, c + r * n, sc + r * groups, flip);
          return;
        }
      }
#endif
      thread_local std::vector<float> rotated;
      if (sg != nullptr) rotated.resize(n);
      // Each group (without one, the whole row) rotated as it is scaled: one pass over the row either way.
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = g * width;
        const scalar_t* from = in + r * stride + at;
        const float amax =
            sg != nullptr ? rotate_row(from, sg + at, width, rotated.data() + at) : row_amax(from, width);
        const float scale = amax > 0.0f ? amax * inv_max : 1.0f;
        auto quantize = [&](const auto* values) {
          if constexpr (std::is_same_v<code_t, int8_t>) {
            quantize_row(values, 1.0f / scale, width, c + r * n + at, flip);
          } else {
            quantize_row(values, 1.0f / scale, width, c + r * n + at);
          }
        };
        if (sg != nullptr) {
          quantize(rotated.data() + at);
        } else {
          quantize(from);
        }
        sc[r * groups + g] = scale;
      }
    });
  });
  return {codes, scales};
}

// 16-bit activation codes for the AVX2 int8 linear (int8_linear_avx2.cpp), which multiplies 16-bit words anyway:
// max_code up to 32767, small enough that a row's sum over K inputs cannot overflow int32 (the caller's bound).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int16(const at::Tensor& x, const std::optional<at::Tensor>& signs,
                                                       int64_t max_code) {
  TORCH_CHECK(max_code >= 1 && max_code <= 32767, "quantize_rows_int16: max_code in [1, 32767]");
  return quantize_rows<int16_t>(x, signs, max_code, "quantize_rows_int16");
}

// y [M, N] float32 (sums already times each column's weight scale) -> y * row_scales [M, 1] + bias [N], in dtype;
// gated (the columns [gate; up] interleaved per 16): [M, N / 2], silu(gate) x up (int8_epilogue.h, as our kernels).
at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& row_scales, const std::optional<at::Tensor>& bias,
                      at::ScalarType dtype, bool gated) {
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous(),
              "scale_rows: y must be contiguous float32 [M, N]");
  const int64_t rows = y.size(0), n = y.size(1);
  const at::Tensor bias_f = tokenloom::checked_rows_and_bias("scale_rows", row_scales, rows, n, bias, dtype);
  const float* b = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(!gated || n % 32 == 0, "scale_rows: gated columns come in 16 gate, 16 up");
#else
  TORCH_CHECK(!gated, "scale_rows: gated needs AVX-512");
#endif
  const int64_t width = gated ? n / 2 : n;
  at::Tensor out = at::empty({rows, width}, y.options().dtype(dtype));
  const float* in = y.const_data_ptr<float>();
  const float* s = row_scales.const_data_ptr<float>();
  dispatch(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t r) {
      int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const __m512 scale = _mm512_set1_ps(s[r]);
      auto at = [&](int64_t c) {
        const __m512 add = b ? _mm512_loadu_ps(b + c) : _mm512_setzero_ps();
        return tokenloom::scale_sums(_mm512_loadu_ps(in + r * n + c), scale, add);
      };
      if (gated) {
        for (int64_t c = 0; c < n; c += 32) store16(o + r * width + c / 2, tokenloom::silu_times(at(c), at(c + 16)));
        return;
      }
      for (; i + 16 <= n; i += 16) store16(o + r * n + i, at(i));
#endif
      for (; i < n; ++i) store(o + r * n + i, in[r * n + i] * s[r] + (b ? b[i] : 0.0f));
    });
  });
  return out;
}

}  // namespace

namespace tokenloom {
// The quantize_rows_int8 operator, outside the anonymous namespace: int8_linear.cpp's int8_linear_rows calls it too
// (int8_packing.h declares it).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x, const std::optional<at::Tensor>& signs,
                                                      int64_t group, bool shifted) {
  return quantize_rows<int8_t>(x, signs, 127, "quantize_rows_int8", group, shifted);
}
}  // namespace tokenloom

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(c!) cache_k, Tensor(d!) cache_v, Tensor slots, int kv_kind=0, int block_size=0) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "dequantize_past(Tensor cache, Tensor block_table, int length, int head_dim, int kv_kind, int block_size, "
      "Tensor(a!) out) -> ()");
  m.def("quantize_rows_int8(Tensor x, Tensor? signs=None, int group=0, bool shifted=False) -> (Tensor, Tensor)");
  m.def("quantize_rows_int16(Tensor x, Tensor? signs, int max_code) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor row_scales, Tensor? bias, ScalarType dtype, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding_and_cache", &rotary_embedding_and_cache);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("dequantize_past", &dequantize_past);
  m.impl("quantize_rows_int8", &tokenloom::quantize_rows_int8);
  m.impl("quantize_rows_int16", &quantize_rows_int16);
  m.impl("scale_rows", &scale_rows);
}
