// Host builder of the stage-read exception index (stage_read_index.hpp).
#include "moe/stage_read_index.hpp"

#include <fmt/core.h>

#include <algorithm>

#include "csfmoe/errors.hpp"

namespace csfmoe::moe_detail {

StageReadIndex build_stage_read_index(const CsfGeometry& g, const IndexRows& rows,
                                      std::span<const std::uint32_t> exceptions,
                                      std::span<const std::uint32_t> row_prefix,
                                      std::uint32_t capacity_limit) {
  StageReadIndex idx;
  const GridShape& s = g.shape;
  const std::uint32_t cols_per_block = 128 / group_size(s.format);
  if (s.cols % cols_per_block != 0 || s.cols / cols_per_block > kIndexMaxKBlocks) return idx;
  if (capacity_limit > kIndexMaxCapacity)
    throw InvalidArgument(
        fmt::format("stage-read index: capacity limit {} above {}", capacity_limit, kIndexMaxCapacity));
  if (rows.blocks_per_expert != 0 && rows.row(rows.blocks_per_expert - 1, kDecodeRows - 1) >= s.rows)
    throw InvalidArgument(fmt::format("stage-read index: row block {} reaches row {} of a {}-row grid",
                                      rows.blocks_per_expert - 1,
                                      rows.row(rows.blocks_per_expert - 1, kDecodeRows - 1), s.rows));
  const std::uint64_t rows_total = g.total_rows();
  if (row_prefix.size() != rows_total + 1 || row_prefix.back() != exceptions.size())
    throw FormatError(fmt::format(
        "stage-read index: row_prefix has {} entries ending at {}, expected {} "
        "ending at {} records",
        row_prefix.size(), row_prefix.empty() ? 0 : row_prefix.back(), rows_total + 1, exceptions.size()));
  idx.kblocks = s.cols / cols_per_block;
  idx.blocks_per_expert = rows.blocks_per_expert;
  const std::uint64_t blocks = std::uint64_t(s.experts) * idx.blocks_per_expert;

  // Pass 1: each row block's (K block, entry) pairs, in record order.
  std::vector<std::vector<std::uint32_t>> kb_of(blocks), entry_of(blocks);
  std::uint32_t largest = 0;
  for (std::uint32_t e = 0; e < s.experts; ++e) {
    for (std::uint32_t b = 0; b < idx.blocks_per_expert; ++b) {
      const std::uint64_t at_block = std::uint64_t(e) * idx.blocks_per_expert + b;
      for (std::uint32_t br = 0; br < kDecodeRows; ++br) {
        const std::uint32_t row = rows.row(b, br);
        const std::uint64_t at = std::uint64_t(e) * g.padded_rows + row;
        const std::uint32_t begin = row_prefix[at], end = row_prefix[at + 1];
        if (begin > end || end > exceptions.size())
          throw FormatError(fmt::format("stage-read index: expert {} row {}: record range [{}, {}) invalid",
                                        e, row, begin, end));
        for (std::uint32_t i = begin; i < end; ++i) {
          const std::uint32_t pos = csf::record_position(exceptions[i]),
                              byte = csf::record_value_u32(exceptions[i]);
          if (csf::position_row(pos, g.padded_cols) != row)
            throw FormatError(fmt::format("stage-read index: expert {} record {} lies in row {}, not {}", e,
                                          i, csf::position_row(pos, g.padded_cols), row));
          const std::uint32_t col = csf::position_col(pos, g.padded_cols), kb = col / cols_per_block;
          if (kb >= idx.kblocks) continue;  // a padding column: never read
          const std::uint32_t cb = col % cols_per_block;
          kb_of[at_block].push_back(kb);
          entry_of[at_block].push_back(s.format == ScaleFormat::nvfp4
                                           ? exception_entry<ScaleFormat::nvfp4>(br, cb, byte)
                                           : exception_entry<ScaleFormat::mxfp4>(br, cb, byte));
        }
      }
      largest = std::max<std::uint32_t>(largest, std::uint32_t(kb_of[at_block].size()));
    }
  }
  idx.capacity = std::min((largest + 7) / 8 * 8, capacity_limit / 8 * 8);
  idx.block_bytes = index_block_bytes(idx.capacity, idx.kblocks);
  idx.bytes.assign(blocks * idx.block_bytes, 0);

  // Pass 2: lay the row blocks out (counting sort by K block, stable).
  std::vector<std::uint32_t> start(idx.kblocks + 1);
  for (std::uint64_t blk = 0; blk < blocks; ++blk) {
    std::uint8_t* out = idx.bytes.data() + blk * idx.block_bytes;
    std::uint8_t* offsets = out + 2 * idx.capacity;
    const std::vector<std::uint32_t>& kbs = kb_of[blk];
    if (kbs.size() > idx.capacity) {
      offsets[0] = kIndexOverflow;
      ++idx.overflow_blocks;
      continue;
    }
    std::fill(start.begin(), start.end(), 0u);
    for (std::uint32_t kb : kbs) ++start[kb + 1];
    for (std::uint32_t kb = 0; kb < idx.kblocks; ++kb) start[kb + 1] += start[kb];
    for (std::uint32_t kb = 0; kb <= idx.kblocks; ++kb) offsets[kb] = std::uint8_t(start[kb]);
    for (std::size_t i = 0; i < kbs.size(); ++i) {
      const std::uint32_t slot = start[kbs[i]]++, v = entry_of[blk][i];
      out[2 * slot] = std::uint8_t(v);  // little-endian u16
      out[2 * slot + 1] = std::uint8_t(v >> 8);
    }
  }
  return idx;
}

}  // namespace csfmoe::moe_detail
