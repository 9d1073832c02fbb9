// CPU feature checks and the run-time choice of a kernel body, shared by the op sides
// (segattn_op.cpp, qmm_op.cpp). Those are compiled for the baseline ISA only; the kernel
// bodies (segattn_kernel.cpp, qmm_kernel.cpp) never include this header, so the inline
// code here can never be built with wide -m flags and picked for baseline callers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace cpu_isa {

inline bool always() {
  return true;
}

#if defined(__x86_64__) || defined(_M_X64)
// AVX2 bodies also use FMA and F16C. GCC's and Clang's checks include the OS (XGETBV)
// support for the ymm/zmm state.
inline bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
inline bool has_avx512f() {
  return has_avx2() && __builtin_cpu_supports("avx512f");
}
inline bool has_avx512bw() {
  return has_avx512f() && __builtin_cpu_supports("avx512bw");
}
inline bool has_avx512vnni() {
  return has_avx512bw() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// The body to use: the one named by the environment variable `env` if this CPU runs it,
// else the first supported entry (tables list their default first and end with an
// always-supported portable body). Entry needs `name` and `supported`.
template <class Entry, std::size_t N>
const Entry* pick(const Entry (&table)[N], const char* env) {
  const char* forced = std::getenv(env);
  if (forced != nullptr && *forced != '\0') {
    for (const auto& e : table) {
      if (std::strcmp(e.name, forced) == 0 && e.supported()) return &e;
    }
  }
  for (const auto& e : table) {
    if (e.supported()) return &e;
  }
  return &table[N - 1];
}

// One op's table of bodies and the body in use: picked on first use (`pick`), or set by
// name (tests and benchmarks compare bodies). Entry needs `name` and `supported`.
template <class Entry, std::size_t N>
class Choice {
 public:
  Choice(const Entry (&table)[N], const char* env) : table_(table), env_(env) {}

  const Entry* current() {
    const Entry* e = current_.load(std::memory_order_acquire);
    if (e == nullptr) {
      e = pick(table_, env_);
      current_.store(e, std::memory_order_release);
    }
    return e;
  }

  std::vector<std::string> supported_names() const {
    std::vector<std::string> names;
    for (const auto& e : table_) {
      if (e.supported()) names.emplace_back(e.name);
    }
    return names;
  }

  void set(const std::string& name) {
    for (const auto& e : table_) {
      if (name == e.name) {
        if (!e.supported()) throw std::invalid_argument("ISA " + name + " is not supported by this CPU");
        current_.store(&e, std::memory_order_release);
        return;
      }
    }
    throw std::invalid_argument("unknown ISA " + name);
  }

 private:
  const Entry (&table_)[N];
  const char* env_;
  std::atomic<const Entry*> current_{nullptr};
};

}  // namespace cpu_isa
