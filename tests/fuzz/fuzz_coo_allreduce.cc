// Fuzz target for the COO sparse all-reduce as a rank runs it
// (csrc/algorithms/allreduce_coo.cc): rank 0 of a ring of 2-5 ranks calls
// allreduceCoo on a small tensor the input chooses, and every byte it receives
// (the other ranks' 56-byte headers, relayed round the ring, then their payloads)
// comes from the input, through a transport that hands each receive the next bytes
// of a feed. So the header checks, the caps (each announcement by the tensor's
// shape, their checked sum by the host's memory), the scratch layout, the row
// decoder and the merge and sum all run on hostile bytes.
//
// The feed is built from the input: for each other rank (in the order the ring
// delivers them) rows and values, encoded as a peer would (cooHeader,
// encodeCooRows), then optionally corrupted (a header field replaced, payload
// bits flipped); or, with options bit 0, the rest of the input as it is.
//
// Checks beyond ASan/UBSan: the call ends (returns or throws pycomm::Error); a
// failure that blames a peer names one of ranks 1..n-1; and when no byte was
// corrupted, the result is exactly the reference sum (every row of every rank,
// ascending, each the sum of its values over ranks; small integers in float64 or
// int32, so every order of addition gives the same result).
//
// Build: make fuzz (libFuzzer, -fsanitize=fuzzer,address,undefined).
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/comm.h"
#include "algorithms/sparse_wire.h"
#include "common/error.h"
#include "fuzz_input.h"

using namespace pycomm;

using pycomm_fuzz::check;
using pycomm_fuzz::Reader;

namespace {

// Rank `rank` of `size`: sends complete at once (their bytes are dropped); each
// receive takes the next bytes of the feed, or fails as a lost connection when the
// feed runs out.
class FeedTransport : public Transport {
 public:
  FeedTransport(int rank, int size, std::vector<uint8_t> feed) : rank_(rank), size_(size), feed_(std::move(feed)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "feed"; }
  RequestPtr isend(int peer, uint64_t, const void*, size_t bytes) override {
    auto request = std::make_shared<Request>(peer, bytes);
    if (aborted_) request->fail("aborted");
    else request->complete();
    return request;
  }
  RequestPtr irecv(int peer, uint64_t, void* data, size_t bytes, bool) override {
    auto request = std::make_shared<Request>(peer, bytes);
    if (aborted_ || feed_.size() - used_ < bytes) {
      request->fail(strCat("rank ", rank_, " lost the connection to ", rankName(peer)));
      return request;
    }
    if (bytes > 0) std::memcpy(data, feed_.data() + used_, bytes);
    used_ += bytes;
    received_ += bytes;
    request->complete();
    return request;
  }
  void abort(const std::string&) override { aborted_ = true; }
  uint64_t bytesSent() const override { return 0; }
  uint64_t bytesReceived() const override { return received_; }

 private:
  const int rank_, size_;
  std::vector<uint8_t> feed_;
  size_t used_ = 0;
  uint64_t received_ = 0;
  bool aborted_ = false;
};

const DataType kTypes[] = {DataType::kFloat64, DataType::kInt32, DataType::kFloat32, DataType::kInt64};

// A rank's tensor: up to 48 rows (any order, repeats allowed) of rowElems small integers.
struct Tensor {
  std::vector<int64_t> rows;
  std::vector<uint8_t> values;  // rows.size() x rowElems elements of the dtype
};

Tensor makeTensor(Reader& in, uint64_t rowCount, size_t rowElems, DataType dtype, bool ascending) {
  Tensor t;
  const size_t nnz = in.next(1) % 49;
  int64_t row = -1;
  for (size_t j = 0; j < nnz; ++j) {
    const uint64_t pick = in.next(2);
    if (ascending) row += 1 + static_cast<int64_t>(pick % 97);
    else row = static_cast<int64_t>(pick % rowCount);
    if (row >= static_cast<int64_t>(rowCount)) break;
    t.rows.push_back(row);
  }
  const size_t elem = elementSize(dtype);
  t.values.resize(t.rows.size() * rowElems * elem);
  for (size_t i = 0; i < t.rows.size() * rowElems; ++i) {
    const int v = static_cast<int>(in.next(1)) - 128;
    uint8_t* at = t.values.data() + i * elem;
    switch (dtype) {
      case DataType::kFloat64: { const double d = v; std::memcpy(at, &d, 8); break; }
      case DataType::kFloat32: { const float f = static_cast<float>(v); std::memcpy(at, &f, 4); break; }
      case DataType::kInt32: { const int32_t x = v; std::memcpy(at, &x, 4); break; }
      default: { const int64_t x = v; std::memcpy(at, &x, 8); break; }
    }
  }
  return t;
}

double valueAt(const uint8_t* at, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat64: { double d; std::memcpy(&d, at, 8); return d; }
    case DataType::kFloat32: { float f; std::memcpy(&f, at, 4); return f; }
    case DataType::kInt32: { int32_t x; std::memcpy(&x, at, 4); return x; }
    default: { int64_t x; std::memcpy(&x, at, 8); return static_cast<double>(x); }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const uint8_t options = static_cast<uint8_t>(in.next(1));
  const int n = 2 + static_cast<int>(in.next(1) % 4);
  const uint64_t rowCount = 1 + in.next(2) % 4096;
  const size_t rowElems = in.next(1) % 5;
  const DataType dtype = kTypes[in.next(1) % 4];
  // AVG of integers is refused before this layer (tensor_checks.cc: checkReduceSupported).
  const bool floating = dtype == DataType::kFloat64 || dtype == DataType::kFloat32;
  const ReduceOp op = (options & 2) && floating ? ReduceOp::kAvg : ReduceOp::kSum;
  const uint64_t shape = (options & 4) ? 0x5eedull : 0;
  const size_t elem = elementSize(dtype);
  const Tensor mine = makeTensor(in, rowCount, rowElems, dtype, false);

  // The other ranks' tensors, in the ring's delivery order to rank 0 (n-1, n-2, ..., 1).
  std::vector<Tensor> peers(n);
  std::vector<CooHeader> headers(n);
  std::vector<std::vector<uint8_t>> payloads(n);
  bool corrupted = false;
  std::vector<uint8_t> feed;
  if (options & 1) {
    feed.assign(in.data, in.data + in.size);
    corrupted = true;
  } else {
    for (int j = n - 1; j >= 1; --j) {
      peers[j] = makeTensor(in, rowCount, rowElems, dtype, true);
      CooHeader& h = headers[j];
      h = cooHeader(peers[j].rows.data(), peers[j].rows.size(), rowCount, rowElems, dtype, shape);
      payloads[j].resize(static_cast<size_t>(h.payloadBytes));
      uint8_t* values = encodeCooRows(h, peers[j].rows.data(), payloads[j].data());
      if (!peers[j].values.empty()) std::memcpy(values, peers[j].values.data(), peers[j].values.size());
      const uint8_t corrupt = static_cast<uint8_t>(in.next(1));
      if (corrupt & 1) {  // one header field replaced
        uint64_t fields[7];  // 7 words: format|dtype, then the sizes and the shape
        static_assert(sizeof(fields) == sizeof(CooHeader), "header words");
        std::memcpy(fields, &h, sizeof(h));
        const int field = (corrupt >> 2) % 7;
        fields[field] = (corrupt & 2) ? in.next(8) : fields[field] + in.next(1) - 128;
        std::memcpy(&h, fields, sizeof(h));
        corrupted = true;
      }
      if ((corrupt & 0x80) && !payloads[j].empty()) {  // payload bits flipped
        for (int flips = 1 + in.next(1) % 3; flips > 0; --flips)
          payloads[j][in.next(2) % payloads[j].size()] ^= static_cast<uint8_t>(1u << in.next(1) % 8);
        corrupted = true;
      }
    }
    for (int j = n - 1; j >= 1; --j) {
      const auto* p = reinterpret_cast<const uint8_t*>(&headers[j]);
      feed.insert(feed.end(), p, p + sizeof(CooHeader));
    }
    // The payloads as the receiver sizes them: what each (possibly corrupted) header announces.
    for (int j = n - 1; j >= 1; --j) {
      std::vector<uint8_t> bytes = payloads[j];
      if (headers[j].payloadBytes <= (1u << 20)) bytes.resize(static_cast<size_t>(headers[j].payloadBytes));
      feed.insert(feed.end(), bytes.begin(), bytes.end());
    }
  }

  FeedTransport transport(0, n, std::move(feed));
  Comm comm(transport, std::chrono::milliseconds(1000), 1 << 20);
  std::vector<int64_t> outRows;
  std::vector<uint8_t> outValues;
  bool ok = false;
  try {
    comm.begin("allreduce");
    allreduceCoo(comm, mine.rows.data(), mine.values.data(), mine.rows.size(), rowCount, rowElems, dtype, op,
                 [&](size_t nnz) {
                   check(nnz <= rowCount, "the result has at most rowCount rows");
                   outRows.resize(nnz);
                   outValues.resize(nnz * rowElems * elem);
                   return CooOutput{outRows.data(), outValues.data()};
                 },
                 shape);
    ok = true;
  } catch (const Error& e) {
    const std::string text = e.what();
    bool namesPeer = false;
    for (int j = 1; j < n; ++j) namesPeer = namesPeer || text.find(strCat("rank ", j)) != std::string::npos;
    if (!namesPeer) std::fprintf(stderr, "error: %s\n", text.c_str());
    check(namesPeer, "a failure names the rank it blames");
  }
  check(ok || corrupted, "uncorrupted messages all-reduce");
  if (!ok) return 0;
  for (size_t k = 0; k < outRows.size(); ++k)
    check(outRows[k] >= 0 && static_cast<uint64_t>(outRows[k]) < rowCount && (k == 0 || outRows[k] > outRows[k - 1]),
          "result rows ascending, inside the tensor");
  if (corrupted) return 0;
  // The reference: every rank's rows, each the sum of its values over ranks.
  std::map<int64_t, std::vector<double>> expected;
  auto add = [&](const Tensor& t) {
    for (size_t j = 0; j < t.rows.size(); ++j) {
      auto& row = expected[t.rows[j]];
      row.resize(rowElems, 0.0);
      for (size_t e = 0; e < rowElems; ++e) row[e] += valueAt(t.values.data() + (j * rowElems + e) * elem, dtype);
    }
  };
  add(mine);
  for (int j = 1; j < n; ++j) add(peers[j]);
  check(outRows.size() == expected.size(), "result has the union of the rows");
  size_t k = 0;
  for (const auto& entry : expected) {
    check(outRows[k] == entry.first, "result rows are the union");
    for (size_t e = 0; e < rowElems; ++e) {
      double want = entry.second[e];
      if (op == ReduceOp::kAvg) want /= n;
      const double got = valueAt(outValues.data() + (k * rowElems + e) * elem, dtype);
      // AVG is one division (float32: its rounding); sums of small integers are exact.
      const double tolerance = op == ReduceOp::kAvg ? 1e-5 * (1 + std::abs(want)) : 0.0;
      check(std::abs(got - want) <= tolerance, "result values are the sums over ranks");
    }
    ++k;
  }
  return 0;
}
