// Host-only resident-memory accounting (csfmoe/memory.hpp): the CSF figure is
// what the device parts occupy, computed independently from the part sizes.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/memory.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

// Bytes of every part, counted from the vectors themselves.
std::uint64_t part_bytes(const CsfTensor& t) {
  return t.fixed.size() + 4 * (t.exceptions.size() + t.row_prefix.size() + t.partition_index.size());
}

TEST(Memory, CsfResidentBytesCountEveryPart) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 12; ++i) {
    GridShape s;
    s.format = rng() % 2 ? ScaleFormat::nvfp4 : ScaleFormat::mxfp4;
    s.layout = ScaleLayout::row_major;
    s.experts = 1 + static_cast<std::uint32_t>(rng() % 4);
    s.rows = 1 + static_cast<std::uint32_t>(rng() % 400);
    s.cols = 1 + static_cast<std::uint32_t>(rng() % 300);
    const auto dist = i % 3 == 0 ? ScaleDistribution::uniform_random : ScaleDistribution::realistic;
    const CsfTensor t = encode(s, synthetic_scales(s, dist, rng()));
    EXPECT_EQ(csf_resident_bytes(t), part_bytes(t));
    const ResidentBytes rb = resident_bytes(t);
    EXPECT_EQ(rb.native, std::uint64_t{s.experts} * s.rows * s.cols);
    EXPECT_EQ(rb.csf, part_bytes(t));
    EXPECT_DOUBLE_EQ(rb.ratio(), double(rb.csf) / double(rb.native));
    EXPECT_EQ(rb.saved(), rb.native > rb.csf ? rb.native - rb.csf : 0);
  }
}

TEST(Memory, NativeTensorsAndLayerSums) {
  const GridShape w13 = w13_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4);
  const GridShape w2 = w2_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4);
  const ResidentBytes a = resident_bytes(w13), b = resident_bytes(w2);
  EXPECT_EQ(a.native, 256ull * 4096 * 448);
  EXPECT_EQ(a.csf, a.native);
  EXPECT_EQ(b.native, 256ull * 7168 * 128);
  const ResidentBytes layer = a + b;
  EXPECT_EQ(layer.native, a.native + b.native);
  EXPECT_DOUBLE_EQ(layer.ratio(), 1.0);
  EXPECT_EQ(layer.saved(), 0u);
  EXPECT_EQ(expand_scratch_bytes(w13, w2, ScaleLayout::row_major), a.native + b.native);
  // The swizzled layout pads columns to a multiple of 4 (a no-op here) and rows to 128.
  const GridShape m13 = w13_scale_shape(kDeepSeekV3, ScaleFormat::mxfp4);
  const GridShape m2 = w2_scale_shape(kDeepSeekV3, ScaleFormat::mxfp4);
  EXPECT_EQ(expand_scratch_bytes(m13, m2, ScaleLayout::swizzled_128x4),
            256ull * 4096 * round_up(224, 4) + 256ull * 7168 * round_up(64, 4));
  EXPECT_EQ(ResidentBytes{}.ratio(), 0.0);
}

TEST(Memory, RejectsInconsistentParts) {
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 128, 32};
  CsfTensor t = encode(s, std::vector<std::uint8_t>(2 * 128 * 32, 9));
  t.fixed.pop_back();
  EXPECT_THROW(csf_resident_bytes(t), FormatError);
  t = encode(s, std::vector<std::uint8_t>(2 * 128 * 32, 9));
  t.partition_index.push_back(0);
  EXPECT_THROW(resident_bytes(t), FormatError);
  EXPECT_THROW(resident_bytes(GridShape{ScaleFormat::nvfp4, ScaleLayout::row_major, 0, 1, 1}),
               InvalidArgument);
}

}  // namespace
}  // namespace csfmoe
