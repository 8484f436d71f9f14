// Block timeline of the decode kernel, a diagnostic (scripts/lab/gpu-timeline-decode):
// built with -DCSFMOE_DECODE_TIMELINE=1, every decode block records when it
// started, passed its waits, finished its prologue and exited (%globaltimer,
// with its SM), to place a call's time across its blocks. In every other
// build DecodeTimeline is empty and its hooks compile to nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/primitives/ptx.cuh"

#ifndef CSFMOE_DECODE_TIMELINE
#define CSFMOE_DECODE_TIMELINE 0
#endif

namespace csfmoe::moe_detail {

// Stamps of one block, in the order the kernel passes them.
enum class DecodeStamp : int {
  entry = 0,
  gate_up_waited = 1,  // after the gate/up GEMM's wait (taken by the down GEMM too)
  prologue_done = 2,   // rows and exception records staged
  down_waited = 3,     // after the down GEMM's wait (taken by gate/up too)
  exit = 4,
};

#if CSFMOE_DECODE_TIMELINE
// One decode block's timeline (ns, %globaltimer, indexed by DecodeStamp).
// Read back by decode_timeline_dump (decode_launch.cu).
struct DecodeTimelineEvent {
  unsigned long long t[5];
  unsigned sm, gate_up, tile, row_block_group, valid;
};
constexpr unsigned kDecodeTimelineCapacity = 1u << 18;
__device__ unsigned g_decode_timeline_count;
__device__ DecodeTimelineEvent g_decode_timeline[kDecodeTimelineCapacity];

class DecodeTimeline {
 public:
  __device__ __forceinline__ explicit DecodeTimeline(bool gate_up) {
    ev_.t[0] = ptx::global_ns();
    ev_.gate_up = gate_up, ev_.tile = blockIdx.x, ev_.row_block_group = blockIdx.y;
  }
  __device__ __forceinline__ void stamp(DecodeStamp s) { ev_.t[int(s)] = ptx::global_ns(); }
  __device__ __forceinline__ void valid_rows(int valid) { ev_.valid = unsigned(valid); }
  // Stamps the exit; thread 0 of the block appends the event.
  __device__ __forceinline__ void record() {
    if (threadIdx.x != 0) return;
    DecodeTimelineEvent ev = ev_;
    ev.t[int(DecodeStamp::exit)] = ptx::global_ns();
    ev.sm = ptx::sm_id();
    const unsigned at = atomicAdd(&g_decode_timeline_count, 1u);
    if (at < kDecodeTimelineCapacity) g_decode_timeline[at] = ev;
  }

 private:
  DecodeTimelineEvent ev_{};
};

// Host side, defined in decode_launch.cu: clear the timeline, and append what
// was recorded since to `f` as JSON lines tagged with `label` (a JSON object
// body, e.g. "\"shape\":\"ds3\""). Returns the events written.
void decode_timeline_reset();
unsigned decode_timeline_dump(std::FILE* f, const char* label);
#else
class DecodeTimeline {
 public:
  __device__ __forceinline__ explicit DecodeTimeline(bool) {}
  __device__ __forceinline__ void stamp(DecodeStamp) {}
  __device__ __forceinline__ void valid_rows(int) {}
  __device__ __forceinline__ void record() {}
};
#endif

}  // namespace csfmoe::moe_detail
