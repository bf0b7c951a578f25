// For tests that must change what only a process can: run a body in a forked child, and
// make every write that would grow a file fail, as on a full disk.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace ampdiag::test {

// Runs `body` in a child process and returns its exit code (100 + the signal if it was
// killed): the child changes limits and signal dispositions that the test process keeps.
template <typename Body>
int in_child(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

// As on a full disk: a write past `bytes` fails with EFBIG instead of raising SIGXFSZ.
// Only the soft limit: allow_file_growth() lifts it again, as when space is freed.
inline void forbid_file_growth(rlim_t bytes) {
  ::signal(SIGXFSZ, SIG_IGN);
  const rlimit limit{bytes, RLIM_INFINITY};
  ::setrlimit(RLIMIT_FSIZE, &limit);
}

inline void allow_file_growth() {
  const rlimit limit{RLIM_INFINITY, RLIM_INFINITY};
  ::setrlimit(RLIMIT_FSIZE, &limit);
}

}  // namespace ampdiag::test
