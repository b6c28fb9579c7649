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
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"

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

// Adds a message's values into acc[0 .. chunk). Returns nullptr, or what is wrong
// with the message (entries before the fault may have been added). Never reads
// payload past h.payloadBytes nor writes acc past chunk, whatever the header says.
const char* accumulateSparse(const SparseHeader& h, const uint8_t* payload, size_t chunk, DataType type,
                             float* acc);

// The most payload bytes a well-formed message for `elements` elements can take
// (the receiver refuses to allocate more).
inline uint64_t maxSparsePayloadBytes(size_t elements, size_t valueBytes) {
  return static_cast<uint64_t>(elements) * (valueBytes + 10) + 16;
}

// The value as the wire carries it.
float wireRoundTrip(float v, DataType type);

}  // namespace pycomm
