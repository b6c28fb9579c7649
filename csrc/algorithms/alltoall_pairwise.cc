// All-to-all: every receive is posted first, then sends go out in a staggered
// order (rank r sends to r+1, r+2, ...) so no rank is flooded by all at once.
#include <cstring>
#include <vector>

#include "algorithms/collectives.h"

namespace pycomm {

void alltoallPairwise(Comm& comm, const std::vector<const char*>& sends,
                      const std::vector<size_t>& sendBytes, const std::vector<char*>& recvs,
                      const std::vector<size_t>& recvBytes) {
  const int n = comm.size();
  const int r = comm.rank();
  PYCOMM_CHECK_INTERNAL(sendBytes[r] == recvBytes[r], "all-to-all self block: sends ",
                        sendBytes[r], " bytes, expects ", recvBytes[r]);
  std::vector<RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int peer = (r + n - k) % n;
    requests.push_back(comm.recv(peer, recvs[peer], recvBytes[peer]));
  }
  for (int k = 1; k < n; ++k) {
    const int peer = (r + k) % n;
    requests.push_back(comm.send(peer, sends[peer], sendBytes[peer]));
  }
  if (sendBytes[r] > 0 && sends[r] != recvs[r]) std::memmove(recvs[r], sends[r], sendBytes[r]);
  comm.waitAll(requests);
}

}  // namespace pycomm
