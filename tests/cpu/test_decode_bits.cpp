// The decode kernel's bit-level conversions (src/cuda/moe/dequant.cuh),
// compiled for the host: every E2M1 nibble pair at every position, every
// scale byte alone and in packed words, against the format decoders.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "csfmoe/formats.hpp"
#include "cuda/moe/dequant.cuh"
#include "test_seed.hpp"

namespace csfmoe::moe_detail::decode_bits {
namespace {

float bf16_value(std::uint32_t bits16) {
  const std::uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int J>
void check_pair(std::uint32_t q) {
  const std::uint32_t pair = e2m1_pair<J>(q);
  const std::uint32_t lo = (q >> (4 * J)) & 0xFu, hi = (q >> (4 * (J + 4))) & 0xFu;
  // value * 2^-126, sign included (negative zero stays negative zero).
  const float want_lo = std::ldexp(e2m1_to_float(std::uint8_t(lo)), -126);
  const float want_hi = std::ldexp(e2m1_to_float(std::uint8_t(hi)), -126);
  const float got_lo = bf16_value(pair & 0xFFFFu), got_hi = bf16_value(pair >> 16);
  ASSERT_EQ(got_lo, want_lo) << "J=" << J << " q=" << std::hex << q;
  ASSERT_EQ(got_hi, want_hi) << "J=" << J << " q=" << std::hex << q;
  ASSERT_EQ(std::signbit(got_lo), (lo & 8u) != 0) << "J=" << J << " q=" << std::hex << q;
  ASSERT_EQ(std::signbit(got_hi), (hi & 8u) != 0) << "J=" << J << " q=" << std::hex << q;
}

TEST(DecodeBits, E2m1PairsEveryNibblePairAtEveryPosition) {
  // Each pair (J, J + 4) takes all 256 combinations while the other six
  // nibbles hold random bits (they must not leak into the pair).
  CSFMOE_SEEDED(seed);
  std::mt19937 rng(std::uint32_t(seed ^ (seed >> 32)));
  for (int rep = 0; rep < 16; ++rep)
    for (std::uint32_t a = 0; a < 16; ++a)
      for (std::uint32_t b = 0; b < 16; ++b) {
        const std::uint32_t noise = rng();
        const auto with = [&](int j) {
          const std::uint32_t keep = ~((0xFu << (4 * j)) | (0xFu << (4 * (j + 4))));
          return (noise & keep) | (a << (4 * j)) | (b << (4 * (j + 4)));
        };
        check_pair<0>(with(0));
        check_pair<1>(with(1));
        check_pair<2>(with(2));
        check_pair<3>(with(3));
      }
}

template <ScaleFormat F>
void check_scale_bytes() {
  for (unsigned b = 0; b < 256; ++b) {
    const float v =
        F == ScaleFormat::nvfp4 ? e4m3fn_to_float(std::uint8_t(b)) : e8m0_to_float(std::uint8_t(b));
    const std::uint16_t got = scale_bf16<F>(std::uint8_t(b));
    if (std::isnan(v)) {
      EXPECT_EQ(got, 0x7FFF) << b;
      continue;
    }
    const float want = F == ScaleFormat::nvfp4 ? std::ldexp(v, 118) : v;
    EXPECT_EQ(bf16_value(got), want) << b;
    EXPECT_EQ(std::signbit(bf16_value(got)), std::signbit(want)) << b;
  }
}

TEST(DecodeBits, ScaleBytesExact) {
  check_scale_bytes<ScaleFormat::nvfp4>();
  check_scale_bytes<ScaleFormat::mxfp4>();
}

template <ScaleFormat F>
void check_scale_word(std::uint32_t v) {
  bool special = false;
  for (int i = 0; i < 4; ++i) {
    const unsigned b = (v >> (8 * i)) & 0xFFu;
    if (F == ScaleFormat::nvfp4)
      special |= (b & 0x78u) == 0 || (b & 0x7Fu) == 0x7Fu || (b & 0x80u) != 0;
    else
      special |= b == 0 || b == 0xFFu;
  }
  ASSERT_EQ(scale_word_special<F>(v), special) << std::hex << v;
  if (special) return;
  const std::uint32_t got[4] = {scale_splat_bf16<F, 0>(v), scale_splat_bf16<F, 1>(v),
                                scale_splat_bf16<F, 2>(v), scale_splat_bf16<F, 3>(v)};
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t want = scale_bf16<F>(std::uint8_t(v >> (8 * i)));
    ASSERT_EQ(got[i], want | (want << 16)) << std::hex << v << " byte " << i;
  }
}

TEST(DecodeBits, PackedScaleWordsMatchBytewiseConversion) {
  // Every byte at every position of the word (the others random), then
  // random words, then words built from the special bytes only.
  CSFMOE_SEEDED(seed);
  std::mt19937 rng(std::uint32_t(seed ^ (seed >> 32)));
  for (int pos = 0; pos < 4; ++pos)
    for (std::uint32_t b = 0; b < 256; ++b)
      for (int rep = 0; rep < 8; ++rep) {
        const std::uint32_t v = (rng() & ~(0xFFu << (8 * pos))) | (b << (8 * pos));
        check_scale_word<ScaleFormat::nvfp4>(v);
        check_scale_word<ScaleFormat::mxfp4>(v);
      }
  for (int rep = 0; rep < 200000; ++rep) {
    const std::uint32_t v = rng();
    check_scale_word<ScaleFormat::nvfp4>(v);
    check_scale_word<ScaleFormat::mxfp4>(v);
  }
  const std::uint8_t edge[] = {0x00, 0x01, 0x07, 0x08, 0x77, 0x78, 0x7E, 0x7F, 0x80, 0x87, 0x88, 0xFE, 0xFF};
  for (std::uint8_t a : edge)
    for (std::uint8_t b : edge)
      for (std::uint8_t c : edge)
        for (std::uint8_t d : edge) {
          const std::uint32_t v = a | (b << 8) | (c << 16) | (std::uint32_t(d) << 24);
          check_scale_word<ScaleFormat::nvfp4>(v);
          check_scale_word<ScaleFormat::mxfp4>(v);
        }
}

// The grouped kernel's folded MXFP4 scale pairs: for every byte the fold
// accepts, one bf16 multiply of every nibble pair (value * 2^-126) by the
// folded pair gives value * 2^(b - 127) exactly, a bf16 number (normal from
// b = 2; bytes 0 and 1 reach bf16's subnormal range as the unfolded path's
// second multiply does); the fold refuses exactly the bytes above 0x80, at
// every position of a word.
TEST(DecodeBits, FoldedMxfp4ScalesGiveExactProducts) {
  for (std::uint32_t b = 0; b < 256; ++b) {
    const std::uint32_t word = b * 0x01010101u;
    ASSERT_EQ(mxfp4_word_unfoldable(word), b > 0x80u) << std::hex << b;
    if (b > 0x80u) continue;
    const std::uint32_t pair = mxfp4_folded_splat_bf16<2>(word);
    ASSERT_EQ(pair >> 16, pair & 0xFFFFu);
    const float scale = bf16_value(pair & 0xFFFFu);
    ASSERT_EQ(scale, std::ldexp(1.0f, int(b) - 1)) << std::hex << b;
    for (std::uint32_t nib = 0; nib < 16; ++nib) {
      const float nibble = bf16_value(e2m1_pair<0>(nib) & 0xFFFFu);  // value * 2^-126
      const float product = nibble * scale;                          // exact in float
      const float want = e2m1_to_float(std::uint8_t(nib)) * e8m0_to_float(std::uint8_t(b));
      ASSERT_EQ(product, want) << std::hex << b << " " << nib;
      ASSERT_EQ(std::signbit(product), (nib & 8u) != 0);
      // Representable in bf16: the hardware multiply is exact too.
      std::uint32_t bits;
      std::memcpy(&bits, &product, 4);
      ASSERT_EQ(bits & 0xFFFFu, 0u) << std::hex << b << " " << nib;
      if (product != 0.0f && b >= 2) ASSERT_GE(std::fabs(product), std::ldexp(1.0f, -126));
    }
  }
  CSFMOE_SEEDED(seed);
  std::mt19937 rng(std::uint32_t(seed ^ (seed >> 32)));
  for (int rep = 0; rep < 200000; ++rep) {
    const std::uint32_t v = rep < 1024 ? (rng() & 0x80808080u) | (rng() & 0x01010101u) : rng();
    bool above = false;
    for (int i = 0; i < 4; ++i) above |= ((v >> (8 * i)) & 0xFFu) > 0x80u;
    ASSERT_EQ(mxfp4_word_unfoldable(v), above) << std::hex << v;
  }
}

// The prefill kernel's K order: a bijection of each 128-wide K block whose
// inverse is prefill_k_slot, and which puts at every position of the wgmma A
// fragment (m16n8k16 layout per warp: thread t holds K columns 2t + 8q + e of
// step s) the physical K that the kernel's dequantization writes there: step
// 2w + h of thread t takes e2m1_pair<2h + q> of its word w, i.e. K
// 32t + 8w + (2h + q) + 4e of its 32 consecutive K.
TEST(DecodeBits, PrefillKOrderMatchesTheDequantizedFragment) {
  std::uint32_t seen[128] = {};
  for (std::uint32_t l = 0; l < 128; ++l) {
    const std::uint32_t k = prefill_k_source(l);
    ASSERT_LT(k, 128u);
    ++seen[k];
    EXPECT_EQ(prefill_k_slot(k), l) << "l=" << l;
  }
  for (std::uint32_t k = 0; k < 128; ++k) EXPECT_EQ(seen[k], 1u) << "k=" << k;
  for (std::uint32_t t = 0; t < 4; ++t)
    for (std::uint32_t w = 0; w < 4; ++w)
      for (std::uint32_t h = 0; h < 2; ++h)
        for (std::uint32_t q = 0; q < 2; ++q)
          for (std::uint32_t e = 0; e < 2; ++e) {
            const std::uint32_t step = 2 * w + h, column = 2 * t + 8 * q + e;
            EXPECT_EQ(prefill_k_source(16 * step + column), 32 * t + 8 * w + (2 * h + q) + 4 * e)
                << "t=" << t << " w=" << w << " h=" << h << " q=" << q << " e=" << e;
          }
  // Whole rows: block b of a row moves within itself.
  for (std::uint32_t k : {0u, 5u, 127u, 128u, 300u, 7167u})
    EXPECT_EQ(prefill_permuted_column(k) / 128, k / 128) << "k=" << k;
  EXPECT_EQ(prefill_permuted_column(128 + 32), 128 + prefill_k_slot(32));
}

}  // namespace
}  // namespace csfmoe::moe_detail::decode_bits
