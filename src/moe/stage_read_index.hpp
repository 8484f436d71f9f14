// Load-time index of a CSF tensor's exception records for the decode kernel's
// stage-read path (src/cuda/moe/decode_kernel.cuh, BlockExceptions).
//
// Without it, every decode block reads its rows' record ranges (row_prefix),
// then the records, then sorts them into K-block buckets behind three
// barriers: the block timelines put that prologue at 57-69 % of the extra
// life of a stage-read block (docs/performance.md). The index does the sort
// once, at prepare_weights: per expert and decode row block (the 32 weight
// rows one decode block streams: 16 gate + 16 up rows of 16 outputs, or 32
// down rows), the records' patch entries (exception_entry) in K-block order
// with the first entry of each K block, at a place computed from (expert, row
// block) alone. A block reads it in the same round trip as its routing rows
// and finds the buckets the per-block sort would have built.
//
// Row-block layout (block_bytes, a multiple of 16): u16 entries[capacity],
// then u8 offsets[kblocks + 1] (offsets[kb] = first entry of K block kb,
// offsets[kblocks] = the count). A row block with more records than capacity
// has offsets[0] = kIndexOverflow and nothing else; its decode blocks sort
// per block as before.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"
#include "moe/decode_shape.hpp"

namespace csfmoe::moe_detail {

constexpr std::uint32_t kIndexMaxCapacity = 248;  // entries per row block (u8 offsets, a multiple of 8)
constexpr std::uint32_t kIndexMaxKBlocks = 256;   // K <= 32768
constexpr std::uint8_t kIndexOverflow = 0xFF;

CSFMOE_HD std::uint32_t index_block_bytes(std::uint32_t capacity, std::uint32_t kblocks) {
  return (2 * capacity + kblocks + 1 + 15) / 16 * 16;
}

// Patch entry of a record of block row br (0..31), column col_in_block of its
// K block (128 / group size columns), byte v: bits 0..2 the lane's g = br % 8,
// bits 3..4 its t (lane of the quad holding the column), bits 5..7 the
// byte's index p in the lane's gathered scale word(s) (LaneScales layout:
// chunk c = br / 8; NVFP4 p = 2c + col % 2, MXFP4 p = c), bits 8..15 the byte.
template <ScaleFormat F>
CSFMOE_HD std::uint32_t exception_entry(std::uint32_t br, std::uint32_t col_in_block, std::uint32_t v) {
  const std::uint32_t c = br / 8 % 4;
  const std::uint32_t lane_t = F == ScaleFormat::nvfp4 ? col_in_block / 2 : col_in_block;
  const std::uint32_t p = F == ScaleFormat::nvfp4 ? 2 * c + col_in_block % 2 : c;
  return br % 8 | lane_t << 3 | p << 5 | v << 8;
}

// The weight rows of a decode row block b: block row r < 16 is row
// first_half + stride * b + r, block row r >= 16 is second_half + stride * b
// + r - 16. Gate/up (w13): {gate_row0, up_row0, 16, N / 16}; down (w2): {0,
// 16, 32, H / 32}.
struct IndexRows {
  std::uint32_t first_half = 0, second_half = kDecodeHalfRows, stride = kDecodeRows, blocks_per_expert = 0;
  CSFMOE_HD std::uint32_t row(std::uint32_t b, std::uint32_t r) const {
    return (r < kDecodeHalfRows ? first_half : second_half) + stride * b + r % kDecodeHalfRows;
  }
};

// The index of one CSF tensor, as built on the host.
struct StageReadIndex {
  std::uint32_t capacity = 0;     // entries per row block, a multiple of 8
  std::uint32_t kblocks = 0;      // 128-wide K blocks of a row
  std::uint32_t block_bytes = 0;  // index_block_bytes(capacity, kblocks)
  std::uint32_t blocks_per_expert = 0;
  std::uint64_t overflow_blocks = 0;  // row blocks marked kIndexOverflow
  std::vector<std::uint8_t> bytes;    // experts * blocks_per_expert * block_bytes; empty: no index
};

// Builds the index of a tensor with geometry `g` (whose rows are those
// `rows` lays out) from its exception records and row prefix (CsfTensor
// layout). capacity = the largest row block's count rounded up to 8, at most
// capacity_limit; larger row blocks are marked overflowing. No index (empty
// bytes) where K is not a whole number of 128-wide blocks or has more than
// kIndexMaxKBlocks. Throws InvalidArgument when `rows` leaves the grid and
// FormatError when a record or the prefix does not fit the geometry.
StageReadIndex build_stage_read_index(const CsfGeometry& g, const IndexRows& rows,
                                      std::span<const std::uint32_t> exceptions,
                                      std::span<const std::uint32_t> row_prefix,
                                      std::uint32_t capacity_limit = kIndexMaxCapacity);

}  // namespace csfmoe::moe_detail
