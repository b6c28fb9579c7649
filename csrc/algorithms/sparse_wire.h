// The sparse all-reduce's message format (allreduce_sparse.cc): encoding, and the
// decoder that validates what a peer sent. Torch- and transport-free, so
// tests/fuzz/fuzz_sparse.cc can feed it arbitrary bytes.
//
// A message (little-endian) is a 16-byte header {uint32 format, uint32 nnz, uint64
// payloadBytes}, then the payload:
//   format 0 (sparse): the nnz positions in the chunk, ascending, as LEB128 varints
//            of the gaps (first: position, then position - previous - 1), then nnz
//            values in the wire value type;
//   format 1 (dense):  every element of the chunk in the wire value type.
// The wire value type is float32, float16 or bfloat16 (round to nearest even).
//
// The COO all-reduce (allreduce_coo.cc: torch's sparse COO tensors, rows of any
// dtype) has its own format, below: a CooHeader every rank all-gathers first, then a
// payload of the row ids as varints of their gaps, zero padding to 16 bytes, and the
// rows' values as they are (nnz x rowElems elements of the header's dtype).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/half.h"

namespace pycomm {

constexpr uint32_t kSparseFormat = 0;
constexpr uint32_t kDenseFormat = 1;

struct SparseHeader {
  uint32_t format;
  uint32_t nnz;
  uint64_t payloadBytes;
};
static_assert(sizeof(SparseHeader) == 16, "wire header is 16 bytes");

// One encoded message: header then payload, contiguous.
struct SparseMessage {
  std::vector<uint8_t> bytes;
  SparseHeader* header() { return reinterpret_cast<SparseHeader*>(bytes.data()); }
  uint8_t* payload() { return bytes.data() + sizeof(SparseHeader); }
  size_t payloadBytes() const { return bytes.size() - sizeof(SparseHeader); }
};

// Encodes pairs (chunk-relative ascending indices `rel`, values) of a chunk of
// `chunk` elements, in whichever format is smaller.
SparseMessage encodeSparse(const std::vector<uint32_t>& rel, const float* values, size_t chunk,
                           DataType type);

// A value in the wire value type, as a float.
inline float wireValue(const uint8_t* in, DataType type) {
  if (type == DataType::kFloat32) {
    float v;
    std::memcpy(&v, in, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, in, 2);
  return type == DataType::kFloat16 ? halfToFloat(h) : bfloat16ToFloat(h);
}

// Calls visit(index, value) for every entry of a message of a chunk of `chunk`
// elements, in ascending index order (each index at most once; the dense form visits
// every index). Returns nullptr, or what is wrong with the message (entries before the
// fault may have been visited). Never reads payload past h.payloadBytes nor visits an
// index >= chunk, whatever the header says.
template <typename Visit>
const char* visitSparse(const SparseHeader& h, const uint8_t* payload, size_t chunk, DataType type,
                        Visit&& visit) {
  const size_t valueBytes = elementSize(type);
  if (h.format == kDenseFormat) {
    if (h.payloadBytes != chunk * valueBytes) return "dense size";
    for (size_t i = 0; i < chunk; ++i) visit(i, wireValue(payload + i * valueBytes, type));
    return nullptr;
  }
  if (h.format != kSparseFormat || h.nnz > chunk) return "format";
  const uint64_t valuesAt = h.payloadBytes - static_cast<uint64_t>(h.nnz) * valueBytes;
  if (static_cast<uint64_t>(h.nnz) * valueBytes > h.payloadBytes) return "size";
  const uint8_t* p = payload;
  const uint8_t* end = payload + valuesAt;
  uint64_t index = 0;
  for (uint32_t j = 0; j < h.nnz; ++j) {
    uint64_t gap = 0;
    int shift = 0;
    while (true) {
      if (p >= end || shift > 56) return "index";
      const uint8_t byte = *p++;
      gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) break;
      shift += 7;
    }
    index = j == 0 ? gap : index + gap + 1;
    if (index >= chunk) return "index out of range";
    visit(static_cast<size_t>(index), wireValue(payload + valuesAt + j * valueBytes, type));
  }
  if (p != end) return "index bytes";
  return nullptr;
}

// `*target += v` for scattered targets, kBatch at a time: each target is prefetched as
// it becomes known and the additions run, in the order given, once kBatch are known,
// so the cache and TLB misses of a batch overlap. One at a time, each waited for its
// miss: on a 64 MiB bucket at 1% these scattered additions were most of the sparse
// all-reduce's time. The sums are the same, bit for bit (same additions, same order).
// With a divisor d != 1, `*target = (*target + v) / d` (the division one pass over the
// targets afterwards would do).
class ScatterAdd {
 public:
  static constexpr int kBatch = 32;
  explicit ScatterAdd(float divisor = 1.0f) : divisor_(divisor) {}
  void add(float* target, float v) {
    __builtin_prefetch(target, 1);
    targets_[n_] = target;
    values_[n_] = v;
    if (++n_ == kBatch) flush();
  }
  void flush() {
    if (divisor_ == 1.0f) {
      for (int i = 0; i < n_; ++i) *targets_[i] += values_[i];
    } else {
      for (int i = 0; i < n_; ++i) *targets_[i] = (*targets_[i] + values_[i]) / divisor_;
    }
    n_ = 0;
  }

 private:
  const float divisor_;
  float* targets_[kBatch];
  float values_[kBatch];
  int n_ = 0;
};

// Adds a message's values into acc[0 .. chunk) (visitSparse's checks and guarantees).
inline const char* accumulateSparse(const SparseHeader& h, const uint8_t* payload, size_t chunk,
                                    DataType type, float* acc) {
  ScatterAdd adds;
  const char* problem = visitSparse(h, payload, chunk, type, [&adds, acc](size_t i, float v) { adds.add(acc + i, v); });
  adds.flush();
  return problem;
}

// The most payload bytes a well-formed message for `elements` elements can take
// (the receiver refuses to allocate more).
inline uint64_t maxSparsePayloadBytes(size_t elements, size_t valueBytes) {
  return static_cast<uint64_t>(elements) * (valueBytes + 10) + 16;
}

// The value as the wire carries it.
float wireRoundTrip(float v, DataType type);

// LEB128 varints (little-endian groups of 7 bits). getVarint returns the byte after
// the value, or nullptr when it runs past `end` or past 64 bits.
size_t varintBytes(uint64_t v);
uint8_t* putVarint(uint8_t* out, uint64_t v);
const uint8_t* getVarint(const uint8_t* p, const uint8_t* end, uint64_t* v);

// ---- COO rows (allreduce_coo.cc)

constexpr uint32_t kCooFormat = 0x434f4f31;  // "COO1"

struct CooHeader {
  uint32_t format;        // kCooFormat
  uint32_t dtype;         // DataType of the values
  uint64_t rowCount;      // rows of the index space (product of the sparse sizes)
  uint64_t rowElems;      // elements per row (product of the dense sizes)
  uint64_t nnz;           // rows this rank sends, strictly ascending
  uint64_t indexBytes;    // bytes of the varint gaps (the first gap is the first row)
  uint64_t payloadBytes;  // cooValuesOffset(indexBytes) + nnz * rowElems * element size
  uint64_t shape;         // a hash of the tensor's sizes and sparse_dim (0: not given)
};
static_assert(sizeof(CooHeader) == 56, "COO header is 56 bytes");

// Where the values start in a payload: the index bytes padded to 16.
inline uint64_t cooValuesOffset(uint64_t indexBytes) { return (indexBytes + 15) / 16 * 16; }
// Bytes of the varint gaps of `nnz` strictly ascending non-negative rows.
size_t cooIndexBytes(const int64_t* rows, size_t nnz);
// The header of `nnz` rows (strictly ascending) of `rowElems` elements of `dtype`.
CooHeader cooHeader(const int64_t* rows, size_t nnz, uint64_t rowCount, uint64_t rowElems, DataType dtype,
                    uint64_t shape = 0);
// Writes the first part of h's payload at out: the row gaps and the padding. Returns
// where the values go (out + cooValuesOffset(h.indexBytes)), for the caller to fill.
uint8_t* encodeCooRows(const CooHeader& h, const int64_t* rows, uint8_t* out);
// nullptr, or what is wrong with a peer's header (sizes that do not add up, a
// dtype pycomm does not carry, more rows than the index space has). Whether the
// header matches this rank's tensor is the caller's check.
const char* checkCooHeader(const CooHeader& h);
// The most payload bytes a well-formed header for a tensor of `rowCount` rows of
// `rowElems` elements of `dtype` can announce (every row once, each gap at most 10
// varint bytes), saturating at UINT64_MAX. checkCooHeader's checks imply it; the
// receiver checks it once more before it sizes anything.
uint64_t maxCooPayloadBytes(uint64_t rowCount, uint64_t rowElems, DataType dtype);
// The COO all-reduce's scratch: every rank's payload at a 64-byte aligned offset,
// offsets[j] for rank j and offsets[n] the total, added with checked arithmetic
// (the headers of other ranks come relayed through the ring: their sum may be
// anything). nullptr, or what is wrong (the total wraps or exceeds `limit`); then
// *culprit is the rank that announced the most.
const char* cooScratchLayout(const std::vector<CooHeader>& headers, size_t limit, std::vector<size_t>* offsets,
                             int* culprit);
// Decodes a checked header's rows into rows[0 .. h.nnz). nullptr, or what is wrong:
// gaps past the index bytes, rows not strictly ascending or outside [0, rowCount).
const char* decodeCooRows(const CooHeader& h, const uint8_t* payload, int64_t* rows);

}  // namespace pycomm
