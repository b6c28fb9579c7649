// One collective call, as its entry point describes it, and the prefix of its errors.
//
// The backend builds a CallDescriptor once per entry point (the op and the call's
// tensors, reduce op, root and timeout); the work queue adds the bytes and resolves
// the timeout, then the flight recorder, the profiler, the call check and the call
// hash (backend/call_check.h), Comm (its op and deadline) and the stats read it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace pycomm {

// "pycomm <op>", "pycomm <op> (<algorithm>)", or "pycomm" for no op: the one place
// an error's prefix is built (usage errors add ": ", as Error does).
inline std::string errorPrefix(const std::string& op, const std::string& algorithm = "") {
  if (op.empty()) return "pycomm";
  return algorithm.empty() ? "pycomm " + op : "pycomm " + op + " (" + algorithm + ")";
}

// What a call does, whatever its entry point: the planner's input (algorithms/plan.h)
// and what each shared-memory step posts (arenaCall, algorithms/comm.h), which is why
// kAllreduce..kBarrier keep the values 1-8.
enum class Collective : uint8_t {
  kAllreduce = 1, kBroadcast, kAllgather, kReduceScatter, kGather, kScatter, kAlltoall, kBarrier,
  kReduce, kMonitoredBarrier, kAllreduceQuantized, kAllreduceSparse, kAllreduceCoo,
};

struct CallDescriptor {
  // The entry point ("allreduce_coalesced"): errors, stats, the flight recorder, the profiler.
  const char* op = "";
  Collective collective = Collective::kBarrier;
  // The name ranks compare (call check, call hash) where it is not `op`: a sparse
  // all-reduce is "allreduce (sparse)", so that it never matches a dense one.
  const char* comparedAs = nullptr;
  int32_t dtype = -1;     // DataType; -1: none (a barrier) or not compared
  int32_t reduceOp = -1;  // ReduceOp; -1: none
  int64_t count = -1;     // elements this rank contributes; -1: not compared (all-to-all)
  int32_t root = -1;      // the root rank, or a compressed collective's codec setting; -1: none
  uint64_t bytes = 0;     // what its output tensors hold (the work queue sets it)
  // The call's timeout (torch's per-call option; the work queue puts the group's in
  // place of an unset one).
  std::chrono::milliseconds timeout{0};

  const char* comparedName() const { return comparedAs != nullptr ? comparedAs : op; }
  const char* dtypeName() const { return dtype >= 0 ? dataTypeName(static_cast<DataType>(dtype)) : ""; }
};

// A call with only its op and collective so far (a barrier has nothing more).
inline CallDescriptor describeCall(const char* op, Collective collective, std::chrono::milliseconds timeout) {
  CallDescriptor call;
  call.op = op;
  call.collective = collective;
  call.timeout = timeout;
  return call;
}

}  // namespace pycomm
