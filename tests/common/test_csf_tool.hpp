// Runs the csf command-line tool (CSFMOE_CSF_BINARY, defined for every CPU
// test) as a child process, no shell involved.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "test_files.hpp"

namespace csfmoe::testing {

struct CsfRun {
  int code = -1;  // the exit status, or 128 + the signal that ended it
  std::string out, err;
};

// csf with `args`: stdin from /dev/null, stdout and stderr captured through
// the files `io`/stdout and `io`/stderr (a folder that must exist).
inline CsfRun run_csf_tool(const std::vector<std::string>& args, const std::filesystem::path& io) {
  const std::filesystem::path o = io / "stdout", e = io / "stderr";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, o.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, e.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<std::string> all = {CSFMOE_CSF_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  CsfRun r;
  const int rc = ::posix_spawn(&pid, CSFMOE_CSF_BINARY, &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "cannot start " << CSFMOE_CSF_BINARY << ": " << std::strerror(rc);
    return r;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_bytes(o);
  r.err = read_bytes(e);
  return r;
}

}  // namespace csfmoe::testing
