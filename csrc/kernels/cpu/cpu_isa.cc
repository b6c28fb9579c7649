#include "kernels/cpu/cpu_isa.h"

#ifdef PYCOMM_X86_DISPATCH
#include <cpuid.h>
#endif

namespace pycomm {

#ifdef PYCOMM_X86_DISPATCH
namespace {

// F16C from CPUID leaf 1 (ECX bit 29): not every compiler's __builtin_cpu_supports
// knows "f16c". The AVX register state it needs is checked with avx2 below.
bool hasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

}  // namespace
#endif

const char* cpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool cpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return true;
    case CpuIsa::kAvx2: {
#ifdef PYCOMM_X86_DISPATCH
      static const bool yes = __builtin_cpu_supports("avx2") && hasF16c();
      return yes;
#else
      return false;
#endif
    }
    case CpuIsa::kAvx512: {
#ifdef PYCOMM_X86_DISPATCH
      static const bool yes = cpuSupports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
                              __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") &&
                              __builtin_cpu_supports("avx512dq");
      return yes;
#else
      return false;
#endif
    }
  }
  return false;
}

CpuIsa bestCpuIsa() {
  static const CpuIsa best = cpuSupports(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                             : cpuSupports(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                          : CpuIsa::kGeneric;
  return best;
}

std::vector<CpuIsa> supportedCpuIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (cpuSupports(isa)) isas.push_back(isa);
  return isas;
}

bool parseCpuIsa(const std::string& name, CpuIsa* isa) {
  for (CpuIsa candidate : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpuIsaName(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

}  // namespace pycomm
