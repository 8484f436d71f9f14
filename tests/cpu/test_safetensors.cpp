// safetensors reader/writer: round trips, every validation rule, atomic
// output and shard-index path checks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;
using ojson = nlohmann::ordered_json;

namespace {

using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;

// A file from raw header text and data, independent of the library's writer.
std::string raw_file(const std::string& header, const std::string& data,
                     std::uint64_t declared_len = UINT64_MAX) {
  std::string out(8, '\0');
  const std::uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Expects FormatError from File::open whose message names the file and every `needles`.
void expect_format_error(const fs::path& p, std::vector<std::string> needles) {
  try {
    (void)st::File::open(p);
    FAIL() << "no FormatError for " << p;
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(p.string()), std::string::npos) << m;
    for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' not in: " << m;
  }
}

}  // namespace

TEST(Safetensors, DtypeTable) {
  const std::vector<std::pair<std::string, std::size_t>> all = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8}};
  for (const auto& [n, s] : all) {
    auto d = st::parse_dtype(n);
    ASSERT_TRUE(d) << n;
    EXPECT_EQ(st::to_string(*d), n);
    EXPECT_EQ(st::dtype_size(*d), s) << n;
  }
  EXPECT_FALSE(st::parse_dtype("F4"));
  EXPECT_FALSE(st::parse_dtype("bf16"));
  EXPECT_FALSE(st::parse_dtype(""));
}

TEST(Safetensors, WriterRoundTripRandomTensors) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::vector<st::Dtype> dts = {st::Dtype::U8,  st::Dtype::BF16, st::Dtype::F32, st::Dtype::F8_E4M3,
                                      st::Dtype::I64, st::Dtype::U32,  st::Dtype::BOOL};
  struct T {
    std::string name;
    st::Dtype d;
    std::vector<std::uint64_t> shape;
    std::vector<std::uint8_t> bytes;
  };
  std::vector<T> ts;
  const int n = 1 + static_cast<int>(rng() % 12);
  for (int i = 0; i < n; ++i) {
    T t;
    t.name = "layer." + std::to_string(i) + (i % 3 ? ".weight" : ".bias \xc3\xa9");  // includes UTF-8
    t.d = dts[rng() % dts.size()];
    const int rank = static_cast<int>(rng() % 4);
    std::uint64_t el = 1;
    for (int r = 0; r < rank; ++r) {
      t.shape.push_back(rng() % 7);
      el *= t.shape.back();
    }
    t.bytes.resize(el * st::dtype_size(t.d));
    for (auto& b : t.bytes) b = static_cast<std::uint8_t>(rng());
    ts.push_back(std::move(t));
  }
  st::Metadata md = {{"format", "pt"}, {"note", "quote \" and \\ backslash"}};
  const fs::path p = dir.path / "a.safetensors";
  {
    st::Writer w(p, 4096);
    for (const auto& t : ts) {
      // Stream in two pieces to exercise partial writes.
      const std::size_t half = t.bytes.size() / 2;
      w.begin_tensor(t.name, t.d, t.shape);
      w.write(std::span(t.bytes).subspan(0, half));
      w.write(std::span(t.bytes).subspan(half));
      w.end_tensor();
    }
    w.commit(md);
  }
  EXPECT_EQ(dir.entries(), std::set<std::string>{"a.safetensors"});
  const st::File f = st::File::open(p);
  EXPECT_EQ(f.data_offset() % 8, 0u);
  ASSERT_EQ(f.tensors().size(), ts.size());
  ASSERT_TRUE(f.header().metadata);
  EXPECT_EQ(*f.header().metadata, md);
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const auto& got = f.tensors()[i];
    EXPECT_EQ(got.name, ts[i].name);
    EXPECT_EQ(got.dtype, ts[i].d);
    EXPECT_EQ(got.shape, ts[i].shape);
    EXPECT_EQ(got.begin, pos);  // contiguous, as the reference loader requires
    pos = got.end;
    const auto d = f.data(got);
    EXPECT_TRUE(std::equal(d.begin(), d.end(), ts[i].bytes.begin(), ts[i].bytes.end())) << got.name;
  }
  EXPECT_EQ(pos, f.data_size());
  // Padding is spaces only.
  const std::string_view h = f.header_bytes();
  const auto close = h.find_last_of('}');
  EXPECT_EQ(h.find_first_not_of(' ', close + 1), std::string_view::npos);
}

TEST(Safetensors, WriterRejectsWrongByteCountAndTinyReservation) {
  TempDir dir;
  {
    st::Writer w(dir.path / "x.safetensors", 1024);
    w.begin_tensor("t", st::Dtype::F32, {3});
    const std::vector<std::uint8_t> b(11);
    w.write(b);
    EXPECT_THROW(w.end_tensor(), InvalidArgument);
  }
  {
    st::Writer w(dir.path / "y.safetensors", 4);
    const std::vector<std::uint8_t> b(4);
    w.add_tensor("a_long_tensor_name", st::Dtype::F32, {1}, b);
    EXPECT_THROW(w.commit(std::nullopt), Unsupported);
  }
  EXPECT_TRUE(dir.entries().empty()) << "temporaries left behind";
}

TEST(Safetensors, AtomicFileRefusesExistingAndCleansUp) {
  TempDir dir;
  write_bytes(dir.path / "out", "keep");
  {
    st::AtomicFile f(dir.path / "out");
    f.write(std::string_view("new"));
    EXPECT_THROW(f.commit(), InvalidArgument);
  }
  EXPECT_EQ(read_bytes(dir.path / "out"), "keep");
  {
    st::AtomicFile f(dir.path / "other");
    f.write(std::string_view("abc"));
  }
  EXPECT_EQ(dir.entries(), std::set<std::string>{"out"});
}

TEST(Safetensors, AcceptsTrailingSpacesAndGapsAndKeepsHeaderVerbatim) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::size_t spaces = rng() % 50;
  const std::string json = R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},)"
                           R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})" +
                           std::string(spaces, ' ');
  std::string data(24, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  const fs::path p = dir.path / "g.safetensors";
  write_bytes(p, raw_file(json, data));
  const st::File f = st::File::open(p);
  EXPECT_EQ(f.header_bytes(), json);
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "b");  // file order kept
  EXPECT_FALSE(f.header().metadata);
  EXPECT_EQ(f.data_size(), 24u);
  EXPECT_EQ(std::memcmp(f.data(*f.find("b")).data(), data.data() + 12, 8), 0);
}

TEST(Safetensors, RejectsMalformedFiles) {
  TempDir dir;
  int i = 0;
  auto file = [&](const std::string& bytes) {
    const fs::path p = dir.path / ("bad" + std::to_string(i++) + ".safetensors");
    write_bytes(p, bytes);
    return p;
  };
  const std::string ok_t = R"("t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
  const std::string data16(16, 'x');

  expect_format_error(file("abc"), {"shorter than the 8-byte"});
  expect_format_error(file(raw_file("{" + ok_t + "}", data16, 5000)), {"header length 5000", "past the end"});
  expect_format_error(file(raw_file("{}", "", 200'000'000)), {"header length 200000000", "limit"});
  expect_format_error(file(raw_file("{\"t\":", data16)), {"not valid JSON"});
  expect_format_error(file(raw_file("[1,2]", data16)), {"not a JSON object"});
  expect_format_error(file(raw_file("{" + ok_t + "," + ok_t + "}", data16)), {"'t'", "duplicate"});
  expect_format_error(
      file(raw_file(R"({"t":{"dtype":"F32","dtype":"U8","shape":[16],"data_offsets":[0,16]}})", data16)),
      {"duplicate key 'dtype'"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", data16)),
                      {"'t'", "unknown dtype 'F4'"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", data16)),
                      {"'t'", "shape[0]"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", data16)),
                      {"'t'", "shape[0]"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})", data16)),
                      {"'t'", "data_offsets"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"U8","shape":[20],"data_offsets":[0,20]}})", data16)),
                      {"'t'", "past the end of the data section"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", data16)),
                      {"'t'", "begin after end"});
  expect_format_error(file(raw_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data16)),
                      {"'t'", "16 bytes", "needs 12"});
  expect_format_error(file(raw_file(R"({"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},)"
                                    R"("b":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})",
                                    data16)),
                      {"'b'", "overlaps", "'a'"});
  expect_format_error(file(raw_file(R"({"__metadata__":{"k":1},)" + ok_t + "}", data16)),
                      {"__metadata__", "'k'"});
  expect_format_error(file(raw_file(R"({"__metadata__":[1],)" + ok_t + "}", data16)), {"__metadata__"});
  expect_format_error(file(raw_file(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", data16)),
                      {"empty name"});
  expect_format_error(
      file(raw_file("{\"t\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", data16)),
      {"not valid JSON"});
  expect_format_error(
      file(raw_file(R"({"t":{"dtype":"U8","shape":[[[[1]]]],"data_offsets":[0,1]}})", data16)),
      {"nests deeper"});
  expect_format_error(
      file(raw_file(R"({"t":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,1]}})",
                    data16)),
      {"'t'", "overflow"});
}

TEST(Safetensors, RandomByteFlipsNeverCrashTheParser) {
  // Hostile headers must fail with FormatError (or parse), never anything else.
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})";
  const std::string good = raw_file(json, std::string(16, 'z'));
  for (int it = 0; it < 300; ++it) {
    std::string b = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng());
    const fs::path p = dir.path / "f.safetensors";
    write_bytes(p, b);
    try {
      const st::File f = st::File::open(p);
      for (const auto& t : f.tensors()) EXPECT_LE(t.end, f.data_size());
    } catch (const FormatError&) {
    }
    fs::remove(p);
  }
}

TEST(Safetensors, ShardIndexPathRules) {
  TempDir dir;
  const fs::path folder = dir.path / "ckpt";
  fs::create_directories(folder);
  write_bytes(folder / "s1.safetensors", "x");
  write_bytes(dir.path / "outside.safetensors", "y");
  fs::create_symlink("s1.safetensors", folder / "inside_link.safetensors");
  fs::create_symlink("../outside.safetensors", folder / "escape.safetensors");
  auto index_with = [&](const std::string& shard) {
    ojson j;
    j["metadata"] = {{"total_size", 1}};
    j["weight_map"] = {{"a", "s1.safetensors"}, {"b", shard}};
    write_bytes(folder / "model.safetensors.index.json", j.dump());
    return folder / "model.safetensors.index.json";
  };
  {
    const auto idx = st::read_shard_index(index_with("inside_link.safetensors"));
    EXPECT_EQ(idx.shards, (std::vector<std::string>{"s1.safetensors", "inside_link.safetensors"}));
    EXPECT_EQ(idx.weight_map.size(), 2u);
    EXPECT_EQ(idx.raw, read_bytes(folder / "model.safetensors.index.json"));
  }
  for (const std::string bad : {"../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "..", "",
                                "missing.safetensors", "escape.safetensors"}) {
    const auto p = index_with(bad);
    try {
      (void)st::read_shard_index(p);
      ADD_FAILURE() << "accepted shard '" << bad << "'";
    } catch (const FormatError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(p.string()), std::string::npos) << m;
      EXPECT_NE(m.find("weight_map['b']"), std::string::npos) << m;
    }
  }
  write_bytes(folder / "model.safetensors.index.json",
              R"({"weight_map":{"a":"s1.safetensors","a":"s1.safetensors"}})");
  EXPECT_THROW((void)st::read_shard_index(folder / "model.safetensors.index.json"), FormatError);
  write_bytes(folder / "model.safetensors.index.json", R"({"weight_map":{"a":3}})");
  EXPECT_THROW((void)st::read_shard_index(folder / "model.safetensors.index.json"), FormatError);
}
