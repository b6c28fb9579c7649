// Collective algorithms over any Transport (see comm.h). Buffers are raw
// pointers; counts are in elements unless a name says bytes. Every rank of the
// group calls the same function with matching arguments.
//
// Rule for every algorithm here: each message a rank sends in a collective is
// received in that collective (a receive posted and waited on before the call
// returns, 0-byte messages and flow-control credits included), and a rank posts
// collective receives only for the collective it runs. The TCP transport relies on
// it: a message of an earlier collective that meets a later receive fails it
// (transport.h earlierCall), so an algorithm that leaves a message unreceived (an
// early exit, a cancelled or first-arrival receive) would fail the next call. One
// Comm (one sequence counter) per tag space of a transport; a view such as the
// hierarchical leaders' SubTransport takes a tag bit of its own.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "algorithms/allreduce_registry.h"
#include "algorithms/comm.h"
#include "common/dtype.h"
#include "common/reduce_op.h"
#include "kernels/cpu/quantize.h"

namespace pycomm {

// All-reduce algorithms (their table, auto and the all-reduce entry point are in
// allreduce_registry.h). Each runs in place with any op but AVG.
// Pipelined ring: reduce-scatter then all-gather, segment by segment.
void allreduceRing(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
// Pipelined binomial tree: reduce to rank 0, then broadcast.
void allreduceTree(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
// Each rank owns one shard: reduce-scatter to owners then all-gather, by
// recursive halving/doubling for power-of-two groups, direct exchange otherwise.
void allreduceSharded(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);

// Among the ranks of the node-local shared-memory arena (comm.arena(); the whole
// group when it is on one host), segment by segment (allreduce_shm.cc).
void allreduceShm(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
// Hosts first: all-reduce inside each host through the arena, then among one
// leader per host over the transport (cost-model algorithm), then broadcast
// inside each host (allreduce_hierarchical.cc).
void allreduceHierarchical(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);

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
// Monitored barrier (barrier_monitored.cc): rank 0 hears from every rank before the
// deadline, then answers each; names the first rank that did not arrive (every one
// with `waitAllRanks`) in the error it fails with.
void barrierMonitored(Comm& comm, bool waitAllRanks);

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

// ---- sparse COO tensors (allreduce_coo.cc)

// Where the result of allreduceCoo goes: `rows` (nnz int64) and `values` (nnz x
// rowElems elements), from the caller's allocator, given the result's nnz.
struct CooOutput {
  int64_t* rows;
  void* values;
};
using CooAllocate = std::function<CooOutput(size_t nnz)>;
// All-reduce of sparse rows: rows[j] in [0, rowCount) (any order, repeats allowed)
// holds values[j * rowElems .. +rowElems) of `dtype`. The result, from `allocate`, is
// every row present on some rank, ascending, with the sum (SUM) or mean (AVG, floating
// dtypes) of its values over ranks (ranks without the row add nothing); rows are
// summed in rank order, so the result is bit-identical on every rank. Two all-gathers
// (headers, then payloads); never the dense tensor. Other ops are a usage error.
// rowCount is at most 2^63 - 1 (torch's int64 element count). `shape` (nonzero: a hash
// of the caller's sizes and sparse_dim) must match on every rank, so that tensors with
// the same rows and row width but another shape ((4, 6) against (6, 4)) fail the call.
void allreduceCoo(Comm& comm, const int64_t* rows, const void* values, size_t nnz, uint64_t rowCount,
                  size_t rowElems, DataType dtype, ReduceOp op, const CooAllocate& allocate,
                  uint64_t shape = 0);

// ---- compressed collectives (float32 gradients; allreduce_quantized.cc, allreduce_sparse.cc)

// Two-phase quantized all-reduce: buf (count float32) <- the sum over ranks of the
// decoded quantized contributions, requantized by each chunk's owner; bit-identical on
// every rank. segments: lengths of the runs (parameters) the buffer holds, summing to
// count (empty: one); rank c owns chunk c (whole blocks) of each, so blocks never cross
// segments and each element's result depends on its segment alone. segmentKeys (empty,
// or one per segment) name segments in the stochastic-rounding seeds. residual (count
// float32, or nullptr): error feedback for both phases (see allreduce_quantized.cc).
void allreduceQuantized(Comm& comm, float* buf, size_t count, const std::vector<size_t>& segments,
                        const std::vector<uint64_t>& segmentKeys, const QuantizeOptions& opts,
                        float* residual);
// Payload bytes `rank` sends in allreduceQuantized.
size_t quantizedAllreduceBytes(size_t count, const std::vector<size_t>& segments,
                               const QuantizeOptions& opts, int worldSize, int rank);

struct SparseAllreduceOptions {
  DataType valueType = DataType::kFloat32;  // values on the wire: float32, float16 or bfloat16
  double keepDensity = 0.0;  // owners keep ceil(keepDensity * chunk) entries; 0 keeps every nonzero
  float divisor = 1.0f;      // out holds the sums divided by it (an average: the world size)
};
struct SparseAllreduceResult {
  size_t bytesSent = 0;    // payload bytes this rank sent (headers included)
  size_t keptByOwner = 0;  // entries this rank's chunk kept in phase 2
};
// Sparse all-reduce: out (count float32) <- the sum over ranks of the pairs
// (indices strictly ascending in [0, count), values), reduced by the owners of each
// segment's chunks, who keep their largest entries (opts.keepDensity); bit-identical on
// every rank; divided by opts.divisor as they are placed (the same float division as
// dividing out afterwards, without another pass over it). segments as in
// allreduceQuantized. residual
// (count float32, or nullptr): += wire rounding of this rank's values and, on owners,
// what phase 2 dropped. Format and protocol in allreduce_sparse.cc.
SparseAllreduceResult allreduceSparse(Comm& comm, const int64_t* indices, const float* values,
                                      size_t nnz, size_t count, const std::vector<size_t>& segments,
                                      float* out, float* residual, const SparseAllreduceOptions& opts);
// Throws a usage error naming `op` unless indices are strictly ascending in [0, count).
void checkSparseInput(const char* op, const int64_t* indices, size_t nnz, size_t count);

}  // namespace pycomm
