// Dissemination barrier (Hensgen, Finkel, Manber 1988): in round k rank r
// signals r + 2^k and waits for r - 2^k; after ceil(log2 n) rounds every rank
// has heard, directly or not, from every other.
#include <vector>

#include "algorithms/collectives.h"

namespace pycomm {

void barrierDissemination(Comm& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  char token = 0;
  char sink = 0;
  for (int distance = 1; distance < n; distance <<= 1) {
    std::vector<RequestPtr> requests;
    requests.push_back(comm.recv((r - distance + n) % n, &sink, 0));
    requests.push_back(comm.send((r + distance) % n, &token, 0));
    comm.waitAll(requests);
  }
}

}  // namespace pycomm
