// Which x86 vector instruction sets the CPU kernels may use, detected once at run
// time (the build never bakes in -march=native): kernels compile one copy per
// instruction set with __attribute__((target(...))) and pick one per call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define PYCOMM_X86_DISPATCH 1
// The target() strings of the kernel copies; cpuSupports() checks the same features.
#define PYCOMM_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define PYCOMM_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")))
#endif

#if defined(__GNUC__)
#define PYCOMM_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PYCOMM_ALWAYS_INLINE inline
#endif

namespace pycomm {

enum class CpuIsa : uint8_t {
  kGeneric,  // the build's baseline (SSE2 on x86-64), portable C++
  kAvx2,     // AVX2 + F16C
  kAvx512,   // AVX-512 F, BW, VL, DQ (+ AVX2, F16C)
};

const char* cpuIsaName(CpuIsa isa);

// True when this CPU can run `isa` and this build has code for it.
bool cpuSupports(CpuIsa isa);

// The widest instruction set cpuSupports(), detected once.
CpuIsa bestCpuIsa();

// Every instruction set cpuSupports(), narrowest first.
std::vector<CpuIsa> supportedCpuIsas();

// "generic" / "avx2" / "avx512" -> the enum; false for any other name.
bool parseCpuIsa(const std::string& name, CpuIsa* isa);

}  // namespace pycomm
