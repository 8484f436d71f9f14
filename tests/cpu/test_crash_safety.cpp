// Crash safety of `csf compress` / `csf decompress` (the real binary,
// CSFMOE_CSF_BINARY): a run killed with SIGKILL part-way leaves the source
// untouched and no output (only its own temporary, which a re-run ignores);
// the re-run succeeds and restores byte for byte. The tool refuses to
// overwrite its input or an existing output, and a full disk (RLIMIT_FSIZE,
// and a small tmpfs where mounting is allowed) ends in a clear error naming
// the output, a non-zero exit and nothing left behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;

namespace {

using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;

// CRC32 of every regular file under p (or of p itself), keyed by relative name.
std::map<std::string, std::uint32_t> tree_hash(const fs::path& p) {
  std::map<std::string, std::uint32_t> out;
  auto one = [&](const fs::path& f, const std::string& key) {
    const std::string b = read_bytes(f);
    out[key] = static_cast<std::uint32_t>(
        ::crc32(0L, reinterpret_cast<const Bytef*>(b.data()), static_cast<uInt>(b.size())));
  };
  if (fs::is_directory(p)) {
    for (const auto& e : fs::recursive_directory_iterator(p))
      if (e.is_regular_file()) one(e.path(), fs::relative(e.path(), p).string());
  } else {
    one(p, p.filename().string());
  }
  return out;
}

std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

// A multi-MB NVFP4 checkpoint file written with the library (weights random,
// scales realistic), plus a BF16 passthrough tensor.
void write_checkpoint(const fs::path& p, std::uint64_t seed, std::uint32_t experts, std::uint32_t rows) {
  const std::uint32_t K = 2048;
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, experts, rows, K / 16};
  const auto scales = synthetic_scales(g, ScaleDistribution::realistic, seed);
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> w(std::size_t{experts} * rows * K / 2);
  for (std::size_t i = 0; i + 8 <= w.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(w.data() + i, &v, 8);
  }
  std::vector<std::uint8_t> bf(2 * 4096);
  for (auto& b : bf) b = static_cast<std::uint8_t>(rng());
  st::Writer out(p, 4096);
  out.add_tensor("model.layers.0.mlp.experts.w13.weight", st::Dtype::U8, {experts, rows, K / 2}, w);
  out.add_tensor("model.layers.0.mlp.experts.w13.weight_scale", st::Dtype::F8_E4M3, {experts, rows, K / 16},
                 scales);
  out.add_tensor("model.norm.weight", st::Dtype::BF16, {4096}, bf);
  out.commit(st::Metadata{{"format", "pt"}});
}

struct RunResult {
  int status = 0;  // waitpid status
  std::string err;
  bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  bool killed() const { return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL; }
};

// Starts `csf args...`; stderr goes to err_file. The child gets the file-size
// limit (with SIGXFSZ ignored, so writes fail with EFBIG instead of killing it).
pid_t spawn(const std::vector<std::string>& args, const fs::path& err_file,
            std::optional<rlim_t> fsize = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) ::dup2(fd, 2);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, 1);
    if (fsize) {
      ::signal(SIGXFSZ, SIG_IGN);
      const rlimit lim{*fsize, *fsize};
      ::setrlimit(RLIMIT_FSIZE, &lim);
    }
    std::vector<char*> argv;
    static std::string bin = CSFMOE_CSF_BINARY;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

RunResult run_csf(const std::vector<std::string>& args, const fs::path& err_file,
                  std::optional<rlim_t> fsize = {}) {
  RunResult r;
  const pid_t pid = spawn(args, err_file, fsize);
  ::waitpid(pid, &r.status, 0);
  r.err = read_bytes(err_file);
  return r;
}

bool has_temp_of(const fs::path& dir, const std::string& out_name) {
  for (const auto& n : entries(dir))
    if (n.rfind("." + out_name + ".tmp-", 0) == 0) return true;
  return false;
}

// Runs `csf <verb> in out` and SIGKILLs it once its temporary output exists
// and has grown for a random few milliseconds. Returns true if the kill
// landed while the tool was still running (false: it finished first).
bool kill_part_way(const std::string& verb, const fs::path& in, const fs::path& out, const fs::path& err,
                   std::mt19937_64& rng) {
  const pid_t pid = spawn({verb, "--threads", "1", "-q", in.string(), out.string()}, err);
  const fs::path dir = out.parent_path();
  const auto start = std::chrono::steady_clock::now();
  bool armed = false;
  std::chrono::steady_clock::time_point fire;
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return false;
    const auto now = std::chrono::steady_clock::now();
    if (!armed && has_temp_of(dir, out.filename().string())) {
      armed = true;
      fire = now + std::chrono::microseconds(rng() % 20000);
    }
    if ((armed && now >= fire) || now - start > std::chrono::seconds(60)) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// Kills `verb` part-way (retrying with new delays until a kill lands before
// the end), then checks the aftermath and that a re-run succeeds.
void kill_and_rerun(const std::string& verb, const fs::path& in, const fs::path& out, std::mt19937_64& rng) {
  const auto before = tree_hash(in);
  const fs::path dir = out.parent_path();
  const fs::path err = dir / "stderr.txt";
  const auto listing = entries(dir);
  int landed = 0;
  for (int attempt = 0; attempt < 20 && landed < 2; ++attempt) {
    if (!kill_part_way(verb, in, out, err, rng)) {
      // Finished before the kill: a complete output; remove it and retry.
      ASSERT_TRUE(fs::exists(out)) << read_bytes(err);
      fs::remove_all(out);
      continue;
    }
    ++landed;
    EXPECT_EQ(tree_hash(in), before) << "source changed by a killed " << verb;
    EXPECT_FALSE(fs::exists(out)) << "a killed " << verb << " left a (partial) output";
    // Anything new must be the killed run's temporary, which a re-run ignores.
    for (const auto& n : entries(dir))
      if (!listing.count(n) && n != "stderr.txt")
        EXPECT_EQ(n.rfind("." + out.filename().string() + ".tmp-", 0), 0u) << "unexpected leftover " << n;
  }
  ASSERT_GT(landed, 0) << verb
                       << " always finished before the kill; the checkpoint is too small to test this";
  const RunResult r = run_csf({verb, "--threads", "1", "-q", in.string(), out.string()}, err);
  ASSERT_TRUE(r.exited_ok()) << r.err;
  EXPECT_EQ(tree_hash(in), before);
  EXPECT_TRUE(fs::exists(out));
}

void remove_temps(const fs::path& dir) {
  for (const auto& n : entries(dir))
    if (n.find(".tmp-") != std::string::npos) fs::remove_all(dir / n);
}

}  // namespace

TEST(CrashSafety, KilledCompressAndDecompressOfAFileLeaveNoOutput) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path src = d.path / "model.safetensors";
  write_checkpoint(src, seed, 16, 1024);  // ~18 MB
  const fs::path csf = d.path / "model.csf.safetensors", back = d.path / "model.back.safetensors";
  kill_and_rerun("compress", src, csf, rng);
  remove_temps(d.path);
  kill_and_rerun("decompress", csf, back, rng);
  EXPECT_EQ(tree_hash(back).begin()->second, tree_hash(src).begin()->second) << "restored file differs";
}

TEST(CrashSafety, KilledCompressOfAFolderLeavesNoOutput) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path in = d.path / "ckpt";
  fs::create_directories(in);
  for (int s = 0; s < 3; ++s)
    write_checkpoint(in / ("model-0000" + std::to_string(s + 1) + "-of-00003.safetensors"), seed + s, 8, 512);
  std::ofstream(in / "config.json") << R"({"model_type": "test"})";
  const fs::path out = d.path / "ckpt.csf";
  kill_and_rerun("compress", in, out, rng);
  const fs::path back = d.path / "ckpt.back";
  const RunResult r = run_csf({"decompress", "-q", out.string(), back.string()}, d.path / "err2.txt");
  ASSERT_TRUE(r.exited_ok()) << r.err;
  EXPECT_EQ(tree_hash(back), tree_hash(in));
}

TEST(CrashSafety, RefusesToOverwriteInputOrExistingOutput) {
  CSFMOE_SEEDED(seed);
  TempDir d;
  const fs::path src = d.path / "m.safetensors";
  write_checkpoint(src, seed, 2, 128);
  const auto before = tree_hash(src);
  const fs::path err = d.path / "err.txt";
  for (const std::string& verb : {"compress", "decompress"}) {
    SCOPED_TRACE(verb);
    for (const fs::path& same :
         {src, d.path / "." / "m.safetensors", d.path / ".." / d.path.filename() / "m.safetensors"}) {
      const RunResult r = run_csf({verb, src.string(), same.string()}, err);
      EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) != 0) << r.err;
      EXPECT_NE(r.err.find("is the input"), std::string::npos) << r.err;
      EXPECT_EQ(tree_hash(src), before);
    }
  }
  const fs::path other = d.path / "existing.safetensors";
  std::ofstream(other) << "precious";
  const RunResult r = run_csf({"compress", src.string(), other.string()}, err);
  EXPECT_NE(WEXITSTATUS(r.status), 0);
  EXPECT_NE(r.err.find("already exists"), std::string::npos) << r.err;
  EXPECT_EQ(read_bytes(other), "precious");
  EXPECT_EQ(tree_hash(src), before);
}

TEST(CrashSafety, FullDiskByFileSizeLimitFailsCleanly) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path src = d.path / "m.safetensors";
  write_checkpoint(src, seed, 4, 512);  // ~2 MB
  const auto before = tree_hash(src);
  const auto listing = entries(d.path);
  // Any limit below the output's size: the write that crosses it fails.
  const rlim_t limit = 4096 + rng() % (1u << 20);
  for (const std::string& verb : {"compress", "decompress"}) {
    SCOPED_TRACE(verb);
    fs::path in = src;
    if (verb == "decompress") {
      in = d.path / "m.csf.safetensors";
      ASSERT_TRUE(run_csf({"compress", "-q", src.string(), in.string()}, d.path / "e0.txt").exited_ok());
    }
    const fs::path out = d.path / ("out-" + verb + ".safetensors");
    const RunResult r = run_csf({verb, "-q", in.string(), out.string()}, d.path / "err.txt", limit);
    ASSERT_TRUE(WIFEXITED(r.status)) << "killed by signal " << WTERMSIG(r.status) << ": " << r.err;
    EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.err;
    EXPECT_NE(r.err.find("csf: error:"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(out.string()), std::string::npos) << "message does not name the output: " << r.err;
    EXPECT_NE(r.err.find("File too large"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(has_temp_of(d.path, out.filename().string())) << "temporary left behind";
    EXPECT_EQ(tree_hash(src), before);
  }
}

TEST(CrashSafety, FullTmpfsFailsCleanly) {
  CSFMOE_SEEDED(seed);
  TempDir d;
  const fs::path mnt = d.path / "small";
  fs::create_directories(mnt);
  if (::geteuid() != 0 || ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): " << std::strerror(errno)
                 << "; the RLIMIT_FSIZE test covers the same path";
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const fs::path src = d.path / "m.safetensors";
  write_checkpoint(src, seed, 4, 512);  // ~2 MB: does not fit 1 MiB
  const auto before = tree_hash(src);
  const fs::path out = mnt / "m.csf.safetensors";
  const RunResult r = run_csf({"compress", "-q", src.string(), out.string()}, d.path / "err.txt");
  EXPECT_EQ(WEXITSTATUS(r.status), 1) << r.err;
  EXPECT_NE(r.err.find(out.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_TRUE(entries(mnt).empty()) << "something left on the full filesystem";
  EXPECT_EQ(tree_hash(src), before);
}
