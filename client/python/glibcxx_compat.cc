// Keeps _native.so within the C++ runtime of manylinux_2_34 (RHEL 9's GCC 11 libstdc++,
// GLIBCXX_3.4.29), although Debian 12 builds it with GCC 12 (docs/python.md, "Wheels").
//
// GCC 12's libstdc++ gave std::condition_variable::wait(unique_lock&) a new symbol version,
// GLIBCXX_3.4.30, when it stopped being noexcept (so that a thread cancelled inside it
// unwinds instead of terminating; PR libstdc++/103382), and its headers bind every call to
// that version. It is the only GLIBCXX_3.4.30 symbol our code calls, and nothing here
// cancels threads: this definition, linked into _native.so and local to it (its version
// script exports PyInit__native alone), forwards every call in the module to the
// GLIBCXX_3.4.11 version of the same function, which every libstdc++ since GCC 4.5 has.
#include <condition_variable>
#include <mutex>

extern "C" void ckptd_condition_variable_wait_3_4_11(std::condition_variable* cv,
                                                     std::unique_lock<std::mutex>& lock);
__asm__(".symver ckptd_condition_variable_wait_3_4_11, "
        "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE@GLIBCXX_3.4.11");

void std::condition_variable::wait(std::unique_lock<std::mutex>& lock) {
  ckptd_condition_variable_wait_3_4_11(this, lock);
}
