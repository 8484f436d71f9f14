// Crash safety of `csf compress` / `csf decompress` (the real binary,
// CSFMOE_CSF_BINARY): a run killed with SIGKILL part-way leaves the source
// untouched and no output (only its own temporary, which the re-run
// removes); the re-run succeeds and restores byte for byte. Stale
// temporaries of dead pids are swept by the next writer into their folder
// (CLI and library), those of live pids, symlinks and other names are left
// exactly as they were, and no symlink is followed. The tool refuses to
// overwrite its input or an existing output, and a full disk (RLIMIT_FSIZE,
// and a small tmpfs where mounting is allowed) ends in a clear error naming
// the output, a non-zero exit and nothing left behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
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
#include "test_processes.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;

namespace {

using csfmoe::testing::dead_pid;
using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;

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

// Whether `dir` holds a temporary of `out_name` (of that pid only, if given).
bool has_temp_of(const fs::path& dir, const std::string& out_name, std::optional<pid_t> pid = {}) {
  const std::string prefix = "." + out_name + ".tmp-" + (pid ? std::to_string(*pid) : "");
  for (const auto& n : entries(dir))
    if (n.rfind(prefix, 0) == 0 && (!pid || n.size() == prefix.size())) return true;
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
    // Its own temporary: a previous attempt's may still be there until this run sweeps it.
    if (!armed && has_temp_of(dir, out.filename().string(), pid)) {
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
    // Anything new must be the killed run's temporary, which the re-run removes.
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
  EXPECT_FALSE(has_temp_of(dir, out.filename().string())) << "the re-run left a killed run's temporary";
}

void remove_temps(const fs::path& dir) {
  for (const auto& n : entries(dir))
    if (n.find(".tmp-") != std::string::npos) fs::remove_all(dir / n);
}

// A live process that is not the writer (a concurrent writer's stand-in).
struct Sleeper {
  pid_t pid = ::fork();
  Sleeper() {
    if (pid == 0)
      for (;;) ::pause();
  }
  ~Sleeper() {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
  Sleeper(const Sleeper&) = delete;
  Sleeper& operator=(const Sleeper&) = delete;
};

std::string random_bytes(std::mt19937_64& rng) {
  std::string b(rng() % 4096, '\0');
  for (auto& c : b) c = static_cast<char>(rng());
  return b;
}

// What an entry is, without following a symlink at it: kind plus content
// (a folder's recursive listing and file contents, a link's target).
std::string describe(const fs::path& p) {
  const auto st = fs::symlink_status(p);
  if (fs::is_symlink(st)) return "link:" + fs::read_symlink(p).string();
  if (fs::is_regular_file(st)) return "file:" + read_bytes(p);
  if (fs::is_directory(st)) {
    std::string out = "dir:";
    for (const auto& e : fs::recursive_directory_iterator(p))
      out += fs::relative(e.path(), p).string() + "=" + describe(e.path()) + ";";
    return out;
  }
  return fs::exists(st) ? "other" : "missing";
}

// Leftovers planted beside output `out_name` in `dir`: temporaries of dead
// pids that the next writer must remove (a killed file writer's, a killed
// folder writer's holding symlinks out of it, a killed sweep's `.stale`),
// and entries it must leave exactly as they are: temporaries of live pids,
// symlinks and a FIFO named like stale temporaries, and names that only
// look similar. Symlinks point at `victim`, which must survive untouched.
struct Leftovers {
  fs::path dir, victim;
  std::vector<std::string> removed;
  std::map<std::string, std::string> kept;  // name -> describe() before the run
  std::map<std::string, std::uint32_t> victim_hash;
  std::set<std::string> listing;  // entries of dir once planted

  Leftovers(const fs::path& d, const std::string& out_name, const std::vector<pid_t>& alive,
            std::mt19937_64& rng)
      : dir(d), victim(d / ("victim-of-" + out_name)) {
    fs::create_directories(victim / "sub");
    write_bytes(victim / "precious", random_bytes(rng));
    write_bytes(victim / "sub" / "precious2", random_bytes(rng));
    victim_hash = tree_hash(victim);
    const std::string t = "." + out_name + ".tmp-";
    auto name = [&](pid_t p) { return t + std::to_string(p); };
    std::vector<pid_t> dead;
    for (int i = 0; i < 6; ++i) dead.push_back(dead_pid());

    write_bytes(dir / name(dead[0]), random_bytes(rng));
    const fs::path folder = dir / name(dead[1]);
    fs::create_directories(folder / "sub" / "deeper");
    write_bytes(folder / "part.safetensors", random_bytes(rng));
    write_bytes(folder / "sub" / "deeper" / "x", random_bytes(rng));
    fs::create_directory_symlink(victim, folder / "to-victim");
    fs::create_directory_symlink(victim, folder / "sub" / "deeper" / "to-victim");
    fs::create_symlink(victim / "precious", folder / "to-precious");
    fs::create_directories(dir / (name(dead[2]) + ".stale") / "sub");
    write_bytes(dir / (name(dead[2]) + ".stale") / "sub" / "y", random_bytes(rng));
    removed = {name(dead[0]), name(dead[1]), name(dead[2]) + ".stale"};

    std::vector<std::string> keep;
    for (std::size_t i = 0; i < alive.size(); ++i) {
      const fs::path p = dir / name(alive[i]);
      if (i % 2 == 0) {
        write_bytes(p, random_bytes(rng));
      } else {
        fs::create_directories(p / "sub");
        write_bytes(p / "sub" / "z", random_bytes(rng));
      }
      keep.push_back(p.filename());
    }
    fs::create_directory_symlink(victim, dir / name(dead[3]));
    fs::create_symlink(victim / "precious", dir / name(dead[4]));
    ::mkfifo((dir / name(dead[5])).c_str(), 0600);
    keep.insert(keep.end(), {name(dead[3]), name(dead[4]), name(dead[5])});
    const std::string d0 = std::to_string(dead[0]);
    // Other outputs' temporaries of dead runs go too: a killed run's file can be gigabytes.
    for (const std::string& n :
         {"." + out_name + "x.tmp-" + d0, ".." + out_name + ".tmp-" + d0, ".other.tmp-" + d0}) {
      write_bytes(dir / n, random_bytes(rng));
      removed.push_back(n);
    }
    for (const std::string& n :
         {"." + out_name + ".tmp-" + d0 + "x", "." + out_name + ".tmp-0" + d0, "." + out_name + ".tmp-+" + d0,
          "." + out_name + ".tmp--" + d0, "." + out_name + ".tmp-0", "." + out_name + ".tmp-",
          "." + out_name + ".tmp-" + d0 + ".stale.x", "." + out_name + ".tmp-99999999999999999999",
          out_name + ".tmp-" + d0, "x" + t + d0, ".tmp-" + d0, "..tmp-" + d0}) {
      write_bytes(dir / n, random_bytes(rng));
      keep.push_back(n);
    }
    for (const auto& n : keep) kept[n] = describe(dir / n);
    listing = entries(dir);
  }

  // After the writer ran: the stale ones are gone (not merely renamed),
  // everything else intact, nothing new but `allowed`.
  void check(const std::set<std::string>& allowed) const {
    for (const auto& n : removed)
      EXPECT_FALSE(fs::exists(fs::symlink_status(dir / n))) << "stale " << n << " left";
    for (const auto& n : entries(dir))
      if (!listing.count(n)) EXPECT_TRUE(allowed.count(n)) << "unexpected new entry " << n;
    for (const auto& [n, before] : kept) EXPECT_EQ(describe(dir / n), before) << n << " was touched";
    EXPECT_EQ(tree_hash(victim), victim_hash) << "a symlink was followed";
  }
};

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

TEST(CrashSafety, NextRunSweepsStaleTemporariesOfDeadPidsOnly) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const Sleeper s1, s2;
  // Live owners: two other processes and this test (the writer is the csf child).
  const std::vector<pid_t> alive{s1.pid, ::getpid(), s2.pid};
  auto run_with_leftovers = [&](const std::string& verb, const fs::path& in, const fs::path& out) {
    SCOPED_TRACE(verb + " to " + out.filename().string());
    const Leftovers left(d.path, out.filename().string(), alive, rng);
    const RunResult r = run_csf({verb, "-q", in.string(), out.string()}, d.path / "err.txt");
    ASSERT_TRUE(r.exited_ok()) << r.err;
    left.check({out.filename().string(), "err.txt"});
  };
  const fs::path src = d.path / "model.safetensors";
  write_checkpoint(src, seed, 2, 256);
  const fs::path csf = d.path / "model.csf.safetensors", back = d.path / "model.back.safetensors";
  run_with_leftovers("compress", src, csf);
  run_with_leftovers("decompress", csf, back);
  EXPECT_EQ(read_bytes(back), read_bytes(src)) << "restored file differs";

  // A folder: the stale temporaries are folders too.
  const fs::path in = d.path / "ckpt";
  fs::create_directories(in);
  for (int s = 0; s < 2; ++s)
    write_checkpoint(in / ("model-0000" + std::to_string(s + 1) + "-of-00002.safetensors"), seed + s, 2, 128);
  std::ofstream(in / "config.json") << R"({"model_type": "test"})";
  const fs::path ccsf = d.path / "ckpt.csf", cback = d.path / "ckpt.back";
  run_with_leftovers("compress", in, ccsf);
  run_with_leftovers("decompress", ccsf, cback);
  EXPECT_EQ(tree_hash(cback), tree_hash(in)) << "restored folder differs";
}

TEST(CrashSafety, LibraryWriterSweepsStaleTemporariesOfDeadPidsOnly) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d, ref;
  const fs::path out = d.path / "w.safetensors";
  EXPECT_EQ(st::prepare_temporary(out), d.path / (".w.safetensors.tmp-" + std::to_string(::getpid())));
  const Sleeper s1, s2;  // this process is the writer here, so its own pid is not planted
  const Leftovers left(d.path, out.filename().string(), {s1.pid, s2.pid}, rng);
  write_checkpoint(out, seed, 2, 128);
  left.check({out.filename().string()});
  write_checkpoint(ref.path / "w.safetensors", seed, 2, 128);
  EXPECT_EQ(read_bytes(out), read_bytes(ref.path / "w.safetensors")) << "output differs from a clean write";
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
  // A live run's temporary in the folder: the error names it (it may be what filled the disk).
  const std::string busy = ".busy.safetensors.tmp-" + std::to_string(::getpid());
  write_bytes(d.path / busy, std::string(64, 1));
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
    EXPECT_NE(r.err.find(busy), std::string::npos) << "message does not name the other temporary: " << r.err;
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
