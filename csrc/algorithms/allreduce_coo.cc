// All-reduce of sparse COO tensors (torch's sparse gradients: nn.Embedding(sparse=True)
// gives rows of the embedding width), without ever building the dense tensor.
//
// A tensor here is `nnz` rows, each `rowElems` elements of one dtype, at row ids in
// [0, rowCount) (the backend linearizes torch's sparse_dim indices into one id and
// flattens the dense dimensions into the row).
//
//   local:   rows are coalesced (sorted; duplicates summed in input order) straight
//            into this rank's payload, unless already strictly ascending.
//   round 1: every rank all-gathers the 56-byte CooHeader of every rank (row count,
//            row width, a hash of the sizes, payload size); a rank whose tensor differs
//            in shape or dtype fails the call on every rank, naming both.
//   round 2: the payloads (varint gaps of the row ids, then the rows' values; format
//            in sparse_wire.h) are all-gathered, variable sizes, through the group's
//            all-gather (the shared-memory arena on one host, the ring otherwise).
//   merge:   every rank merges the n sorted row lists; a row present on several ranks
//            is summed in rank order, so the result is bit-identical on every rank.
//            AVG divides the merged values once.
//
// Bytes: each rank receives every other rank's rows once ((n-1) x nnz rows for equal
// nnz), as gloo's all-gather of indices and values does, in two all-gathers instead of
// gloo's three, with 1-3 bytes per row id instead of 8 x sparse_dim.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/sparse_wire.h"
#include "common/checked_size.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

bool strictlyAscending(const int64_t* rows, size_t nnz) {
  for (size_t j = 1; j < nnz; ++j)
    if (rows[j] <= rows[j - 1]) return false;
  return true;
}

// The order that sorts `rows` stably (by row, then input position): (row, position)
// pairs, sorted. The unique rows go to `unique`.
void sortRows(const int64_t* rows, size_t nnz, std::vector<std::pair<int64_t, size_t>>& sorted,
              std::vector<int64_t>& unique) {
  sorted.resize(nnz);
  for (size_t j = 0; j < nnz; ++j) sorted[j] = {rows[j], j};
  std::sort(sorted.begin(), sorted.end());
  unique.clear();
  for (const auto& entry : sorted)
    if (unique.empty() || unique.back() != entry.first) unique.push_back(entry.first);
}

std::string describe(const CooHeader& h) {
  return strCat(h.rowCount, " rows of ", h.rowElems, " ",
                dataTypeName(static_cast<DataType>(h.dtype)));
}

// What a host can hold at most: no scratch is sized past it, whatever peers announce.
size_t physicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), pageBytes = sysconf(_SC_PAGESIZE);
  size_t total = 0;
  if (pages <= 0 || pageBytes <= 0 || !checkedMul(static_cast<size_t>(pages), static_cast<size_t>(pageBytes), &total))
    return SIZE_MAX;
  return total;
}

}  // namespace

void allreduceCoo(Comm& comm, const int64_t* rows, const void* values, size_t nnz, uint64_t rowCount,
                  size_t rowElems, DataType dtype, ReduceOp op, const CooAllocate& allocate, uint64_t shape) {
  PYCOMM_CHECK_USAGE(op == ReduceOp::kSum || op == ReduceOp::kAvg, "pycomm ", comm.opName(),
                     ": sparse tensors support only SUM and AVG (got ", reduceOpName(op), ")");
  PYCOMM_CHECK_USAGE(rowCount <= static_cast<uint64_t>(INT64_MAX), "pycomm ", comm.opName(),
                     ": the sparse dimensions hold more than 2^63 - 1 rows (", rowCount, ")");
  for (size_t j = 0; j < nnz; ++j)
    PYCOMM_CHECK_USAGE(rows[j] >= 0 && static_cast<uint64_t>(rows[j]) < rowCount, "pycomm ",
                       comm.opName(), ": sparse index ", rows[j], " at position ", j,
                       " is outside the tensor (", rowCount, " rows)");
  const int n = comm.size();
  const int r = comm.rank();
  const size_t elem = elementSize(dtype);
  const size_t rowBytes = rowElems * elem;

  // ---- local: strictly ascending rows (coalesced straight into the payload, below)
  std::vector<std::pair<int64_t, size_t>> sorted;
  std::vector<int64_t> localRows;
  const int64_t* myRows = rows;
  const char* myValues = static_cast<const char*>(values);
  const bool coalesce = !strictlyAscending(rows, nnz);
  if (coalesce) {
    sortRows(rows, nnz, sorted, localRows);
    myRows = localRows.data();
    nnz = localRows.size();
  }

  // ---- round 1: every rank's header
  std::vector<CooHeader> headers(n);
  headers[r] = cooHeader(myRows, nnz, rowCount, rowElems, dtype, shape);
  if (n > 1) {
    std::vector<char*> chunks;
    for (auto& h : headers) chunks.push_back(reinterpret_cast<char*>(&h));
    pycomm::allgather(comm, chunks, std::vector<size_t>(n, sizeof(CooHeader)));
  }
  comm.setAlgorithm("coo");
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    const CooHeader& h = headers[j];
    if (const char* problem = checkCooHeader(h))
      comm.fail(ErrorKind::kConnection, comm.transport().rankName(j), " sent a malformed sparse header (",
                problem, ")");
    if (h.dtype != headers[r].dtype || h.rowCount != rowCount || h.rowElems != rowElems)
      comm.fail(ErrorKind::kUsage, "ranks passed different sparse tensors: ", comm.transport().rankName(j),
                " has ", describe(h), ", ", comm.transport().rankName(r), " has ", describe(headers[r]));
    if (h.shape != shape)
      comm.fail(ErrorKind::kUsage, "ranks passed different sparse tensors: ", comm.transport().rankName(j),
                " and ", comm.transport().rankName(r), " both have ", describe(h),
                " but their sizes or sparse dimensions differ");
  }

  // ---- round 2: every rank's payload, each announcement capped by what this
  // tensor's shape allows and their sum by this host's memory (checked: the ring
  // relays other ranks' headers, so the sum is whatever the relay says)
  const uint64_t maxPayload = maxCooPayloadBytes(rowCount, rowElems, dtype);
  for (int j = 0; j < n; ++j)
    if (j != r && headers[j].payloadBytes > maxPayload)
      comm.fail(ErrorKind::kConnection, comm.transport().rankName(j), " announced ", headers[j].payloadBytes,
                " sparse payload bytes, more than a tensor of ", describe(headers[r]), " can have");
  std::vector<size_t> offsets, bytes(n);
  int culprit = 0;
  if (const char* problem = cooScratchLayout(headers, physicalMemoryBytes(), &offsets, &culprit))
    comm.fail(ErrorKind::kConnection, "the sparse headers (", comm.transport().rankName(culprit),
              " announced ", headers[culprit].payloadBytes, " bytes): ", problem);
  for (int j = 0; j < n; ++j) bytes[j] = headers[j].payloadBytes;
  char* payloads = comm.scratch(2, std::max<size_t>(offsets[n], 64));
  char* mine = reinterpret_cast<char*>(
      encodeCooRows(headers[r], myRows, reinterpret_cast<uint8_t*>(payloads + offsets[r])));
  if (!coalesce) {
    if (nnz * rowBytes > 0) std::memcpy(mine, myValues, nnz * rowBytes);
  } else {  // duplicates summed in their input order
    char* dst = mine - rowBytes;
    for (size_t j = 0; j < sorted.size(); ++j) {
      const char* src = myValues + sorted[j].second * rowBytes;
      if (j > 0 && sorted[j].first == sorted[j - 1].first) {
        reduceInto(dst, src, rowElems, dtype, ReduceOp::kSum);
      } else {
        dst += rowBytes;
        if (rowBytes > 0) std::memcpy(dst, src, rowBytes);
      }
    }
  }
  if (n > 1) {
    std::vector<char*> chunks;
    for (int j = 0; j < n; ++j) chunks.push_back(payloads + offsets[j]);
    pycomm::allgather(comm, chunks, bytes);
    comm.setAlgorithm("coo");
  }

  // ---- merge, in rank order
  std::vector<std::vector<int64_t>> peerRows(n);
  std::vector<const int64_t*> rowsOf(n);
  std::vector<const char*> valuesOf(n);
  for (int j = 0; j < n; ++j) {
    const uint8_t* payload = reinterpret_cast<const uint8_t*>(payloads + offsets[j]);
    valuesOf[j] = reinterpret_cast<const char*>(payload + cooValuesOffset(headers[j].indexBytes));
    if (j == r) {
      rowsOf[j] = myRows;
      continue;
    }
    peerRows[j].resize(headers[j].nnz);
    if (const char* problem = decodeCooRows(headers[j], payload, peerRows[j].data()))
      comm.fail(ErrorKind::kConnection, comm.transport().rankName(j), " sent a malformed sparse message (",
                problem, ")");
    rowsOf[j] = peerRows[j].data();
  }
  std::vector<size_t> cursor(n, 0);
  auto nextRow = [&](int64_t* row) {  // the smallest row not yet merged; false when none
    bool any = false;
    for (int j = 0; j < n; ++j)
      if (cursor[j] < headers[j].nnz && (!any || rowsOf[j][cursor[j]] < *row)) {
        *row = rowsOf[j][cursor[j]];
        any = true;
      }
    return any;
  };
  size_t unionRows = 0;
  for (int64_t row = 0; nextRow(&row); ++unionRows)
    for (int j = 0; j < n; ++j)
      if (cursor[j] < headers[j].nnz && rowsOf[j][cursor[j]] == row) ++cursor[j];

  CooOutput out = allocate(unionRows);
  std::fill(cursor.begin(), cursor.end(), 0);
  char* dst = static_cast<char*>(out.values);
  size_t k = 0;
  for (int64_t row = 0; nextRow(&row); ++k) {
    out.rows[k] = row;
    bool first = true;
    for (int j = 0; j < n; ++j) {
      if (cursor[j] >= headers[j].nnz || rowsOf[j][cursor[j]] != row) continue;
      const char* src = valuesOf[j] + cursor[j] * rowBytes;
      if (first) {
        if (rowBytes > 0) std::memcpy(dst + k * rowBytes, src, rowBytes);
        first = false;
      } else {
        reduceInto(dst + k * rowBytes, src, rowElems, dtype, ReduceOp::kSum);
      }
      ++cursor[j];
    }
  }
  if (op == ReduceOp::kAvg && n > 1) divideBy(dst, unionRows * rowElems, dtype, n);
}

}  // namespace pycomm
