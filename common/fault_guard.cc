#include "common/fault_guard.h"

#include <unistd.h>

#include <csetjmp>
#include <csignal>
#include <cstring>
#include <mutex>

namespace ckpt {
namespace {

// The copy this thread is guarding, if any. Read by the signal handler on the same thread.
thread_local sigjmp_buf* volatile t_guard = nullptr;

struct sigaction g_previous;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  if (sigjmp_buf* guard = t_guard) {
    t_guard = nullptr;
    siglongjmp(*guard, 1);
  }
  // Not ours: behave as before this handler was installed.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(signal, info, context);
    return;
  }
  if (g_previous.sa_handler == SIG_IGN) return;
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(signal);
    return;
  }
  std::signal(SIGBUS, SIG_DFL);
  std::raise(SIGBUS);
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

}  // namespace

bool GuardedMemcpy(void* dst, const void* src, size_t n) {
  InstallOnce();
  sigjmp_buf guard;
  // savemask=1: the handler runs with SIGBUS blocked unless SA_NODEFER; restoring the mask
  // on the jump keeps later faults deliverable either way.
  if (sigsetjmp(guard, 1) != 0) return false;
  t_guard = &guard;
  std::memcpy(dst, src, n);
  t_guard = nullptr;
  return true;
}

bool GuardedTouch(void* data, size_t n) {
  InstallOnce();
  sigjmp_buf guard;
  if (sigsetjmp(guard, 1) != 0) return false;
  t_guard = &guard;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto* p = static_cast<volatile char*>(data);
  for (size_t off = 0; off < n; off += page) p[off] = p[off];
  t_guard = nullptr;
  return true;
}

}  // namespace ckpt
