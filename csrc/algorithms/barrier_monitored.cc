// Monitored barrier (torch's dist.monitored_barrier, which gloo alone implements in
// torch): every other rank sends rank 0 an empty message and waits for its answer;
// rank 0 waits for each of them before the deadline and answers all once every
// one arrived. A rank that did not arrive in time is named ("Rank 1 failed to pass
// monitoredBarrier in 2000 ms", gloo's words): the first such rank, or with
// `waitAllRanks` every one. Without `waitAllRanks`, a rank 0 already past its deadline
// when it comes to a rank that has not arrived says so as gloo's does ("Rank 0 timed
// out in monitoredBarrier after 0 ms." and the ranks it processed). That is a runtime
// failure, so rank 0 aborts the group and the ranks waiting on it learn why from its
// abort (they wait a grace past the deadline for it).
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "algorithms/collectives.h"

namespace pycomm {

void barrierMonitored(Comm& comm, bool waitAllRanks) {
  const int n = comm.size();
  const int me = comm.rank();
  const long long ms = static_cast<long long>(comm.timeout().count());
  char token = 0;
  if (me != 0) {
    char answer = 0;
    RequestPtr arrived = comm.send(0, &token, 0);
    RequestPtr released = comm.recv(0, &answer, 0);
    // Rank 0's verdict comes at its own deadline, as this one's would: a grace of up
    // to 5 s lets its abort (naming the late ranks) arrive here before this rank gives
    // up on it with less to say.
    const auto grace = std::min<std::chrono::milliseconds>(comm.timeout(), std::chrono::seconds(5));
    for (const RequestPtr& request : {arrived, released}) {
      if (!request->waitUntil(comm.deadline() + grace)) {
        comm.fail(ErrorKind::kTimeout, "Rank ", me, " reached monitoredBarrier, but rank 0 did not answer in ",
                  ms + grace.count(), " ms (is rank 0 in the same monitored barrier? is it alive?)");
      }
      if (request->failed()) {
        comm.fail(ErrorKind::kConnection, "Rank ", me,
                  " successfully reached monitoredBarrier, but received errors while waiting for send/recv from "
                  "rank 0. Please check rank 0 logs for faulty rank. ",
                  request->error());
      }
    }
    return;
  }
  std::vector<char> sinks(n);
  std::vector<RequestPtr> arrivals(n);
  for (int j = 1; j < n; ++j) arrivals[j] = comm.recv(j, &sinks[j], 0);
  std::vector<int> missing;
  std::vector<int> processed;
  std::string reasons;
  for (int j = 1; j < n; ++j) {
    const bool outOfTime = Clock::now() >= comm.deadline();
    // Past the deadline waitUntil only looks: with waitAllRanks every late rank is named.
    if (!arrivals[j]->waitUntil(comm.deadline())) {
      if (outOfTime && !waitAllRanks) {
        std::string done;
        for (size_t i = 0; i < processed.size(); ++i) done += (i ? ", " : "") + std::to_string(processed[i]);
        comm.fail(ErrorKind::kTimeout, "Rank 0 timed out in monitoredBarrier after ", ms, " ms.\n",
                  processed.empty() ? std::string("No ranks successfully processed in monitoredBarrier.")
                                    : "Successfully processed ranks: " + done);
      }
      missing.push_back(j);
    } else if (arrivals[j]->failed()) {  // e.g. rank j is in another collective
      missing.push_back(j);
      reasons += strCat(" (rank ", j, ": ", arrivals[j]->error(), ")");
    }
    if (!missing.empty() && !waitAllRanks) break;
    if (missing.empty()) processed.push_back(j);
  }
  if (!missing.empty()) {
    std::string ranks;
    for (size_t i = 0; i < missing.size(); ++i) ranks += (i ? ", " : "") + std::to_string(missing[i]);
    comm.fail(ErrorKind::kTimeout, "[Rank 0]: Rank", missing.size() > 1 ? "s " : " ", ranks,
              " failed to pass monitoredBarrier in ", ms, " ms", reasons);
  }
  std::vector<RequestPtr> answers;
  for (int j = 1; j < n; ++j) answers.push_back(comm.send(j, &token, 0));
  comm.waitAll(answers);
}

}  // namespace pycomm
