// The two AVX-512 VNNI multiply-adds, acc += u x s by `vpdpbusd` (unsigned x signed bytes) and acc += a x b by
// `vpdpwssd` (signed words), written so that the accumulator keeps its own register. Through the intrinsics GCC (12)
// kept each accumulator of a tile in two registers and copied it in and out around every multiply (two moves a
// `vpdpbusd`, and spills in the larger tiles). The accumulators' arrays also need their loops unrolled before GCC's
// scalar replacement (`#pragma GCC unroll` on each), or they stay in memory, a load and a store per multiply.
#pragma once

#if defined(__AVX512VNNI__)
#include <immintrin.h>

namespace tokenloom {

[[gnu::always_inline]] inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
}

[[gnu::always_inline]] inline void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

}  // namespace tokenloom

#endif  // __AVX512VNNI__
