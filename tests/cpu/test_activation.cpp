// The activations' one home (csfmoe/detail/activation.hpp) against
// straightforward float64 formulas: random values and the edges (past the
// clamp either way, large negatives, zeros, infinities, NaN); the f32
// instantiation the kernels use against the float64 one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "csfmoe/detail/activation.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

// transformers' GptOssExperts: gate.clamp(max=limit), up.clamp(-limit, limit),
// (up + 1) * gate * sigmoid(gate * alpha).
double gpt_oss_formula(double gate, double up, double alpha = 1.702, double limit = 7.0) {
  const double g = std::min(gate, limit);
  const double u = std::clamp(up, -limit, limit);
  const double sigmoid = 1.0 / (1.0 + std::exp(-(g * alpha)));
  return (u + 1.0) * g * sigmoid;
}

double silu_formula(double gate, double up) { return gate * (1.0 / (1.0 + std::exp(-gate))) * up; }

// Equal within a few float64 ulps (the formulas associate differently), or
// both NaN.
void expect_close(double got, double want) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << got;
    return;
  }
  if (std::isinf(want)) {
    EXPECT_EQ(got, want);
    return;
  }
  EXPECT_NEAR(got, want, 1e-14 * std::max(1.0, std::abs(want))) << want;
}

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();
const std::vector<double> kEdges = {0.0,    -0.0, 1e-300, -1e-300, 6.999, 7.0,  7.001, -7.0,   -7.001,
                                    8.5,    -8.5, 100.0,  -100.0,  1e6,   -1e6, 1e300, -1e300, 745.0,
                                    -745.0, 1.0,  -1.0,   0.5,     -0.5,  kInf, -kInf, kNaN};

TEST(Activation, GptOssMatchesTheFormulaOnEdges) {
  const ClampedSwiglu<double> act;
  EXPECT_EQ(act.alpha, 1.702);
  EXPECT_EQ(act.limit, 7.0);
  for (double gate : kEdges)
    for (double up : kEdges) {
      SCOPED_TRACE(::testing::Message() << "gate " << gate << " up " << up);
      expect_close(act.apply(gate, up), gpt_oss_formula(gate, up));
      expect_close(apply_activation(MoeActivationSpec::gpt_oss(), gate, up), gpt_oss_formula(gate, up));
    }
  // Past the clamp the output does not move: gate saturates at the limit
  // (but not from below), up at +-limit.
  EXPECT_EQ(act.apply(7.0, 3.0), act.apply(1e9, 3.0));
  EXPECT_EQ(act.apply(2.0, 7.0), act.apply(2.0, 50.0));
  EXPECT_EQ(act.apply(2.0, -7.0), act.apply(2.0, -50.0));
  EXPECT_NE(act.apply(-7.0, 3.0), act.apply(-8.0, 3.0));
  // up = -1 zeroes the output; gate = 0 too; large negative gates vanish.
  EXPECT_EQ(act.apply(3.0, -1.0), 0.0);
  EXPECT_EQ(act.apply(0.0, 5.0), 0.0);
  EXPECT_EQ(act.apply(-1e6, 5.0), 0.0);
  // A NaN input stays NaN (torch.clamp), it is not clamped away.
  EXPECT_TRUE(std::isnan(act.apply(kNaN, 1.0)));
  EXPECT_TRUE(std::isnan(act.apply(1.0, kNaN)));
}

TEST(Activation, GptOssMatchesTheFormulaOnRandomInputs) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, 6.0);  // a good share beyond +-7
  std::uniform_real_distribution<double> alpha(0.1, 4.0), limit(0.5, 20.0);
  for (int i = 0; i < 20000; ++i) {
    const double a = i % 2 ? 1.702 : alpha(rng), l = i % 2 ? 7.0 : limit(rng);
    const double gate = d(rng), up = d(rng);
    SCOPED_TRACE(::testing::Message() << "gate " << gate << " up " << up << " alpha " << a << " limit " << l);
    expect_close(ClampedSwiglu<double>{a, l}.apply(gate, up), gpt_oss_formula(gate, up, a, l));
    expect_close(apply_activation(MoeActivationSpec::gpt_oss(a, l), gate, up),
                 gpt_oss_formula(gate, up, a, l));
    if (HasFailure()) return;
  }
}

TEST(Activation, SiluMulMatchesTheFormula) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, 6.0);
  for (int i = 0; i < 20000; ++i) {
    const double gate = d(rng), up = d(rng);
    expect_close(SiluMul::apply(gate, up), silu_formula(gate, up));
    expect_close(apply_activation(MoeActivationSpec::silu(), gate, up), silu_formula(gate, up));
  }
  for (double gate : kEdges)
    for (double up : kEdges) {
      if (std::isinf(gate) || std::isinf(up)) continue;  // inf * 0 forms differ in sign only
      SCOPED_TRACE(::testing::Message() << "gate " << gate << " up " << up);
      expect_close(SiluMul::apply(gate, up), silu_formula(gate, up));
    }
}

// The f32 instantiation on the host: the IEEE expression for SiLU (bitwise),
// and within f32 rounding of float64 for both (the kernels' fast form is
// checked against the float64 reference by the GPU MoE tests).
TEST(Activation, FloatInstantiationTracksFloat64) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 6.0f);
  for (int i = 0; i < 20000; ++i) {
    const float gate = d(rng), up = d(rng);
    EXPECT_EQ(SiluMul::apply(gate, up), gate / (1.0f + std::exp(-gate)) * up);
    const double want = gpt_oss_formula(gate, up, double(1.702f), 7.0);
    const float got = ClampedSwiglu<float>{}.apply(gate, up);
    EXPECT_NEAR(double(got), want, 1e-5 * std::max(1.0, std::abs(want))) << gate << " " << up;
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace csfmoe
