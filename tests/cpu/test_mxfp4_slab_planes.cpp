// MXFP4 slab planes (docs/csf-format.md, "MXFP4 slab planes"): the encoder
// against one written here from the documented layout, exact round trips to
// b12x's planes on realistic and adversarial grids, refusal of tampered
// parts, and the container storage mxfp4_slab: chosen only when smaller,
// version 3, byte-exact restore and the same resident form as the planes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/mxfp4_slab_planes.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;
using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;
constexpr ScaleFormat kMx = ScaleFormat::mxfp4;

// --- the documented slab layout, written independently -----------------------
struct RefSlabs {
  Bytes slabs, escapes;
};

RefSlabs reference_slabs(const CsfPlanes& p) {
  const std::uint32_t C = p.shape.cols, row_bytes = (C + 7) / 8;
  const std::size_t in_slab = 16 * (1 + row_bytes), out_slab = 5 + 2 * std::size_t{C};
  RefSlabs out;
  out.slabs.assign(p.shape.rows / 16 * out_slab, 0);
  for (std::uint32_t s = 0; s < p.shape.rows / 16; ++s) {
    const std::uint8_t* in = p.fixed.data() + s * in_slab;
    std::uint8_t* o = out.slabs.data() + s * out_slab;
    int slab_base = 0, best = -1;
    for (int b = 0; b <= 254; ++b) {
      int n = 0;
      for (int i = 0; i < 16; ++i) n += in[i] >= b && in[i] <= b + 2;
      if (n > best) best = n, slab_base = b;
    }
    o[0] = static_cast<std::uint8_t>(slab_base);
    for (int i = 0; i < 16; ++i) {
      const int d = int(in[i]) - slab_base;
      const int code = d >= 0 && d <= 2 ? d : 3;
      o[1 + i / 4] = static_cast<std::uint8_t>(o[1 + i / 4] | code << (2 * (i % 4)));
      if (code == 3) out.escapes.push_back(in[i]);
    }
    for (std::uint32_t i = 0; i < 16; ++i)
      for (std::uint32_t c = 0; c < C; ++c) {
        const unsigned bit = (in[16 + i * row_bytes + c / 8] >> (c % 8)) & 1;
        const std::uint32_t k = i * C + c;
        o[5 + k / 8] = static_cast<std::uint8_t>(o[5 + k / 8] | bit << (k % 8));
      }
  }
  return out;
}

// --- grids ----------------------------------------------------------------------
enum class Regime { realistic, wide_bases, all_equal, uniform, edges, drift };

Bytes make_grid(std::uint32_t R, std::uint32_t C, Regime regime, std::mt19937_64& rng) {
  Bytes g(std::size_t{R} * C);
  auto row_of = [&](std::uint32_t r, int base, double exc) {
    for (std::uint32_t c = 0; c < C; ++c) {
      int v = base + int(rng() % 2);
      if (std::uniform_real_distribution<>(0, 1)(rng) < exc) v = int(rng() % 256);
      g[std::size_t{r} * C + c] = static_cast<std::uint8_t>(std::clamp(v, 0, 255));
    }
  };
  switch (regime) {
    case Regime::realistic:
      return synthetic_scales(GridShape{kMx, ScaleLayout::row_major, 1, R, C}, ScaleDistribution::realistic,
                              rng());
    case Regime::wide_bases:  // every row its own base anywhere in the byte range: escapes
      for (std::uint32_t r = 0; r < R; ++r) row_of(r, int(rng() % 255), 0.05);
      break;
    case Regime::all_equal:
      std::fill(g.begin(), g.end(), std::uint8_t(rng() % 256));
      break;
    case Regime::uniform:
      for (auto& x : g) x = static_cast<std::uint8_t>(rng());
      break;
    case Regime::edges:  // bases 0, 253, 254 and rows of 0xFF next to each other
      for (std::uint32_t r = 0; r < R; ++r) {
        const int pick = int(rng() % 4);
        if (pick == 3)
          std::fill_n(g.begin() + std::ptrdiff_t(std::size_t{r} * C), C, std::uint8_t{0xFF});
        else
          row_of(r, pick == 0 ? 0 : 252 + pick, 0.02);
      }
      break;
    case Regime::drift:  // bases climb by one per row: deltas 0..4 and beyond in a slab
      for (std::uint32_t r = 0; r < R; ++r) row_of(r, 100 + int(r % 16) * int(1 + rng() % 2), 0.01);
      break;
  }
  return g;
}

const char* regime_name(Regime r) {
  switch (r) {
    case Regime::realistic:
      return "realistic";
    case Regime::wide_bases:
      return "wide_bases";
    case Regime::all_equal:
      return "all_equal";
    case Regime::uniform:
      return "uniform";
    case Regime::edges:
      return "edges";
    case Regime::drift:
      return "drift";
  }
  return "?";
}

constexpr Regime kRegimes[] = {Regime::realistic, Regime::wide_bases, Regime::all_equal,
                               Regime::uniform,   Regime::edges,      Regime::drift};

TEST(Mxfp4SlabPlanes, MatchTheDocumentedLayoutAndGiveThePlanesBack) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> cols;
  for (std::uint32_t c = 1; c <= 24; ++c) cols.push_back(c);
  for (std::uint32_t c : {31u, 32u, 33u, 48u, 56u, 57u, 90u, 128u}) cols.push_back(c);
  for (const std::uint32_t C : cols)
    for (const Regime regime : kRegimes) {
      const std::uint32_t R = 16 * (1 + rng() % 6);
      const PlaneShape s{kMx, R, C};
      SCOPED_TRACE(::testing::Message() << to_string(s) << " " << regime_name(regime));
      const Bytes native = make_grid(R, C, regime, rng);
      const CsfPlanes planes = encode_planes(s, native, "t");
      const Mxfp4SlabPlanes slabs = planes_to_mxfp4_slabs(planes, "t");
      const RefSlabs want = reference_slabs(planes);
      ASSERT_EQ(slabs.slabs, want.slabs);
      ASSERT_EQ(slabs.escapes, want.escapes);
      EXPECT_EQ(slabs.exceptions, planes.exceptions);
      EXPECT_EQ(slabs.slabs.size(), mxfp4_slab_plane_bytes(s));
      EXPECT_EQ(mxfp4_slab_escape_count(s, slabs.slabs, "t"), slabs.escapes.size());
      const CsfPlanes back = mxfp4_slabs_to_planes(slabs, "t");
      ASSERT_EQ(back.shape, s);
      ASSERT_EQ(back.fixed, planes.fixed);
      ASSERT_EQ(back.exceptions, planes.exceptions);
      EXPECT_EQ(decode_planes(back, "t"), native);
      const std::vector<Mxfp4SlabPlanes> one{slabs};
      EXPECT_EQ(mxfp4_slabs_stored_bytes(one),
                slabs.slabs.size() + slabs.escapes.size() + 4 * slabs.exceptions.size() + 4);
    }
}

// Escapes hold exactly the rows outside [slab base, slab base + 2]; a slab of
// one base needs none, and the lowest of tied slab bases wins.
TEST(Mxfp4SlabPlanes, EscapesAreTheRowsOutsideTheSlabRange) {
  const std::uint32_t C = 12;
  const PlaneShape s{kMx, 32, C};
  Bytes native(std::size_t{32} * C);
  // A row of one value v has base v - 1 (the lowest window holding it).
  // Slab 0: bases 40, 41, 42 except rows 3 (43) and 9 (7); slab 1: bases 10
  // and 20, eight each: [8, 10] is the lowest range holding eight.
  for (std::uint32_t r = 0; r < 32; ++r) {
    int base = r < 16 ? 40 + int(r % 3) : (r % 2 ? 20 : 10);
    if (r == 3) base = 43;
    if (r == 9) base = 7;
    std::fill_n(native.begin() + std::ptrdiff_t(r * C), C, std::uint8_t(base + 1));
  }
  const Mxfp4SlabPlanes p = planes_to_mxfp4_slabs(encode_planes(s, native, "t"), "t");
  EXPECT_EQ(p.slabs[0], 40);
  EXPECT_EQ(p.slabs[mxfp4_slab_bytes(C)], 8);
  EXPECT_EQ(p.escapes, (Bytes{43, 7, 20, 20, 20, 20, 20, 20, 20, 20}));
  EXPECT_EQ(decode_planes(mxfp4_slabs_to_planes(p, "t"), "t"), native);
}

TEST(Mxfp4SlabPlanes, BadShapesAreInvalidArguments) {
  const Bytes nv(16 * 4, 0x38);
  const CsfPlanes nvfp4 = encode_planes({ScaleFormat::nvfp4, 16, 4}, nv, "t");
  EXPECT_THROW(planes_to_mxfp4_slabs(nvfp4, "t"), InvalidArgument);
  EXPECT_THROW(mxfp4_slabs_to_planes({ScaleFormat::nvfp4, 16, 4}, Bytes(13), {}, {}, "t"), InvalidArgument);
  EXPECT_THROW(mxfp4_slabs_to_planes({kMx, 24, 4}, Bytes(13), {}, {}, "t"), InvalidArgument);
  EXPECT_THROW(mxfp4_slabs_to_planes({kMx, 16, 0}, Bytes(5), {}, {}, "t"), InvalidArgument);
}

// --- tampering --------------------------------------------------------------------
const char* kName = "model.layers.5.mlp.experts.2.w1.scale";

void expect_refused(const PlaneShape& s, const Bytes& slabs, const Bytes& escapes,
                    const std::vector<std::uint32_t>& records, const char* reason) {
  try {
    mxfp4_slabs_to_planes(s, slabs, escapes, records, kName);
    ADD_FAILURE() << "accepted; expected refusal for: " << reason;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(kName), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

TEST(Mxfp4SlabPlanes, TamperedPartsAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint32_t C = 6 + rng() % 19, R = 48;
  const PlaneShape s{kMx, R, C};
  SCOPED_TRACE(to_string(s));
  Bytes native = make_grid(R, C, Regime::realistic, rng);
  // Row 0 far from the others (an escape), records in rows 0 and 1, slab 2 of
  // bases 120 (no escapes).
  for (std::uint32_t c = 0; c < C; ++c) native[c] = std::uint8_t(200 + c % 2);
  for (std::uint32_t i = 32 * C; i < 48 * C; ++i) native[i] = std::uint8_t(120 + rng() % 2);
  native[1] = 0x00, native[C + 2] = 0xFF;
  const Mxfp4SlabPlanes good = planes_to_mxfp4_slabs(encode_planes(s, native, "t"), "t");
  ASSERT_GE(good.exceptions.size(), 2u);
  ASSERT_GE(good.escapes.size(), 1u);
  const std::uint64_t slab = mxfp4_slab_bytes(C);
  auto with = [&](const std::function<void(Mxfp4SlabPlanes&)>& edit) {
    Mxfp4SlabPlanes p = good;
    edit(p);
    return p;
  };
  auto refused = [&](const Mxfp4SlabPlanes& p, const char* reason) {
    SCOPED_TRACE(reason);
    expect_refused(p.shape, p.slabs, p.escapes, p.exceptions, reason);
  };
  refused(with([](auto& p) { p.slabs.pop_back(); }), "expected");                // truncated
  refused(with([](auto& p) { p.slabs.push_back(0); }), "expected");              // overlong
  refused(with([](auto& p) { p.escapes.pop_back(); }), "escape list holds");     // escape missing
  refused(with([](auto& p) { p.escapes.push_back(9); }), "escape list holds");   // one too many
  refused(with([](auto& p) { p.escapes[0] = p.slabs[0]; }), "must be a delta");  // escape inside the range
  refused(with([](auto& p) { p.escapes[0] = std::uint8_t(p.slabs[0] + 2); }), "must be a delta");
  refused(with([](auto& p) { p.escapes[0] = 255; }), "above 254");    // escaped base too high
  refused(with([&](auto& p) { p.slabs[slab] = 255; }), "above 254");  // slab base too high
  refused(with([&](auto& p) {                                         // base + delta too high
            p.slabs[2 * slab] = 254;
            p.slabs[2 * slab + 1] = 0b01;  // row 32: delta 1, the others delta 0
            p.slabs[2 * slab + 2] = p.slabs[2 * slab + 3] = p.slabs[2 * slab + 4] = 0;
          }),
          "above 254");
  refused(with([](auto& p) { std::swap(p.exceptions[0], p.exceptions[1]); }), "strictly increasing");
  refused(with([&](auto& p) { p.exceptions.back() = (p.exceptions.back() & 0xFF000000u) | (R * C); }),
          "outside");
  // Records win over their slot (b12x's and vLLM's rule): a set selector bit
  // under a record, or a record whose byte is in its row's window, is read
  // as the record's byte, and the planes go back to the encoder's form.
  const auto wins = [&](const Mxfp4SlabPlanes& p, const Bytes& want) {
    const CsfPlanes planes = mxfp4_slabs_to_planes(p, "t");
    EXPECT_TRUE(decode_planes(planes, "t") == want);
    const CsfTensor t = planes_to_csf(std::vector<CsfPlanes>{planes}, "t");
    EXPECT_NO_THROW(validate(t));
    const CsfPlanes back = csf_to_planes(t, "t").at(0), fresh = encode_planes(s, want, "t");
    EXPECT_TRUE(back.fixed == fresh.fixed);
    EXPECT_TRUE(back.exceptions == fresh.exceptions);
  };
  wins(with([&](auto& p) {  // a set selector bit under a record
         const std::uint32_t pos = p.exceptions[0] & 0xFFFFFF, r = pos / C, c = pos % C;
         const std::uint32_t k = (r % 16) * C + c;
         p.slabs[(r / 16) * slab + 5 + k / 8] |= std::uint8_t(1u << (k % 8));
       }),
       native);
  // A record whose byte is in its row's window: base of row 0 is escaped, 200.
  Bytes in_window = native;
  in_window[good.exceptions[0] & 0xFFFFFF] = 201;
  wins(with([&](auto& p) { p.exceptions[0] = (201u << 24) | (p.exceptions[0] & 0xFFFFFF); }), in_window);
}

// --- the container storage ---------------------------------------------------------
struct Source {
  std::uint32_t E, R, C;
  Bytes scales;
};

// A stacked gpt-oss style MXFP4 layer: the scales with their blocks.
void write_layer(const fs::path& p, const Source& s, std::mt19937_64& rng) {
  st::Writer w(p, 1 << 16);
  Bytes blocks(std::uint64_t{s.E} * s.R * s.C * 16);
  for (auto& x : blocks) x = static_cast<std::uint8_t>(rng());
  w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks", st::Dtype::U8, {s.E, s.R, s.C, 16}, blocks);
  w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_scales", st::Dtype::U8, {s.E, s.R, s.C}, s.scales);
  w.commit(std::nullopt);
}
const std::string kScale = "model.layers.0.mlp.experts.gate_up_proj_scales";

int descriptor_version(const fs::path& p) {
  const auto f = st::File::open(p);
  return nlohmann::json::parse(f.header().metadata->at(detail::kContainerKey)).at("version").get<int>();
}

// Planes of every expert of a stacked source, and their two stored sizes.
struct Sizes {
  std::uint64_t planes = 0, slabs = 0;
};
Sizes stored_sizes(const Source& s) {
  std::vector<CsfPlanes> planes;
  std::vector<Mxfp4SlabPlanes> slabs;
  const std::size_t per = std::size_t{s.R} * s.C;
  for (std::uint32_t e = 0; e < s.E; ++e) {
    planes.push_back(encode_planes({kMx, s.R, s.C}, std::span(s.scales).subspan(e * per, per), "t"));
    slabs.push_back(planes_to_mxfp4_slabs(planes.back(), "t"));
  }
  return {detail::planes_stored_bytes(planes), mxfp4_slabs_stored_bytes(slabs)};
}

TEST(Mxfp4SlabStorage, ChosenWhenSmallerRestoresExactlyAndLoadsLikeThePlanes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 4; ++round) {
    Source s{1 + std::uint32_t(rng() % 3), 16 * (1 + std::uint32_t(rng() % 8)),
             4 + std::uint32_t(rng() % 21)};
    SCOPED_TRACE(::testing::Message() << "E=" << s.E << " R=" << s.R << " C=" << s.C);
    s.scales = synthetic_scales(GridShape{kMx, ScaleLayout::row_major, s.E, s.R, s.C},
                                ScaleDistribution::realistic, rng());
    const Sizes sizes = stored_sizes(s);
    ASSERT_LT(sizes.slabs, sizes.planes);
    TempDir d;
    write_layer(d.path / "m.safetensors", s, rng);
    CompressOptions o;
    o.keep_unprofitable = false;
    const CheckpointReport rep = compress_checkpoint(d.path / "m.safetensors", d.path / "c.safetensors", o);
    EXPECT_EQ(rep.scale_stored_bytes, sizes.slabs);
    EXPECT_EQ(descriptor_version(d.path / "c.safetensors"), 3);
    const auto file = st::File::open(d.path / "c.safetensors");
    const auto info = detail::get_container_metadata(file.header().metadata, "c");
    ASSERT_TRUE(info && info->csf.size() == 1);
    EXPECT_EQ(info->csf[0].storage, detail::CsfStorage::mxfp4_slab);
    const auto* slabs = file.find(kScale + ".csf.slabs");
    ASSERT_NE(slabs, nullptr);
    EXPECT_EQ(slabs->shape,
              (std::vector<std::uint64_t>{std::uint64_t{s.E} * s.R / 16, mxfp4_slab_bytes(s.C)}));
    EXPECT_EQ(file.find(kScale + ".csf.planes"), nullptr);
    std::uint64_t parts = 0;
    for (const auto& n : detail::stored_part_names(kScale, detail::CsfStorage::mxfp4_slab, kMx))
      parts += file.find(n)->nbytes();
    EXPECT_EQ(parts, sizes.slabs);
    // The resident form loads as from the planes: equal to encoding the grid.
    const CsfTensor loaded = detail::load_csf_parts(file, info->csf[0], "c");
    const CsfTensor want = encode(GridShape{kMx, ScaleLayout::row_major, s.E, s.R, s.C}, s.scales, {});
    EXPECT_EQ(loaded.fixed, want.fixed);
    EXPECT_EQ(loaded.exceptions, want.exceptions);
    EXPECT_EQ(loaded.row_prefix, want.row_prefix);
    EXPECT_EQ(loaded.partition_index, want.partition_index);
    verify_checkpoint(d.path / "c.safetensors");
    decompress_checkpoint(d.path / "c.safetensors", d.path / "back.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(d.path / "m.safetensors"));
    // Turned off: b12x's planes in a version 2 file, more bytes, the same original.
    o.mxfp4_slab = false;
    const CheckpointReport planes_rep =
        compress_checkpoint(d.path / "m.safetensors", d.path / "p.safetensors", o);
    EXPECT_EQ(planes_rep.scale_stored_bytes, sizes.planes);
    EXPECT_EQ(descriptor_version(d.path / "p.safetensors"), 2);
    EXPECT_NE(st::File::open(d.path / "p.safetensors").find(kScale + ".csf.planes"), nullptr);
  }
}

// Rows whose bases are scattered over the byte range escape almost all:
// then the slab form is larger and the planes are stored.
TEST(Mxfp4SlabStorage, NeverChosenWhenLarger) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  Source s{2, 64, 8, {}};
  for (std::uint32_t r = 0; r < s.E * s.R; ++r) {
    const std::uint8_t base = static_cast<std::uint8_t>(rng() % 255);
    for (std::uint32_t c = 0; c < s.C; ++c) s.scales.push_back(static_cast<std::uint8_t>(base + rng() % 2));
  }
  const Sizes sizes = stored_sizes(s);
  ASSERT_GT(sizes.slabs, sizes.planes);
  TempDir d;
  write_layer(d.path / "m.safetensors", s, rng);
  CompressOptions o;
  o.keep_unprofitable = false;
  const CheckpointReport rep = compress_checkpoint(d.path / "m.safetensors", d.path / "c.safetensors", o);
  EXPECT_EQ(rep.scale_stored_bytes, sizes.planes);
  EXPECT_EQ(descriptor_version(d.path / "c.safetensors"), 2);
  const auto file = st::File::open(d.path / "c.safetensors");
  EXPECT_NE(file.find(kScale + ".csf.planes"), nullptr);
  EXPECT_EQ(file.find(kScale + ".csf.slabs"), nullptr);
  decompress_checkpoint(d.path / "c.safetensors", d.path / "back.safetensors");
  EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(d.path / "m.safetensors"));
}

// On scales like real ones (the recalibrated generator) the slab form is
// never larger than the planes, at any C and row count.
TEST(Mxfp4SlabStorage, NotLargerThanPlanesOnRealisticScales) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 40; ++round) {
    Source s{1 + std::uint32_t(rng() % 4), 16 * (1 + std::uint32_t(rng() % 32)),
             1 + std::uint32_t(rng() % 96)};
    SCOPED_TRACE(::testing::Message() << "E=" << s.E << " R=" << s.R << " C=" << s.C);
    s.scales = synthetic_scales(GridShape{kMx, ScaleLayout::row_major, s.E, s.R, s.C},
                                ScaleDistribution::realistic, rng());
    const Sizes sizes = stored_sizes(s);
    EXPECT_LE(sizes.slabs, sizes.planes);
  }
}

// Tampered slab parts in a container: refused naming the file and tensor, nothing restored.
TEST(Mxfp4SlabStorage, TamperedContainerIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  Source s{2, 32, 12, {}};
  s.scales = synthetic_scales(GridShape{kMx, ScaleLayout::row_major, s.E, s.R, s.C},
                              ScaleDistribution::realistic, rng());
  // Expert 1's first row far away: one escape.
  std::fill_n(s.scales.begin() + std::ptrdiff_t(s.R * s.C), s.C, std::uint8_t{3});
  TempDir d;
  write_layer(d.path / "m.safetensors", s, rng);
  const fs::path c = d.path / "c.safetensors";
  compress_checkpoint(d.path / "m.safetensors", c);
  const std::string clean = read_bytes(c);
  std::size_t esc_at = 0, esc_bytes = 0, slab_at = 0;
  {
    const auto file = st::File::open(c);
    const auto* esc = file.find(kScale + ".csf.slab_escapes");
    const auto* slabs = file.find(kScale + ".csf.slabs");
    ASSERT_TRUE(esc && slabs);
    esc_bytes = esc->nbytes();
    ASSERT_GE(esc_bytes, 1u);
    esc_at = std::size_t(file.data(*esc).data() - file.bytes().data());
    slab_at = std::size_t(file.data(*slabs).data() - file.bytes().data());
  }
  auto refused = [&](std::size_t at, std::uint8_t value, const char* reason) {
    SCOPED_TRACE(reason);
    std::string bad = clean;
    bad[at] = static_cast<char>(value);
    write_bytes(c, bad);
    try {
      verify_checkpoint(c);
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(kScale), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
    EXPECT_THROW(decompress_checkpoint(c, d.path / "back.safetensors"), FormatError);
    EXPECT_FALSE(fs::exists(d.path / "back.safetensors"));
  };
  refused(esc_at + esc_bytes - 1, 255, "above 254");
  refused(slab_at, 255, "above 254");
  refused(slab_at + 1, 0xFF, "escape");  // four more escaped rows than escape bytes
  // A version 2 descriptor cannot name the version 3 storage.
  std::string v2 = clean;
  const std::string from = R"(\"format\":\"csfmoe-csf\",\"version\":3)";
  const std::string to = R"(\"format\":\"csfmoe-csf\",\"version\":2)";
  const auto at = v2.find(from);
  ASSERT_NE(at, std::string::npos);
  v2.replace(at, from.size(), to);
  write_bytes(c, v2);
  try {
    verify_checkpoint(c);
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("mxfp4_slab"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace csfmoe
