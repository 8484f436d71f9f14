// The grouped MoE kernel's host side (moe/grouped_shape.hpp, plan_call):
// token-tile choice, shared-memory layout, routing bounds on uniform and
// skewed draws, the persistent work list, the consumer fragment map and the
// producer's activation chunks, restated here from the kernel's contract
// (src/cuda/moe/grouped_kernel.cuh) and the PTX ISA's wgmma layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "csfmoe/call_plan.hpp"
#include "csfmoe/errors.hpp"
#include "cuda/moe/dequant.cuh"
#include "moe/call_plan.hpp"
#include "moe/grouped_shape.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using namespace moe_detail;

MoeDeviceCaps h200() {
  MoeDeviceCaps c;
  c.sm_count = 132;
  c.smem_per_block_optin = 232448;
  c.cc_major = 9;
  c.cc_minor = 0;
  c.prefill_kernels = true;
  c.grouped_kernels = true;
  return c;
}

MoePlan plan_of(ScaleCompression c, const MoeLayerGeometry& g) {
  MoeConstraints k;
  k.compression = c;
  k.max_tokens = 16384;
  return plan_weights(ScaleFormat::nvfp4, g, k);
}

const MoeLayerGeometry kDs3{256, 7168, 2048, 8, GateUpOrder::w13};
const MoeLayerGeometry kQwen3{128, 2048, 768, 8, GateUpOrder::w13};

// The measured table (H100, bench/RESULTS.md): the class the sweep found
// fastest at each measured point, and every R mapped to a class.
TEST(GroupedPlan, TokenTileFollowsTheMeasuredTable) {
  const MoeLayerGeometry kimi{384, 7168, 2048, 8, GateUpOrder::w13};
  struct Point {
    MoeLayerGeometry g;
    std::uint32_t tokens, tile;
  };
  for (const Point& p :
       {Point{kDs3, 256, 16}, Point{kDs3, 512, 24}, Point{kDs3, 1024, 48}, Point{kDs3, 2048, 80},
        Point{kDs3, 4096, 128}, Point{kDs3, 8192, 128}, Point{kimi, 256, 16}, Point{kimi, 512, 16},
        Point{kimi, 1024, 32}, Point{kimi, 2048, 64}, Point{kimi, 4096, 128}, Point{kimi, 8192, 96},
        Point{kQwen3, 128, 16}, Point{kQwen3, 256, 24}, Point{kQwen3, 512, 48}, Point{kQwen3, 1024, 80},
        Point{kQwen3, 8192, 128}}) {
    SCOPED_TRACE("E=" + std::to_string(p.g.experts) + " T=" + std::to_string(p.tokens));
    EXPECT_EQ(grouped_token_tile(p.tokens, p.g.topk, p.g.experts, 0), p.tile);
  }
  // Every mean is mapped to a class, and no class needs more than two tiles
  // for an expert of mean rows up to 256 (the largest class's two).
  for (std::uint64_t t = 1; t <= 65536; t = t * 5 / 4 + 1) {
    const std::uint64_t r = (t * 8 + 255) / 256;
    const std::uint32_t nt = grouped_token_tile(t, 8, 256, 0);
    SCOPED_TRACE("T=" + std::to_string(t));
    EXPECT_TRUE(grouped_token_tile_valid(nt));
    EXPECT_GE(2 * std::uint64_t(nt), std::min<std::uint64_t>(r, 2 * kGroupedMaxTile));
  }
  // Boundaries: R = 12 -> 16, 13 -> 24; R = 64 -> 80, 65 -> 128; R = 129 -> 96, 193 -> 128.
  EXPECT_EQ(grouped_token_tile(12 * 32, 8, 256, 0), 16u);
  EXPECT_EQ(grouped_token_tile(12 * 32 + 1, 8, 256, 0), 24u);
  EXPECT_EQ(grouped_token_tile(64 * 32, 8, 256, 0), 80u);
  EXPECT_EQ(grouped_token_tile(64 * 32 + 1, 8, 256, 0), 128u);
  EXPECT_EQ(grouped_token_tile(128 * 32 + 1, 8, 256, 0), 96u);
  EXPECT_EQ(grouped_token_tile(192 * 32 + 1, 8, 256, 0), 128u);
  EXPECT_EQ(grouped_token_tile(8192, 8, 256, 32), 32u);  // a requested class wins
  for (std::uint32_t bad : {1u, 8u, 40u, 136u, 256u}) EXPECT_FALSE(grouped_token_tile_valid(bad));
}

TEST(GroupedPlan, SharedMemoryFitsAndKeepsTheSwizzleAlignment) {
  for (const bool nvfp4 : {true, false})
    for (const bool ring : {true, false}) {
      // The per-thread path's stages hold no scale rows.
      const std::uint32_t row_bytes = ring ? grouped_scale_row_bytes(nvfp4) : 0;
      for (int nt : kGroupedTokenTiles) {
        const GroupedSmem s = grouped_path_smem(std::uint32_t(nt), nvfp4, ring);
        SCOPED_TRACE("tile " + std::to_string(nt) + (nvfp4 ? " nvfp4" : " mxfp4") + (ring ? " ring" : ""));
        EXPECT_LE(s.total, kGroupedSmemLimit);
        EXPECT_GE(s.stages, 4u);  // deep enough to keep HBM busy
        EXPECT_LE(s.stages, kGroupedMaxStages);
        EXPECT_EQ(s.stage_bytes % 1024, 0u);              // 128-byte swizzle atoms of every stage
        EXPECT_EQ(s.act_bytes, std::uint32_t(nt) * 256);  // two 64-K halves of nt rows of 128 bytes
        // Weights, activations, then one scale row per weight row of the stage.
        EXPECT_EQ(s.scale_offset, kGroupedWeightStageBytes + s.act_bytes);
        EXPECT_EQ(s.stage_bytes, s.scale_offset + kGroupedRows * row_bytes);
        EXPECT_EQ(s.scale_offset % 16, 0u);
        EXPECT_EQ(s.barriers, s.stages * s.stage_bytes);
        EXPECT_EQ(s.barriers % 8, 0u);
        EXPECT_EQ(s.tables, s.barriers + 16 * s.stages);
        EXPECT_GE(s.total, s.tables + 2 * std::uint32_t(nt) * 4 + 1023);  // the slack aligns the ring
        // One more stage would not fit.
        EXPECT_TRUE(s.stages == kGroupedMaxStages || s.total + s.stage_bytes + 16 > kGroupedSmemLimit);
      }
    }
  // One scale byte per 16 (NVFP4) / 32 (MXFP4) K of the 128-wide block.
  EXPECT_EQ(grouped_scale_row_bytes(true), kGroupedKBlock / 16);
  EXPECT_EQ(grouped_scale_row_bytes(false), kGroupedKBlock / 32);
}

// Tiles of one call as the routing kernel makes them: each expert's slots
// padded to whole tiles of nt rows.
std::vector<std::uint32_t> tiles_per_expert(const std::vector<std::uint32_t>& count, std::uint32_t nt) {
  std::vector<std::uint32_t> t(count.size());
  for (std::size_t e = 0; e < count.size(); ++e) t[e] = (count[e] + nt - 1) / nt;
  return t;
}

TEST(GroupedPlan, RoutedTilesBoundHoldsOnUniformAndSkewedDraws) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const MoeLayerGeometry& g : {kDs3, kQwen3}) {
    for (std::uint32_t t : {1u, 7u, 128u, 300u, 4096u}) {
      for (int skew = 0; skew < 3; ++skew) {
        std::vector<std::uint32_t> count(g.experts, 0);
        const std::uint64_t slots = std::uint64_t(t) * g.topk;
        for (std::uint64_t s = 0; s < slots; ++s) {
          std::uint32_t e = std::uint32_t(rng() % g.experts);
          if (skew == 1 && rng() % 4 != 0) e = 0;        // one hot expert
          if (skew == 2) e = std::uint32_t(s % g.topk);  // every token on experts 0..k-1
          count[e]++;
        }
        for (int nt : kGroupedTokenTiles) {
          const auto tiles = tiles_per_expert(count, std::uint32_t(nt));
          std::uint64_t total = 0, padding = 0;
          for (std::size_t e = 0; e < tiles.size(); ++e) {
            total += tiles[e];
            padding += std::uint64_t(tiles[e]) * nt - count[e];
            EXPECT_LT(std::uint64_t(tiles[e]) * nt - count[e], std::uint64_t(nt));
          }
          SCOPED_TRACE("T=" + std::to_string(t) + " skew=" + std::to_string(skew) +
                       " tile=" + std::to_string(nt));
          EXPECT_LE(total, routed_tiles(slots, g.experts, std::uint32_t(nt)));
          EXPECT_EQ(total * nt, slots + padding);
          // The workspace sizes its tables for the smallest and largest classes.
          EXPECT_LE(total, routed_tiles(slots, g.experts, kGroupedMinTile));
          EXPECT_LE(total * nt, routed_tiles(slots, g.experts, kGroupedMaxTile) * kGroupedMaxTile);
        }
      }
    }
  }
}

TEST(GroupedPlan, WorkListCoversEveryItemOnceBalancedInRasterGroups) {
  for (std::uint32_t tiles : {1u, 5u, 131u, 132u, 133u, 1000u}) {
    for (std::uint32_t row_blocks : {1u, 16u, 28u}) {
      for (std::uint32_t group : {1u, 3u, 8u, 0xFFFFFFFFu}) {
        SCOPED_TRACE("tiles " + std::to_string(tiles) + " row blocks " + std::to_string(row_blocks) +
                     " group " + std::to_string(group));
        const std::uint32_t items = tiles * row_blocks, grid = 132;
        std::vector<int> seen(items, 0);
        std::uint32_t most = 0, fewest = ~0u;
        for (std::uint32_t cta = 0; cta < grid; ++cta) {
          std::uint32_t mine = 0;
          for (std::uint32_t i = cta; i < items; i += grid, ++mine) {
            const GroupedItem w = grouped_item(i, tiles, row_blocks, group);
            ASSERT_LT(w.tile, tiles);
            ASSERT_LT(w.row_block, row_blocks);
            seen[w.row_block * tiles + w.tile]++;
          }
          most = std::max(most, mine);
          fewest = std::min(fewest, mine);
        }
        for (int s : seen) EXPECT_EQ(s, 1);
        EXPECT_LE(most - fewest, 1u);
        // Raster groups: an item's group of tiles is done, every row block, before the next
        // group starts; inside a group the tile is the fast index.
        const std::uint32_t width = std::min(group, tiles);
        for (std::uint32_t i = 0; i < items; ++i) {
          const GroupedItem w = grouped_item(i, tiles, row_blocks, group);
          const std::uint32_t first = w.tile / width * width;
          const std::uint32_t in_group = std::min(width, tiles - first);
          EXPECT_EQ(i, first * row_blocks + w.row_block * in_group + (w.tile - first));
        }
      }
    }
  }
}

// wgmma m64nNk16 A operand in registers (PTX ISA, "Register fragment
// layout for matrix A"): within warp wi of the warpgroup, lane group g holds
// rows 16 wi + g and 16 wi + g + 8 of the m64 tile. Each class's consumer
// warpgroups and their m64 tiles cover the item's 256 weight rows; the map
// must give every ring row to exactly one (thread, chunk), and gate/up must
// pair the gate and up rows of one output in the same thread.
TEST(GroupedPlan, FragmentMapCoversTheRingOnceAndPairsGateWithUp) {
  for (int nt : kGroupedTokenTiles) {
    const GroupedConsumers cons = grouped_consumers(nt);
    ASSERT_EQ(cons.m_tiles * cons.groups, 4) << nt;
    EXPECT_EQ(cons.threads, 128 * (1 + cons.groups)) << nt;
    // setmaxnreg moves registers within the pool the CTA holds from launch.
    EXPECT_LE(128 * cons.producer_regs + 128 * cons.groups * cons.consumer_regs,
              grouped_register_pool(cons.threads))
        << nt;
    EXPECT_EQ(cons.consumer_regs % 8, 0);
    EXPECT_EQ(cons.producer_regs % 8, 0);
    for (bool gate_up : {false, true}) {
      std::vector<int> owner(kGroupedRows * 4, 0);  // (ring row, lane % 4)
      for (int wg = 0; wg < cons.groups; ++wg)
        for (int wi = 0; wi < 4; ++wi)
          for (int g = 0; g < 8; ++g)
            for (int c = 0; c < 2 * cons.m_tiles; ++c) {
              const int q = wg * cons.m_tiles + c / 2, h = c % 2;
              const std::uint32_t row = grouped_ring_row(gate_up, q, wi, g, h);
              ASSERT_LT(row, kGroupedRows);
              for (int t = 0; t < 4; ++t) owner[row * 4 + t]++;
              const std::uint32_t out = grouped_out_in_item(gate_up, q, wi, g);
              if (gate_up) {
                EXPECT_LT(out, 128u);
                EXPECT_EQ(row, out + 128u * h);  // gate row, then the up row of the same output
              } else {
                // m64 tile q: rows 64 q + 16 wi + g (+ 8).
                EXPECT_EQ(row, std::uint32_t(64 * q + 16 * wi + g + 8 * h));
              }
            }
      for (int o : owner) EXPECT_EQ(o, 1) << nt;
    }
  }
}

TEST(GroupedPlan, ProducerChunksFillEachStageOnceInTheSwizzledLayout) {
  for (int nt : kGroupedTokenTiles) {
    std::vector<int> byte_owner(std::size_t(nt) * 256 / 16, 0);
    std::set<std::uint64_t> sources;
    for (int p = 0; p < 128; ++p)
      for (int a = 0; a < nt / 8; ++a) {
        const GroupedActChunk c = grouped_act_chunk(std::uint32_t(nt), p, a);
        ASSERT_LT(c.row, std::uint32_t(nt));
        ASSERT_LT(c.offset + 16, std::uint32_t(nt) * 256 + 1);
        EXPECT_EQ(c.offset % 16, 0u);
        byte_owner[c.offset / 16]++;
        // Chunk a is chunk 0 moved down 8a rows (what the kernel's loop assumes).
        EXPECT_EQ(c.offset, grouped_act_chunk(std::uint32_t(nt), p, 0).offset + 1024u * a);
        // 128-byte swizzle: 16-byte unit j of row n lands at unit j ^ (n % 8) of its 128-byte row.
        const std::uint32_t in_half = c.offset - c.half * std::uint32_t(nt) * 128;
        EXPECT_EQ(in_half / 128, c.row);
        EXPECT_EQ((in_half % 128) / 16, c.c8 ^ (c.row % 8));
        sources.insert(std::uint64_t(c.row) * 128 + c.half * 64 + c.c8 * 8);  // element of the row's K block
      }
    for (int o : byte_owner) EXPECT_EQ(o, 1);
    EXPECT_EQ(sources.size(), std::size_t(nt) * 16);
  }
}

TEST(GroupedPlan, ProducerRowTableHoldsEachThreadsRowsSideBySide) {
  for (int nt : kGroupedTokenTiles) {
    const auto n = std::uint32_t(nt);
    const int vec = grouped_row_table_vec(n);
    std::vector<int> owner(n, 0);
    for (std::uint32_t row = 0; row < n; ++row) {
      const std::uint32_t i = grouped_row_table_index(n, row);
      ASSERT_LT(i, n) << nt;
      owner[i]++;
    }
    for (int o : owner) EXPECT_EQ(o, 1) << nt;  // a bijection onto the table
    // Every producer thread finds its chunks' rows at one aligned block.
    for (int p = 0; p < 128; ++p) {
      const std::uint32_t base = grouped_row_table_index(n, grouped_act_chunk(n, p, 0).row);
      EXPECT_EQ(base % std::uint32_t(vec), 0u) << nt;
      for (int a = 0; a < nt / 8; ++a)
        EXPECT_EQ(grouped_row_table_index(n, grouped_act_chunk(n, p, a).row), base + std::uint32_t(a)) << nt;
    }
    EXPECT_EQ((n / 8) % std::uint32_t(vec), 0u) << nt;
    // The epilogue's slot batches divide its 8-token steps; the two-tile
    // consumers hold at most 4 slots beside their accumulators.
    const int batch = grouped_slot_batch(n);
    EXPECT_EQ((nt / 8) % batch, 0) << nt;
    if (grouped_consumers(nt).m_tiles == 2) EXPECT_LE(batch, 4) << nt;
    if (!grouped_batches_reads(n)) EXPECT_TRUE(vec == 1 && batch == 1) << nt;  // one read at a time
    // The table's two buffers start 16-byte aligned in shared memory.
    for (const bool nvfp4 : {true, false})
      EXPECT_EQ(grouped_smem(n, grouped_scale_row_bytes(nvfp4)).tables % 16, 0u) << nt;
    EXPECT_EQ((n * 4) % 16, 0u) << nt;
  }
}

// Ring row j of a stage holds weight row grouped_weight_row(j) (its weights
// from the TMA boxes, its scales from the producer's copies): the consumers'
// fragment rows must read the scales of the weight rows they multiply.
TEST(GroupedPlan, RingRowsAreTheWeightRowsOfTheTmaBoxesAndTheFragmentMap) {
  for (const bool gate_up : {true, false}) {
    for (const auto [g0, u0] : {std::pair{0u, 1024u}, std::pair{1024u, 0u}}) {  // w13 and w31 orders
      for (const std::uint32_t rb : {0u, 3u}) {
        SCOPED_TRACE(std::string(gate_up ? "gate/up" : "down") + " rb " + std::to_string(rb));
        std::set<std::uint32_t> rows;
        for (std::uint32_t j = 0; j < 256; ++j) {
          const std::uint32_t r = grouped_weight_row(gate_up, j, rb, g0, u0);
          rows.insert(r);
          // The kernel's two TMA boxes: 128 rows from y0 at ring row 0, from y1 at 128.
          const std::uint32_t y0 = gate_up ? g0 + rb * 128 : rb * 256,
                              y1 = gate_up ? u0 + rb * 128 : y0 + 128;
          EXPECT_EQ(r, (j < 128 ? y0 : y1) + j % 128) << j;
        }
        EXPECT_EQ(rows.size(), 256u);
        // Fragment rows: gate/up pairs gate row o (h = 0) with up row o (h = 1)
        // of output o = 128 rb + out_in_item; down reads rows 256 rb + out_in_item + 8h.
        for (int q = 0; q < 4; ++q)
          for (int wi = 0; wi < 4; ++wi)
            for (int g = 0; g < 8; ++g)
              for (int h = 0; h < 2; ++h) {
                const std::uint32_t o = grouped_out_in_item(gate_up, q, wi, g);
                const std::uint32_t want = gate_up ? (h == 0 ? g0 : u0) + rb * 128 + o : rb * 256 + o + 8 * h;
                EXPECT_EQ(grouped_weight_row(gate_up, grouped_ring_row(gate_up, q, wi, g, h), rb, g0, u0),
                          want);
              }
      }
    }
  }
}

std::uint8_t byte_of(std::uint32_t w, std::uint32_t b) { return std::uint8_t(w >> (8 * (b & 3u))); }
// __byte_perm(x, y, s) on the host: byte i of the result is byte (s >> 4i) & 7 of y:x.
std::uint32_t byte_perm(std::uint32_t x, std::uint32_t y, std::uint32_t s) {
  const std::uint64_t xy = std::uint64_t(y) << 32 | x;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= std::uint32_t((xy >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
}

// The scale path of the grouped kernel emulated on the host: the producer's
// copies of each ring row's words (from grouped_weight_row, the row and K
// block strides and, for the second row, grouped_scale_rows_apart), then each
// consumer lane's word at grouped_scale_lane_byte and the byte selectors of
// dense_scale_selectors. Every lane must get the bytes of its rows and
// columns from the dense grid, row-major and swizzled, NVFP4 and MXFP4.
TEST(GroupedPlan, RingScaleRowsGiveEachLaneItsGridBytes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const bool nvfp4 : {true, false}) {
    for (const bool swizzled : {false, true}) {
      for (const bool gate_up : {true, false}) {
        // One expert: gate/up 2N x H, down H x N (K = H or N), N = 256, H = 512.
        const std::uint32_t n = 256, h = 512, rows = gate_up ? 2 * n : h, k = gate_up ? h : n;
        const std::uint32_t cols = k / (nvfp4 ? 16 : 32), pcols = swizzled ? (cols + 3) / 4 * 4 : cols;
        const std::uint32_t g0 = gate_up ? n : 0, u0 = 0;  // the w31 order: up rows first
        std::vector<std::uint8_t> grid(std::size_t(rows) * pcols);
        for (auto& b : grid) b = std::uint8_t(rng());
        const auto index = [&](std::uint32_t r, std::uint32_t c) -> std::size_t {
          return swizzled ? swizzled_index(r, c, pcols) : std::size_t(r) * cols + c;
        };
        const std::uint32_t row_bytes = grouped_scale_row_bytes(nvfp4);
        const std::uint32_t stride = grouped_scale_kb_stride(nvfp4, swizzled);
        const std::int64_t apart =
            grouped_scale_rows_apart(swizzled, gate_up ? std::int64_t(u0) - g0 : 128, pcols);
        const std::uint32_t row_blocks = gate_up ? n / 128 : h / 256;
        SCOPED_TRACE(std::string(nvfp4 ? "nvfp4" : "mxfp4") + (swizzled ? " swizzled" : " row-major") +
                     (gate_up ? " gate/up" : " down"));
        for (std::uint32_t rb = 0; rb < row_blocks; ++rb) {
          for (std::uint32_t kb = 0; kb < k / kGroupedKBlock; ++kb) {
            std::vector<std::uint8_t> ring(256 * row_bytes);
            for (std::uint32_t tid = 0; tid < 128; ++tid) {
              const std::size_t first = index(grouped_weight_row(gate_up, tid, rb, g0, u0), 0) + kb * stride;
              for (int second = 0; second < 2; ++second) {
                const std::size_t src = std::size_t(std::int64_t(first) + (second ? apart : 0));
                std::uint8_t* dst = ring.data() + (tid + 128 * second) * row_bytes;
                // NVFP4 swizzled: two 4-byte words a tile apart; else one copy of row_bytes.
                const std::uint32_t words = nvfp4 && swizzled ? 2 : 1,
                                    bytes = nvfp4 && swizzled ? 4 : row_bytes;
                for (std::uint32_t w = 0; w < words; ++w) {
                  ASSERT_EQ(src % bytes, 0u);  // the copy's alignment
                  ASSERT_LE(src + w * 512 + bytes, grid.size());
                  std::copy_n(grid.data() + src + w * 512, bytes, dst + w * 4);
                }
              }
            }
            for (std::uint32_t t = 0; t < 4; ++t) {
              const std::uint32_t lane_byte = grouped_scale_lane_byte(nvfp4, t);
              for (std::uint32_t j0 = 0; j0 < 256; j0 += 4) {
                // A lane's four rows (here ring rows j0..j0 + 3) and their words.
                std::uint32_t w[4], pos[4], sel[2];
                for (int c = 0; c < 4; ++c) {
                  std::memcpy(&w[c], ring.data() + (j0 + c) * row_bytes + (lane_byte & ~3u), 4);
                  pos[c] = lane_byte & 3u;
                }
                if (nvfp4) {
                  moe_detail::decode_bits::dense_scale_selectors<true>(pos, sel);
                  for (int jj = 0; jj < 2; ++jj) {
                    const std::uint32_t u = byte_perm(w[2 * jj], w[2 * jj + 1], sel[jj]);
                    for (int b = 0; b < 4; ++b) {
                      const std::uint32_t r = grouped_weight_row(gate_up, j0 + 2 * jj + b / 2, rb, g0, u0);
                      const std::uint32_t c = 8 * kb + 2 * t + b % 2;
                      ASSERT_EQ(byte_of(u, b), grid[index(r, c)])
                          << "kb " << kb << " t " << t << " row " << r;
                    }
                  }
                } else {
                  moe_detail::decode_bits::dense_scale_selectors<false>(pos, sel);
                  const std::uint32_t u =
                      byte_perm(byte_perm(w[0], w[1], sel[0]), byte_perm(w[2], w[3], sel[1]), 0x5410);
                  for (int b = 0; b < 4; ++b) {
                    const std::uint32_t r = grouped_weight_row(gate_up, j0 + b, rb, g0, u0);
                    ASSERT_EQ(byte_of(u, b), grid[index(r, 4 * kb + t)])
                        << "kb " << kb << " t " << t << " row " << r;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// grouped_scale_rows_apart against the grids' own addressing, for row
// distances of whole 128-row tiles in both directions.
TEST(GroupedPlan, ScaleRowsApartMatchesBothGridLayouts) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 2000; ++i) {
    const std::uint32_t pcols = 4 * std::uint32_t(1 + rng() % 300), r = std::uint32_t(rng() % 4096);
    const std::int64_t d = 128 * (std::int64_t(rng() % 64) - 32);
    if (std::int64_t(r) + d < 0) continue;
    const std::uint32_t c = std::uint32_t(rng() % pcols), r2 = std::uint32_t(std::int64_t(r) + d);
    EXPECT_EQ(std::int64_t(swizzled_index(r2, c, pcols)) - std::int64_t(swizzled_index(r, c, pcols)),
              grouped_scale_rows_apart(true, d, pcols));
    EXPECT_EQ(std::int64_t(r2) * pcols - std::int64_t(r) * pcols, grouped_scale_rows_apart(false, d, pcols));
  }
}

TEST(GroupedPlan, CallPlanChoosesTheGroupedKernelFromFiveRowsPerExpert) {
  const MoePlan native = plan_of(ScaleCompression::none, kDs3), csf = plan_of(ScaleCompression::csf, kDs3);
  MoeBindOptions o;
  // The default threshold: T * k >= 5 * E (DeepSeek-V3: T >= 160; Qwen3-30B-A3B: T >= 80;
  // Kimi K2: T >= 240), ahead of the prefill kernel (T * k >= 16 * E).
  EXPECT_EQ(grouped_threshold(o, kDs3), 160u);
  EXPECT_EQ(grouped_threshold(o, kQwen3), 80u);
  EXPECT_EQ(grouped_threshold(o, {384, 7168, 2048, 8, GateUpOrder::w13}), 240u);
  EXPECT_EQ(grouped_threshold(o, {7, 512, 256, 3, GateUpOrder::w13}), 12u);  // ceil(35 / 3)
  EXPECT_EQ(plan_call(native, h200(), 159, false, false, o).kernel, MoeKernel::decode);
  for (std::uint32_t t : {160u, 256u, 512u, 600u, 8192u}) {
    const MoeCallPlan p = plan_call(native, h200(), t, false, false, o);
    EXPECT_EQ(p.kernel, MoeKernel::grouped);
    EXPECT_EQ(p.token_tile, grouped_token_tile(t, 8, 256, 0));
    EXPECT_EQ(p.tile_group, kGroupedDefaultTileGroup);
    EXPECT_TRUE(p.bf16_slots);
    EXPECT_EQ(p.token_pass, 0u);
  }
  o.grouped_min_tokens = 128;
  EXPECT_NE(plan_call(native, h200(), 127, false, false, o).kernel, MoeKernel::grouped);
  EXPECT_EQ(plan_call(native, h200(), 128, false, false, o).kernel, MoeKernel::grouped);
  // CSF: a grouped call with a scratch expands its routed experts; without
  // one it stays stage-read on the decode kernel.
  EXPECT_EQ(plan_call(csf, h200(), 128, false, true, o).mode, MoeScaleMode::routed);
  EXPECT_EQ(plan_call(csf, h200(), 128, false, true, o).kernel, MoeKernel::grouped);
  EXPECT_EQ(plan_call(csf, h200(), 128, false, false, o).mode, MoeScaleMode::stage_read);
  EXPECT_EQ(plan_call(csf, h200(), 128, false, false, o).kernel, MoeKernel::decode);
  // Devices and shapes without it; 0xFFFFFFFF turns it off.
  MoeDeviceCaps old = h200();
  old.grouped_kernels = false;
  EXPECT_EQ(plan_call(native, old, 4096, false, false, o).kernel, MoeKernel::prefill);
  const MoePlan odd = plan_of(ScaleCompression::none, {16, 384, 256, 4, GateUpOrder::w13});
  EXPECT_NE(plan_call(odd, h200(), 4096, false, false, o).kernel, MoeKernel::grouped);
  o.grouped_fp32_slots = true;
  EXPECT_FALSE(plan_call(native, h200(), 8192, false, false, o).bf16_slots);
  // Ring scales: by default for the 16- and 24-row tiles (DeepSeek-V3 T = 160..384
  // and 385..512), else per-thread loads; 0 and 1 force them; only the grouped kernel.
  for (const std::uint32_t t : {160u, 300u, 384u, 385u, 512u, 513u, 1024u, 8192u}) {
    const MoeCallPlan p = plan_call(native, h200(), t, false, false, o);
    EXPECT_EQ(p.ring_scales, p.token_tile == 16 || p.token_tile == 24) << t;
    EXPECT_EQ(p.ring_scales, t <= 512) << t;
  }
  o.grouped_ring_scales = 1;
  EXPECT_TRUE(plan_call(native, h200(), 8192, false, false, o).ring_scales);
  EXPECT_FALSE(plan_call(native, h200(), 1, false, false, o).ring_scales);  // decode
  EXPECT_FALSE(plan_call(native, old, 8192, false, false, o).ring_scales);  // prefill
  o.grouped_ring_scales = 0;
  EXPECT_FALSE(plan_call(native, h200(), 300, false, false, o).ring_scales);
  for (const int bad : {-2, 2}) {
    o.grouped_ring_scales = bad;
    EXPECT_THROW(validate(o), InvalidArgument) << bad;
    EXPECT_THROW(plan_call(native, h200(), 300, false, false, o), InvalidArgument) << bad;
  }
  o.grouped_ring_scales = -1;
  // Calls whose activation offsets would not fit the producer's 32 bits run the prefill kernel.
  EXPECT_TRUE(grouped_offsets_fit(16384, 8, 7168, 2048));
  EXPECT_FALSE(grouped_offsets_fit(600000, 8, 7168, 2048));  // 600000 * 7168 >= 2^32
  EXPECT_FALSE(grouped_offsets_fit(300000, 8, 2048, 2048));  // 300000 * 8 * 2048 >= 2^32
  {
    MoeConstraints big;
    big.max_tokens = 1u << 20;
    const MoePlan huge = plan_weights(ScaleFormat::nvfp4, kDs3, big);
    EXPECT_EQ(plan_call(huge, h200(), 262000, false, false, o).kernel,
              MoeKernel::grouped);  // 262000 * 8 * 2048 < 2^32
    EXPECT_EQ(plan_call(huge, h200(), 263000, false, false, o).kernel, MoeKernel::prefill);
  }
  o.grouped_min_tokens = 0xFFFFFFFFu;
  EXPECT_EQ(plan_call(native, h200(), 8192, false, false, o).kernel, MoeKernel::prefill);
  EXPECT_FALSE(plan_call(native, h200(), 8192, false, false, o).bf16_slots);  // FP32 off the grouped kernel
  o.grouped_fp32_slots = false;
  EXPECT_FALSE(plan_call(native, h200(), 8192, false, false, o).bf16_slots);
  o.grouped_min_tokens = 0;
  // A requested tile and raster group.
  o.grouped_token_tile = 64;
  o.grouped_tile_group = 3;
  EXPECT_EQ(plan_call(native, h200(), 300, false, false, o).token_tile, 64u);
  EXPECT_EQ(plan_call(native, h200(), 300, false, false, o).tile_group, 3u);
  o.grouped_token_tile = 40;
  try {
    (void)plan_call(native, h200(), 300, false, false, o);
    FAIL() << "tile 40 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("grouped_token_tile is 40: allowed 0 (auto), 16, 24, 32"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(validate(o), InvalidArgument);
  EXPECT_STREQ(to_string(MoeKernel::grouped), "grouped");
}

}  // namespace
}  // namespace csfmoe
