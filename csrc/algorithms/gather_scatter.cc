// Rooted direct collectives: gather and scatter (one message per non-root rank).
#include <cstring>
#include <vector>

#include "algorithms/collectives.h"

namespace pycomm {

void gatherDirect(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs,
                  int root) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<RequestPtr> requests;
  if (r == root) {
    for (int peer = 0; peer < n; ++peer)
      if (peer != r) requests.push_back(comm.recv(peer, outputs[peer], bytes));
    if (bytes > 0 && outputs[r] != input) std::memcpy(outputs[r], input, bytes);
  } else {
    requests.push_back(comm.send(root, input, bytes));
  }
  comm.waitAll(requests);
}

void scatterDirect(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes,
                   int root) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<RequestPtr> requests;
  if (r == root) {
    for (int k = 1; k < n; ++k) {
      const int peer = (r + k) % n;
      requests.push_back(comm.send(peer, inputs[peer], bytes));
    }
    if (bytes > 0 && inputs[r] != output) std::memcpy(output, inputs[r], bytes);
  } else {
    requests.push_back(comm.recv(root, output, bytes));
  }
  comm.waitAll(requests);
}

}  // namespace pycomm
