// Fused MoE layer over FP4 (NVFP4 / MXFP4) expert weights: planning and
// validation of a layer's geometry, host-side weight containers, and the
// float64 CPU reference that is the oracle of every GPU test and the fallback
// of `csf moe` on machines without a GPU. Nothing here needs CUDA; the device
// path (prepare_weights, bind, run) is in csfmoe/moe_cuda.hpp.
//
// Semantics of one layer call, for T tokens, top-k slots per token:
//   for each token t and slot j (expert e = topk_ids[t, j], weight w = topk_weights[t, j]):
//     gu   = W13[e] x hidden[t]           (2N outputs; halves gate and up, order w13 or w31)
//     gu  += b13[e]                        (gpt-oss activation only, optional)
//     act  = SiLU(gate) * up               (N values; or gpt-oss's clamped SwiGLU,
//                                           csfmoe/detail/activation.hpp)
//     y    = W2[e] x act                   (H outputs)
//     y   += b2[e]                          (gpt-oss activation only, optional)
//     out[t] += w * y                      (slots summed in slot order)
// Duplicate expert ids inside one token are separate slots: each one adds its
// own weighted contribution. Ids outside [0, E) are rejected by the host
// reference; on the device they contribute nothing and are counted (see
// moe_cuda.hpp).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/detail/activation.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {

// Row order of the fused gate/up projection: w13 = gate rows [0, N) then up
// rows [N, 2N); w31 = up first (some checkpoints).
enum class GateUpOrder : std::uint8_t { w13 = 0, w31 = 1 };
// How the layer keeps its block scales on the device.
enum class ScaleCompression : std::uint8_t { none = 0, csf = 1 };
// Where a call's GEMMs read their block scales from.
enum class MoeScaleMode : std::uint8_t {
  native = 0,      // the caller's native scale tensors (compression none)
  expanded = 1,    // scratch filled by expand_scales before the call (scales_expanded = true)
  routed = 2,      // the call expands its routed experts into the scratch first
  stage_read = 3,  // the GEMM rebuilds each K slice's scales from CSF in shared memory
};

std::string_view to_string(GateUpOrder o) noexcept;
std::string_view to_string(ScaleCompression c) noexcept;
std::string_view to_string(MoeScaleMode m) noexcept;
std::string_view to_string(MoeActivation a) noexcept;
// Parse "w13"/"w31", "none"/"csf", "native"/"expanded"/"routed"/"stage_read";
// throw InvalidArgument listing the accepted names otherwise.
GateUpOrder parse_gate_up_order(std::string_view s);
ScaleCompression parse_scale_compression(std::string_view s);
MoeScaleMode parse_moe_scale_mode(std::string_view s);
// "silu" / "gpt_oss".
MoeActivation parse_moe_activation(std::string_view s);
// Throws InvalidArgument for an unknown kind, or for gpt_oss an alpha or
// limit that is not finite and > 0.
void validate(const MoeActivationSpec& activation);

struct MoeLayerGeometry {
  std::uint32_t experts = 0;       // E
  std::uint32_t hidden = 0;        // H (K of the gate/up GEMM, rows of w2)
  std::uint32_t intermediate = 0;  // N (per-expert intermediate size)
  std::uint32_t topk = 0;          // k slots per token
  GateUpOrder order = GateUpOrder::w13;
  // The gate/up activation (csfmoe/detail/activation.hpp), computed alike by
  // the CPU reference and every GPU kernel's gate/up epilogue (gpt_oss with
  // the expert biases of MoeHostWeights / MoeDeviceWeights).
  MoeActivationSpec activation;
};

struct MoeConstraints {
  ScaleCompression compression = ScaleCompression::none;
  std::uint32_t max_tokens = 4096;  // largest T any bound call may use
  // CSF calls with T <= this read scales inside the GEMM (stage_read); larger
  // calls expand their routed experts first (routed).
  std::uint32_t stage_read_max_tokens = 1536;
  // Layout of the caller's native scale tensors (NVFP4 checkpoints ship both).
  ScaleLayout scale_layout = ScaleLayout::row_major;
};

// Everything derived from (format, geometry, constraints), validated.
struct MoePlan {
  // Tile sizes of the GPU kernels; H and N must be multiples of kTile.
  static constexpr std::uint32_t kTile = 64;
  static constexpr std::uint32_t kMaxExperts = 1024;
  static constexpr std::uint32_t kMaxTopk = 64;

  ScaleFormat format = ScaleFormat::nvfp4;
  MoeLayerGeometry geometry;
  MoeConstraints constraints;
  GridShape w13_scales;  // the caller's scale tensors, in constraints.scale_layout
  GridShape w2_scales;
  std::uint64_t w13_bytes = 0;        // packed FP4 bytes, all experts: E * 2N * H/2
  std::uint64_t w2_bytes = 0;         // E * H * N/2
  std::uint64_t w13_scale_bytes = 0;  // native bytes in scale_layout
  std::uint64_t w2_scale_bytes = 0;
};

// Validate and derive. Throws InvalidArgument naming the offending field:
// E in [1, 1024], k in [1, 64], H and N non-zero multiples of 64, 2N*H/g and
// H*N/g positions per expert below 2^24 when compression is csf, max_tokens
// in [1, 2^31 / k), known format, order, layout and activation, and for
// gpt_oss a finite alpha > 0 and a finite limit > 0.
MoePlan plan_weights(ScaleFormat source_format, const MoeLayerGeometry& geometry,
                     const MoeConstraints& constraints);

// A layer's weights in host memory, as a checkpoint holds them. Scales are
// row-major [E, rows, K/g]; global scales are one FP32 per expert and
// projection (1 for MXFP4).
struct MoeHostWeights {
  ScaleFormat format = ScaleFormat::nvfp4;
  MoeLayerGeometry geometry;
  std::vector<std::uint8_t> w13;         // [E, 2N, H/2]; low nibble = even element
  std::vector<std::uint8_t> w13_scales;  // [E, 2N, H/g]
  std::vector<float> w13_global;         // [E]
  std::vector<std::uint8_t> w2;          // [E, H, N/2]
  std::vector<std::uint8_t> w2_scales;   // [E, H, N/g]
  std::vector<float> w2_global;          // [E]
  // Expert biases, gpt_oss activation only (empty: none): w13_bias [E, 2N] in
  // the w13 row order (gate then up, or up then gate for w31), w2_bias [E, H].
  std::vector<float> w13_bias;
  std::vector<float> w2_bias;
};

// Throws InvalidArgument naming the member whose size disagrees with the geometry.
void validate(const MoeHostWeights& w);

// Random weights quantized with the real recipe (quantize.hpp), one seed per
// (expert, projection). `fast` draws uniform E2M1 codes with "realistic"
// synthetic scale grids instead: no quantizer pass, for large geometries.
MoeHostWeights synthetic_moe_weights(ScaleFormat f, const MoeLayerGeometry& g, std::uint64_t seed,
                                     bool fast = false);

// The same scale tensors in another layout (row_major or swizzled_128x4),
// e.g. to feed a kernel the layout a checkpoint would ship.
std::vector<std::uint8_t> relayout_scales(const GridShape& row_major_shape, std::span<const std::uint8_t> src,
                                          ScaleLayout layout);

// CPU reference: float64 accumulation over exactly dequantized weights
// (e2m1 * scale * global in float64) and bf16 inputs, the geometry's
// activation (apply_activation<double>) and the biases in float64,
// multithreaded over tokens (threads 0: all cores). hidden is bf16 bits
// [T, H]; ids/weights are [T, k]; out is [T, H] float. Throws
// InvalidArgument for wrong sizes or an id outside [0, E) (naming token and slot).
void moe_reference(const MoeHostWeights& w, std::span<const std::uint16_t> hidden, std::uint32_t tokens,
                   std::span<const std::int64_t> topk_ids, std::span<const float> topk_weights,
                   std::span<float> out, unsigned threads = 0);
void moe_reference(const MoeHostWeights& w, std::span<const std::uint16_t> hidden, std::uint32_t tokens,
                   std::span<const std::int32_t> topk_ids, std::span<const float> topk_weights,
                   std::span<float> out, unsigned threads = 0);

// ||a - b||_2 / ||b||_2 in float64 (b the reference); NaN anywhere gives NaN,
// a zero reference gives ||a||_2.
double relative_error(std::span<const float> a, std::span<const float> b);

}  // namespace csfmoe
