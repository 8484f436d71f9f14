// The call plan (csfmoe/call_plan.hpp): scale mode, kernel, token pass and
// decode block shape of every call size of the model layers, against the rules
// as documented (call_plan.hpp, moe_cuda.hpp, docs/moe-api.md), restated here
// independently of src/moe/call_plan.cpp. Host arithmetic only.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "csfmoe/call_plan.hpp"
#include "csfmoe/errors.hpp"
#include "moe/call_plan.hpp"
#include "moe/decode_shape.hpp"

namespace csfmoe {
namespace {

constexpr std::uint32_t kH200Sms = 132;
constexpr std::uint32_t kMaxT = 16384;

MoeDeviceCaps h200() {
  MoeDeviceCaps c;
  c.sm_count = kH200Sms;
  c.smem_per_block_optin = 232448;
  c.cc_major = 9;
  c.cc_minor = 0;
  c.prefill_kernels = true;
  return c;
}

struct Model {
  const char* name;
  MoeLayerGeometry geometry;
  std::uint32_t prefill_from;  // documented default threshold: T * k >= 16 * E
};

const Model kModels[] = {
    {"DeepSeek-V3", {256, 7168, 2048, 8, GateUpOrder::w13}, 512},
    {"Kimi K2", {384, 7168, 2048, 8, GateUpOrder::w13}, 768},
    {"Qwen3-30B-A3B", {128, 2048, 768, 8, GateUpOrder::w13}, 256},
};

MoePlan plan_of(ScaleFormat f, const MoeLayerGeometry& g, ScaleCompression c) {
  MoeConstraints k;
  k.compression = c;
  k.max_tokens = kMaxT;
  return plan_weights(f, g, k);
}

// Routing tiles of a call (routing_tiles.hpp): ceil(T k / 64) plus one
// partial tile per expert that can be hit.
std::uint64_t tiles_of(std::uint32_t tokens, const MoeLayerGeometry& g) {
  const std::uint64_t slots = std::uint64_t(tokens) * g.topk;
  return (slots + 63) / 64 + std::min<std::uint64_t>(slots, g.experts);
}

// Documented decode shared memory: per warp a ring of 4 stages of 5 x 32
// uint4 (10240 B) or, if larger and no run, its partial sums (32 rows x 8 nt
// tokens x 4 B); plus 64 routing rows x 4 B, a CSF block's 4504 B of
// exception staging, and a run's own partial-sum region.
std::uint32_t expected_smem(std::uint32_t warps, std::uint32_t nt, bool csf, bool run) {
  const std::uint32_t ring = warps * 10240, partial = warps * 32 * 8 * nt * 4;
  const std::uint32_t first = run ? ring : std::max(ring, partial);
  return first + 256 + (csf ? 4504 : 0) + (run ? partial : 0);
}

// The documented warps rule: the largest of 1, 2, 4, 8 whose warps get
// kb_per_warp K blocks each (at least 1 warp); then double while the launch
// fills fewer than `waves` waves of 2 x 8 warps per SM and each warp keeps
// min_kb K blocks.
std::uint32_t expected_warps(std::uint32_t kblocks, std::uint64_t blocks, std::uint32_t kb_per_warp = 28,
                             std::uint32_t min_kb = 3, std::uint32_t waves = 2) {
  std::uint32_t w = 1;
  for (std::uint32_t c : {2u, 4u, 8u})
    if (c * kb_per_warp <= kblocks) w = c;
  while (w < 8 && blocks * w < std::uint64_t(kH200Sms) * 16 * waves && 2 * w * min_kb <= kblocks) w *= 2;
  return w;
}

struct Expected {
  MoeScaleMode mode;
  MoeKernel kernel;
  std::uint32_t pass;
};

// The documented mode, kernel and token-pass rules for default options on an
// H200 (both model shapes allow prefill and decode).
Expected expected_call(const Model& m, ScaleCompression c, bool scratch, std::uint32_t t) {
  const bool prefill_size = t >= m.prefill_from;
  MoeScaleMode mode;
  if (c == ScaleCompression::none)
    mode = MoeScaleMode::native;
  else if (scratch && prefill_size)
    mode = MoeScaleMode::routed;
  else
    mode = t <= 1536 ? MoeScaleMode::stage_read : MoeScaleMode::routed;
  MoeKernel kernel = prefill_size && mode != MoeScaleMode::stage_read ? MoeKernel::prefill
                     : t <= 8192                                      ? MoeKernel::decode
                                                                      : MoeKernel::tiled;
  std::uint32_t pass = 0;
  if (kernel == MoeKernel::decode)
    pass = t <= 32 || t * m.geometry.topk <= 4 * m.geometry.experts ? 8 : t <= 512 ? 16 : 32;
  return {mode, kernel, pass};
}

void check_decode_shape(const MoeDecodeShape& s, std::uint32_t k, std::uint64_t blocks, std::uint32_t nt,
                        bool csf) {
  const std::uint32_t kblocks = k / 128;
  EXPECT_EQ(s.warps, expected_warps(kblocks, blocks));
  // Pairs where every warp gets whole pairs, the same number each.
  EXPECT_EQ(s.copy_kblocks, kblocks % (2 * s.warps) == 0 ? 2u : 1u);
  // Runs of 2 only for dense scales, passes of 8, >= 4 K blocks per warp,
  // blocks of >= 4 warps and launches of >= 1.5 waves.
  const bool runs_possible = !csf && nt == 1 && kblocks >= 4 * s.warps;
  const bool run2 = runs_possible && s.warps >= 4 && 2 * blocks * s.warps >= 3ull * kH200Sms * 16;
  EXPECT_EQ(s.row_block_run, run2 ? 2u : 1u);
  EXPECT_EQ(s.smem_bytes, expected_smem(s.warps, nt, csf, s.row_block_run > 1));
  EXPECT_LE(s.smem_bytes, moe_detail::decode_smem_bytes(k));
}

TEST(CallPlan, ModelLayersEveryTokenCount) {
  const MoeDeviceCaps caps = h200();
  for (const Model& m : kModels)
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
      for (ScaleCompression c : {ScaleCompression::none, ScaleCompression::csf}) {
        const MoePlan plan = plan_of(f, m.geometry, c);
        for (bool scratch : {false, true}) {
          if (c == ScaleCompression::none && scratch) continue;
          for (std::uint32_t t = 1; t <= kMaxT; ++t) {
            SCOPED_TRACE(std::string(m.name) + " " + std::string(to_string(f)) + " " +
                         std::string(to_string(c)) + (scratch ? " scratch" : "") +
                         " T = " + std::to_string(t));
            const MoeCallPlan p = plan_call(plan, caps, t, false, scratch, MoeBindOptions{});
            const Expected e = expected_call(m, c, scratch, t);
            ASSERT_EQ(p.mode, e.mode);
            ASSERT_EQ(p.kernel, e.kernel);
            ASSERT_EQ(p.token_pass, e.pass);
            ASSERT_TRUE(p.programmatic_launch);
            if (p.kernel != MoeKernel::decode) continue;
            // Check the decode shapes on a sample of T (all small T, then sparser).
            if (t > 128 && t % 61 != 0) continue;
            const std::uint64_t tiles = tiles_of(t, m.geometry);
            const bool csf = p.mode == MoeScaleMode::stage_read;
            const std::uint32_t nt = p.token_pass / 8;
            {
              SCOPED_TRACE("gate/up");
              check_decode_shape(p.gate_up, m.geometry.hidden, tiles * (m.geometry.intermediate / 16), nt,
                                 csf);
            }
            {
              SCOPED_TRACE("down");
              check_decode_shape(p.down, m.geometry.intermediate, tiles * (m.geometry.hidden / 32), nt, csf);
            }
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
}

TEST(CallPlan, ScalesExpandedReadsTheScratch) {
  const Model& m = kModels[0];
  const MoePlan plan = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::csf);
  for (std::uint32_t t : {1u, 64u, 511u, 512u, 4096u, 16384u}) {
    const MoeCallPlan p = plan_call(plan, h200(), t, true, true, MoeBindOptions{});
    EXPECT_EQ(p.mode, MoeScaleMode::expanded);
    EXPECT_EQ(p.kernel, t >= 512 ? MoeKernel::prefill : MoeKernel::decode);
  }
}

// The launch shapes measured best on the H200 for the model layers (bench/
// RESULTS.md: "decode kernel v4" for the warps, "runs of row blocks, fixed
// rule" for the runs, "paired ring copies" for the copies); dense scales.
// The metadata query: a CSF call reads expanded scales exactly when it does
// not stage-read (T above stage_read_max_tokens, or a prefill call with a
// scratch), whatever the binding; native layers never do.
TEST(CallPlan, ReadsExpandedScalesFromMetadataAlone) {
  for (const Model& m : kModels) {
    SCOPED_TRACE(m.name);
    const MoePlan csf = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::csf);
    const MoePlan native = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::none);
    const std::uint32_t limit = csf.constraints.stage_read_max_tokens;
    for (std::uint32_t t : {1u, 8u, 64u, m.prefill_from - 1, m.prefill_from, limit, limit + 1, 8192u}) {
      SCOPED_TRACE(t);
      const bool prefill = t >= m.prefill_from;
      EXPECT_EQ(reads_expanded_scales(csf, h200(), t, /*has_scratch=*/true), t > limit || prefill);
      EXPECT_EQ(reads_expanded_scales(csf, h200(), t, /*has_scratch=*/false), t > limit);
      EXPECT_FALSE(reads_expanded_scales(native, h200(), t, true));
      MoeDeviceCaps no_prefill = h200();
      no_prefill.prefill_kernels = false;
      EXPECT_EQ(reads_expanded_scales(csf, no_prefill, t, true), t > limit);
    }
  }
}

TEST(CallPlan, ModelLayersGetTheMeasuredWarpsAndRuns) {
  struct Shape {
    std::uint32_t warps, run, copy;
  };
  struct Case {
    const Model* model;
    std::uint32_t tokens;
    Shape gate_up, down;
  };
  const Case cases[] = {
      {&kModels[0], 1, {4, 2, 2}, {4, 2, 2}},
      {&kModels[0], 8, {2, 1, 2}, {1, 1, 2}},
      {&kModels[0], 64, {2, 1, 2}, {1, 1, 2}},
      {&kModels[1], 1, {4, 2, 2}, {4, 2, 2}},
      {&kModels[1], 8, {2, 1, 2}, {1, 1, 2}},
      // K = 768 is 6 K blocks: 2 warps cannot take whole pairs evenly.
      {&kModels[2], 1, {4, 1, 2}, {2, 1, 1}},
      {&kModels[2], 8, {2, 1, 2}, {2, 1, 1}},
      {&kModels[2], 64, {1, 1, 2}, {1, 1, 2}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.model->name) + " T = " + std::to_string(c.tokens));
    const MoePlan dense = plan_of(ScaleFormat::nvfp4, c.model->geometry, ScaleCompression::none);
    const MoeCallPlan p = plan_call(dense, h200(), c.tokens, false, false, MoeBindOptions{});
    ASSERT_EQ(p.kernel, MoeKernel::decode);
    const auto expect = [](const MoeDecodeShape& got, const Shape& want, const char* gemm) {
      SCOPED_TRACE(gemm);
      EXPECT_EQ(got.warps, want.warps);
      EXPECT_EQ(got.row_block_run, want.run);
      EXPECT_EQ(got.copy_kblocks, want.copy);
    };
    expect(p.gate_up, c.gate_up, "gate/up");
    expect(p.down, c.down, "down");
    // CSF (stage-read) scales never run row blocks.
    const MoePlan csf = plan_of(ScaleFormat::nvfp4, c.model->geometry, ScaleCompression::csf);
    const MoeCallPlan q = plan_call(csf, h200(), c.tokens, false, false, MoeBindOptions{});
    ASSERT_EQ(q.mode, MoeScaleMode::stage_read);
    EXPECT_EQ(q.gate_up.warps, p.gate_up.warps);
    EXPECT_EQ(q.gate_up.row_block_run, 1u);
    EXPECT_EQ(q.down.row_block_run, 1u);
  }
  // Pairs need every warp to get the same number of whole pairs.
  EXPECT_EQ(moe_detail::decode_copy_kblocks(1, 3), 1u);
  EXPECT_EQ(moe_detail::decode_copy_kblocks(4, 12), 1u);
  EXPECT_EQ(moe_detail::decode_copy_kblocks(4, 16), 2u);
}

// The shared-memory bound bind configures: the widest block's largest token
// pass with CSF staging, or a run of row blocks (8-token passes, dense).
TEST(CallPlan, DecodeSharedMemoryBound) {
  for (std::uint32_t k = 128; k <= 32768; k += 128) {
    const std::uint32_t warps = std::min<std::uint32_t>(k / 128, 8);
    EXPECT_EQ(moe_detail::decode_smem_bytes(k),
              std::max(expected_smem(warps, 4, true, false), expected_smem(warps, 1, false, true)))
        << "K = " << k;
  }
}

TEST(CallPlan, ForcedModes) {
  const Model& m = kModels[0];
  const MoePlan csf = plan_of(ScaleFormat::mxfp4, m.geometry, ScaleCompression::csf);
  MoeBindOptions o;
  o.force_mode = MoeScaleMode::routed;
  MoeCallPlan p = plan_call(csf, h200(), 1, false, true, o);
  EXPECT_EQ(p.mode, MoeScaleMode::routed);
  EXPECT_EQ(p.kernel, MoeKernel::decode);
  EXPECT_EQ(p.token_pass, 8u);
  EXPECT_EQ(p.gate_up.row_block_run, 2u);  // dense scratch scales run row blocks at T = 1
  EXPECT_EQ(plan_call(csf, h200(), 512, false, true, o).kernel, MoeKernel::prefill);
  // Stage-read calls never run the prefill kernel.
  o.force_mode = MoeScaleMode::stage_read;
  p = plan_call(csf, h200(), 4096, false, true, o);
  EXPECT_EQ(p.mode, MoeScaleMode::stage_read);
  EXPECT_EQ(p.kernel, MoeKernel::decode);
  EXPECT_EQ(p.token_pass, 32u);
  o.force_mode = MoeScaleMode::expanded;
  EXPECT_EQ(plan_call(csf, h200(), 100, false, true, o).mode, MoeScaleMode::expanded);
  const MoePlan native = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::none);
  o.force_mode = MoeScaleMode::native;
  EXPECT_EQ(plan_call(native, h200(), 600, false, false, o).kernel, MoeKernel::prefill);
}

TEST(CallPlan, KernelOptionsAndDeviceLimits) {
  const Model& m = kModels[2];
  const MoePlan native = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::none);
  const MoePlan csf = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::csf);
  MoeBindOptions o;
  o.decode_max_tokens = 100;
  o.prefill_min_tokens = 0xFFFFFFFFu;
  EXPECT_EQ(plan_call(native, h200(), 100, false, false, o).kernel, MoeKernel::decode);
  EXPECT_EQ(plan_call(native, h200(), 101, false, false, o).kernel, MoeKernel::tiled);
  EXPECT_EQ(plan_call(native, h200(), 101, false, false, o).token_pass, 0u);
  o.decode_max_tokens = 0;
  EXPECT_EQ(plan_call(native, h200(), 1, false, false, o).kernel, MoeKernel::tiled);
  // The prefill threshold takes precedence over decode_max_tokens.
  o.prefill_min_tokens = 200;
  EXPECT_EQ(plan_call(native, h200(), 199, false, false, o).kernel, MoeKernel::tiled);
  EXPECT_EQ(plan_call(native, h200(), 200, false, false, o).kernel, MoeKernel::prefill);
  o = {};
  o.prefill_min_tokens = 1;
  EXPECT_EQ(plan_call(native, h200(), 1, false, false, o).kernel, MoeKernel::prefill);
  // ... and with a scratch, CSF calls from it on expand their routed experts.
  EXPECT_EQ(plan_call(csf, h200(), 1, false, true, o).mode, MoeScaleMode::routed);
  EXPECT_EQ(plan_call(csf, h200(), 1, false, false, o).mode, MoeScaleMode::stage_read);
  // A device without the prefill kernels: CSF calls keep reading stage-read.
  MoeDeviceCaps no_prefill = h200();
  no_prefill.prefill_kernels = false;
  MoeCallPlan p = plan_call(csf, no_prefill, 1000, false, true, MoeBindOptions{});
  EXPECT_EQ(p.mode, MoeScaleMode::stage_read);
  EXPECT_EQ(p.kernel, MoeKernel::decode);
  EXPECT_EQ(plan_call(csf, no_prefill, 1537, false, true, MoeBindOptions{}).mode, MoeScaleMode::routed);
  // Too little shared memory for the widest decode block: tiled.
  MoeDeviceCaps small = h200();
  small.smem_per_block_optin = std::max(moe_detail::decode_smem_bytes(m.geometry.hidden),
                                        moe_detail::decode_smem_bytes(m.geometry.intermediate)) -
                               1;
  EXPECT_EQ(plan_call(native, small, 1, false, false, MoeBindOptions{}).kernel, MoeKernel::tiled);
  small.smem_per_block_optin += 1;
  EXPECT_EQ(plan_call(native, small, 1, false, false, MoeBindOptions{}).kernel, MoeKernel::decode);
  // Programmatic launch needs sm_90 or newer and the option.
  MoeDeviceCaps ampere = h200();
  ampere.cc_major = 8;
  EXPECT_FALSE(plan_call(native, ampere, 1, false, false, MoeBindOptions{}).programmatic_launch);
  o = {};
  o.programmatic_launch = false;
  EXPECT_FALSE(plan_call(native, h200(), 1, false, false, o).programmatic_launch);
}

TEST(CallPlan, LayerShapesOutsideTheKernels) {
  // H = 320: not whole K blocks of 128, so always tiled (below the prefill threshold).
  const MoePlan odd = plan_of(ScaleFormat::nvfp4, {4, 320, 128, 2, GateUpOrder::w13}, ScaleCompression::none);
  EXPECT_EQ(plan_call(odd, h200(), 1, false, false, MoeBindOptions{}).kernel, MoeKernel::tiled);
  EXPECT_FALSE(moe_detail::decode_shape_ok(320, 128));
  // H = 384: decode, but never prefill (H % 256 != 0).
  const MoePlan narrow =
      plan_of(ScaleFormat::nvfp4, {4, 384, 128, 2, GateUpOrder::w13}, ScaleCompression::none);
  MoeBindOptions o;
  o.prefill_min_tokens = 1;
  EXPECT_EQ(plan_call(narrow, h200(), 64, false, false, o).kernel, MoeKernel::decode);
  EXPECT_FALSE(moe_detail::prefill_shape_ok(384, 128));
  EXPECT_TRUE(moe_detail::prefill_shape_ok(512, 128));
  EXPECT_FALSE(moe_detail::prefill_shape_ok(512, 192));
}

TEST(CallPlan, TuningOverrides) {
  const Model& qwen = kModels[2];
  const MoePlan native = plan_of(ScaleFormat::nvfp4, qwen.geometry, ScaleCompression::none);
  const MoePlan csf = plan_of(ScaleFormat::nvfp4, qwen.geometry, ScaleCompression::csf);
  // Forced warps: the largest power of two up to the request that K's blocks
  // can feed (gate/up K = 2048: 16 K blocks; down K = 768: 6).
  for (int w : {1, 2, 4, 8}) {
    MoeBindOptions o;
    o.tuning.warps = w;
    for (std::uint32_t t : {1u, 8u, 100u, 200u}) {
      const MoeCallPlan p = plan_call(native, h200(), t, false, false, o);
      EXPECT_EQ(p.gate_up.warps, std::uint32_t(w));
      EXPECT_EQ(p.down.warps, std::uint32_t(std::min(w, 4)));
      EXPECT_EQ(p.gate_up.smem_bytes,
                expected_smem(p.gate_up.warps, p.token_pass / 8, false, p.gate_up.row_block_run > 1));
    }
  }
  // Forced runs apply where runs are possible: dense scales, passes of 8, at
  // least 4 K blocks per warp.
  for (int run : {2, 3}) {
    MoeBindOptions o;
    o.tuning.row_block_run = run;
    o.tuning.warps = 2;
    MoeCallPlan p = plan_call(native, h200(), 1, false, false, o);
    EXPECT_EQ(p.gate_up.row_block_run, std::uint32_t(run));  // 16 K blocks, 2 warps
    EXPECT_EQ(p.down.row_block_run, 1u);                     // 6 K blocks, 2 warps: too few
    EXPECT_EQ(p.gate_up.smem_bytes, expected_smem(2, 1, false, true));
    EXPECT_EQ(plan_call(csf, h200(), 1, false, false, o).gate_up.row_block_run, 1u);
    EXPECT_EQ(plan_call(native, h200(), 200, false, false, o).gate_up.row_block_run, 1u);  // passes of 16
  }
  // Single-K-block copies everywhere.
  {
    MoeBindOptions o;
    o.tuning.copy_kblocks = 1;
    for (std::uint32_t t : {1u, 64u}) {
      const MoeCallPlan p = plan_call(native, h200(), t, false, false, o);
      EXPECT_EQ(p.gate_up.copy_kblocks, 1u);
      EXPECT_EQ(p.down.copy_kblocks, 1u);
    }
  }
  // The warps rule's fields.
  {
    const Model& ds3 = kModels[0];
    const MoePlan p3 = plan_of(ScaleFormat::nvfp4, ds3.geometry, ScaleCompression::none);
    MoeBindOptions o;
    o.tuning.kblocks_per_warp = 7;
    o.tuning.min_kblocks_per_warp = 7;
    o.tuning.waves = 1;
    for (std::uint32_t t : {1u, 8u, 64u}) {
      const MoeCallPlan p = plan_call(p3, h200(), t, false, false, o);
      const std::uint64_t tiles = tiles_of(t, ds3.geometry);
      EXPECT_EQ(p.gate_up.warps, expected_warps(56, tiles * 128, 7, 7, 1)) << "T = " << t;
      EXPECT_EQ(p.down.warps, expected_warps(16, tiles * 224, 7, 7, 1)) << "T = " << t;
    }
  }
}

// The chunked routing only where asked for and where a call has more than
// one chunk of 1024 slots; the default (not yet measured on a GPU) never.
TEST(CallPlan, ChunkedRoutingFromItsThreshold) {
  for (const Model& m : kModels) {
    SCOPED_TRACE(m.name);
    const MoePlan native = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::none);
    const std::uint32_t k = m.geometry.topk;
    // By default every call of more than one chunk of 1024 slots.
    for (const std::uint32_t t : {1u, 1024u / k})
      EXPECT_FALSE(plan_call(native, h200(), t, false, false, {}).routing_chunked) << t;
    for (const std::uint32_t t : {1024u / k + 1, 4096u, kMaxT})
      EXPECT_TRUE(plan_call(native, h200(), t, false, false, {}).routing_chunked) << t;
    MoeBindOptions o;
    o.routing_chunked_min_slots = 0xFFFFFFFFu;  // always one block
    for (const std::uint32_t t : {1u, 1024u / k + 1, 4096u, kMaxT})
      EXPECT_FALSE(plan_call(native, h200(), t, false, false, o).routing_chunked) << t;
    o.routing_chunked_min_slots = 1;
    // 1024 slots are one chunk: one block whatever the option says.
    EXPECT_FALSE(plan_call(native, h200(), 1024 / k, false, false, o).routing_chunked);
    EXPECT_TRUE(plan_call(native, h200(), 1024 / k + 1, false, false, o).routing_chunked);
    o.routing_chunked_min_slots = 4096 * k;
    EXPECT_FALSE(plan_call(native, h200(), 4095, false, false, o).routing_chunked);
    EXPECT_TRUE(plan_call(native, h200(), 4096, false, false, o).routing_chunked);
    EXPECT_TRUE(plan_call(native, h200(), kMaxT, false, false, o).routing_chunked);
  }
}

TEST(CallPlan, InvalidTuningIsRejectedNamingTheField) {
  const auto rejects = [](void (*set)(MoeDecodeTuning&), const char* field) {
    MoeDecodeTuning t;
    set(t);
    try {
      validate(t);
      ADD_FAILURE() << field << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
    MoeBindOptions o;
    o.tuning = t;
    const MoePlan plan = plan_of(ScaleFormat::nvfp4, kModels[2].geometry, ScaleCompression::none);
    EXPECT_THROW((void)plan_call(plan, h200(), 1, false, false, o), InvalidArgument) << field;
  };
  rejects([](MoeDecodeTuning& t) { t.warps = 0; }, "warps");
  rejects([](MoeDecodeTuning& t) { t.warps = 3; }, "warps");
  rejects([](MoeDecodeTuning& t) { t.warps = 16; }, "warps");
  rejects([](MoeDecodeTuning& t) { t.warps = -2; }, "warps");
  rejects([](MoeDecodeTuning& t) { t.row_block_run = 0; }, "row_block_run");
  rejects([](MoeDecodeTuning& t) { t.row_block_run = 65; }, "row_block_run");
  rejects([](MoeDecodeTuning& t) { t.copy_kblocks = 0; }, "copy_kblocks");
  rejects([](MoeDecodeTuning& t) { t.copy_kblocks = 2; }, "copy_kblocks");
  rejects([](MoeDecodeTuning& t) { t.kblocks_per_warp = 0; }, "kblocks_per_warp");
  rejects([](MoeDecodeTuning& t) { t.kblocks_per_warp = 1025; }, "kblocks_per_warp");
  rejects([](MoeDecodeTuning& t) { t.min_kblocks_per_warp = -7; }, "min_kblocks_per_warp");
  rejects([](MoeDecodeTuning& t) { t.waves = 0; }, "waves");
  // Every allowed value passes.
  MoeDecodeTuning ok;
  EXPECT_NO_THROW(validate(ok));
  ok.warps = 8;
  ok.row_block_run = 64;
  ok.copy_kblocks = 1;
  ok.kblocks_per_warp = 1024;
  ok.min_kblocks_per_warp = 1;
  ok.waves = 1;
  EXPECT_NO_THROW(validate(ok));
}

// The routed-expansion rule as documented (call_plan.hpp): every expert from
// 16 routed ids per expert, a presence mask from 64 ids, a dedupe scan below;
// restated here as a direct comparison on exact integers.
RoutedExpansion documented_expansion(std::uint64_t tokens, std::uint32_t k, std::uint32_t e) {
  const unsigned __int128 ids = static_cast<unsigned __int128>(tokens) * k;
  if (ids >= static_cast<unsigned __int128>(16) * e) return RoutedExpansion::all_experts;
  if (ids >= 64) return RoutedExpansion::presence_mask;
  return RoutedExpansion::dedupe_scan;
}

TEST(RoutedExpansion, EveryThresholdAndItsNeighbours) {
  for (std::uint32_t e : {1u, 2u, 3u, 4u, 5u, 7u, 8u, 16u, 64u, 128u, 256u, 384u, 1024u}) {
    for (std::uint32_t k : {1u, 2u, 3u, 4u, 6u, 8u, 16u, 64u}) {
      if (k > e) continue;
      SCOPED_TRACE("E=" + std::to_string(e) + " k=" + std::to_string(k));
      // T around both thresholds: ceil(threshold / k) - 2 .. + 2, and small T.
      std::vector<std::uint64_t> ts = {0, 1, 2, 3, 7, 8, 9};
      for (std::uint64_t ids : {std::uint64_t{64}, std::uint64_t{16} * e})
        for (int d = -2; d <= 2; ++d) {
          const std::int64_t t = std::int64_t((ids + k - 1) / k) + d;
          if (t >= 0) ts.push_back(std::uint64_t(t));
        }
      for (std::uint64_t t : ts) {
        SCOPED_TRACE("T=" + std::to_string(t));
        EXPECT_EQ(routed_expansion(t, k, e), documented_expansion(t, k, e));
      }
    }
  }
}

TEST(RoutedExpansion, ExactBoundaries) {
  // DeepSeek-V3 (E = 256, k = 8): 64 ids at T = 8, 16 E = 4096 ids at T = 512.
  EXPECT_EQ(routed_expansion(1, 8, 256), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(7, 8, 256), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(8, 8, 256), RoutedExpansion::presence_mask);
  EXPECT_EQ(routed_expansion(511, 8, 256), RoutedExpansion::presence_mask);
  EXPECT_EQ(routed_expansion(512, 8, 256), RoutedExpansion::all_experts);
  // T * k not a multiple of the threshold: 63 and 64 ids, 16 E - 1 and 16 E.
  EXPECT_EQ(routed_expansion(21, 3, 256), RoutedExpansion::dedupe_scan);    // 63
  EXPECT_EQ(routed_expansion(22, 3, 256), RoutedExpansion::presence_mask);  // 66
  EXPECT_EQ(routed_expansion(4095, 1, 256), RoutedExpansion::presence_mask);
  EXPECT_EQ(routed_expansion(4096, 1, 256), RoutedExpansion::all_experts);
  // Few experts: 16 E below 64 ids, so the mask is never chosen.
  EXPECT_EQ(routed_expansion(15, 1, 1), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(16, 1, 1), RoutedExpansion::all_experts);
  EXPECT_EQ(routed_expansion(1, 2, 2), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(16, 2, 2), RoutedExpansion::all_experts);
  for (std::uint64_t t = 0; t < 200; ++t)
    EXPECT_NE(routed_expansion(t, 1, 3), RoutedExpansion::presence_mask) << t;  // 16 E = 48 < 64
  // 16 E = 64: both thresholds meet.
  EXPECT_EQ(routed_expansion(63, 1, 4), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(64, 1, 4), RoutedExpansion::all_experts);
  EXPECT_EQ(routed_expansion(15, 4, 4), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(16, 4, 4), RoutedExpansion::all_experts);
  // The constants are the documented ones.
  EXPECT_EQ(kExpandAllIdsPerExpert, 16u);
  EXPECT_EQ(kExpandMaskMinIds, 64u);
}

TEST(RoutedExpansion, AdversarialInputs) {
  // No tokens: the scan (which expands nothing), on every layer size.
  EXPECT_EQ(routed_expansion(0, 1, 1), RoutedExpansion::dedupe_scan);
  EXPECT_EQ(routed_expansion(0, 64, 1024), RoutedExpansion::dedupe_scan);
  // One expert, k = 1.
  EXPECT_EQ(routed_expansion(1, 1, 1), RoutedExpansion::dedupe_scan);
  // T * k past 2^64 saturates (all experts) instead of wrapping to few ids.
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  EXPECT_EQ(routed_expansion(max, 64, 1024), RoutedExpansion::all_experts);
  EXPECT_EQ(routed_expansion(max / 2 + 1, 2, 1024), RoutedExpansion::all_experts);  // wraps to 0
  EXPECT_EQ(routed_expansion((max / 8) + 1, 8, 256), RoutedExpansion::all_experts);
  EXPECT_EQ(routed_expansion(std::uint64_t{1} << 32, 64, 0xFFFFFFFFu), RoutedExpansion::all_experts);
  // 16 E of the largest E does not overflow.
  EXPECT_EQ(routed_expansion(64, 1, 0xFFFFFFFFu), RoutedExpansion::presence_mask);
  // Impossible layers are errors.
  EXPECT_THROW((void)routed_expansion(1, 0, 8), InvalidArgument);
  EXPECT_THROW((void)routed_expansion(1, 1, 0), InvalidArgument);
  EXPECT_THROW((void)routed_expansion(0, 0, 0), InvalidArgument);
  EXPECT_THROW((void)routed_expansion(1, 9, 8), InvalidArgument);
  EXPECT_THROW((void)routed_expansion(1, 2, 1), InvalidArgument);
  try {
    (void)routed_expansion(1, 9, 8);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("k <= E"), std::string::npos) << e.what();
  }
}

TEST(RoutedExpansion, KernelThatRuns) {
  EXPECT_EQ(routed_expansion_kernel(RoutedExpansion::none), RoutedExpansion::none);
  // Until the GPU has measured expand-all in this role and a dedupe-scan
  // kernel exists, the routed (presence-mask) kernel runs for every strategy.
  EXPECT_EQ(routed_expansion_kernel(RoutedExpansion::all_experts), RoutedExpansion::presence_mask);
  EXPECT_EQ(routed_expansion_kernel(RoutedExpansion::presence_mask), RoutedExpansion::presence_mask);
  EXPECT_EQ(routed_expansion_kernel(RoutedExpansion::dedupe_scan), RoutedExpansion::presence_mask);
  EXPECT_STREQ(to_string(RoutedExpansion::none), "none");
  EXPECT_STREQ(to_string(RoutedExpansion::all_experts), "all_experts");
  EXPECT_STREQ(to_string(RoutedExpansion::presence_mask), "presence_mask");
  EXPECT_STREQ(to_string(RoutedExpansion::dedupe_scan), "dedupe_scan");
}

// The plan records the strategy of routed calls only, and for every call size
// of the model layers it is the rule's.
TEST(RoutedExpansion, RecordedInTheCallPlan) {
  for (const Model& m : kModels) {
    SCOPED_TRACE(m.name);
    const MoePlan csf = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::csf);
    const MoePlan native = plan_of(ScaleFormat::nvfp4, m.geometry, ScaleCompression::none);
    const std::uint32_t limit = csf.constraints.stage_read_max_tokens;
    for (std::uint32_t t :
         {0u, 1u, 7u, 8u, 9u, 63u, 64u, m.prefill_from - 1, m.prefill_from, limit, limit + 1, 4096u, kMaxT}) {
      SCOPED_TRACE(t);
      MoeBindOptions forced;
      forced.force_mode = MoeScaleMode::routed;
      const MoeCallPlan r = plan_call(csf, h200(), t, false, true, forced);
      const RoutedExpansion want =
          t == 0 ? RoutedExpansion::none : documented_expansion(t, m.geometry.topk, m.geometry.experts);
      EXPECT_EQ(r.expansion, want);
      EXPECT_EQ(r.expansion_kernel, routed_expansion_kernel(want));
      // Auto mode: routed above the stage-read bound (or for the prefill
      // kernel with a scratch), else nothing to expand.
      const MoeCallPlan a = plan_call(csf, h200(), t, false, true, MoeBindOptions{});
      EXPECT_EQ(a.expansion, a.mode == MoeScaleMode::routed ? want : RoutedExpansion::none);
      for (bool expanded : {false, true}) {
        const MoeCallPlan n = plan_call(native, h200(), t, expanded, false, MoeBindOptions{});
        EXPECT_EQ(n.expansion, RoutedExpansion::none);
        EXPECT_EQ(n.expansion_kernel, RoutedExpansion::none);
      }
      EXPECT_EQ(plan_call(csf, h200(), t, true, true, MoeBindOptions{}).expansion, RoutedExpansion::none);
      MoeBindOptions stage;
      stage.force_mode = MoeScaleMode::stage_read;
      EXPECT_EQ(plan_call(csf, h200(), t, false, true, stage).expansion, RoutedExpansion::none);
    }
  }
}

}  // namespace
}  // namespace csfmoe
