#include "st_io.hpp"

#include "csfmoe/formats.hpp"

namespace csfmoe::cli {

void write_safetensors(const std::filesystem::path& out, const std::vector<OutTensor>& tensors,
                       const st::Metadata& metadata) {
  // The header is written last, so its size is computed up front from the
  // offsets the tensors will get.
  std::vector<st::TensorInfo> infos;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    st::TensorInfo info;
    info.name = t.name;
    info.dtype = t.dtype;
    info.shape = t.shape;
    std::uint64_t n = st::dtype_size(t.dtype);
    for (const auto d : t.shape) n *= d;
    info.begin = offset;
    info.end = offset + n;
    offset = info.end;
    infos.push_back(std::move(info));
  }
  const std::uint64_t reserve = 8 + round_up(st::Writer::header_json_size(infos, metadata), 8);
  st::Writer w(out, reserve);
  for (const auto& t : tensors) {
    w.begin_tensor(t.name, t.dtype, t.shape);
    t.write(w);
    w.end_tensor();
  }
  w.commit(metadata);
}

}  // namespace csfmoe::cli
