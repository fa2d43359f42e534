// What our AMX kernels share (amx_int8_linear.cpp, amx_bf16_linear.cpp; paged_attention.cpp the first two): the
// process's permission to use the tiles, one tile configuration, and the split of a step into units of work.
//
// Every kernel holds a 32 x 32 block of sums in tiles 0-3 (rows 0-15 and 16-31 by features 0-15 and 16-31), the
// block's two A tiles (16 rows of 64 bytes: 64 int8 or 32 bf16 inputs) in 4-5 and its two B tiles (the packed
// weight's 16 rows of 64 bytes) in 6-7. A unit is up to 4 row blocks (128 rows) by a run of 32-feature blocks, taken
// feature block by feature block, so a feature block's weight (from L1) serves every row block of the unit and the
// unit's rows (from L2) serve every feature block. The rows' tiles are loaded with the streaming hint: loaded
// normally they evicted the feature block's weight from L1 between row blocks (576 x 960 at 2,048 rows 1.4x slower).
// The runs of feature blocks are sized so their weight stays in L2 (kWeightInL2) and units go run by run, every row
// group through one run before the next: a wide weight (3.5 MB) was otherwise streamed from L3 by every row group.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "work_sharing.h"

// Built for a CPU with AMX's bf16 tiles, and for Linux, which grants them on request: where the bf16 attention
// kernels (prefill_attention.cpp, paged_attention.cpp) take them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TOKENLOOM_AMX_BF16 1
#endif

#if defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace tokenloom::amx {

constexpr int kTileRows = 16;                  // rows of an A tile and of a C tile
constexpr int kFeatures = 16;                  // output features per B and C tile
constexpr int kRows = 2 * kTileRows;           // rows of a block: two A tiles
constexpr int kBlockFeatures = 2 * kFeatures;  // features of a block: two B tiles
constexpr int64_t kTileBytes = 64 * 16;        // one packed B tile
constexpr int64_t kRowBlocksPerUnit = 4;
constexpr int64_t kWeightInL2 = 1 << 20;  // bytes of weight in one run of feature blocks, at most (or one block)

// Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of a whole configuration. GCC 12 models _tile_loadconfig as reading less than its 64 bytes, and once
// dropped a configuration's stores past the first 32 as dead (the tiles' shapes left unset: ldtilecfg faulted); the
// empty asm says every byte is read.
inline void load_config(const TileConfig& config) {
  asm volatile("" : : "m"(config));
  _tile_loadconfig(&config);
}

// All eight tiles 16 rows of 64 bytes. Loaded at the start of every unit: other code on this thread (oneDNN) may
// have configured the tiles its own way since.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTileRows;
  }
  load_config(config);
}

// Rows of the inputs as a unit sees them: `a` (row stride `stride` bytes) padded to whole 32-row blocks.
struct Rows {
  const uint8_t* a;
  int64_t stride;
  int64_t row;    // the output row of a's first
  int64_t count;  // valid rows, the rest padding
};

// Runs body(rows, first, last) for every unit of an M-row step (rows of `row_bytes` bytes at stride `stride` from
// `a`) over `feature_blocks` blocks of 32 features, on the caller and the helpers, with the tiles configured. At
// least 8 units where the step allows, so both cores (and the caller, who starts at once) have work even on a
// 32-row step. A short last row block is copied into zeroed rows, as tiles always read 32.
template <typename Body>
void for_units(const void* a, int64_t stride, int64_t row_bytes, int64_t m, int64_t feature_blocks, const Body& body) {
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t row_groups = (row_blocks + kRowBlocksPerUnit - 1) / kRowBlocksPerUnit;
  const int64_t fitting = std::max<int64_t>(1, kWeightInL2 / (row_bytes * kBlockFeatures));  // blocks whose weight fits
  const int64_t groups = std::min(feature_blocks, std::max({(8 + row_groups - 1) / row_groups,
                                                            (feature_blocks + fitting - 1) / fitting, int64_t{1}}));
  const int64_t per_group = (feature_blocks + groups - 1) / groups;
  const auto* base = static_cast<const uint8_t*>(a);
  const std::function<void(int64_t)> unit = [&](int64_t u) {
    const int64_t g = u / row_groups, row = (u % row_groups) * kRowBlocksPerUnit * kRows;
    const int64_t rows = std::min<int64_t>(kRowBlocksPerUnit * kRows, m - row);
    const int64_t first = g * per_group, last = std::min(feature_blocks, first + per_group);
    if (first >= last) return;
    configure_tiles();
    const int64_t whole = rows / kRows * kRows;
    if (whole > 0) body(Rows{base + row * stride, stride, row, whole}, first, last);
    if (whole < rows) {
      thread_local std::vector<uint8_t> padded;
      padded.assign(kRows * row_bytes, 0);
      for (int64_t r = 0; r < rows - whole; ++r) {
        std::memcpy(padded.data() + r * row_bytes, base + (row + whole + r) * stride, row_bytes);
      }
      body(Rows{padded.data(), row_bytes, row + whole, rows - whole}, first, last);
    }
    _tile_release();
  };
  tokenloom::WorkSharing::instance().run(row_groups * groups, unit);
}

// 4 C tiles -> sums [32][32] (float or int32).
template <typename S>
inline void store_block(S (&sums)[kRows][kBlockFeatures]) {
  constexpr int64_t stride = kBlockFeatures * sizeof(S);
  _tile_stored(0, &sums[0][0], stride);
  _tile_stored(1, &sums[0][kFeatures], stride);
  _tile_stored(2, &sums[kTileRows][0], stride);
  _tile_stored(3, &sums[kTileRows][kFeatures], stride);
}

inline void zero_block() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Tiles 0-3 = the 32 rows at a (row stride lda bytes) times the feature block whose two packed halves start at b0
// and b1, over k_tiles steps of 64 input bytes a row (64 int8 or 32 bf16 inputs; a packed tile is 1 KB); the
// kernel's Multiply::four() issues the step's four tile products (C0 = A0 B0, C1 = A0 B1, C2 = A1 B0, C3 = A1 B1).
template <typename Multiply>
inline void accumulate_block(const uint8_t* a, int64_t lda, const uint8_t* b0, const uint8_t* b1, int64_t k_tiles) {
  zero_block();
  for (int64_t t = 0; t < k_tiles; ++t) {
    _tile_stream_loadd(4, a + t * 64, lda);
    _tile_stream_loadd(5, a + kTileRows * lda + t * 64, lda);
    _tile_loadd(6, b0 + t * kTileBytes, 64);
    _tile_loadd(7, b1 + t * kTileBytes, 64);
    Multiply::four();
  }
}

}  // namespace tokenloom::amx

#endif  // __AMX_TILE__
