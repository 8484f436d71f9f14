// Writes the seed corpora of the fuzzers into <out>/<target>/:
// small native checkpoints and their CSF containers (NVFP4 row-major and
// swizzled, MXFP4 with ModelOpt and gpt-oss names, a tensor kept native, a
// passthrough tensor, metadata), and codec inputs in fuzz_csf_decode's
// format for every scale distribution. Deterministic: same seeds, same files.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "csf_fuzz_input.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;

namespace {

// A codec seed: `header`, then the recipe of `src` encoded on one thread.
std::vector<std::uint8_t> recipe_seed(std::span<const std::uint8_t> header, const GridShape& shape,
                                      const std::vector<std::uint8_t>& src) {
  CodecOptions o;
  o.threads = 1;
  std::vector<std::uint8_t> seed(header.begin(), header.end());
  const auto recipe = csfmoe_fuzz::write_recipe(encode(shape, src, o), src);
  seed.insert(seed.end(), recipe.begin(), recipe.end());
  return seed;
}

void put(const fs::path& p, const std::vector<std::uint8_t>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
std::vector<std::uint8_t> get(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

struct Layer {
  ScaleFormat format;
  ScaleLayout layout;
  bool gpt_oss;
  ScaleDistribution dist;
};

// One small MoE projection: weight + block scales (+ NVFP4 globals) and a
// BF16 passthrough tensor.
void write_checkpoint(const fs::path& p, const Layer& l, std::uint64_t seed) {
  const std::uint32_t E = 2, R = l.layout == ScaleLayout::swizzled_128x4 ? 128 : 64, K = 128;
  const std::uint32_t g = group_size(l.format);
  GridShape s{l.format, l.layout, E, R, K / g};
  if (l.layout == ScaleLayout::swizzled_128x4) s.cols = static_cast<std::uint32_t>(round_up(s.cols, 4));
  const auto scales = synthetic_scales(s, l.dist, seed);
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> w(std::size_t{E} * R * K / 2);
  for (auto& b : w) b = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> bf16(64);
  for (auto& b : bf16) b = static_cast<std::uint8_t>(rng());
  st::Writer out(p, 4096);
  const std::string x = "model.layers.0.mlp.experts.w13";
  if (l.gpt_oss) {
    out.add_tensor(x + "_blocks", st::Dtype::U8, {E, R, K / 32, 16}, w);
    out.add_tensor(x + "_scales", st::Dtype::U8, {E, s.rows, s.cols}, scales);
  } else {
    out.add_tensor(x + ".weight", st::Dtype::U8, {E, R, K / 2}, w);
    out.add_tensor(x + ".weight_scale", l.format == ScaleFormat::nvfp4 ? st::Dtype::F8_E4M3 : st::Dtype::U8,
                   {E, s.rows, s.cols}, scales);
    if (l.format == ScaleFormat::nvfp4) {
      const std::vector<std::uint8_t> one = {0, 0, 0x80, 0x3f};
      out.add_tensor(x + ".weight_scale_2", st::Dtype::F32, {}, one);
    }
  }
  out.add_tensor("model.norm.weight", st::Dtype::BF16, {32}, bf16);
  out.commit(st::Metadata{{"format", "pt"}});
}

// Adds records that win over their slot (b12x's and vLLM's readers allow
// them): on slots holding a non-zero code, and with bytes inside the row's
// window; records stay sorted.
void add_winning_records(CsfPlanes& p, std::mt19937_64& rng) {
  const PlaneShape& s = p.shape;
  const unsigned w = s.format == ScaleFormat::nvfp4 ? 16 : 2;
  const std::size_t row_bytes = s.format == ScaleFormat::nvfp4 ? s.cols / 2 : (s.cols + 7) / 8;
  const std::size_t slab = 16 * (1 + row_bytes);
  std::map<std::uint32_t, std::uint32_t> recs;
  for (const std::uint32_t r : p.exceptions) recs[exception_position(r)] = r;
  for (int i = 0; i < 6; ++i) {
    const std::uint32_t pos = static_cast<std::uint32_t>(rng() % (std::uint64_t{s.rows} * s.cols));
    const std::uint32_t r = pos / s.cols;
    const std::uint8_t base = p.fixed[(r / 16) * slab + r % 16];
    const std::uint8_t v = static_cast<std::uint8_t>(i % 2 ? base + rng() % w : base + w + rng() % (256 - w));
    recs[pos] = make_exception(pos, v);
  }
  p.exceptions.clear();
  for (const auto& [pos, r] : recs) p.exceptions.push_back(r);
}

// A file written the way b12x writes it: one expert projection's weight and
// its planes, the fixed plane 2-D or flat (U8 [n]), records that win or not.
void write_b12x_file(const fs::path& p, ScaleFormat f, bool flat, bool wins, std::uint64_t seed) {
  const std::uint32_t R = 32, K = 256, C = K / group_size(f);
  std::mt19937_64 rng(seed);
  const auto grid =
      synthetic_scales(GridShape{f, ScaleLayout::row_major, 1, R, C}, ScaleDistribution::realistic, seed);
  const std::string scale = "model.layers.0.mlp.experts.0.up_proj.weight_scale";
  CsfPlanes planes = encode_planes(PlaneShape{f, R, C}, grid, scale);
  if (wins) add_winning_records(planes, rng);
  std::vector<std::uint8_t> w(std::size_t{R} * K / 2);
  for (auto& b : w) b = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> rec(planes.exceptions.size() * 4);
  if (!rec.empty()) std::memcpy(rec.data(), planes.exceptions.data(), rec.size());
  st::Writer out(p, 4096);
  out.add_tensor("model.layers.0.mlp.experts.0.up_proj.weight", st::Dtype::U8, {R, K / 2}, w);
  const std::vector<std::uint64_t> shape = flat ? std::vector<std::uint64_t>{planes.fixed.size()}
                                                : std::vector<std::uint64_t>{R / 16, plane_slab_bytes(f, C)};
  out.add_tensor(b12x_fixed_name(scale, f), st::Dtype::U8, shape, planes.fixed);
  out.add_tensor(b12x_exceptions_name(scale, f), st::Dtype::U32, {planes.exceptions.size()}, rec);
  out.commit(st::Metadata{{"format", "pt"}});
}

// A fuzz_b12x_planes raw-planes input: the header and the fixed plane from
// the front; from the back (FuzzedDataProvider's order, high byte first) the
// tidy flag, the record count, the records, then 0 edits.
std::vector<std::uint8_t> raw_planes_seed(const std::uint8_t (&h)[3], const CsfPlanes& p) {
  std::vector<std::uint8_t> front(h, h + 3), tail;
  front.insert(front.end(), p.fixed.begin(), p.fixed.end());
  tail.push_back(0);  // tidy = false: the records are already sorted and inside the grid
  const std::size_t n = p.exceptions.size();
  tail.push_back(static_cast<std::uint8_t>(n >> 8));
  tail.push_back(static_cast<std::uint8_t>(n));
  for (const std::uint32_t r : p.exceptions)
    for (int k = 3; k >= 0; --k) tail.push_back(static_cast<std::uint8_t>(r >> (8 * k)));
  tail.push_back(0);  // no edits
  front.insert(front.end(), tail.rbegin(), tail.rend());
  return front;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fmt::print(stderr, "usage: {} OUT_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  for (const char* t : {"fuzz_safetensors_header", "fuzz_container", "fuzz_csf_decode", "fuzz_b12x_planes",
                        "fuzz_mxfp4_slabs"})
    fs::create_directories(out / t);
  const fs::path tmp = fs::temp_directory_path() / fmt::format("csfmoe-corpus-{}", ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  const Layer layers[] = {
      {ScaleFormat::nvfp4, ScaleLayout::row_major, false, ScaleDistribution::realistic},
      {ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, false, ScaleDistribution::realistic},
      {ScaleFormat::nvfp4, ScaleLayout::row_major, false, ScaleDistribution::uniform_random},  // kept native
      {ScaleFormat::mxfp4, ScaleLayout::row_major, false, ScaleDistribution::extremes},
      {ScaleFormat::mxfp4, ScaleLayout::row_major, true, ScaleDistribution::realistic},
  };
  int i = 0;
  for (const auto& l : layers) {
    const fs::path src = tmp / fmt::format("src{}.safetensors", i);
    const fs::path csf = tmp / fmt::format("csf{}.safetensors", i);
    write_checkpoint(src, l, 1000 + i);
    CompressOptions o;
    o.threads = 1;
    o.layout = l.layout;
    compress_checkpoint(src, csf, o);
    fs::copy_file(src, out / "fuzz_safetensors_header" / fmt::format("native{}", i));
    fs::copy_file(csf, out / "fuzz_safetensors_header" / fmt::format("container{}", i));
    fs::copy_file(csf, out / "fuzz_container" / fmt::format("container{}", i));
    ++i;
  }
  fs::remove_all(tmp);

  // Codec inputs: header + recipe of a synthetic grid, for each format,
  // layout and distribution; then a few raw-parts seeds.
  int n = 0;
  const ScaleDistribution dists[] = {ScaleDistribution::realistic, ScaleDistribution::dispersed,
                                     ScaleDistribution::uniform_random, ScaleDistribution::constant,
                                     ScaleDistribution::extremes};
  for (int f = 0; f < 2; ++f)
    for (int swz = 0; swz < 2; ++swz)
      for (const auto d : dists) {
        // rows selector 199 -> 200 rows (row-major) or 256 (swizzled); cols 20 / 24.
        const std::uint8_t h[5] = {static_cast<std::uint8_t>(f | (swz << 1) | ((n % 3 == 0) << 3)),
                                   static_cast<std::uint8_t>(n % 2), 199, 1,
                                   static_cast<std::uint8_t>(19 + 4 * swz)};
        const auto choice = csfmoe_fuzz::shape_from_header(h);
        put(out / "fuzz_csf_decode" / fmt::format("grid{}", n),
            recipe_seed(h, choice.shape, synthetic_scales(choice.shape, d, 77 + n)));
        ++n;
      }
  std::mt19937_64 rng(4242);
  for (int k = 0; k < 4; ++k) {
    std::vector<std::uint8_t> seed = {static_cast<std::uint8_t>(4 | (k & 1)), 0,
                                      static_cast<std::uint8_t>(k * 40), 0, static_cast<std::uint8_t>(8 + k)};
    for (int j = 0; j < 3000; ++j) seed.push_back(static_cast<std::uint8_t>(rng()));
    put(out / "fuzz_csf_decode" / fmt::format("raw{}", k), seed);
  }
  // b12x plane inputs: header (format, rows, cols selectors) + recipe, then raw planes.
  int m = 0;
  for (int f = 0; f < 2; ++f)
    for (const auto d : dists) {
      // rows selector 6 -> 112 rows; cols selector 17 -> 36 (NVFP4) / 18 (MXFP4) columns.
      const std::uint8_t h[3] = {static_cast<std::uint8_t>(f), 6, 17};
      const GridShape shape{f ? ScaleFormat::mxfp4 : ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 112,
                            f ? 18u : 36u};
      put(out / "fuzz_b12x_planes" / fmt::format("grid{}", m),
          recipe_seed(h, shape, synthetic_scales(shape, d, 500 + m)));
      ++m;
    }
  for (int k = 0; k < 4; ++k) {
    std::vector<std::uint8_t> seed = {static_cast<std::uint8_t>(2 | (k & 1)), static_cast<std::uint8_t>(k),
                                      static_cast<std::uint8_t>(5 + 7 * k)};
    for (int j = 0; j < 2000; ++j) seed.push_back(static_cast<std::uint8_t>(rng()));
    put(out / "fuzz_b12x_planes" / fmt::format("raw{}", k), seed);
  }
  // MXFP4 slab inputs: header (raw flag, rows, cols selectors) + recipe, at
  // short rows (C = 6, 12, 18, 20) and longer ones; then raw slab parts.
  int q = 0;
  for (const int cols : {6, 12, 18, 20, 40})
    for (const auto d : dists) {
      // 16 (1 + q % 8) rows; the cols selector is cols - 1.
      const std::uint8_t h[3] = {0, static_cast<std::uint8_t>(q % 8), static_cast<std::uint8_t>(cols - 1)};
      const GridShape shape{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 16u * (1 + q % 8),
                            static_cast<std::uint32_t>(cols)};
      put(out / "fuzz_mxfp4_slabs" / fmt::format("grid{}", q),
          recipe_seed(h, shape, synthetic_scales(shape, d, 900 + q)));
      ++q;
    }
  for (int k = 0; k < 4; ++k) {
    std::vector<std::uint8_t> seed = {2, static_cast<std::uint8_t>(k), static_cast<std::uint8_t>(5 + 6 * k)};
    for (int j = 0; j < 1500; ++j) seed.push_back(static_cast<std::uint8_t>(rng()));
    put(out / "fuzz_mxfp4_slabs" / fmt::format("raw{}", k), seed);
  }
  // Forms that b12x's and vLLM's readers accept (issue 31): files with flat
  // fixed planes and with records that win over their slot, and raw planes
  // with such records.
  for (int f = 0; f < 2; ++f) {
    const ScaleFormat fmt_ = f ? ScaleFormat::mxfp4 : ScaleFormat::nvfp4;
    const fs::path flat = tmp / "flat.safetensors", wins = tmp / "wins.safetensors";
    fs::create_directories(tmp);
    write_b12x_file(flat, fmt_, true, false, 7000 + f);
    write_b12x_file(wins, fmt_, f == 1, true, 7100 + f);
    fs::copy_file(flat, out / "fuzz_container" / fmt::format("b12x_flat{}", f));
    fs::copy_file(wins, out / "fuzz_container" / fmt::format("b12x_wins{}", f));
    fs::copy_file(wins, out / "fuzz_safetensors_header" / fmt::format("b12x_wins{}", f));
    fs::remove_all(tmp);
    // rows selector 2 -> 48 rows; cols selector 17 -> 36 (NVFP4) / 18 (MXFP4) columns.
    const std::uint8_t h[3] = {static_cast<std::uint8_t>(2 | f), 2, 17};
    const PlaneShape s{fmt_, 48, f ? 18u : 36u};
    std::mt19937_64 r2(7200 + f);
    CsfPlanes p = encode_planes(s,
                                synthetic_scales(GridShape{fmt_, ScaleLayout::row_major, 1, s.rows, s.cols},
                                                 ScaleDistribution::realistic, 7300 + f),
                                "seed");
    add_winning_records(p, r2);
    put(out / "fuzz_b12x_planes" / fmt::format("wins{}", f), raw_planes_seed(h, p));
  }
  fmt::print("wrote {} checkpoint seeds, {} codec seeds, {} plane seeds and {} slab seeds under {}\n", i + 6,
             n + 4, m + 6, q + 4, out.string());
  return 0;
}
