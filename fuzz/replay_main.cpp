// Corpus replay (zstd's regression driver): feeds every file of the corpus
// folders (or files) named on the command line to the fuzz target's
// LLVMFuzzerTestOneInput once, in name order, built with the regular compiler
// so that the committed corpus runs as an ordinary test (and under the ASan
// preset). The test fails when a property check or a sanitizer aborts, when an
// exception escapes the target (libFuzzer reports that as a crash too), and
// when the corpus holds no file (a lost corpus must not pass quietly).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace fs = std::filesystem;

namespace {

std::vector<fs::path> corpus_files(int argc, char** argv) {
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path p = argv[i];
    if (fs::is_directory(p)) {
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
    } else if (fs::is_regular_file(p)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "fuzz replay: %s is neither a file nor a folder\n", p.c_str());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The input in an allocation of exactly its size, so that ASan sees a read
// past its end (as under libFuzzer).
std::unique_ptr<std::uint8_t[]> read_file(const fs::path& p, std::size_t& size) {
  std::ifstream in(p, std::ios::binary);
  size = static_cast<std::size_t>(fs::file_size(p));
  auto data = std::make_unique<std::uint8_t[]>(size);
  if (!in.read(reinterpret_cast<char*>(data.get()), static_cast<std::streamsize>(size)))
    throw std::runtime_error("cannot read " + p.string());
  return data;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_FOLDER_OR_FILE...\n", argv[0]);
    return 2;
  }
  const std::vector<fs::path> files = corpus_files(argc, argv);
  if (files.empty()) {
    std::fprintf(stderr, "fuzz replay: no corpus file found\n");
    return 1;
  }
  for (const fs::path& p : files) {
    std::size_t size = 0;
    try {
      const auto data = read_file(p, size);
      // Named first, so that a crash report says which input caused it.
      std::fprintf(stderr, "fuzz replay: %s (%zu bytes)\n", p.c_str(), size);
      std::fflush(stderr);
      LLVMFuzzerTestOneInput(data.get(), size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz replay: %s: exception escaped the fuzz target: %s\n", p.c_str(), e.what());
      return 1;
    } catch (...) {
      std::fprintf(stderr, "fuzz replay: %s: a non-std exception escaped the fuzz target\n", p.c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "fuzz replay: %zu inputs passed\n", files.size());
  return 0;
}
