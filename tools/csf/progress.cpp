// Progress on stderr for long jobs.
#include <fmt/core.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "cli.hpp"

namespace csfmoe::cli {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

ProgressPrinter::ProgressPrinter(std::string verb, bool quiet)
    : verb_(std::move(verb)), quiet_(quiet), tty_(::isatty(STDERR_FILENO) == 1), start_(now_seconds()) {
  // Logs get their first line only once the job has run a while.
  last_ = tty_ ? -1e9 : start_;
}

ProgressPrinter::~ProgressPrinter() { finish(); }

ProgressFn ProgressPrinter::callback() {
  if (quiet_) return {};
  return [this](const Progress& p) { update(p); };
}

void ProgressPrinter::update(const Progress& p) {
  latest_ = p;
  const double t = now_seconds();
  const bool done = p.bytes_total != 0 && p.bytes_done >= p.bytes_total;
  // A terminal is redrawn ~10 times a second; a log gets a line every 2 s so
  // CI output stays short.
  const double interval = tty_ ? 0.1 : 2.0;
  if (!done && t - last_ < interval) return;
  if (!tty_ && done && !drawn_) return;  // a fast job needs no progress line in a log
  last_ = t;
  const double elapsed = std::max(t - start_, 1e-6);
  const double mbs = double(p.bytes_done) / 1e6 / elapsed;
  const double frac = p.bytes_total ? double(p.bytes_done) / double(p.bytes_total) : 0.0;
  if (tty_) {
    constexpr int kWidth = 28;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::string cur = p.current;
    if (cur.size() > 40) cur = "..." + cur.substr(cur.size() - 37);
    fmt::print(stderr, "\r\033[K{} [{}] {:5.1f}%  {} / {}  {:.1f} MB/s  {}", verb_, bar, 100.0 * frac,
               human_bytes(p.bytes_done), human_bytes(p.bytes_total), mbs, cur);
  } else {
    fmt::print(stderr, "{}: {:.1f}%  {} / {}  {:.1f} MB/s  {}\n", verb_, 100.0 * frac,
               human_bytes(p.bytes_done), human_bytes(p.bytes_total), mbs, p.current);
  }
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressPrinter::finish() {
  if (tty_ && drawn_) {
    fmt::print(stderr, "\n");
    std::fflush(stderr);
  }
  drawn_ = false;
}

}  // namespace csfmoe::cli
