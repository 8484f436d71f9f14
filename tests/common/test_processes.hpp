// Process helpers for tests of the temporary-file sweep.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

namespace csfmoe::testing {

// A pid with no process: a child that exited and was reaped.
inline pid_t dead_pid() {
  for (;;) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (::kill(pid, 0) != 0 && errno == ESRCH) return pid;
  }
}

}  // namespace csfmoe::testing
