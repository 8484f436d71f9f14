// GPU CSF codec against the CPU codec (the bit-exact reference): encode on
// the device, expand all, expand routed, graph capture, stream ordering,
// device guard, upload/download. Every test skips when no CUDA device is
// present. CSFMOE_GPU_TEST_SMALL=1 shrinks sizes and trial counts (used under
// compute-sanitizer by scripts/gpu-check).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/memory.hpp"
#include "csfmoe/synthetic.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/strf.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using Bytes = std::vector<std::uint8_t>;

using cuda_detail::strf;

int gpu_count() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return c;
  }();
  return n;
}

bool small_mode() {
  const char* s = std::getenv("CSFMOE_GPU_TEST_SMALL");
  return s != nullptr && s[0] != '\0' && s[0] != '0';
}

class GpuCodec : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or returned 0)";
    CSFMOE_CUDA_CHECK(cudaSetDevice(0));
  }
};

// Owning device buffer.
class DevBuf {
 public:
  explicit DevBuf(std::size_t bytes, int device = 0) : bytes_(bytes), device_(device) {
    cuda_detail::DeviceGuard g(device);
    CSFMOE_CUDA_CHECK(cudaMalloc(&p_, std::max<std::size_t>(bytes, 1) + 16));
  }
  ~DevBuf() {
    cuda_detail::DeviceGuard g(device_);
    (void)cudaFree(p_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  std::uint8_t* get() const { return static_cast<std::uint8_t*>(p_); }
  std::size_t size() const { return bytes_; }
  void upload(const void* src, std::size_t n, std::size_t offset = 0) const {
    CSFMOE_CUDA_CHECK(cudaMemcpy(get() + offset, src, n, cudaMemcpyHostToDevice));
  }
  Bytes download(std::size_t n, std::size_t offset = 0) const {
    Bytes out(n);
    CSFMOE_CUDA_CHECK(cudaDeviceSynchronize());
    CSFMOE_CUDA_CHECK(cudaMemcpy(out.data(), get() + offset, n, cudaMemcpyDeviceToHost));
    return out;
  }
  void poison(std::uint8_t v) const { CSFMOE_CUDA_CHECK(cudaMemset(p_, v, bytes_ + 16)); }

 private:
  void* p_ = nullptr;
  std::size_t bytes_;
  int device_;
};

template <class T>
std::string mismatch(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  if (got.size() != want.size()) return strf("{}: {} entries, expected {}", what, got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return strf("{}: first difference at {}: got {:#x}, expected {:#x}", what, i,
                  static_cast<std::uint64_t>(got[i]), static_cast<std::uint64_t>(want[i]));
  return {};
}

// All parts equal, or the first difference.
std::string diff_tensors(const CsfTensor& got, const CsfTensor& want) {
  if (!(got.geometry.shape == want.geometry.shape)) return "geometry shapes differ";
  for (auto s :
       {mismatch(got.fixed, want.fixed, "fixed"), mismatch(got.exceptions, want.exceptions, "exceptions"),
        mismatch(got.row_prefix, want.row_prefix, "row_prefix"),
        mismatch(got.partition_index, want.partition_index, "partition_index")})
    if (!s.empty()) return s;
  return {};
}

std::string shape_name(const GridShape& s) {
  return strf("[{}, {}, {}] {} {}", s.experts, s.rows, s.cols, std::string(to_string(s.format)),
              std::string(to_string(s.layout)));
}

// The GPU encoder on `src` must equal the CPU encoder; returns the CPU tensor.
CsfTensor expect_gpu_encode_exact(const GridShape& shape, const Bytes& src) {
  SCOPED_TRACE(shape_name(shape));
  const CsfTensor want = encode(shape, src);
  DevBuf d(src.size());
  d.upload(src.data(), src.size());
  const DeviceCsfTensor t = encode_on_device(shape, d.get(), 0, nullptr);
  EXPECT_EQ(t.view().num_exceptions, want.exceptions.size());
  const CsfTensor got = t.download();
  EXPECT_EQ(diff_tensors(got, want), "");
  return want;
}

GridShape random_shape(std::mt19937_64& rng) {
  GridShape s;
  s.format = rng() % 2 ? ScaleFormat::nvfp4 : ScaleFormat::mxfp4;
  s.layout = rng() % 2 ? ScaleLayout::row_major : ScaleLayout::swizzled_128x4;
  s.experts = 1 + static_cast<std::uint32_t>(rng() % 3);
  const std::uint32_t max_cols = rng() % 4 == 0 ? 1300 : 260;
  if (s.layout == ScaleLayout::row_major) {
    s.rows = 1 + static_cast<std::uint32_t>(rng() % 300);
    s.cols = 1 + static_cast<std::uint32_t>(rng() % max_cols);
  } else {
    s.rows = 128 * (1 + static_cast<std::uint32_t>(rng() % 3));
    s.cols = 4 * (1 + static_cast<std::uint32_t>(rng() % (max_cols / 4)));
  }
  return s;
}

constexpr ScaleDistribution kDistributions[] = {ScaleDistribution::realistic, ScaleDistribution::dispersed,
                                                ScaleDistribution::uniform_random,
                                                ScaleDistribution::constant, ScaleDistribution::extremes};

// Expected bytes of expand_all / expand_routed, from the CPU decoder.
Bytes cpu_decode(const CsfTensor& t, ScaleLayout layout) {
  Bytes out(t.geometry.native_bytes(layout));
  decode(t, layout, out);
  return out;
}

// expand_all into scratch poisoned with `poison`, compared in full with the CPU.
void expect_expand_all_exact(const DeviceCsfTensor& t, const CsfTensor& host, ScaleLayout layout,
                             std::size_t misalign = 0) {
  SCOPED_TRACE(strf("expand_all to {} (dst offset {})", std::string(to_string(layout)), misalign));
  const Bytes want = cpu_decode(host, layout);
  DevBuf dst(want.size() + misalign);
  for (std::uint8_t poison : {std::uint8_t{0xA5}, std::uint8_t{0x5A}}) {  // two poisons: every byte written
    dst.poison(poison);
    expand_all(t.view(), layout, dst.get() + misalign, nullptr);
    CSFMOE_CUDA_CHECK(cudaGetLastError());
    const Bytes got = dst.download(want.size(), misalign);
    EXPECT_EQ(mismatch(got, want, "expanded grid"), "") << "poison " << int(poison);
    // Bytes past the tensor stay untouched.
    const Bytes tail = dst.download(16, misalign + want.size());
    EXPECT_EQ(std::count(tail.begin(), tail.end(), poison), 16);
  }
}

// ---------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------
TEST_F(GpuCodec, EncodeMatchesCpuOnRandomShapes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const int trials = small_mode() ? 6 : 40;
  for (int i = 0; i < trials; ++i) {
    const GridShape s = random_shape(rng);
    const ScaleDistribution dist = kDistributions[rng() % std::size(kDistributions)];
    SCOPED_TRACE(strf("trial {} distribution {}", i, static_cast<int>(dist)));
    const Bytes src = synthetic_scales(s, dist, rng());
    expect_gpu_encode_exact(s, src);
  }
}

TEST_F(GpuCodec, EncodeMatchesCpuOnAdversarialGrids) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  // Staged (narrow) and unstaged (wide) NVFP4 slabs, short MXFP4 rows.
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> dims = {
      {256, 448}, {128, 1000}, {192, 64}, {70, 3}};
  for (const auto& [rows, cols] : dims)
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
      for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
        GridShape s{f, l, 2, rows, cols};
        if (l == ScaleLayout::swizzled_128x4) {
          s.rows = static_cast<std::uint32_t>(round_up(rows, 128));
          s.cols = static_cast<std::uint32_t>(round_up(cols, 4));
        }
        const std::size_t n = CsfGeometry::of(s).native_bytes(l);
        const std::uint8_t c = static_cast<std::uint8_t>(rng());
        std::vector<std::pair<std::string, Bytes>> grids;
        grids.emplace_back("all 0x00", Bytes(n, 0x00));
        grids.emplace_back("all 0xFF", Bytes(n, 0xFF));
        grids.emplace_back(strf("constant {:#x}", c), Bytes(n, c));
        Bytes alt(n), nan(n), uni(n);
        const std::uint8_t nans[] = {0x7F, 0xFF, 0x80, 0x00, 0xFE, 0x7E};
        for (std::size_t i = 0; i < n; ++i) {
          alt[i] = (i % 2) ? 0xFF : 0x00;
          nan[i] = nans[rng() % std::size(nans)];
          uni[i] = static_cast<std::uint8_t>(rng());
        }
        grids.emplace_back("alternating 0x00/0xFF", alt);
        grids.emplace_back("NaN patterns", nan);
        grids.emplace_back("uniform random (mostly exceptions)", uni);
        grids.emplace_back("extremes", synthetic_scales(s, ScaleDistribution::extremes, rng()));
        for (const auto& [name, g] : grids) {
          SCOPED_TRACE(name);
          const CsfTensor host = expect_gpu_encode_exact(s, g);
          // The device-encoded tensor also expands back to the source.
          DevBuf d(g.size());
          d.upload(g.data(), g.size());
          const DeviceCsfTensor t = encode_on_device(s, d.get(), 0, nullptr);
          DevBuf out(g.size());
          out.poison(0xA5);
          expand_all(t.view(), l, out.get(), nullptr);
          EXPECT_EQ(mismatch(out.download(g.size()), g, "round trip"), "");
          (void)host;
        }
      }
}

GridShape reduced(GridShape s, std::uint32_t experts) {
  s.experts = experts;
  return s;
}

// Real layer geometries; experts reduced to 2 (1 in small mode) for memory and time.
TEST_F(GpuCodec, RealGeometriesEncodeAndExpandExactly) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::vector<MoeGeometry> models = {kDeepSeekV3, kKimiK2, kQwen3_235B_A22B};
  if (small_mode()) models.resize(1);
  const std::uint32_t experts = small_mode() ? 1 : 2;
  for (const MoeGeometry& m : models)
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
      for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4})
        for (const GridShape& s0 : {w13_scale_shape(m, f, l), w2_scale_shape(m, f, l)}) {
          const GridShape s = reduced(s0, experts);
          SCOPED_TRACE(std::string(m.name));
          const Bytes src = synthetic_scales(s, ScaleDistribution::realistic, rng());
          const CsfTensor host = expect_gpu_encode_exact(s, src);
          const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
          for (ScaleLayout out : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4})
            expect_expand_all_exact(t, host, out);
        }
}

TEST_F(GpuCodec, EncodeRejectsBadArguments) {
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 128, 16};
  Bytes host(128 * 16, 1);
  EXPECT_THROW(encode_on_device(s, nullptr, 0, nullptr), InvalidArgument);
  EXPECT_THROW(encode_on_device(s, host.data(), 0, nullptr), InvalidArgument);  // host memory
  DevBuf d(host.size());
  EXPECT_THROW(encode_on_device(s, d.get(), gpu_count(), nullptr), InvalidArgument);
  const GridShape bad{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 100,
                      16};  // swizzle needs rows % 128
  EXPECT_THROW(encode_on_device(bad, d.get(), 0, nullptr), InvalidArgument);
}

// ---------------------------------------------------------------------------
// Expand all
// ---------------------------------------------------------------------------
TEST_F(GpuCodec, ExpandAllMatchesCpuDecodeOnRandomShapes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const int trials = small_mode() ? 4 : 30;
  for (int i = 0; i < trials; ++i) {
    const GridShape s = random_shape(rng);
    const ScaleDistribution dist = kDistributions[rng() % std::size(kDistributions)];
    SCOPED_TRACE(strf("trial {} {} distribution {}", i, shape_name(s), static_cast<int>(dist)));
    const CsfTensor host = encode(s, synthetic_scales(s, dist, rng()));
    const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
    for (ScaleLayout out : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4})
      expect_expand_all_exact(t, host, out, i % 3 == 0 ? 1 + rng() % 15 : 0);  // some unaligned destinations
  }
}

TEST_F(GpuCodec, ExpandRejectsBadArguments) {
  const GridShape s{ScaleFormat::mxfp4, ScaleLayout::row_major, 2, 64, 40};
  const CsfTensor host = encode(s, Bytes(2 * 64 * 40, 0x7F));
  const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
  DevBuf dst(host.source_bytes());
  EXPECT_THROW(expand_all(t.view(), ScaleLayout::row_major, nullptr, nullptr), InvalidArgument);
  EXPECT_THROW(expand_all(t.view(), static_cast<ScaleLayout>(7), dst.get(), nullptr), InvalidArgument);
  EXPECT_THROW(expand_all(DeviceCsfTensor{}.view(), ScaleLayout::row_major, dst.get(), nullptr),
               InvalidArgument);
  CsfDeviceView broken = t.view();
  broken.geometry.padded_rows += 64;
  EXPECT_THROW(expand_all(broken, ScaleLayout::row_major, dst.get(), nullptr), InvalidArgument);
  DevBuf ids(16);
  EXPECT_THROW(
      expand_routed(t.view(), ScaleLayout::row_major, nullptr, IndexType::int32, 4, dst.get(), nullptr),
      InvalidArgument);
  EXPECT_THROW(
      expand_routed(t.view(), ScaleLayout::row_major, ids.get() + 4, IndexType::int64, 1, dst.get(), nullptr),
      InvalidArgument);  // int64 ids must be 8-byte aligned
}

// ---------------------------------------------------------------------------
// Expand routed
// ---------------------------------------------------------------------------
// T tokens x k distinct experts each, plus (optionally) ids that must be skipped.
std::vector<std::int64_t> random_routing(std::mt19937_64& rng, std::uint32_t experts, std::uint32_t tokens,
                                         std::uint32_t k, bool junk) {
  std::vector<std::int64_t> ids;
  std::vector<std::int64_t> all(experts);
  for (std::uint32_t e = 0; e < experts; ++e) all[e] = e;
  for (std::uint32_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (std::uint32_t j = 0; j < std::min(k, experts); ++j) ids.push_back(all[j]);
  }
  if (junk) {
    ids.push_back(-1);
    ids.push_back(experts);
    ids.push_back(experts + 1000);
    ids.push_back(std::numeric_limits<std::int64_t>::min());
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  return ids;
}

// Expected scratch after a routed expansion into a 0xA5-poisoned buffer.
Bytes routed_expected(const CsfTensor& host, const std::vector<std::int64_t>& ids, ScaleLayout layout) {
  Bytes want(host.geometry.native_bytes(layout), 0xA5);
  std::vector<std::uint32_t> used;
  for (std::int64_t id : ids)
    if (id >= 0 && id < std::int64_t{host.geometry.shape.experts})
      used.push_back(static_cast<std::uint32_t>(id));
  decode_experts(host, used, layout, want);
  return want;
}

struct IdsBuffer {
  DevBuf buf;
  IndexType type;
  std::size_t count = 0;
  IdsBuffer(std::size_t max_count, IndexType t) : buf(max_count * 8), type(t) {}
  void write(const std::vector<std::int64_t>& ids, cudaStream_t stream = nullptr) {
    count = ids.size();
    if (type == IndexType::int64) {
      CSFMOE_CUDA_CHECK(
          cudaMemcpyAsync(buf.get(), ids.data(), ids.size() * 8, cudaMemcpyHostToDevice, stream));
    } else {
      std::vector<std::int32_t> v(ids.size());
      for (std::size_t i = 0; i < ids.size(); ++i)
        v[i] = ids[i] > INT32_MAX || ids[i] < INT32_MIN ? -7 : static_cast<std::int32_t>(ids[i]);
      CSFMOE_CUDA_CHECK(cudaMemcpyAsync(buf.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice, stream));
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // v goes out of scope
    }
  }
};

TEST_F(GpuCodec, ExpandRoutedWritesExactlyTheRoutedExperts) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const int trials = small_mode() ? 3 : 16;
  for (int i = 0; i < trials; ++i) {
    GridShape s = random_shape(rng);
    s.experts = 2 + static_cast<std::uint32_t>(rng() % 40);
    if (i == 0) s.experts = 300;  // several bitmap words
    const CsfTensor host = encode(s, synthetic_scales(s, ScaleDistribution::realistic, rng()));
    const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
    const IndexType type = i % 2 ? IndexType::int64 : IndexType::int32;
    const std::uint32_t tokens = 1 + static_cast<std::uint32_t>(rng() % 6);
    const auto ids =
        random_routing(rng, s.experts, tokens, 1 + static_cast<std::uint32_t>(rng() % 8), i % 3 == 0);
    SCOPED_TRACE(strf("trial {} {} ids {} ({})", i, shape_name(s), ids.size(),
                      type == IndexType::int64 ? "int64" : "int32"));
    IdsBuffer d_ids(ids.size(), type);
    d_ids.write(ids);
    for (ScaleLayout out : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      const Bytes want = routed_expected(host, ids, out);
      DevBuf dst(want.size());
      dst.poison(0xA5);
      expand_routed(t.view(), out, d_ids.buf.get(), type, ids.size(), dst.get(), nullptr);
      EXPECT_EQ(mismatch(dst.download(want.size()), want, "routed scratch"), "") << to_string(out);
    }
  }
}

TEST_F(GpuCodec, ExpandRoutedWithNoIdsWritesNothing) {
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 4, 128, 32};
  const CsfTensor host = encode(s, synthetic_scales(s, ScaleDistribution::realistic, 5));
  const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
  DevBuf dst(host.source_bytes());
  dst.poison(0xA5);
  IdsBuffer ids(4, IndexType::int32);
  ids.write({-1, 4, 99, -100});  // only out-of-range ids
  expand_routed(t.view(), ScaleLayout::row_major, ids.buf.get(), IndexType::int32, 4, dst.get(), nullptr);
  expand_routed(t.view(), ScaleLayout::row_major, nullptr, IndexType::int32, 0, dst.get(), nullptr);
  const Bytes got = dst.download(host.source_bytes());
  EXPECT_EQ(std::count(got.begin(), got.end(), 0xA5), static_cast<long>(got.size()));
}

TEST_F(GpuCodec, ExpandRoutedReplaysFromACudaGraph) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 16, 256, small_mode() ? 64u : 448u};
  const CsfTensor host = encode(s, synthetic_scales(s, ScaleDistribution::realistic, rng()));
  const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
  const std::uint32_t tokens = 3, k = 4;
  for (IndexType type : {IndexType::int32, IndexType::int64}) {
    IdsBuffer ids(tokens * k, type);
    ids.write(random_routing(rng, s.experts, tokens, k, false));
    DevBuf dst(host.source_bytes());
    cudaStream_t stream;
    CSFMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Warm-up outside the capture (module load, launch-configuration cache), as a server would.
    expand_routed(t.view(), ScaleLayout::row_major, ids.buf.get(), type, tokens * k, dst.get(), stream);
    CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    CSFMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    expand_routed(t.view(), ScaleLayout::row_major, ids.buf.get(), type, tokens * k, dst.get(), stream);
    CSFMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CSFMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 8; ++replay) {
      SCOPED_TRACE(strf("replay {}", replay));
      const auto routing = random_routing(rng, s.experts, tokens, k, false);
      ids.write(routing, stream);  // fresh routing into the captured buffer
      CSFMOE_CUDA_CHECK(cudaMemsetAsync(dst.get(), 0xA5, dst.size(), stream));
      CSFMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(mismatch(dst.download(dst.size()), routed_expected(host, routing, ScaleLayout::row_major),
                         "graph replay scratch"),
                "");
    }
    CSFMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    CSFMOE_CUDA_CHECK(cudaGraphDestroy(graph));
    CSFMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// ---------------------------------------------------------------------------
// Streams and devices
// ---------------------------------------------------------------------------
// Busy-waits about `ns` nanoseconds so that work queued behind it runs late.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// The consumer: copies the scratch (as a GEMM would read it).
__global__ void consume_kernel(const std::uint8_t* src, std::uint8_t* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x)
    dst[i] = src[i];
}

TEST_F(GpuCodec, SideStreamExpansionIsOrderedByEvents) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 4, 512, 448};
  const CsfTensor host = encode(s, synthetic_scales(s, ScaleDistribution::realistic, rng()));
  const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
  const Bytes want = cpu_decode(host, ScaleLayout::row_major);
  DevBuf scratch(want.size()), seen(want.size());
  cudaStream_t main_s, side;
  cudaEvent_t scratch_free, expanded;
  CSFMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
  CSFMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CSFMOE_CUDA_CHECK(cudaEventCreateWithFlags(&scratch_free, cudaEventDisableTiming));
  CSFMOE_CUDA_CHECK(cudaEventCreateWithFlags(&expanded, cudaEventDisableTiming));
  for (int round = 0; round < 3; ++round) {
    CSFMOE_CUDA_CHECK(cudaMemsetAsync(scratch.get(), 0xA5, want.size(), main_s));
    CSFMOE_CUDA_CHECK(cudaEventRecord(scratch_free, main_s));
    CSFMOE_CUDA_CHECK(cudaStreamWaitEvent(side, scratch_free, 0));
    spin_kernel<<<1, 1, 0, side>>>(2'000'000);  // the side stream is late: ordering must come from the event
    expand_all(t.view(), ScaleLayout::row_major, scratch.get(), side);
    CSFMOE_CUDA_CHECK(cudaEventRecord(expanded, side));
    CSFMOE_CUDA_CHECK(cudaStreamWaitEvent(main_s, expanded, 0));
    consume_kernel<<<256, 256, 0, main_s>>>(scratch.get(), seen.get(), want.size());
    CSFMOE_CUDA_CHECK(cudaGetLastError());
    CSFMOE_CUDA_CHECK(cudaStreamSynchronize(main_s));
    EXPECT_EQ(mismatch(seen.download(want.size()), want, "consumer view"), "") << "round " << round;
  }
  CSFMOE_CUDA_CHECK(cudaEventDestroy(scratch_free));
  CSFMOE_CUDA_CHECK(cudaEventDestroy(expanded));
  CSFMOE_CUDA_CHECK(cudaStreamDestroy(main_s));
  CSFMOE_CUDA_CHECK(cudaStreamDestroy(side));
}

TEST_F(GpuCodec, ExpandsOnTheTensorsDeviceWhateverIsCurrent) {
  if (gpu_count() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices, found " << gpu_count() << ": device guard not exercised";
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 3, 256, 128};
  const Bytes src = synthetic_scales(s, ScaleDistribution::realistic, rng());
  const CsfTensor host = encode(s, src);
  DevBuf d_src(src.size(), 1);
  {
    cuda_detail::DeviceGuard g(1);
    d_src.upload(src.data(), src.size());
  }
  CSFMOE_CUDA_CHECK(cudaSetDevice(0));
  const DeviceCsfTensor t =
      encode_on_device(s, d_src.get(), 1, nullptr);  // encoded on device 1 from device 0
  int cur = -1;
  CSFMOE_CUDA_CHECK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 0);
  EXPECT_EQ(diff_tensors(t.download(), host), "");
  DevBuf dst(src.size(), 1);
  {
    cuda_detail::DeviceGuard g(1);
    dst.poison(0xA5);
  }
  CSFMOE_CUDA_CHECK(cudaSetDevice(0));
  expand_all(t.view(), ScaleLayout::swizzled_128x4, dst.get(), nullptr);
  CSFMOE_CUDA_CHECK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 0);
  cuda_detail::DeviceGuard g(1);
  EXPECT_EQ(mismatch(dst.download(src.size()), src, "expanded on device 1"), "");
}

// ---------------------------------------------------------------------------
// Upload / download, layer API, accounting
// ---------------------------------------------------------------------------
TEST_F(GpuCodec, UploadDownloadRoundTrip) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 6; ++i) {
    const GridShape s = random_shape(rng);
    const CsfTensor host = encode(s, synthetic_scales(s, kDistributions[i % 5], rng()));
    const DeviceCsfTensor t = DeviceCsfTensor::upload(host, 0);
    EXPECT_EQ(diff_tensors(t.download(), host), "") << shape_name(s);
    EXPECT_EQ(t.resident_bytes(), csf_resident_bytes(host));
    EXPECT_EQ(t.view().num_exceptions, host.exceptions.size());
    const DeviceCsfTensor copy = t;  // shared parts stay alive with the copy
    EXPECT_EQ(copy.view().fixed, t.view().fixed);
  }
  CsfTensor corrupt =
      encode(GridShape{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 128, 8}, Bytes(1024, 3));
  corrupt.row_prefix[5] = 77;
  EXPECT_THROW(DeviceCsfTensor::upload(corrupt, 0), FormatError);
  EXPECT_THROW(DeviceCsfTensor{}.download(), InvalidArgument);
}

TEST_F(GpuCodec, LayerExpandScales) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  MoeGeometry m = kQwen3_235B_A22B;
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      SCOPED_TRACE(strf("{} {}", std::string(to_string(f)), std::string(to_string(l))));
      const GridShape s13 = reduced(w13_scale_shape(m, f, l), 3), s2 = reduced(w2_scale_shape(m, f, l), 3);
      const Bytes n13 = synthetic_scales(s13, ScaleDistribution::realistic, rng());
      const Bytes n2 = synthetic_scales(s2, ScaleDistribution::realistic, rng());
      const CsfTensor h13 = encode(s13, n13), h2 = encode(s2, n2);
      const DeviceCsfTensor t13 = DeviceCsfTensor::upload(h13, 0), t2 = DeviceCsfTensor::upload(h2, 0);
      DevBuf d13(n13.size()), d2(n2.size());
      d13.upload(n13.data(), n13.size());
      d2.upload(n2.data(), n2.size());
      DevBuf sc13(n13.size()), sc2(n2.size());
      const ScaleScratch scratch{sc13.get(), sc13.size(), sc2.get(), sc2.size()};

      // Both CSF: one fused launch; both grids exact.
      const LayerScales csf{ScaleTensorRef::of_csf(t13), ScaleTensorRef::of_csf(t2)};
      EXPECT_EQ(scratch_sizes(csf, l).w13, n13.size());
      sc13.poison(0xA5);
      sc2.poison(0xA5);
      EXPECT_TRUE(expand_scales(csf, scratch, l, nullptr));
      EXPECT_EQ(mismatch(sc13.download(n13.size()), n13, "w13 scratch"), "");
      EXPECT_EQ(mismatch(sc2.download(n2.size()), n2, "w2 scratch"), "");
      // A background expansion (one block per SM, each looping over many
      // work items) writes the same bytes.
      sc13.poison(0x5A);
      sc2.poison(0x5A);
      EXPECT_TRUE(expand_scales(csf, scratch, l, nullptr, ExpandLaunch{1}));
      EXPECT_EQ(mismatch(sc13.download(n13.size()), n13, "w13 scratch, 1 block per SM"), "");
      EXPECT_EQ(mismatch(sc2.download(n2.size()), n2, "w2 scratch, 1 block per SM"), "");
      const ScalePointers ptr = scale_pointers(csf, scratch);
      EXPECT_EQ(ptr.w13, sc13.get());
      EXPECT_EQ(ptr.w2, sc2.get());
      const ResidentBytes rb = layer_resident_bytes(csf);
      EXPECT_EQ(rb, resident_bytes(h13) + resident_bytes(h2));
      EXPECT_LT(rb.csf, rb.native);

      // Routed, fused.
      const auto ids = random_routing(rng, 3, 1, 2, false);
      IdsBuffer d_ids(ids.size(), IndexType::int64);
      d_ids.write(ids);
      sc13.poison(0xA5);
      sc2.poison(0xA5);
      EXPECT_TRUE(
          expand_scales_routed(csf, scratch, l, d_ids.buf.get(), IndexType::int64, ids.size(), nullptr));
      EXPECT_EQ(mismatch(sc13.download(n13.size()), routed_expected(h13, ids, l), "routed w13"), "");
      EXPECT_EQ(mismatch(sc2.download(n2.size()), routed_expected(h2, ids, l), "routed w2"), "");

      // Native layer: false, nothing written.
      const LayerScales native{ScaleTensorRef::of_native(s13, d13.get()),
                               ScaleTensorRef::of_native(s2, d2.get())};
      sc13.poison(0xA5);
      EXPECT_FALSE(expand_scales(native, scratch, l, nullptr));
      EXPECT_FALSE(
          expand_scales_routed(native, scratch, l, d_ids.buf.get(), IndexType::int64, ids.size(), nullptr));
      const Bytes untouched = sc13.download(n13.size());
      EXPECT_EQ(std::count(untouched.begin(), untouched.end(), 0xA5), static_cast<long>(untouched.size()));
      EXPECT_EQ(layer_resident_bytes(native),
                (ResidentBytes{n13.size() + n2.size(), n13.size() + n2.size()}));

      // Mixed: w13 CSF, w2 native.
      const LayerScales mixed{ScaleTensorRef::of_csf(t13), ScaleTensorRef::of_native(s2, d2.get())};
      sc13.poison(0xA5);
      EXPECT_TRUE(expand_scales(mixed, scratch, l, nullptr));
      EXPECT_EQ(mismatch(sc13.download(n13.size()), n13, "mixed w13 scratch"), "");
      EXPECT_EQ(scale_pointers(mixed, scratch).w2, d2.get());

      // Errors name the tensor.
      const ScaleLayout other =
          l == ScaleLayout::row_major ? ScaleLayout::swizzled_128x4 : ScaleLayout::row_major;
      EXPECT_THROW(expand_scales(mixed, scratch, other, nullptr),
                   InvalidArgument);  // native w2 in the wrong layout
      ScaleScratch small = scratch;
      small.w13_bytes = n13.size() - 1;
      EXPECT_THROW(expand_scales(csf, small, l, nullptr), InvalidArgument);
    }
}

}  // namespace
}  // namespace csfmoe
