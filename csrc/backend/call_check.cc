#include "backend/call_check.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/collectives.h"
#include "common/fnv.h"

namespace pycomm {

namespace {

std::string callText(const CallSignature& sig) {
  std::string text = sig.op;
  if (sig.dtype >= 0) text += strCat(" ", dataTypeName(static_cast<DataType>(sig.dtype)));
  if (sig.count >= 0) text += strCat(" x", sig.count);
  if (sig.reduceOp >= 0) text += strCat(" ", reduceOpName(static_cast<ReduceOp>(sig.reduceOp)));
  if (sig.root >= 0) text += strCat(" root ", sig.root);
  return text;
}

}  // namespace

CallSignature wireSignature(const CallDescriptor& call) {
  CallSignature sig;
  std::strncpy(sig.op, call.comparedName(), sizeof(sig.op) - 1);
  sig.dtype = call.dtype;
  sig.reduceOp = call.reduceOp;
  sig.count = call.count;
  sig.root = call.root;
  return sig;
}

uint64_t callHash(const CallDescriptor& call) {
  // The bytes the signature's op holds (a name longer than 39 characters cut there).
  const char* name = call.comparedName();
  const size_t length = std::min<size_t>(std::strlen(name), sizeof(CallSignature::op) - 1);
  uint64_t h = fnv1a(name, length, 1469598103934665603ull);  // (a digit short of kFnvOffset)
  h = fnv1a(&call.dtype, sizeof(call.dtype), h);
  h = fnv1a(&call.reduceOp, sizeof(call.reduceOp), h);
  h = fnv1a(&call.root, sizeof(call.root), h);
  return h ^ (h >> 29);
}

void checkSameCall(Comm& comm, const CallDescriptor& call) {
  const int n = comm.size();
  std::vector<CallSignature> all(n);
  all[comm.rank()] = wireSignature(call);
  std::vector<char*> chunks;
  for (auto& sig : all) chunks.push_back(reinterpret_cast<char*>(&sig));
  comm.setAlgorithm("check");
  ringAllgather(comm, chunks, std::vector<size_t>(n, sizeof(CallSignature)));
  comm.setAlgorithm("");
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && std::memcmp(&all[r], &all[0], sizeof(CallSignature)) == 0;
  if (same) return;
  std::string calls;
  for (int r = 0; r < n && r < 8; ++r)
    calls += strCat(r ? "; " : "", comm.transport().rankName(r), ": ", callText(all[r]));
  const std::string detail = strCat("ranks made different calls (PYCOMM_CHECK): ", calls, n > 8 ? "; ..." : "");
  throw Error(ErrorKind::kUsage, errorPrefix(call.comparedName()), detail);
}

}  // namespace pycomm
