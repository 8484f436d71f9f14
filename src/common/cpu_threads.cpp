#include "common/cpu_threads.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace csfmoe::cpu_threads {

unsigned resolve_count(unsigned threads) noexcept {
  if (threads != 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1u : hw;
}

void for_each_index(std::size_t n, unsigned threads, const std::function<void(std::size_t)>& fn) {
  if (n == 0) return;
  const std::size_t workers = std::min<std::size_t>(resolve_count(threads), n);
  if (workers <= 1) {
    for (std::size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  try {
    for (std::size_t t = 1; t < workers; ++t) pool.emplace_back(work);
  } catch (...) {
    // Could not start every worker: the ones that did start and this thread
    // still finish the range.
  }
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace csfmoe::cpu_threads
