// Tensor- and expert-parallel MoE over NCCL (csfmoe/moe_nccl.hpp).
// Built into csfmoe_nccl only, which CMake adds when NCCL is found, so builds
// without NCCL are unaffected.
#include <cuda_bf16.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe_nccl.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/strf.hpp"

namespace csfmoe {
namespace fs = std::filesystem;

namespace {

// nvcc cannot build fmt's compile-time format checks: strf.hpp formats at run time.
using cuda_detail::strf;

void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess)
    throw CudaError(strf("{} failed: {} ({})", call, ncclGetErrorString(r), ncclGetLastError(nullptr)));
}
#define CSFMOE_NCCL(call) nccl_check((call), #call)

// dst[i, :] = src[rows[i], :] for n rows of h bf16 values.
__global__ void gather_rows(const std::uint16_t* src, const std::int32_t* rows, std::uint64_t n,
                            std::uint32_t h, std::uint16_t* dst) {
  for (std::uint64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const std::uint16_t* s = src + std::uint64_t(rows[i]) * h;
    for (std::uint32_t c = threadIdx.x; c < h; c += blockDim.x) dst[i * h + c] = s[c];
  }
}

// out[t, :] = bf16(sum_j w[t, j] * y[pos[t, j], :]) in slot order (fp32), like the fused combine.
__global__ void combine_slots(const std::uint16_t* y, const std::int32_t* pos, const float* w,
                              std::uint32_t tokens, std::uint32_t k, std::uint32_t h, std::uint16_t* out) {
  for (std::uint32_t t = blockIdx.x; t < tokens; t += gridDim.x)
    for (std::uint32_t c = threadIdx.x; c < h; c += blockDim.x) {
      float acc = 0.f;
      for (std::uint32_t j = 0; j < k; ++j) {
        const std::uint16_t b = y[std::uint64_t(pos[t * k + j]) * h + c];
        acc += w[t * k + j] * __uint_as_float(std::uint32_t(b) << 16);
      }
      const __nv_bfloat16 r = __float2bfloat16_rn(acc);
      out[std::uint64_t(t) * h + c] = *reinterpret_cast<const std::uint16_t*>(&r);
    }
}

__global__ void fill_ones(float* p, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::uint64_t(gridDim.x) * blockDim.x)
    p[i] = 1.f;
}

template <class T>
T* device_alloc(std::uint64_t n) {
  void* p = nullptr;
  CSFMOE_CUDA_CHECK(cudaMalloc(&p, std::max<std::uint64_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace

// ---------------------------------------------------------------------------
NcclContext nccl_init_from_file(const fs::path& id_file, int rank, int world, int device, double timeout_s) {
  if (world < 1) throw InvalidArgument(strf("nccl_init_from_file: world size {} is below 1", world));
  if (rank < 0 || rank >= world)
    throw InvalidArgument(strf("nccl_init_from_file: rank {} is outside [0, {})", rank, world));
  // NVLink multicast (NVLS) stays off: it needs fabric support the lent machines do not have.
  ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  CSFMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank == 0) {
    CSFMOE_NCCL(ncclGetUniqueId(&id));
    // Write beside, then rename: a reader never sees a half-written id.
    const fs::path tmp = id_file.string() + ".tmp-" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(id.internal, sizeof(id.internal));
      if (!out) throw IoError(strf("{}: cannot write the NCCL unique id", tmp.string()));
    }
    std::error_code ec;
    fs::rename(tmp, id_file, ec);
    if (ec) throw IoError(strf("{}: cannot publish the NCCL unique id: {}", id_file.string(), ec.message()));
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      std::ifstream in(id_file, std::ios::binary);
      if (in && in.read(id.internal, sizeof(id.internal)) && in.gcount() == sizeof(id.internal)) break;
      if (std::chrono::steady_clock::now() > deadline)
        throw IoError(strf("{}: no NCCL unique id from rank 0 after {} s", id_file.string(), timeout_s));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  NcclContext ctx;
  ctx.rank = rank;
  ctx.world = world;
  ctx.device = device;
  CSFMOE_NCCL(ncclCommInitRank(&ctx.comm, world, id, rank));
  return ctx;
}

void nccl_destroy(NcclContext& ctx) noexcept {
  if (ctx.comm) (void)ncclCommDestroy(ctx.comm);
  ctx.comm = nullptr;
}

// ---------------------------------------------------------------------------
void run_tensor_parallel(const NcclContext& ctx, const BoundMoe& local, const void* hidden,
                         std::uint32_t tokens, const void* topk_ids, IndexType id_type,
                         const float* topk_weights, void* out) {
  if (!ctx.comm) throw InvalidArgument("run_tensor_parallel: the NCCL context has no communicator");
  run(local, hidden, tokens, topk_ids, id_type, topk_weights, out);
  if (ctx.world == 1 || tokens == 0) return;
  const std::uint64_t n = std::uint64_t{tokens} * local.weights().plan().geometry.hidden;
  // Each rank's output is a partial sum over N; the sum is the layer's output.
  CSFMOE_NCCL(ncclAllReduce(out, out, n, ncclBfloat16, ncclSum, ctx.comm, local.stream()));
}

// ---------------------------------------------------------------------------
ExpertParallelMoe::ExpertParallelMoe(const NcclContext& ctx, const BoundMoe& local, std::uint32_t experts,
                                     std::uint32_t hidden, std::uint32_t topk, std::uint32_t max_tokens)
    : ctx_(ctx),
      local_(local),
      part_(expert_parallel_partition(experts, unsigned(ctx.world), unsigned(ctx.rank))),
      experts_(experts),
      hidden_(hidden),
      topk_(topk),
      max_tokens_(max_tokens) {
  const MoeLayerGeometry& lg = local.weights().plan().geometry;
  if (lg.experts != part_.count || lg.topk != 1 || lg.hidden != hidden)
    throw InvalidArgument(
        strf("ExpertParallelMoe: the local layer must hold this rank's {} experts with top-k 1 and H = {}; "
             "it has E = "
             "{}, k = {}, H = {}",
             part_.count, hidden, lg.experts, lg.topk, lg.hidden));
  max_pairs_ = std::uint64_t{max_tokens} * topk;
  max_recv_ = max_pairs_ * std::uint64_t(ctx.world);
  if (local.max_tokens() < max_recv_)
    throw InvalidArgument(strf(
        "ExpertParallelMoe: the local binding takes {} tokens, up to {} (world x max_tokens x k) may arrive",
        local.max_tokens(), max_recv_));
  cuda_detail::DeviceGuard guard(ctx.device);
  send_x_ = device_alloc<std::uint16_t>(max_pairs_ * hidden);
  back_y_ = device_alloc<std::uint16_t>(max_pairs_ * hidden);
  recv_x_ = device_alloc<std::uint16_t>(max_recv_ * hidden);
  recv_y_ = device_alloc<std::uint16_t>(max_recv_ * hidden);
  send_ids_ = device_alloc<std::int32_t>(max_pairs_);
  recv_ids_ = device_alloc<std::int32_t>(max_recv_);
  gather_ = device_alloc<std::int32_t>(max_pairs_);
  slot_pos_ = device_alloc<std::int32_t>(max_pairs_);
  ones_ = device_alloc<float>(max_recv_);
  counts_ = device_alloc<std::int64_t>(2 * std::uint64_t(ctx.world));
  fill_ones<<<256, 256, 0, local.stream()>>>(ones_, max_recv_);
  CSFMOE_CUDA_CHECK(cudaGetLastError());
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(local.stream()));
}

ExpertParallelMoe::~ExpertParallelMoe() {
  for (void* p : {static_cast<void*>(send_x_), static_cast<void*>(back_y_), static_cast<void*>(recv_x_),
                  static_cast<void*>(recv_y_), static_cast<void*>(send_ids_), static_cast<void*>(recv_ids_),
                  static_cast<void*>(gather_), static_cast<void*>(slot_pos_), static_cast<void*>(ones_),
                  static_cast<void*>(counts_)})
    if (p) (void)cudaFree(p);
}

void ExpertParallelMoe::run(const void* hidden, std::uint32_t tokens, const void* topk_ids, IndexType id_type,
                            const float* topk_weights, void* out) {
  if (tokens > max_tokens_)
    throw InvalidArgument(strf("ExpertParallelMoe::run: {} tokens, the layer takes {}", tokens, max_tokens_));
  if (tokens == 0) return;
  cuda_detail::DeviceGuard guard(ctx_.device);
  const cudaStream_t s = local_.stream();
  const int W = ctx_.world;
  const std::uint64_t pairs = std::uint64_t{tokens} * topk_;
  // 1. Routing to the host: who gets which (token, slot).
  host_ids_.resize(pairs);
  if (id_type == IndexType::int64) {
    CSFMOE_CUDA_CHECK(cudaMemcpyAsync(host_ids_.data(), topk_ids, pairs * 8, cudaMemcpyDeviceToHost, s));
    CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  } else {
    std::vector<std::int32_t> tmp(pairs);
    CSFMOE_CUDA_CHECK(cudaMemcpyAsync(tmp.data(), topk_ids, pairs * 4, cudaMemcpyDeviceToHost, s));
    CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    for (std::uint64_t i = 0; i < pairs; ++i) host_ids_[i] = tmp[i];
  }
  std::vector<std::int64_t> send_count(W, 0), send_off(W + 1, 0), recv_count(W), recv_off(W + 1, 0);
  std::vector<int> owner(pairs);
  for (std::uint64_t i = 0; i < pairs; ++i) {
    const std::int64_t e = host_ids_[i];
    if (e < 0 || e >= std::int64_t(experts_))
      throw InvalidArgument(strf("ExpertParallelMoe::run: topk_ids[{}, {}] = {} is outside [0, {})",
                                 i / topk_, i % topk_, e, experts_));
    owner[i] = int(expert_owner(experts_, unsigned(W), std::uint32_t(e)));
    ++send_count[owner[i]];
  }
  for (int p = 0; p < W; ++p) send_off[p + 1] = send_off[p] + send_count[p];
  h_gather_.resize(pairs);
  h_send_ids_.resize(pairs);
  h_slot_pos_.resize(pairs);
  {
    std::vector<std::int64_t> fill(send_off.begin(), send_off.end() - 1);
    for (std::uint64_t i = 0; i < pairs; ++i) {
      const std::int64_t at = fill[owner[i]]++;
      const ExpertPartition dst = expert_parallel_partition(experts_, unsigned(W), unsigned(owner[i]));
      h_gather_[at] = std::int32_t(i / topk_);
      h_send_ids_[at] = std::int32_t(host_ids_[i] - dst.first);
      h_slot_pos_[i] = std::int32_t(at);  // the row comes back to the same place
    }
  }
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(gather_, h_gather_.data(), pairs * 4, cudaMemcpyHostToDevice, s));
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(send_ids_, h_send_ids_.data(), pairs * 4, cudaMemcpyHostToDevice, s));
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(slot_pos_, h_slot_pos_.data(), pairs * 4, cudaMemcpyHostToDevice, s));
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(counts_, send_count.data(), W * 8, cudaMemcpyHostToDevice, s));
  // 2. Counts all-to-all.
  CSFMOE_NCCL(ncclGroupStart());
  for (int p = 0; p < W; ++p) {
    CSFMOE_NCCL(ncclSend(counts_ + p, 1, ncclInt64, p, ctx_.comm, s));
    CSFMOE_NCCL(ncclRecv(counts_ + W + p, 1, ncclInt64, p, ctx_.comm, s));
  }
  CSFMOE_NCCL(ncclGroupEnd());
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(recv_count.data(), counts_ + W, W * 8, cudaMemcpyDeviceToHost, s));
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int p = 0; p < W; ++p) recv_off[p + 1] = recv_off[p] + recv_count[p];
  const std::uint64_t received = std::uint64_t(recv_off[W]);
  if (received > max_recv_)
    throw InvalidArgument(
        strf("ExpertParallelMoe::run: {} pairs arrived, buffers hold {} (peers called with "
             "more tokens than max_tokens?)",
             received, max_recv_));
  // 3. Dispatch: rows and local expert ids to their owners.
  gather_rows<<<std::uint32_t(std::min<std::uint64_t>(pairs, 65535)), 128, 0, s>>>(
      static_cast<const std::uint16_t*>(hidden), gather_, pairs, hidden_, send_x_);
  CSFMOE_CUDA_CHECK(cudaGetLastError());
  const std::uint64_t H = hidden_;
  CSFMOE_NCCL(ncclGroupStart());
  for (int p = 0; p < W; ++p) {
    CSFMOE_NCCL(ncclSend(send_x_ + send_off[p] * H, send_count[p] * H, ncclBfloat16, p, ctx_.comm, s));
    CSFMOE_NCCL(ncclSend(send_ids_ + send_off[p], send_count[p], ncclInt32, p, ctx_.comm, s));
    CSFMOE_NCCL(ncclRecv(recv_x_ + recv_off[p] * H, recv_count[p] * H, ncclBfloat16, p, ctx_.comm, s));
    CSFMOE_NCCL(ncclRecv(recv_ids_ + recv_off[p], recv_count[p], ncclInt32, p, ctx_.comm, s));
  }
  CSFMOE_NCCL(ncclGroupEnd());
  // 4. Local experts, one slot per received row, weight 1 (weights apply at the source).
  csfmoe::run(local_, recv_x_, std::uint32_t(received), recv_ids_, IndexType::int32, ones_, recv_y_);
  // 5. Return the rows to where they came from.
  CSFMOE_NCCL(ncclGroupStart());
  for (int p = 0; p < W; ++p) {
    CSFMOE_NCCL(ncclSend(recv_y_ + recv_off[p] * H, recv_count[p] * H, ncclBfloat16, p, ctx_.comm, s));
    CSFMOE_NCCL(ncclRecv(back_y_ + send_off[p] * H, send_count[p] * H, ncclBfloat16, p, ctx_.comm, s));
  }
  CSFMOE_NCCL(ncclGroupEnd());
  // 6. Combine in slot order.
  combine_slots<<<std::min<std::uint32_t>(tokens, 65535), 128, 0, s>>>(
      back_y_, slot_pos_, topk_weights, tokens, topk_, hidden_, static_cast<std::uint16_t*>(out));
  CSFMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace csfmoe
