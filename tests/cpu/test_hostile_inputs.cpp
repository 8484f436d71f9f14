// Hostile checkpoints: headers that claim huge or overflowing tensors, header
// lengths of 2^63, shard indexes that point outside their folder or at
// missing files, symlink loops, container descriptors that claim huge grids.
// Each must be refused with a typed error whose message names the object and
// the reason, and without a big allocation: every case runs in a forked child
// whose peak RSS growth is measured (VmHWM after resetting it), so a parser
// that trusts a claimed size and allocates it fails the test even when the
// allocation would have succeeded.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;
using ojson = nlohmann::ordered_json;

namespace {

using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;

std::string with_length(std::uint64_t n, std::string_view rest) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + std::string(rest);
}
// A file with this header JSON (padded to 8) followed by `data`.
std::string st_file(const ojson& header, std::string_view data) {
  std::string json = header.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');
  return with_length(json.size(), json) + std::string(data);
}

std::uint64_t peak_rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6));
  return 0;
}
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return static_cast<bool>(f.flush());
}

struct Outcome {
  ErrorKind kind{};
  bool typed = false;
  std::string message;
  std::uint64_t rss_growth_kib = 0;
  bool rss_measured = false;
};

// Runs `op` in a child; it must throw a csfmoe::Error. Reports the error and
// how much the peak RSS grew while it ran.
Outcome run_hostile(const std::function<void()>& op) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) throw std::runtime_error("pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipefd[0]);
    const bool measured = reset_peak_rss();
    const std::uint64_t before = peak_rss_kib();
    ojson r;
    try {
      op();
      r["typed"] = false;
      r["message"] = "no error";
    } catch (const Error& e) {
      r["typed"] = true;
      r["kind"] = static_cast<int>(e.kind());
      r["message"] = e.what();
    } catch (const std::exception& e) {
      r["typed"] = false;
      r["message"] = std::string("untyped exception: ") + e.what();
    }
    const std::uint64_t after = peak_rss_kib();
    r["rss"] = after > before ? after - before : 0;
    r["measured"] = measured;
    const std::string s = r.dump();
    (void)!::write(pipefd[1], s.data(), s.size());
    ::close(pipefd[1]);
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string s;
  char buf[4096];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) s.append(buf, static_cast<std::size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome o;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || s.empty()) {
    o.message = "child died (status " + std::to_string(status) + ")";
    return o;
  }
  const ojson r = ojson::parse(s);
  o.typed = r["typed"].get<bool>();
  if (o.typed) o.kind = static_cast<ErrorKind>(r["kind"].get<int>());
  o.message = r["message"].get<std::string>();
  o.rss_growth_kib = r["rss"].get<std::uint64_t>();
  o.rss_measured = r["measured"].get<bool>();
  return o;
}

// The allocation budget of a hostile case: far below any claimed size, far
// above what parsing a few-KiB file needs (sanitizer builds included).
constexpr std::uint64_t kRssBudgetKib = 64 * 1024;

void expect_refused(const std::function<void()>& op, ErrorKind kind,
                    std::initializer_list<std::string> parts) {
  const Outcome o = run_hostile(op);
  ASSERT_TRUE(o.typed) << o.message;
  EXPECT_EQ(static_cast<int>(o.kind), static_cast<int>(kind)) << o.message;
  for (const auto& p : parts)
    EXPECT_NE(o.message.find(p), std::string::npos) << "'" << p << "' not in: " << o.message;
  if (o.rss_measured) EXPECT_LT(o.rss_growth_kib, kRssBudgetKib) << o.message;
}

ojson tensor(const std::string& dtype, std::vector<std::uint64_t> shape, std::uint64_t b, std::uint64_t e) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {b, e}}};
}

// A small, valid, compressible NVFP4 checkpoint written with the library.
void write_checkpoint(const fs::path& p, std::uint64_t seed, std::uint32_t experts = 2) {
  const std::uint32_t R = 128, K = 256;
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, experts, R, K / 16};
  const auto scales = synthetic_scales(g, ScaleDistribution::realistic, seed);
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> w(std::size_t{experts} * R * K / 2);
  for (auto& b : w) b = static_cast<std::uint8_t>(rng());
  st::Writer out(p, 4096);
  out.add_tensor("layers.0.experts.w13.weight", st::Dtype::U8, {experts, R, K / 2}, w);
  out.add_tensor("layers.0.experts.w13.weight_scale", st::Dtype::F8_E4M3, {experts, R, K / 16}, scales);
  out.commit(std::nullopt);
}

// Re-writes a file's header JSON (same data section) after `edit`.
void edit_header(const fs::path& p, const std::function<void(ojson&)>& edit) {
  const std::string bytes = read_bytes(p);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  ojson h = ojson::parse(bytes.substr(8, n));
  edit(h);
  std::string json = h.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');
  write_bytes(p, with_length(json.size(), json) + bytes.substr(8 + n));
}

}  // namespace

TEST(HostileHeader, LengthOf2To63IsRefusedWithoutAllocating) {
  TempDir d;
  const fs::path p = d.path / "huge_len.safetensors";
  write_bytes(p, with_length(std::uint64_t{1} << 63, "{}      "));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {p.string(), "header length", "limit"});
  // Below the cap but past the end of the file.
  write_bytes(p, with_length(4096, "{}      "));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format,
                 {p.string(), "runs past the end of the file"});
}

TEST(HostileHeader, TensorClaimingHugeSizeIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path p = d.path / "huge_tensor.safetensors";
  // 2^40..2^62 bytes claimed by a file of a few hundred bytes.
  const std::uint64_t claim = std::uint64_t{1} << (40 + rng() % 23);
  ojson h = {{"model.big.weight", tensor("U8", {claim}, 0, claim)}};
  write_bytes(p, st_file(h, std::string(64, 'x')));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format,
                 {p.string(), "model.big.weight", "past the end of the data section"});
  expect_refused([&] { inspect_checkpoint(p); }, ErrorKind::format, {"model.big.weight"});
  // A header claiming 2^63 bytes of data offsets.
  h = {{"t", tensor("U8", {std::uint64_t{1} << 63}, 0, std::uint64_t{1} << 63)}};
  write_bytes(p, st_file(h, "12345678"));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'t'", "past the end"});
}

TEST(HostileHeader, ShapeProductOverflowingU64IsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path p = d.path / "overflow.safetensors";
  // Dimensions whose product wraps to a small number (or zero) modulo 2^64.
  const std::uint64_t a = std::uint64_t{1} << (32 + rng() % 16);
  const std::uint64_t b = (std::uint64_t{1} << 63) / a * 4;  // a * b = 2^65 wraps to 0
  ojson h = {{"wrap", tensor("BF16", {a, b}, 0, 0)}};
  write_bytes(p, st_file(h, ""));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'wrap'", "shape product overflows"});
  // Product fits but times the dtype size does not: 2^62 F32 elements claim 2^64 bytes.
  h = {{"wrap32", tensor("F32", {std::uint64_t{1} << 62}, 0, 16)}};
  write_bytes(p, st_file(h, std::string(16, '\0')));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'wrap32'", "data_offsets"});
}

TEST(HostileHeader, NegativeAndFractionalAndDuplicateEntriesAreRefused) {
  TempDir d;
  const fs::path p = d.path / "bad.safetensors";
  write_bytes(p, st_file(ojson::parse(R"({"t":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})"), "abcd"));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'t'", "shape[0]", "non-negative integer"});
  write_bytes(p, st_file(ojson::parse(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4.5]}})"), "abcd"));
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'t'", "data_offsets[1]"});
  const std::string dup =
      R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  write_bytes(p, with_length(dup.size(), dup) + "abcd");
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {"'t'", "duplicate"});
}

TEST(HostileHeader, BytesHiddenAfterANulAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path p = d.path / "nul.safetensors";
  // Valid JSON, then a NUL and non-UTF-8 bytes: the JSON lexer would stop at
  // the NUL; the reference loader refuses the header.
  std::string json = R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  const std::size_t at = json.size() + rng() % 8;
  json.resize(at, ' ');
  json += '\0';
  for (int i = 0; i < 7; ++i) json += static_cast<char>(0x80 | (rng() & 0x7F));
  write_bytes(p, with_length(json.size(), json) + "abcd");
  expect_refused([&] { st::File::open(p); }, ErrorKind::format, {p.string(), "NUL byte", std::to_string(at)});
  expect_refused([&] { inspect_checkpoint(p); }, ErrorKind::format, {"NUL byte"});
}

TEST(HostileContainer, DescriptorClaimingHugeGridIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path src = d.path / "src.safetensors", csf = d.path / "csf.safetensors";
  write_checkpoint(src, seed);
  CompressOptions o;
  o.threads = 1;
  compress_checkpoint(src, csf, o);
  const std::string name = "layers.0.experts.w13.weight_scale";
  const std::string clean = read_bytes(csf);
  auto tamper = [&](const std::function<void(ojson&)>& edit) {
    write_bytes(csf, clean);
    edit_header(csf, [&](ojson& h) {
      ojson desc = ojson::parse(h["__metadata__"]["csfmoe.container"].get<std::string>());
      edit(desc["tensors"][name]);
      h["__metadata__"]["csfmoe.container"] = desc.dump();
    });
  };
  // 2^32-1 experts: the parts would be terabytes; the file holds kilobytes.
  tamper([](ojson& t) { t["grid"][0] = 0xFFFFFFFFu; });
  expect_refused([&] { verify_checkpoint(csf, o); }, ErrorKind::format, {name, "CSF part", "shape"});
  // A storage this version does not know.
  tamper([](ojson& t) { t["storage"] = "sparse"; });
  expect_refused([&] { verify_checkpoint(csf, o); }, ErrorKind::format, {name, "storage", "sparse"});
  // An expert grid beyond the 24-bit positions.
  tamper([&](ojson& t) {
    t["grid"][1] = 1u << (12 + rng() % 8);
    t["grid"][2] = 1u << 12;
  });
  expect_refused([&] { verify_checkpoint(csf, o); }, ErrorKind::format, {name, "invalid grid", "24-bit"});
  // 2^40 exception records claimed.
  tamper([](ojson& t) { t["exceptions"] = std::uint64_t{1} << 40; });
  expect_refused([&] { verify_checkpoint(csf, o); }, ErrorKind::format, {name, "csf.exceptions", "shape"});
  // A restore record claiming a 2^62-byte original.
  write_bytes(csf, clean);
  edit_header(csf, [](ojson& h) {
    ojson orig = ojson::parse(h["__metadata__"]["csfmoe.original"].get<std::string>());
    orig["file_size"] = std::uint64_t{1} << 62;
    h["__metadata__"]["csfmoe.original"] = orig.dump();
  });
  expect_refused([&] { verify_checkpoint(csf, o); }, ErrorKind::format,
                 {csf.string(), "original data bytes"});
}

class HostileFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    ckpt = d.path / "ckpt";
    fs::create_directories(ckpt);
    write_checkpoint(ckpt / "model-00001-of-00001.safetensors", 7);
  }
  void write_index(const std::string& shard) {
    ojson idx = {{"metadata", {{"total_size", 1}}},
                 {"weight_map",
                  {{"layers.0.experts.w13.weight", "model-00001-of-00001.safetensors"},
                   {"layers.0.experts.w13.weight_scale", shard}}}};
    write_bytes(ckpt / st::kIndexFileName, idx.dump());
  }
  void expect_compress_refused(std::initializer_list<std::string> parts) {
    const fs::path out = d.path / "out";
    expect_refused(
        [&] {
          CompressOptions o;
          o.threads = 1;
          compress_checkpoint(ckpt, out, o);
        },
        ErrorKind::format, parts);
    EXPECT_FALSE(fs::exists(out));
    for (const auto& e : fs::directory_iterator(d.path))
      EXPECT_EQ(e.path().filename().string().find(".out.tmp"), std::string::npos) << e.path();
  }
  TempDir d;
  fs::path ckpt;
};

TEST_F(HostileFolder, IndexPathTraversalIsRefused) {
  write_checkpoint(d.path / "outside.safetensors", 8);
  const std::vector<std::string> evils = {"../outside.safetensors",
                                          (d.path / "outside.safetensors").string(),
                                          "..",
                                          ".",
                                          "sub/../../outside.safetensors",
                                          "..\\outside.safetensors"};
  for (const std::string& evil : evils) {
    SCOPED_TRACE(evil);
    write_index(evil);
    expect_refused([&] { st::read_shard_index(ckpt / st::kIndexFileName); }, ErrorKind::format,
                   {st::kIndexFileName.data(), "layers.0.experts.w13.weight_scale", "not a plain file name"});
    expect_compress_refused({"not a plain file name"});
  }
}

TEST_F(HostileFolder, SymlinkLeavingTheFolderIsRefused) {
  write_checkpoint(d.path / "outside.safetensors", 8);
  fs::create_symlink(d.path / "outside.safetensors", ckpt / "evil.safetensors");
  write_index("evil.safetensors");
  expect_refused([&] { st::read_shard_index(ckpt / st::kIndexFileName); }, ErrorKind::format,
                 {"evil.safetensors", "leaves the folder"});
  // Even without an index, a top-level shard symlinked outside is refused.
  fs::remove(ckpt / st::kIndexFileName);
  expect_compress_refused({"evil.safetensors", "leaves the folder"});
}

TEST_F(HostileFolder, MissingShardIsRefused) {
  write_index("model-00002-of-00002.safetensors");
  expect_refused([&] { st::read_shard_index(ckpt / st::kIndexFileName); }, ErrorKind::format,
                 {"model-00002-of-00002.safetensors", "does not exist"});
  expect_compress_refused({"model-00002-of-00002.safetensors", "does not exist"});
}

TEST_F(HostileFolder, SymlinkLoopIsRefused) {
  fs::create_symlink("b.safetensors", ckpt / "a.safetensors");
  fs::create_symlink("a.safetensors", ckpt / "b.safetensors");
  write_index("a.safetensors");
  expect_refused([&] { st::read_shard_index(ckpt / st::kIndexFileName); }, ErrorKind::format,
                 {"a.safetensors", "symlink loop"});
  fs::remove(ckpt / st::kIndexFileName);
  expect_compress_refused({"a.safetensors", "symlink loop"});
  // A self-loop among the other files of the folder (copied, not parsed).
  fs::remove(ckpt / "a.safetensors");
  fs::remove(ckpt / "b.safetensors");
  fs::create_symlink("config.json", ckpt / "config.json");
  expect_compress_refused({"config.json", "symlink loop"});
}

TEST_F(HostileFolder, OtherFileSymlinkedOutsideIsNotCopied) {
  // A downloaded folder must not make compress copy a file from elsewhere on
  // this machine (e.g. a key) into its output.
  write_bytes(d.path / "secret.txt", "not for the output");
  fs::create_symlink(d.path / "secret.txt", ckpt / "tokenizer.json");
  expect_compress_refused({"tokenizer.json", "leaves the folder"});
}

TEST_F(HostileFolder, IndexNamingATensorTheShardLacksIsRefused) {
  ojson idx = {{"weight_map", {{"no.such.tensor", "model-00001-of-00001.safetensors"}}}};
  write_bytes(ckpt / st::kIndexFileName, idx.dump());
  expect_compress_refused({"no.such.tensor", "has no such tensor"});
}
