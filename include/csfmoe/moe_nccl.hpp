// Multi-GPU MoE through NCCL, one process per GPU (see docs/multi-gpu.md).
//
//   tensor parallel: every rank runs its N-slice of every expert
//     (slice_tensor_parallel) through the single-GPU run(), then the bf16
//     outputs are summed over ranks with ncclAllReduce.
//   expert parallel: every rank holds a block of whole experts
//     (slice_expert_parallel). The (token, slot) pairs of a call are sent to
//     the rank owning their expert (grouped ncclSend/ncclRecv, an all-to-all),
//     run there as one-slot tokens, sent back, and combined in slot order
//     with the routing weights.
//
// Only available in builds with CUDA and NCCL (target csfmoe_nccl).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <filesystem>
#include <vector>

#include "csfmoe/moe_cuda.hpp"
#include "csfmoe/parallel.hpp"

namespace csfmoe {

struct NcclContext {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int world = 1;
  int device = 0;
};

// Sets NCCL_NVLS_ENABLE=0 (NVLink multicast stays off) unless the caller set
// it, selects `device`, and creates the communicator. Rank 0 creates the
// unique id and publishes it atomically at `id_file` (a folder every rank
// can read); the other ranks wait for it up to timeout_s. Throws
// InvalidArgument for bad rank/world, IoError on a missing id, CudaError on
// an NCCL failure.
NcclContext nccl_init_from_file(const std::filesystem::path& id_file, int rank, int world, int device,
                                double timeout_s = 120.0);
void nccl_destroy(NcclContext& ctx) noexcept;

// Tensor parallel: out (bf16 [T, H]) = sum over ranks of run(local, ...).
// `local` is bound to this rank's slice, on the stream the all-reduce uses.
// Every rank must call it with the same T, ids and weights.
void run_tensor_parallel(const NcclContext& ctx, const BoundMoe& local, const void* hidden,
                         std::uint32_t tokens, const void* topk_ids, IndexType id_type,
                         const float* topk_weights, void* out);

// Expert parallel over the ranks of ctx. `local` is bound to this rank's
// experts as a layer of top-k 1 (geometry.experts = partition.count,
// geometry.topk = 1) with max_tokens >= world * max_tokens * topk (the most
// pairs it may receive). Owns its device buffers; run() synchronizes its
// stream twice (routing counts are needed on the host), so it is not
// graph-capturable.
class ExpertParallelMoe {
 public:
  ExpertParallelMoe(const NcclContext& ctx, const BoundMoe& local, std::uint32_t experts,
                    std::uint32_t hidden, std::uint32_t topk, std::uint32_t max_tokens);
  ~ExpertParallelMoe();
  ExpertParallelMoe(const ExpertParallelMoe&) = delete;
  ExpertParallelMoe& operator=(const ExpertParallelMoe&) = delete;

  const ExpertPartition& partition() const { return part_; }
  // hidden, out: bf16 [T, H] device; topk_ids [T, k] int32/int64 and
  // topk_weights [T, k] f32 on the device. Ids outside [0, E) are refused
  // (InvalidArgument), T <= max_tokens.
  void run(const void* hidden, std::uint32_t tokens, const void* topk_ids, IndexType id_type,
           const float* topk_weights, void* out);

 private:
  const NcclContext& ctx_;
  const BoundMoe& local_;
  ExpertPartition part_;
  std::uint32_t experts_, hidden_, topk_, max_tokens_;
  std::uint64_t max_pairs_ = 0, max_recv_ = 0;
  // Device buffers.
  std::uint16_t *send_x_ = nullptr, *recv_x_ = nullptr, *recv_y_ = nullptr, *back_y_ = nullptr;
  std::int32_t *send_ids_ = nullptr, *recv_ids_ = nullptr, *gather_ = nullptr, *slot_pos_ = nullptr;
  float* ones_ = nullptr;
  std::int64_t* counts_ = nullptr;  // [2 * world]: sent, received
  // Host mirrors.
  std::vector<std::int64_t> host_ids_;
  std::vector<std::int32_t> h_gather_, h_send_ids_, h_slot_pos_;
};

}  // namespace csfmoe
