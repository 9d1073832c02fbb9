// CPU feature checks and the run-time choice of a kernel body, shared by the op sides
// (segattn_op.cpp, qmm_op.cpp). Those are compiled for the baseline ISA only; the kernel
// bodies (segattn_kernel.cpp, qmm_kernel.cpp) never include this header, so the inline
// code here can never be built with wide -m flags and picked for baseline callers.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>

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

}  // namespace cpu_isa
