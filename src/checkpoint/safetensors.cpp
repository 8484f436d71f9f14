// safetensors reader (validating, mmap) and streaming writer.
#include "csfmoe/safetensors.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "checkpoint/json_error.hpp"
#include "csfmoe/errors.hpp"

static_assert(std::endian::native == std::endian::little, "csfmoe assumes a little-endian host");

namespace csfmoe::st {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

struct DtypeName {
  Dtype dtype;
  std::string_view name;
  std::size_t size;
};
constexpr DtypeName kDtypes[] = {
    {Dtype::BOOL, "BOOL", 1},       {Dtype::U8, "U8", 1},           {Dtype::I8, "I8", 1},
    {Dtype::F8_E4M3, "F8_E4M3", 1}, {Dtype::F8_E5M2, "F8_E5M2", 1}, {Dtype::F8_E8M0, "F8_E8M0", 1},
    {Dtype::I16, "I16", 2},         {Dtype::U16, "U16", 2},         {Dtype::F16, "F16", 2},
    {Dtype::BF16, "BF16", 2},       {Dtype::I32, "I32", 4},         {Dtype::U32, "U32", 4},
    {Dtype::F32, "F32", 4},         {Dtype::F64, "F64", 8},         {Dtype::I64, "I64", 8},
    {Dtype::U64, "U64", 8},
};

std::string errno_text() { return std::strerror(errno); }

bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

// Rejects duplicate keys at any level (nlohmann keeps the last one silently)
// and nesting deeper than a header ever needs.
class DuplicateGuard {
 public:
  explicit DuplicateGuard(const std::string& label) : label_(label) {}
  bool operator()(int depth, nlohmann::detail::parse_event_t event, ojson& parsed) {
    using E = nlohmann::detail::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        if (depth > 3)
          throw FormatError(
              fmt::format("{}: header JSON nests deeper than a safetensors header can", label_));
        stack_.emplace_back();
        is_object_.push_back(event == E::object_start);
        break;
      case E::object_end:
      case E::array_end:
        if (!stack_.empty()) {
          stack_.pop_back();
          is_object_.pop_back();
        }
        break;
      case E::key: {
        const auto& k = parsed.get_ref<const std::string&>();
        if (!stack_.empty() && !stack_.back().insert(k).second) {
          if (stack_.size() == 1)
            throw FormatError(fmt::format("{}: tensor '{}': duplicate name in header", label_, k));
          throw FormatError(fmt::format("{}: duplicate key '{}' in header object", label_, k));
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

 private:
  const std::string& label_;
  std::vector<std::unordered_set<std::string>> stack_;
  std::vector<bool> is_object_;
};

std::uint64_t get_u64(const ojson& v, const std::string& what) {
  if (!v.is_number_unsigned()) throw FormatError(fmt::format("{} must be a non-negative integer", what));
  return v.get<std::uint64_t>();
}

}  // namespace

std::string_view to_string(Dtype d) noexcept {
  for (const auto& e : kDtypes)
    if (e.dtype == d) return e.name;
  return "?";
}
std::optional<Dtype> parse_dtype(std::string_view s) noexcept {
  for (const auto& e : kDtypes)
    if (e.name == s) return e.dtype;
  return std::nullopt;
}
std::size_t dtype_size(Dtype d) noexcept {
  for (const auto& e : kDtypes)
    if (e.dtype == d) return e.size;
  return 0;
}

std::uint64_t TensorInfo::elements() const {
  std::uint64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

const TensorInfo* Header::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Header parse_header(std::string_view json, std::uint64_t data_size, const std::string& label) {
  // nlohmann's lexer takes a NUL byte for the end of the input, which would
  // let arbitrary (non-UTF-8) bytes follow the JSON unnoticed.
  if (const auto nul = json.find('\0'); nul != std::string_view::npos)
    throw FormatError(fmt::format(
        "{}: header holds a NUL byte at offset {} (it must be UTF-8 JSON padded with spaces)", label, nul));
  ojson root;
  try {
    DuplicateGuard guard(label);
    root = ojson::parse(json.begin(), json.end(), std::ref(guard), /*allow_exceptions=*/true);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: header is {}", label, detail::json_error_text(e)));
  }
  if (!root.is_object()) throw FormatError(fmt::format("{}: header is not a JSON object", label));

  Header h;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const ojson& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object())
        throw FormatError(fmt::format("{}: __metadata__ must be an object of strings", label));
      Metadata md;
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          throw FormatError(fmt::format("{}: __metadata__ entry '{}' must be a string", label, m.key()));
        md.emplace(m.key(), m.value().get<std::string>());
      }
      h.metadata = std::move(md);
      continue;
    }
    const std::string what = fmt::format("{}: tensor '{}'", label, name);
    if (name.empty()) throw FormatError(fmt::format("{}: tensor with an empty name", label));
    if (!v.is_object()) throw FormatError(what + ": entry must be an object");
    TensorInfo t;
    t.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) throw FormatError(what + ": missing or non-string dtype");
    auto parsed = parse_dtype(dt->get_ref<const std::string&>());
    if (!parsed) throw FormatError(what + ": unknown dtype '" + dt->get<std::string>() + "'");
    t.dtype = *parsed;
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) throw FormatError(what + ": missing or non-array shape");
    std::uint64_t elems = 1;
    for (std::size_t i = 0; i < sh->size(); ++i) {
      const std::uint64_t d = get_u64((*sh)[i], fmt::format("{}: shape[{}]", what, i));
      t.shape.push_back(d);
      if (mul_overflows(elems, d, elems)) throw FormatError(what + ": shape product overflows");
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2)
      throw FormatError(what + ": data_offsets must be [begin, end]");
    t.begin = get_u64((*off)[0], what + ": data_offsets[0]");
    t.end = get_u64((*off)[1], what + ": data_offsets[1]");
    if (t.begin > t.end)
      throw FormatError(fmt::format("{}: data_offsets [{}, {}] has begin after end", what, t.begin, t.end));
    if (t.end > data_size)
      throw FormatError(fmt::format("{}: data_offsets [{}, {}] past the end of the data section ({} bytes)",
                                    what, t.begin, t.end, data_size));
    std::uint64_t want = 0;
    if (mul_overflows(elems, dtype_size(t.dtype), want))
      throw FormatError(
          fmt::format("{}: shape {} x {} overflows a 64-bit byte count ({} bytes in data_offsets)", what,
                      fmt::join(t.shape, "x"), to_string(t.dtype), t.nbytes()));
    if (want != t.nbytes())
      throw FormatError(fmt::format("{}: {} bytes in data_offsets but shape {} x {} needs {}", what,
                                    t.nbytes(), fmt::join(t.shape, "x"), to_string(t.dtype), want));
    h.tensors.push_back(std::move(t));
  }

  // Overlap check over tensors sorted by start (empty tensors overlap nothing).
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : h.tensors)
    if (t.nbytes()) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw FormatError(fmt::format("{}: tensor '{}' [{}, {}] overlaps tensor '{}' [{}, {}]", label,
                                    by_offset[i]->name, by_offset[i]->begin, by_offset[i]->end,
                                    by_offset[i - 1]->name, by_offset[i - 1]->begin, by_offset[i - 1]->end));
  return h;
}

// ---------------------------------------------------------------------------
MappedFile::MappedFile(const fs::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("{}: cannot open: {}", path.string(), errno_text()));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const auto msg = errno_text();
    ::close(fd);
    throw IoError(fmt::format("{}: cannot stat: {}", path.string(), msg));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(fmt::format("{}: not a regular file", path.string()));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const auto msg = errno_text();
      ::close(fd);
      throw IoError(fmt::format("{}: cannot mmap: {}", path.string(), msg));
    }
    data_ = static_cast<const std::uint8_t*>(p);
  }
  ::close(fd);
}
MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<std::uint8_t*>(data_), size_);
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}
MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

File File::open(const fs::path& path) {
  File f;
  f.map_ = MappedFile(path);
  const std::string label = path.string();
  const auto b = f.map_.bytes();
  if (b.size() < 8)
    throw FormatError(
        fmt::format("{}: file is {} bytes, shorter than the 8-byte header length", label, b.size()));
  std::uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  if (n > kMaxHeaderBytes)
    throw FormatError(
        fmt::format("{}: header length {} exceeds the {}-byte limit", label, n, kMaxHeaderBytes));
  if (n > b.size() - 8)
    throw FormatError(
        fmt::format("{}: header length {} runs past the end of the file ({} bytes)", label, n, b.size()));
  f.header_size_ = n;
  f.header_ = parse_header(f.header_bytes(), f.data_size(), label);
  return f;
}

std::string_view File::header_bytes() const {
  return {reinterpret_cast<const char*>(map_.bytes().data()) + 8, static_cast<std::size_t>(header_size_)};
}
std::span<const std::uint8_t> File::data(const TensorInfo& t) const {
  return map_.bytes().subspan(data_offset() + t.begin, t.nbytes());
}
std::span<const std::uint8_t> File::data_section() const { return map_.bytes().subspan(data_offset()); }

// ---------------------------------------------------------------------------
namespace {
constexpr std::size_t kWriteBuffer = std::size_t{4} << 20;

// Stale temporary folders deeper than this are left as they are (each level holds a descriptor).
constexpr int kMaxSweepDepth = 64;

// The pid written as `digits` by prepare_temporary (no sign, no leading zero,
// in range), else 0: anything else is not a name this code made.
pid_t parse_pid(std::string_view digits) {
  if (digits.empty() || digits.size() > 10 || digits[0] == '0') return 0;
  std::uint64_t v = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return 0;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v <= static_cast<std::uint64_t>(std::numeric_limits<pid_t>::max()) ? static_cast<pid_t>(v) : 0;
}

bool remove_folder_at(int dirfd, const char* name, dev_t dev, int depth);

// Removes everything inside the folder open as `fd` (closed here) through
// descriptors, so a path swapped for a symlink mid-way is never followed;
// symlinks are unlinked, other filesystems (mount points) not entered.
bool empty_folder(int fd, dev_t dev, int depth) {
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return false;
  }
  bool ok = true;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    if (n == "." || n == "..") continue;
    struct stat s {};
    if (::fstatat(fd, e->d_name, &s, AT_SYMLINK_NOFOLLOW) != 0)
      ok = false;
    else if (S_ISDIR(s.st_mode))
      ok = remove_folder_at(fd, e->d_name, dev, depth - 1) && ok;
    else
      ok = ::unlinkat(fd, e->d_name, 0) == 0 && ok;
  }
  ::closedir(d);
  return ok;
}

// Empties and removes the folder `name` in `dirfd` unless it is a symlink,
// lies on another filesystem than `dev`, or nests deeper than `depth`.
bool remove_folder_at(int dirfd, const char* name, dev_t dev, int depth) {
  if (depth < 0) return false;
  const int fd = ::openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat s {};
  if (::fstat(fd, &s) != 0 || s.st_dev != dev) {
    ::close(fd);
    return false;
  }
  return empty_folder(fd, dev, depth) && ::unlinkat(dirfd, name, AT_REMOVEDIR) == 0;
}

constexpr std::string_view kStale = ".stale";

// Removes `name` in the folder `dirfd` if it is a regular file or a folder. A
// folder is first renamed out of the temporary's name, so that a writer that
// is alive after all (another pid namespace) fails instead of committing it
// half emptied.
void remove_stale(int dirfd, const std::string& name) {
  struct stat s {};
  struct stat parent {};
  if (::fstatat(dirfd, name.c_str(), &s, AT_SYMLINK_NOFOLLOW) != 0 || ::fstat(dirfd, &parent) != 0) return;
  if (S_ISREG(s.st_mode)) {
    ::unlinkat(dirfd, name.c_str(), 0);
    return;
  }
  // A symlink, FIFO, socket or device: no writer made it. A mount point: not ours to empty.
  if (!S_ISDIR(s.st_mode) || s.st_dev != parent.st_dev) return;
  std::string victim = name;
  if (!victim.ends_with(kStale)) {
    victim += kStale;
    if (::renameat2(dirfd, name.c_str(), dirfd, victim.c_str(), RENAME_NOREPLACE) != 0) return;
  }
  remove_folder_at(dirfd, victim.c_str(), s.st_dev, kMaxSweepDepth);
}
}  // namespace

fs::path prepare_temporary(const fs::path& dest) {
  fs::path dir = dest.parent_path();
  if (dir.empty()) dir = ".";
  const std::string name = dest.filename().string();
  const pid_t self = ::getpid();
  // Best effort: if the folder cannot be read, the writer's own create reports why.
  if (const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    // Every ".<name>.tmp-<pid>" of the folder, not only this output's: a
    // killed run's temporary can be gigabytes.
    constexpr std::string_view kTmp = ".tmp-";
    std::vector<std::string> stale;
    if (DIR* d = ::fdopendir(::dup(fd))) {
      while (const dirent* e = ::readdir(d)) {
        std::string_view n = e->d_name;
        const auto at = n.rfind(kTmp);
        if (!n.starts_with('.') || at == std::string_view::npos || at < 2) continue;
        n.remove_prefix(at + kTmp.size());
        if (n.ends_with(kStale)) n.remove_suffix(kStale.size());
        const pid_t pid = parse_pid(n);
        // Only ESRCH means gone; EPERM is a live process of another user.
        if (pid > 0 && pid != self && ::kill(pid, 0) != 0 && errno == ESRCH) stale.emplace_back(e->d_name);
      }
      ::closedir(d);
    }
    for (const auto& n : stale) remove_stale(fd, n);
    ::close(fd);
  }
  return dir / fmt::format(".{}.tmp-{}", name, static_cast<long>(self));
}

AtomicFile::AtomicFile(fs::path dest) : dest_(std::move(dest)) {
  tmp_ = prepare_temporary(dest_);
  fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw IoError(fmt::format("{}: cannot create temporary file: {}", tmp_.string(), errno_text()));
  buf_.reserve(kWriteBuffer);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

std::string AtomicFile::write_failure() const {
  const std::string why = errno_text();
  std::string msg =
      fmt::format("{}: write failed (temporary {}, removed): {}", dest_.string(), tmp_.string(), why);
  // Other runs' temporaries in the folder may be what filled it.
  fs::path dir = tmp_.parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  std::vector<std::string> others;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.starts_with('.') && n.find(".tmp-") != std::string::npos && it->path() != tmp_) others.push_back(n);
  }
  if (!others.empty())
    msg += fmt::format(
        "; other temporaries in {} (runs still going, or left by a run killed outright: remove "
        "them if no csf run is writing there): {}",
        dir.string(), fmt::join(others, ", "));
  return msg;
}

void AtomicFile::flush() {
  std::size_t done = 0;
  while (done < buf_.size()) {
    const auto off = static_cast<off_t>(pos_ - buf_.size() + done);
    const ssize_t w = ::pwrite(fd_, buf_.data() + done, buf_.size() - done, off);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError(write_failure());
    }
    done += static_cast<std::size_t>(w);
  }
  buf_.clear();
}

void AtomicFile::write(std::span<const std::uint8_t> bytes) {
  if (bytes.size() >= kWriteBuffer) {
    flush();
    const std::uint64_t at = pos_;
    pos_ += bytes.size();
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t w =
          ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(at + done));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw IoError(write_failure());
      }
      done += static_cast<std::size_t>(w);
    }
    return;
  }
  if (buf_.size() + bytes.size() > kWriteBuffer) flush();
  buf_.insert(buf_.end(), bytes.begin(), bytes.end());
  pos_ += bytes.size();
}

void AtomicFile::write(std::string_view bytes) {
  write(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
}

void AtomicFile::seek(std::uint64_t offset) {
  flush();
  pos_ = offset;
}

void AtomicFile::pwrite(std::uint64_t offset, std::span<const std::uint8_t> bytes) {
  flush();
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w =
        ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError(write_failure());
    }
    done += static_cast<std::size_t>(w);
  }
}

std::uint64_t AtomicFile::remove_front(std::uint64_t bytes, std::uint64_t move_limit) {
  flush();
  struct stat st {};
  if (bytes == 0 || ::fstat(fd_, &st) != 0) return 0;
  std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  if (size <= bytes) {  // nothing written after the cut range
    if (::ftruncate(fd_, 0) != 0) return 0;
    pos_ = 0;
    return bytes;
  }
  std::uint64_t removed = 0;
  if (st.st_blksize > 0) {
    const std::uint64_t block = static_cast<std::uint64_t>(st.st_blksize);
    const std::uint64_t whole = bytes / block * block;
    if (whole > 0 && ::fallocate(fd_, FALLOC_FL_COLLAPSE_RANGE, 0, static_cast<off_t>(whole)) == 0) {
      removed = whole;
      size -= whole;
    }
  }
  pos_ = size;
  const std::uint64_t rest = bytes - removed;
  if (rest == 0 || size - rest > move_limit) return removed;
  std::vector<std::uint8_t> chunk(
      static_cast<std::size_t>(std::min<std::uint64_t>(size - rest, kWriteBuffer)));
  for (std::uint64_t from = rest; from < size;) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), size - from));
    const ssize_t r = ::pread(fd_, chunk.data(), want, static_cast<off_t>(from));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      throw IoError(fmt::format("{}: cannot read back the temporary {}: {}", dest_.string(), tmp_.string(),
                                r < 0 ? errno_text() : std::string("unexpected end of file")));
    pwrite(from - rest, std::span<const std::uint8_t>(chunk.data(), static_cast<std::size_t>(r)));
    from += static_cast<std::uint64_t>(r);
  }
  if (::ftruncate(fd_, static_cast<off_t>(size - rest)) != 0)
    throw IoError(
        fmt::format("{}: cannot truncate the temporary {}: {}", dest_.string(), tmp_.string(), errno_text()));
  pos_ = size - rest;
  return bytes;
}

void AtomicFile::commit() {
  flush();
  if (::fsync(fd_) != 0)
    throw IoError(
        fmt::format("{}: fsync failed (temporary {}): {}", dest_.string(), tmp_.string(), errno_text()));
  ::close(fd_);
  fd_ = -1;
  // RENAME_NOREPLACE: never clobber an output that appeared meanwhile.
  if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dest_.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST)
      throw InvalidArgument(fmt::format("{}: output already exists; refusing to overwrite", dest_.string()));
    if (errno != EINVAL && errno != ENOSYS)
      throw IoError(
          fmt::format("{}: cannot rename {} into place: {}", dest_.string(), tmp_.string(), errno_text()));
    std::error_code ec;
    if (fs::exists(fs::symlink_status(dest_, ec)))
      throw InvalidArgument(fmt::format("{}: output already exists; refusing to overwrite", dest_.string()));
    if (::rename(tmp_.c_str(), dest_.c_str()) != 0)
      throw IoError(
          fmt::format("{}: cannot rename {} into place: {}", dest_.string(), tmp_.string(), errno_text()));
  }
  committed_ = true;
  fs::path dir = dest_.parent_path();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// ---------------------------------------------------------------------------
std::string Writer::header_json(const std::vector<TensorInfo>& tensors,
                                const std::optional<Metadata>& metadata) {
  // Same shape as the reference writer: __metadata__ first, then tensors in data order.
  ojson root = ojson::object();
  if (metadata) {
    ojson md = ojson::object();
    for (const auto& [k, v] : *metadata) md[k] = v;
    root["__metadata__"] = std::move(md);
  }
  for (const auto& t : tensors) {
    ojson e = ojson::object();
    e["dtype"] = std::string(to_string(t.dtype));
    e["shape"] = t.shape;
    e["data_offsets"] = {t.begin, t.end};
    root[t.name] = std::move(e);
  }
  return root.dump();
}

std::uint64_t Writer::header_json_size(const std::vector<TensorInfo>& tensors,
                                       const std::optional<Metadata>& metadata) {
  return header_json(tensors, metadata).size();
}

Writer::Writer(fs::path dest, std::uint64_t header_reserve)
    : file_(std::move(dest)), reserve_((8 + header_reserve + 7) / 8 * 8) {
  file_.seek(reserve_);
}

void Writer::begin_tensor(std::string name, Dtype dtype, std::vector<std::uint64_t> shape) {
  if (open_tensor_) throw InvalidArgument("safetensors writer: begin_tensor while a tensor is open");
  // The header's metadata key: a tensor of that name makes an invalid file.
  if (name == "__metadata__")
    throw FormatError(
        fmt::format("{}: tensor '__metadata__': the name safetensors keeps for the header's "
                    "metadata cannot be a tensor",
                    file_.destination().string()));
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.begin = t.end = data_pos_;
  tensors_.push_back(std::move(t));
  open_tensor_ = true;
}

void Writer::write(std::span<const std::uint8_t> bytes) {
  if (!open_tensor_) throw InvalidArgument("safetensors writer: write outside a tensor");
  file_.write(bytes);
  data_pos_ += bytes.size();
  tensors_.back().end = data_pos_;
}

void Writer::end_tensor() {
  if (!open_tensor_) throw InvalidArgument("safetensors writer: end_tensor without begin_tensor");
  open_tensor_ = false;
  const auto& t = tensors_.back();
  const std::uint64_t want = t.elements() * dtype_size(t.dtype);
  if (t.nbytes() != want)
    throw InvalidArgument(fmt::format("{}: tensor '{}': wrote {} bytes, shape needs {}",
                                      file_.destination().string(), t.name, t.nbytes(), want));
}

void Writer::add_tensor(std::string name, Dtype dtype, std::vector<std::uint64_t> shape,
                        std::span<const std::uint8_t> bytes) {
  begin_tensor(std::move(name), dtype, std::move(shape));
  write(bytes);
  end_tensor();
}

void Writer::commit(const std::optional<Metadata>& metadata) {
  if (open_tensor_) throw InvalidArgument("safetensors writer: commit with an open tensor");
  std::string json = header_json(tensors_, metadata);
  const std::uint64_t n = reserve_ - 8;
  if (json.size() > n)
    throw Unsupported(fmt::format("{}: header of {} bytes does not fit the {} bytes reserved for it",
                                  file_.destination().string(), json.size(), n));
  if (n > kMaxHeaderBytes)
    throw Unsupported(fmt::format("{}: header of {} bytes exceeds the safetensors limit of {}",
                                  file_.destination().string(), n, kMaxHeaderBytes));
  const std::uint64_t needed = 8 + (json.size() + 7) / 8 * 8;
  const std::uint64_t cut = file_.remove_front(reserve_ - needed, kHeaderMoveLimit);
  const std::uint64_t head_bytes = reserve_ - cut;
  const std::uint64_t padded = head_bytes - 8;
  json.resize(padded, ' ');  // trailing spaces: allowed by safetensors, keeps data 8-byte aligned
  std::vector<std::uint8_t> head(head_bytes);
  std::memcpy(head.data(), &padded, 8);
  std::memcpy(head.data() + 8, json.data(), padded);
  file_.pwrite(0, head);
  file_.commit();
}

// ---------------------------------------------------------------------------
fs::path resolve_inside(const fs::path& folder, const std::string& name, const std::string& what) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\\') != std::string::npos || name.find('\0') != std::string::npos)
    throw FormatError(fmt::format("{}: '{}' is not a plain file name inside the folder", what, name));
  const fs::path p = folder / name;
  std::error_code ec;
  const auto lst = fs::symlink_status(p, ec);
  if (ec || !fs::exists(lst))
    throw FormatError(fmt::format("{}: '{}' does not exist in {}", what, name, folder.string()));
  if (fs::is_symlink(lst)) {
    // A loop or a dangling link would otherwise read as "leaves the folder".
    (void)fs::status(p, ec);
    if (ec == std::errc::too_many_symbolic_link_levels)
      throw FormatError(fmt::format("{}: '{}' is a symlink loop ({})", what, name, ec.message()));
    if (ec) throw FormatError(fmt::format("{}: '{}' is a dangling symlink ({})", what, name, ec.message()));
    const fs::path target = fs::weakly_canonical(p, ec);
    const fs::path base = fs::weakly_canonical(folder, ec);
    auto [b, t] = std::mismatch(base.begin(), base.end(), target.begin(), target.end());
    if (ec || b != base.end() || t == target.end())
      throw FormatError(
          fmt::format("{}: '{}' is a symlink that leaves the folder ({})", what, name, target.string()));
  }
  if (!fs::is_regular_file(p, ec))
    throw FormatError(fmt::format("{}: '{}' is not a regular file", what, name));
  return p;
}

fs::path resolve_under(const fs::path& root, const std::string& rel, const std::string& what,
                       bool directory) {
  bool plain = !rel.empty() && rel.find('\\') == std::string::npos && rel.find('\0') == std::string::npos;
  for (std::size_t a = 0; plain && a <= rel.size();) {
    const std::size_t b = std::min(rel.find('/', a), rel.size());
    const std::string_view part(rel.data() + a, b - a);
    plain = !part.empty() && part != "." && part != "..";
    a = b + 1;
  }
  if (!plain)
    throw FormatError(
        fmt::format("{}: '{}' is not a plain file name or relative path inside the folder", what, rel));
  const fs::path p = root / rel;
  std::error_code ec;
  const auto st = fs::status(p, ec);
  if (ec == std::errc::too_many_symbolic_link_levels)
    throw FormatError(fmt::format("{}: '{}' is a symlink loop ({})", what, rel, ec.message()));
  if (!fs::exists(fs::symlink_status(p, ec)))
    throw FormatError(fmt::format("{}: '{}' does not exist in {}", what, rel, root.string()));
  if (!fs::exists(st)) throw FormatError(fmt::format("{}: '{}' is a dangling symlink", what, rel));
  // Every link on the way resolved: the real path must stay under the real root.
  const fs::path target = fs::canonical(p, ec);
  std::error_code ec2;
  const fs::path base = fs::canonical(root, ec2);
  auto [b, t] = std::mismatch(base.begin(), base.end(), target.begin(), target.end());
  if (ec || ec2 || b != base.end() || t == target.end())
    throw FormatError(fmt::format("{}: '{}' leaves the folder (it resolves outside it: {})", what, rel,
                                  ec ? ec.message() : target.string()));
  if (directory ? !fs::is_directory(st) : !fs::is_regular_file(st))
    throw FormatError(fmt::format("{}: '{}' is not a {}", what, rel, directory ? "folder" : "regular file"));
  return p;
}

fs::path resolve_shard(const fs::path& folder, const std::string& shard, const std::string& what) {
  return shard.find('/') == std::string::npos ? resolve_inside(folder, shard, what)
                                              : resolve_under(folder, shard, what);
}

ShardIndex read_shard_index(const fs::path& index_file) {
  const std::string label = index_file.string();
  ShardIndex idx;
  {
    MappedFile m(index_file);
    idx.raw.assign(reinterpret_cast<const char*>(m.bytes().data()), m.size());
  }
  if (const auto nul = idx.raw.find('\0'); nul != std::string::npos)
    throw FormatError(fmt::format("{}: not valid JSON: a NUL byte at offset {}", label, nul));
  ojson root;
  try {
    DuplicateGuard guard(label);
    root = ojson::parse(idx.raw, std::ref(guard), true);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", label, detail::json_error_text(e)));
  } catch (const FormatError&) {
    throw;
  }
  if (!root.is_object()) throw FormatError(label + ": index is not a JSON object");
  auto wm = root.find("weight_map");
  if (wm == root.end() || !wm->is_object()) throw FormatError(label + ": missing weight_map object");
  const fs::path folder = index_file.parent_path().empty() ? fs::path(".") : index_file.parent_path();
  std::unordered_set<std::string> seen;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string())
      throw FormatError(fmt::format("{}: weight_map['{}'] must be a shard file name", label, it.key()));
    const std::string shard = it.value().get<std::string>();
    if (seen.insert(shard).second) {
      resolve_shard(folder, shard, fmt::format("{}: weight_map['{}']", label, it.key()));
      idx.shards.push_back(shard);
    }
    idx.weight_map.emplace_back(it.key(), shard);
  }
  return idx;
}

}  // namespace csfmoe::st
