// What the checkpoint verbs share (internal): compress (compress.cpp),
// decompress / verify / inspect (restore.cpp) and the stacked-expert split of
// the b12x schema (b12x_split.cpp) report the same tensors the same way, and
// inspect of a native file is compress without the output.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

inline std::uint32_t crc_join(std::uint32_t a, std::uint32_t b, std::uint64_t len_b) {
  return static_cast<std::uint32_t>(crc32_combine64(a, b, static_cast<z_off64_t>(len_b)));
}

// One verb's progress: bytes done out of the job's total.
struct Job {
  const CompressOptions& opt;
  std::uint64_t done = 0, total = 0;
  void tick(std::uint64_t bytes, const std::string& file, const std::string& tensor) {
    done += bytes;
    if (opt.progress) opt.progress(Progress{done, total, file + ":" + tensor});
  }
};

inline CodecOptions codec_options(const CompressOptions& o) {
  CodecOptions c;
  c.threads = o.threads;
  return c;
}

// Tensors in data order (stable for empty tensors that share an offset).
std::vector<const st::TensorInfo*> data_order(const st::Header& h);

TensorReport base_report(const std::string& file, const st::TensorInfo& t);

void add_totals(CheckpointReport& rep, const TensorReport& t, std::uint64_t source, std::uint64_t stored);

// The resident sizes of a CSF tensor: csfmoe's (all parts) and b12x's (the
// fixed slabs and records, plus an 8-byte offset per partition).
void set_resident(TensorReport& tr, const CsfTensor& enc);

inline std::optional<ContainerInfo> container_info(const st::File& f) {
  return get_container_metadata(f.header().metadata, f.path().string());
}

std::uint64_t original_data_bytes(const ContainerInfo& info);

struct FileResult {
  std::map<std::string, std::vector<std::string>> csf_parts;  // tensors stored as CSF -> their part tensors
  std::vector<st::TensorInfo> stored;                         // container tensors
};

// Compresses one validated safetensors file into `dest` (which must not exist).
// `sliced`: planes of some tensors already cut for a tensor-parallel rank
// (slice_checkpoint_tp), stored as they are instead of encoding those tensors.
// Without `write`, only the report is made (inspect of a native file).
FileResult compress_file(const st::File& src, const std::filesystem::path& dest, const std::string& file,
                         Job& job, CheckpointReport& rep, bool write,
                         const std::map<std::string, std::vector<CsfPlanes>>* sliced = nullptr);

// Writes `in` with its stacked expert tensors split per expert to `out`, or
// returns false (writing nothing) when no file of `in` holds stacked expert
// scales. Containers and b12x files are left to compress to refuse.
bool split_stacked_experts(const std::filesystem::path& in, const std::filesystem::path& out,
                           std::optional<ScaleLayout> layout);

}  // namespace csfmoe::detail
