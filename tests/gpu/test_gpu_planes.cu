// CSF planes straight to the device (planes_to_device) and MoE layers
// prepared from planes or resident host parts (prepare_weights with
// MoeCsfPlanes / MoeCsfTensors): the resident
// parts built on the GPU equal the host transcode (planes_to_csf) part for
// part, on fresh random grids with records that win over their slot. The
// checks that need no device run everywhere; the rest skip without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/detail/plane_layout.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_cuda.hpp"
#include "test_gpu.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using testing::check;

// A grid of one expert: rows of a few neighbouring bytes with outliers, so
// every row has codes and some records.
std::vector<std::uint8_t> random_grid(std::mt19937_64& rng, ScaleFormat f, std::uint32_t rows,
                                      std::uint32_t cols) {
  std::vector<std::uint8_t> g(std::size_t{rows} * cols);
  const unsigned window = f == ScaleFormat::nvfp4 ? 16 : 2;
  for (std::uint32_t r = 0; r < rows; ++r) {
    const unsigned base = 1 + rng() % 200;
    const unsigned outliers = rng() % 4 == 0 ? 0 : 1 + rng() % 8;  // some rows have none
    for (std::uint32_t c = 0; c < cols; ++c) {
      const bool out = rng() % 100 < outliers;
      g[std::size_t{r} * cols + c] = static_cast<std::uint8_t>(out ? rng() % 256 : base + rng() % window);
    }
  }
  return g;
}

// Rewrites planes into a form b12x's and vLLM's readers take but csfmoe's
// encoder never writes: codes under some records made non-zero, and records
// added over slots whose byte lies in the row's window (they win, with the
// slot's own byte, so the grid is unchanged).
void make_records_win(std::mt19937_64& rng, CsfPlanes& p) {
  const csf::PlaneLayout L(p.shape.format, p.shape.rows, p.shape.cols);
  for (const std::uint32_t rec : p.exceptions) {
    if (rng() % 2) continue;
    const std::uint32_t pos = csf::record_position(rec), r = pos / L.cols, c = pos % L.cols;
    L.set_code(p.fixed.data() + L.codes_at(r), c, static_cast<std::uint8_t>(1 + rng() % (L.window - 1)));
  }
  std::vector<std::uint32_t> added;
  for (int i = 0; i < 6; ++i) {
    const std::uint32_t r = rng() % L.rows, c = rng() % L.cols, pos = r * L.cols + c;
    const bool taken = std::any_of(p.exceptions.begin(), p.exceptions.end(),
                                   [&](std::uint32_t x) { return csf::record_position(x) == pos; }) ||
                       std::any_of(added.begin(), added.end(),
                                   [&](std::uint32_t x) { return csf::record_position(x) == pos; });
    if (taken) continue;
    const std::uint8_t byte =
        static_cast<std::uint8_t>(p.fixed[L.base_at(r)] + L.code(p.fixed.data() + L.codes_at(r), c));
    added.push_back(csf::make_record(pos, byte));
  }
  p.exceptions.insert(p.exceptions.end(), added.begin(), added.end());
  std::sort(p.exceptions.begin(), p.exceptions.end(), [](std::uint32_t a, std::uint32_t b) {
    return csf::record_position(a) < csf::record_position(b);
  });
}

std::vector<CsfPlanes> random_planes(std::mt19937_64& rng, const PlaneShape& s, std::uint32_t experts,
                                     bool records_win) {
  std::vector<CsfPlanes> out;
  for (std::uint32_t e = 0; e < experts; ++e) {
    out.push_back(encode_planes(s, random_grid(rng, s.format, s.rows, s.cols)));
    if (records_win) make_records_win(rng, out.back());
  }
  return out;
}

void expect_same_parts(const CsfTensor& got, const CsfTensor& want) {
  EXPECT_EQ(got.geometry.shape, want.geometry.shape);
  EXPECT_TRUE(got.fixed == want.fixed) << "fixed part differs";
  EXPECT_TRUE(got.exceptions == want.exceptions) << "records differ";
  EXPECT_TRUE(got.row_prefix == want.row_prefix) << "row_prefix differs";
  EXPECT_TRUE(got.partition_index == want.partition_index) << "partition_index differs";
}

// `call` must throw E with `needle` in its message.
template <class E, class F>
void expect_error(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A top-2 layer; by default the small layer of the refusal tests: 3 experts,
// H 128, N 64, so w13 scales are [128, 8] and w2 scales [128, 4] per expert
// (NVFP4).
MoeLayerGeometry small_geometry(std::uint32_t experts = 3, std::uint32_t hidden = 128,
                                std::uint32_t intermediate = 64) {
  MoeLayerGeometry g;
  g.experts = experts;
  g.hidden = hidden;
  g.intermediate = intermediate;
  g.topk = 2;
  return g;
}

MoePlan small_plan(ScaleCompression compression) {
  MoeConstraints c;
  c.compression = compression;
  return plan_weights(ScaleFormat::nvfp4, small_geometry(), c);
}

// --------------------------------------------------------------- no device needed

TEST(PlanesToDevice, RefusesBadPlanesBeforeAnyDeviceWork) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const PlaneShape s{ScaleFormat::nvfp4, 32, 8};
  std::vector<CsfPlanes> planes = random_planes(rng, s, 3, false);
  EXPECT_THROW(planes_to_device({}, ScaleLayout::row_major, 0, nullptr, "w13"), InvalidArgument);
  {
    auto bad = planes;
    bad[2].shape.cols = 10;
    bad[2].fixed.resize(plane_fixed_bytes(bad[2].shape));
    expect_error<InvalidArgument>([&] { planes_to_device(bad, ScaleLayout::row_major, 0, nullptr, "w13"); },
                                  "expert 2");
  }
  {
    auto bad = planes;
    bad[1].fixed.pop_back();  // truncated fixed plane
    expect_error<FormatError>([&] { planes_to_device(bad, ScaleLayout::row_major, 0, nullptr, "w13"); },
                              "w13 expert 1");
  }
  {
    auto bad = planes;
    bad[0].exceptions.push_back(csf::make_record(s.rows * s.cols, 7));  // past the grid
    EXPECT_THROW(planes_to_device(bad, ScaleLayout::row_major, 0, nullptr, "w13"), FormatError);
  }
  {
    auto bad = planes;
    bad[0].fixed[0] = 250;  // a base above 240
    EXPECT_THROW(planes_to_device(bad, ScaleLayout::row_major, 0, nullptr, "w13"), FormatError);
  }
  // 32 rows cannot be swizzled_128x4.
  EXPECT_THROW(planes_to_device(planes, ScaleLayout::swizzled_128x4, 0, nullptr, "w13"), InvalidArgument);
  // A device that does not exist, after every host check passed.
  EXPECT_ANY_THROW(planes_to_device(planes, ScaleLayout::row_major, 1 << 20, nullptr, "w13"));
}

TEST(PrepareFromPlanes, RefusesMismatchedPlanesBeforeAnyDeviceWork) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoePlan plan = small_plan(ScaleCompression::csf);
  std::vector<CsfPlanes> w13 = random_planes(rng, {ScaleFormat::nvfp4, 128, 8}, 3, false);
  std::vector<CsfPlanes> w2 = random_planes(rng, {ScaleFormat::nvfp4, 128, 4}, 3, false);
  const MoeDeviceWeights d;  // pointers are checked later, on the device
  const auto refuses = [](const MoePlan& pl, const MoeDeviceWeights& dw, const MoeCsfPlanes& sc,
                          const char* needle) {
    expect_error<InvalidArgument>([&] { (void)prepare_weights(pl, dw, sc, nullptr, nullptr); }, needle);
  };
  refuses(plan, d, {std::span(w13).first(2), w2}, "w13 scale planes hold 2 experts");
  refuses(plan, d, {w2, w13}, "w13 scale planes of expert 0 hold grid");
  MoeDeviceWeights with_native = d;
  with_native.w13_scales = reinterpret_cast<const std::uint8_t*>(16);
  refuses(plan, with_native, {w13, w2}, "must be null");
  refuses(small_plan(ScaleCompression::none), d, {w13, w2}, "compression csf");
}

TEST(PrepareFromPlanes, RefusesMismatchedResidentTensorsBeforeAnyDeviceWork) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoePlan plan = small_plan(ScaleCompression::csf);
  const CsfTensor t13 = planes_to_csf(random_planes(rng, {ScaleFormat::nvfp4, 128, 8}, 3, false), "w13");
  const CsfTensor t2 = planes_to_csf(random_planes(rng, {ScaleFormat::nvfp4, 128, 4}, 3, false), "w2");
  const CsfTensor t2_short = planes_to_csf(random_planes(rng, {ScaleFormat::nvfp4, 128, 4}, 2, false), "w2");
  const MoeDeviceWeights d;
  const auto refuses = [](const MoePlan& pl, const MoeDeviceWeights& dw, const MoeCsfTensors& sc,
                          const char* needle) {
    expect_error<InvalidArgument>([&] { (void)prepare_weights(pl, dw, sc, nullptr, nullptr); }, needle);
  };
  refuses(plan, d, {&t13, nullptr}, "w2 CSF tensor is null");
  refuses(plan, d, {&t13, &t2_short}, "w2 CSF tensor has grid");
  refuses(plan, d, {&t2, &t13}, "w13 CSF tensor has grid");
  MoeDeviceWeights with_native = d;
  with_native.w2_scales = reinterpret_cast<const std::uint8_t*>(16);
  refuses(plan, with_native, {&t13, &t2}, "must be null");
  refuses(small_plan(ScaleCompression::none), d, {&t13, &t2}, "compression csf");
}

// --------------------------------------------------------------- on the device

TEST(PlanesToDevice, EqualsTheHostTranscodePartForPart) {
  REQUIRE_GPU();
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  struct Case {
    ScaleFormat f;
    std::uint32_t rows, cols, experts;
  };
  // Rows off the 128 (NVFP4) / 64 (MXFP4) padding, columns off the 4-column
  // granule, one expert and many.
  const Case cases[] = {{ScaleFormat::nvfp4, 16, 2, 1},   {ScaleFormat::nvfp4, 48, 6, 3},
                        {ScaleFormat::nvfp4, 256, 24, 4}, {ScaleFormat::nvfp4, 144, 448, 2},
                        {ScaleFormat::mxfp4, 16, 1, 2},   {ScaleFormat::mxfp4, 80, 13, 5},
                        {ScaleFormat::mxfp4, 128, 90, 3}, {ScaleFormat::mxfp4, 2880, 90, 2}};
  for (const Case& k : cases) {
    for (const bool win : {false, true}) {
      const PlaneShape s{k.f, k.rows, k.cols};
      SCOPED_TRACE(to_string(s) + " experts " + std::to_string(k.experts) + (win ? " records win" : ""));
      std::vector<CsfPlanes> planes = random_planes(rng, s, k.experts, win);
      if (k.experts > 2) planes[1].exceptions.clear();  // an expert without records
      const CsfTensor want = planes_to_csf(planes, "w13");
      const DeviceCsfTensor got = planes_to_device(planes, ScaleLayout::row_major, 0, stream, "w13");
      expect_same_parts(got.download(), want);
      EXPECT_EQ(got.resident_bytes(), csf_resident_bytes(want));
      // swizzled_128x4 where the grid allows it: the parts of the encoder
      // run on the swizzled native grid.
      if (k.rows % 128 == 0 && k.cols % 4 == 0) {
        std::vector<std::uint8_t> native;
        for (const CsfPlanes& p : planes) {
          const std::vector<std::uint8_t> one = decode_planes(p, "w13");
          native.insert(native.end(), one.begin(), one.end());
        }
        const GridShape rm{k.f, ScaleLayout::row_major, k.experts, k.rows, k.cols};
        GridShape sw = rm;
        sw.layout = ScaleLayout::swizzled_128x4;
        const CsfTensor enc = encode(sw, relayout_scales(rm, native, ScaleLayout::swizzled_128x4));
        const DeviceCsfTensor got_sw =
            planes_to_device(planes, ScaleLayout::swizzled_128x4, 0, stream, "w13");
        expect_same_parts(got_sw.download(), enc);
      }
    }
  }
  check(cudaStreamDestroy(stream), "stream destroy");
}

TEST(PrepareFromPlanes, LayerEqualsTheOnePreparedFromNativeScales) {
  REQUIRE_GPU();
  CSFMOE_SEEDED(seed);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (const ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    SCOPED_TRACE(to_string(f));
    const MoeLayerGeometry g = small_geometry(6, 256, 128);
    MoeConstraints c;
    c.compression = ScaleCompression::csf;
    const MoePlan plan = plan_weights(f, g, c);
    const MoeHostWeights hw = synthetic_moe_weights(f, g, seed);
    // Per expert planes of both scale grids, as a checkpoint stores them.
    const auto planes_of = [&](const std::vector<std::uint8_t>& scales, const GridShape& shape) {
      std::vector<CsfPlanes> out;
      const std::size_t per = std::size_t{shape.rows} * shape.cols;
      for (std::uint32_t e = 0; e < shape.experts; ++e)
        out.push_back(encode_planes({f, shape.rows, shape.cols}, std::span(scales).subspan(e * per, per)));
      return out;
    };
    const std::vector<CsfPlanes> p13 = planes_of(hw.w13_scales, plan.w13_scales),
                                 p2 = planes_of(hw.w2_scales, plan.w2_scales);
    std::vector<std::shared_ptr<void>> keep;
    const auto up = [&](const auto& v) {
      void* d = nullptr;
      check(cudaMalloc(&d, std::max<std::size_t>(v.size() * sizeof(v[0]), 16)), "cudaMalloc");
      check(cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice), "upload");
      keep.emplace_back(d, [](void* q) { (void)cudaFree(q); });
      return d;
    };
    MoeDeviceWeights dw;
    dw.w13 = static_cast<const std::uint8_t*>(up(hw.w13));
    dw.w2 = static_cast<const std::uint8_t*>(up(hw.w2));
    if (f == ScaleFormat::nvfp4) {
      dw.w13_global = static_cast<const float*>(up(hw.w13_global));
      dw.w2_global = static_cast<const float*>(up(hw.w2_global));
    }
    MoeDeviceWeights native = dw;
    native.w13_scales = static_cast<const std::uint8_t*>(up(hw.w13_scales));
    native.w2_scales = static_cast<const std::uint8_t*>(up(hw.w2_scales));
    const MoeWeights from_native = prepare_weights(plan, native, nullptr, stream);
    const MoeWeights from_planes = prepare_weights(plan, dw, MoeCsfPlanes{p13, p2}, nullptr, stream);
    const CsfTensor t13 = planes_to_csf(p13, "w13"), t2 = planes_to_csf(p2, "w2");
    const MoeWeights from_tensors = prepare_weights(plan, dw, MoeCsfTensors{&t13, &t2}, nullptr, stream);
    {  // malformed resident parts: refused, naming the projection
      CsfTensor broken = t2;
      broken.row_prefix.back() += 1;  // a record count the records do not have
      expect_error<FormatError>(
          [&] {
            (void)prepare_weights(plan, dw, MoeCsfTensors{&t13, &broken}, nullptr, stream);
          },
          "w2 scales");
    }
    for (const MoeWeights* w : {&from_planes, &from_tensors}) {
      expect_same_parts(w->w13_csf().download(), from_native.w13_csf().download());
      expect_same_parts(w->w2_csf().download(), from_native.w2_csf().download());
      EXPECT_EQ(w->resident_scale_bytes(), from_native.resident_scale_bytes());
      EXPECT_EQ(w->stage_read_index_bytes(), from_native.stage_read_index_bytes());
      EXPECT_EQ(w->source().w13_scales, nullptr);
    }
  }
  check(cudaStreamDestroy(stream), "stream destroy");
}

}  // namespace
}  // namespace csfmoe
