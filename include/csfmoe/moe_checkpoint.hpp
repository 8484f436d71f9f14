// Reading one MoE layer's expert weights out of a safetensors checkpoint (a
// file or a folder of shards; plain or CSF-compressed containers, whose CSF
// scale parts are decoded and CRC-checked) into MoeHostWeights.
//
// Layouts recognised for a layer key L (e.g. "model.layers.3.mlp.experts"):
//   stacked (csf synth, ModelOpt names):
//     L.w13.weight U8 [E, 2N, H/2], L.w13.weight_scale F8_E4M3|U8 [E, 2N, H/16]
//     (H/32 columns: MXFP4, U8|F8_E8M0), L.w13.weight_scale_2 F32 [] | [1] | [E]
//     (NVFP4 only), and the same for w2 with [E, H, N/2] and [E, H, N/g].
//   gpt-oss MXFP4: L.gate_up_proj_blocks U8 [E, 2N, H/32, 16] with
//     L.gate_up_proj_scales [E, 2N, H/32], L.down_proj_blocks/_scales likewise.
//     With expert biases (L.gate_up_proj_bias [E, 2N], L.down_proj_bias
//     [E, H], BF16 or F32, each optional) the layer is gpt-oss's own: gate and
//     up rows interleave (row 2i gate i, row 2i+1 up i, as in transformers'
//     GptOssExperts) and are de-interleaved into the w13 order with their
//     block scales and bias, and the activation is gpt_oss with gpt-oss's
//     alpha and limit (MoeActivationSpec::gpt_oss()). Without biases the rows
//     are taken in the fused [gate; up] order (as csf synth writes them) and
//     the activation is silu.
//   Stacked (w13.bias / w2.bias) and per-expert (L.<e>.<proj>.bias) biases
//   are refused as Unsupported: no known checkpoint convention tells their
//   activation or row order.
//   per-expert (ModelOpt): L.<e>.gate_proj / up_proj / down_proj (or w1 / w3 /
//     w2) .weight [R, K/2], .weight_scale [R, K/g], .weight_scale_2 [] | [1],
//     experts 0..E-1; gate and up are stacked into w13 (gate rows first). Gate
//     and up must share their global scale (the MoE API has one per expert and
//     projection): different ones are refused as Unsupported.
// Scale tensors are read row-major unless the file's __metadata__ says
// "csfmoe.scale_layout": "swizzled_128x4" (or the CSF descriptor does).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/formats.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe {

// Loads layer `layer_key` with geometry.topk = topk, order w13, and checks it
// with plan_weights. Throws InvalidArgument (unknown layer: the message lists
// the checkpoint's layers; geometry refused by plan_weights), FormatError
// (missing tensor, wrong dtype or shape, experts that disagree, a non-finite
// bias), Unsupported (gate/up global scales that differ, stacked or
// per-expert biases), CorruptData (container CRC mismatch), IoError; every
// message names the file and the tensor.
MoeHostWeights load_moe_layer(const std::filesystem::path& checkpoint, std::string_view layer_key,
                              unsigned topk);

// MoE layer keys that hold detected expert block-scale tensors, in natural
// order ("layers.2" before "layers.10").
std::vector<std::string> list_moe_layers(const std::filesystem::path& checkpoint);

// The tensors the layer rules look at: a checkpoint's files (load_moe_layer)
// or tensors already in memory (the Python package's gather_moe_layer).
class MoeTensorSource {
 public:
  virtual ~MoeTensorSource() = default;
  virtual std::string label() const = 0;  // the checkpoint, for layer-level messages
  // The logical tensor (name, dtype, shape; offsets unused), or nullptr.
  virtual const st::TensorInfo* find(const std::string& name) const = 0;
  virtual std::vector<std::string> names_with_prefix(const std::string& prefix) const = 0;  // sorted
  virtual std::string label_of(const std::string& name) const = 0;    // where the tensor is, for messages
  virtual ScaleLayout layout_of(const std::string& scale) const = 0;  // layout of a scale tensor's bytes
  // The tensor's bytes (CRC-checked where the source has CRCs). The rules
  // read only global and input scales and expert biases; load_moe_layer
  // reads the rest.
  virtual std::vector<std::uint8_t> read(const std::string& name) const = 0;
  virtual std::vector<std::string> layers() const = 0;  // MoE layer keys held, for messages
};

// Tensors held elsewhere (in memory): each with its dtype, shape and, for a
// scale tensor, the layout of its bytes; `reader` returns a tensor's bytes.
class MoeTensorTable final : public MoeTensorSource {
 public:
  using Reader = std::function<std::vector<std::uint8_t>(const std::string& name)>;
  MoeTensorTable(std::string label, Reader reader);
  // InvalidArgument on a repeated name.
  void add(std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape,
           ScaleLayout layout = ScaleLayout::row_major);

  std::string label() const override { return label_; }
  const st::TensorInfo* find(const std::string& name) const override;
  std::vector<std::string> names_with_prefix(const std::string& prefix) const override;
  std::string label_of(const std::string&) const override { return label_; }
  ScaleLayout layout_of(const std::string& scale) const override;
  std::vector<std::uint8_t> read(const std::string& name) const override;
  std::vector<std::string> layers() const override;

 private:
  struct Entry {
    st::TensorInfo info;
    ScaleLayout layout = ScaleLayout::row_major;
  };
  std::string label_;
  Reader reader_;
  std::map<std::string, Entry> tensors_;
};

// One packed FP4 weight of a layer and its block scales, as checked.
struct MoeLayerProjection {
  std::string weight, scale;  // tensor names
  ScaleLayout scale_layout = ScaleLayout::row_major;
  std::uint64_t experts = 1;  // leading dimension (1 for a per-expert tensor)
  std::uint64_t rows = 0, k = 0;
};

// A layer resolved by the rules above without reading its weights or block
// scales. w13 / w2: one projection each (stacked, gpt-oss) or, per-expert,
// w13 = gate 0, up 0, gate 1, up 1, ... and w2 = down 0, down 1, ...
struct MoeLayerSpec {
  std::string naming;  // "stacked", "gpt-oss" or "per-expert"
  ScaleFormat format = ScaleFormat::nvfp4;
  // topk as asked, order w13; activation gpt_oss for a gpt-oss layer with
  // biases, silu otherwise.
  MoeLayerGeometry geometry;
  std::vector<MoeLayerProjection> w13, w2;
  // The w13 tensor's rows (and its scales' rows) alternate gate, up, gate,
  // ... in the file (a gpt-oss layer with biases): the reader de-interleaves
  // them into gate rows, then up rows.
  bool gate_up_interleaved = false;
  // Expert biases read as FP32 (gpt-oss; empty when absent): w13_bias
  // [E, 2N] already in the w13 order (gate, then up), w2_bias [E, H].
  std::vector<float> w13_bias, w2_bias;
  std::vector<float> w13_global, w2_global;  // [E]; ones for MXFP4
  // [E] NVFP4 activation scales (w13: the gate's), checked finite and
  // positive; empty when the layer has none.
  std::vector<float> w13_input_scale, w2_input_scale;
};

// The checks and errors of load_moe_layer, on any source; plan_weights runs
// with `topk`.
MoeLayerSpec resolve_moe_layer(const MoeTensorSource& source, std::string_view layer_key, unsigned topk);

}  // namespace csfmoe
