// safetensors reading and writing: a validating read-only view of a file
// (mmap), a streaming writer that goes through a temporary file and renames at
// the end, and sharded-checkpoint index parsing.
//
// File layout (https://github.com/huggingface/safetensors): 8-byte
// little-endian header length N, N bytes of JSON header (an object mapping
// tensor names to {"dtype", "shape", "data_offsets": [begin, end]} plus an
// optional "__metadata__" string->string map; trailing spaces allowed), then
// the data section, offsets relative to its start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace csfmoe::st {

enum class Dtype : std::uint8_t {
  BOOL,
  U8,
  I8,
  F8_E4M3,
  F8_E5M2,
  F8_E8M0,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
};

std::string_view to_string(Dtype d) noexcept;
std::optional<Dtype> parse_dtype(std::string_view s) noexcept;
std::size_t dtype_size(Dtype d) noexcept;

// Headers larger than this are refused (the reference implementation uses the same cap).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// Largest data section Writer::commit moves to drop unused header space.
inline constexpr std::uint64_t kHeaderMoveLimit = std::uint64_t(256) << 20;

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::U8;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  // offsets inside the data section
  std::uint64_t end = 0;
  std::uint64_t nbytes() const { return end - begin; }
  std::uint64_t elements() const;
};

using Metadata = std::map<std::string, std::string>;

// A parsed and fully validated header. Throws FormatError naming `label`
// (usually the file path) and the tensor or field at fault.
struct Header {
  std::vector<TensorInfo> tensors;   // in the order of the JSON text
  std::optional<Metadata> metadata;  // absent when the header has no (or a null) __metadata__
  const TensorInfo* find(std::string_view name) const;
};
Header parse_header(std::string_view json, std::uint64_t data_size, const std::string& label);

// Read-only memory map of a whole file. Movable, not copyable.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);  // throws IoError
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::uint8_t> bytes() const { return {data_, size_}; }
  std::uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

// A validated safetensors file.
class File {
 public:
  static File open(const std::filesystem::path& path);  // IoError / FormatError

  const std::filesystem::path& path() const { return map_.path(); }
  std::uint64_t file_size() const { return map_.size(); }
  // The N header bytes exactly as stored (JSON text plus any padding).
  std::string_view header_bytes() const;
  std::uint64_t data_offset() const { return 8 + header_size_; }
  std::uint64_t data_size() const { return file_size() - data_offset(); }
  const Header& header() const { return header_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const TensorInfo* find(std::string_view name) const { return header_.find(name); }
  std::span<const std::uint8_t> data(const TensorInfo& t) const;
  std::span<const std::uint8_t> data_section() const;
  std::span<const std::uint8_t> bytes() const { return map_.bytes(); }

 private:
  MappedFile map_;
  std::uint64_t header_size_ = 0;
  Header header_;
};

// The temporary `.<name>.tmp-<pid>` (this process's pid) beside `dest`, where
// a writer builds `dest` before renaming it into place. First it removes what
// killed writers left there: every `.<any name>.tmp-<N>` in that folder (N
// decimal, as written here; any output's, not only dest's) whose process no
// longer exists, i.e. kill(N, 0) fails with ESRCH. A temporary whose owner is
// alive (a concurrent writer, or EPERM: another user's process) is left
// alone, as is this pid's own, anything named otherwise, and anything that is not a regular file
// or a folder (a symlink named like a temporary is neither followed nor
// removed). A stale folder is first renamed to `.<name>.tmp-<N>.stale` (also
// swept, by the same rule), then emptied through file descriptors without
// following symlinks (they are unlinked) or entering another filesystem.
// Best effort: what cannot be removed stays and the write goes on. A writer
// in another pid namespace or on another host sharing the folder looks dead;
// removing or renaming its temporary makes that run fail (its rename finds
// nothing), never commit a partial output. Used by AtomicFile and the
// checkpoint folder writer.
std::filesystem::path prepare_temporary(const std::filesystem::path& dest);

// A file written to `.<name>.tmp-<pid>` in the destination folder (see
// prepare_temporary) and renamed onto the destination by commit() (after
// fsync), refusing to replace an existing file. Destroying it uncommitted
// removes the temporary.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path dest);  // throws IoError
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(std::span<const std::uint8_t> bytes);  // appends (buffered)
  void write(std::string_view bytes);
  void pwrite(std::uint64_t offset, std::span<const std::uint8_t> bytes);  // unbuffered, at an offset
  void seek(std::uint64_t offset);                                         // next write() position
  std::uint64_t position() const { return pos_; }
  // Cuts the first `bytes` bytes of the written file (the caller rewrites
  // what stays in front): block-aligned parts by collapsing the range where
  // the file system can, the rest by moving the file down when at most
  // `move_limit` bytes would move. Returns how many bytes it cut.
  std::uint64_t remove_front(std::uint64_t bytes, std::uint64_t move_limit);
  void commit();

  const std::filesystem::path& destination() const { return dest_; }
  const std::filesystem::path& temporary() const { return tmp_; }

 private:
  void flush();
  // The message of a failed write: errno, and the folder's other temporaries.
  std::string write_failure() const;
  std::filesystem::path dest_, tmp_;
  int fd_ = -1;
  std::uint64_t pos_ = 0;
  std::vector<std::uint8_t> buf_;
  bool committed_ = false;
};

// Streams a safetensors file: the header is written last into `header_reserve`
// bytes left at the start, tensor data are appended in call order, contiguous.
// commit cuts the reservation down to the header's real size (JSON padded
// with spaces to 8-byte alignment) by a range collapse where the file system
// has one, else by moving the data down when they are at most
// kHeaderMoveLimit bytes; otherwise the unused reservation stays as spaces.
class Writer {
 public:
  Writer(std::filesystem::path dest, std::uint64_t header_reserve);

  void begin_tensor(std::string name, Dtype dtype, std::vector<std::uint64_t> shape);
  void write(std::span<const std::uint8_t> bytes);
  void end_tensor();  // checks that exactly product(shape) * dtype_size bytes came
  void add_tensor(std::string name, Dtype dtype, std::vector<std::uint64_t> shape,
                  std::span<const std::uint8_t> bytes);
  // Writes the header (throws Unsupported if it does not fit the reservation), fsyncs, renames.
  void commit(const std::optional<Metadata>& metadata);
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  // Length of the header JSON that commit() would write for these entries.
  static std::uint64_t header_json_size(const std::vector<TensorInfo>& tensors,
                                        const std::optional<Metadata>& metadata);
  static std::string header_json(const std::vector<TensorInfo>& tensors,
                                 const std::optional<Metadata>& metadata);

 private:
  AtomicFile file_;
  std::uint64_t reserve_ = 0;  // bytes before the data section (8 + N)
  std::uint64_t data_pos_ = 0;
  std::vector<TensorInfo> tensors_;
  bool open_tensor_ = false;
};

// model.safetensors.index.json of a sharded checkpoint.
struct ShardIndex {
  std::string raw;                                              // the file bytes verbatim
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard file name, file order
  std::vector<std::string> shards;                              // distinct shard names, first-use order
};
// Parses and validates the index in `folder`: shard names must be plain file
// names or relative paths of plain names ("tensors/model-00001.safetensors";
// no "." or "..", no absolute path), name existing regular files, and
// symlinks must resolve inside the folder. Throws FormatError naming the index and entry.
ShardIndex read_shard_index(const std::filesystem::path& index_file);
// Checks that `name` (a shard or other entry) is a plain name that resolves to a regular file
// inside `folder`; throws FormatError naming `what`.
std::filesystem::path resolve_inside(const std::filesystem::path& folder, const std::string& name,
                                     const std::string& what);
// Checks that `rel` ("a/b/c": plain names joined by '/', no "." or "..")
// names a regular file (or, with `directory`, a folder) that resolves,
// through every symlink on the way, to a path strictly inside `root`; a
// loop, a dangling link or a link out of `root` is refused. Nothing is
// opened. Throws FormatError naming `what`; returns root / rel.
std::filesystem::path resolve_under(const std::filesystem::path& root, const std::string& rel,
                                    const std::string& what, bool directory = false);
// A shard named by an index: resolve_inside for a plain name, resolve_under
// for a path into a sub-folder.
std::filesystem::path resolve_shard(const std::filesystem::path& folder, const std::string& shard,
                                    const std::string& what);

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

}  // namespace csfmoe::st
