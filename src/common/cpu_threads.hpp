// cpu_threads::for_each_index: a small fork-join loop over an index range on
// CPU threads (TP/EP parallelism across GPUs is csfmoe/parallel.hpp). Work is
// handed out one index at a time from a shared counter, so uneven tasks
// (experts with many exceptions) balance themselves; callers size their tasks
// (a slab, an expert) so that the per-index overhead stays negligible.
#pragma once

#include <cstddef>
#include <functional>

namespace csfmoe::cpu_threads {

// Threads that `threads` stands for: 0 means every hardware thread (at least 1).
unsigned resolve_count(unsigned threads) noexcept;

// Calls fn(i) once for every i in [0, n) on up to `threads` threads (0: all
// hardware threads; 1: only the calling thread, in order). The calling thread
// takes part. If a call throws, the remaining indices are skipped and the
// first exception is rethrown on the calling thread after all workers joined.
void for_each_index(std::size_t n, unsigned threads, const std::function<void(std::size_t)>& fn);

}  // namespace csfmoe::cpu_threads
