// Collective algorithms over any Transport (see comm.h). Buffers are raw
// pointers; counts are in elements unless a name says bytes. Every rank of the
// group calls the same function with matching arguments.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "algorithms/comm.h"
#include "common/dtype.h"
#include "common/reduce_op.h"

namespace pycomm {

enum class AllreduceAlgorithm { kAuto, kRing, kTree, kSharded, kShm };

const char* allreduceAlgorithmName(AllreduceAlgorithm algorithm);
// Parses "auto" | "ring" | "tree" | "sharded" | "shm"; throws a usage error otherwise.
AllreduceAlgorithm parseAllreduceAlgorithm(const std::string& name);
// The algorithm kAuto resolves to: shm when every rank shares the node-local
// arena (`onOneHost`), else the alpha-beta cost model (select.cc).
AllreduceAlgorithm selectAllreduceAlgorithm(size_t bytes, int worldSize, bool onOneHost = false);
// Whether comm's arena spans the whole group (trivially true for one rank).
inline bool onOneHost(const Comm& comm) {
  return comm.size() == 1 || (comm.arena() != nullptr && comm.arena()->localSize() == comm.size());
}

// All-reduce in place. Resolves kAuto, finishes AVG with a division.
void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
               AllreduceAlgorithm algorithm);
// Pipelined ring: reduce-scatter then all-gather, segment by segment.
void allreduceRing(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
// Pipelined binomial tree: reduce to rank 0, then broadcast.
void allreduceTree(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
// Each rank owns one shard: reduce-scatter to owners then all-gather, by
// recursive halving/doubling for power-of-two groups, direct exchange otherwise.
void allreduceSharded(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);

// Through the node-local shared-memory arena (comm.arena(), every rank of the
// group on one host), segment by segment (allreduce_shm.cc).
void allreduceShm(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);

// Ring phases over chunks that may live in separate buffers: chunk i has
// counts[i] elements at chunks[i]. Reduce-scatter leaves chunk r fully reduced
// on rank r (other chunks are scratch); all-gather sends chunk r of rank r to all.
void ringReduceScatter(Comm& comm, const std::vector<char*>& chunks,
                       const std::vector<size_t>& counts, DataType dtype, ReduceOp op);
void ringAllgather(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes);

// Binomial-tree broadcast of `bytes` bytes from `root`, pipelined by segment.
void broadcastTree(Comm& comm, void* buf, size_t bytes, int root);
// Binomial-tree reduce to `root`. `acc` is modified on every rank; it holds the
// result on the root.
void reduceTree(Comm& comm, void* acc, size_t count, DataType dtype, ReduceOp op, int root);

// Gather `bytes` from every rank into outputs[i] on the root (outputs ignored elsewhere).
void gatherDirect(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs,
                  int root);
// Scatter inputs[i] (root only) to rank i's `output`.
void scatterDirect(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes,
                   int root);
// Every rank sends sendBytes[i] bytes at sends[i] to rank i and receives
// recvBytes[i] bytes from rank i into recvs[i].
void alltoallPairwise(Comm& comm, const std::vector<const char*>& sends,
                      const std::vector<size_t>& sendBytes, const std::vector<char*>& recvs,
                      const std::vector<size_t>& recvBytes);
// Dissemination barrier: ceil(log2 n) rounds of empty messages.
void barrierDissemination(Comm& comm);

// The same collectives through the node-local shared-memory arena (every rank
// on one host; collectives_shm.cc). Same arguments and results as above;
// reduce leaves the result on every rank (a superset of the contract).
void broadcastShm(Comm& comm, void* buf, size_t bytes, int root);
void allgatherShm(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes);
void reduceScatterShm(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op);
void gatherShm(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs,
               int root);
void scatterShm(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes,
                int root);
void alltoallShm(Comm& comm, const std::vector<const char*>& sends, const std::vector<size_t>& sendBytes,
                 const std::vector<char*>& recvs, const std::vector<size_t>& recvBytes);
void barrierShm(Comm& comm);

// What the backend calls (dispatch.cc): the shm version above when every rank
// of the group shares a host, else the transport algorithm (tree broadcast and
// reduce, ring all-gather and reduce-scatter, direct gather/scatter, pairwise
// all-to-all, dissemination barrier).
void broadcast(Comm& comm, void* buf, size_t bytes, int root);
void reduce(Comm& comm, void* acc, size_t count, DataType dtype, ReduceOp op, int root);
void allgather(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes);
void reduceScatter(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op);
void gather(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs, int root);
void scatter(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes, int root);
void alltoall(Comm& comm, const std::vector<const char*>& sends, const std::vector<size_t>& sendBytes,
              const std::vector<char*>& recvs, const std::vector<size_t>& recvBytes);
void barrier(Comm& comm);

}  // namespace pycomm
