// The sparse all-reduce's message format (sparse_wire.h).
#include "algorithms/sparse_wire.h"

#include <algorithm>
#include <cstring>

#include "common/checked_size.h"
#include "kernels/cpu/half.h"

namespace pycomm {
namespace {

void putValue(uint8_t* out, float v, DataType type) {
  if (type == DataType::kFloat32) {
    std::memcpy(out, &v, 4);
  } else {
    const uint16_t h = type == DataType::kFloat16 ? floatToHalf(v) : floatToBfloat16(v);
    std::memcpy(out, &h, 2);
  }
}

}  // namespace

size_t varintBytes(uint64_t v) {
  size_t bytes = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++bytes;
  }
  return bytes;
}

uint8_t* putVarint(uint8_t* out, uint64_t v) {
  while (v >= 0x80) {
    *out++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *out++ = static_cast<uint8_t>(v);
  return out;
}

const uint8_t* getVarint(const uint8_t* p, const uint8_t* end, uint64_t* v) {
  uint64_t value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (p >= end) return nullptr;
    const uint8_t byte = *p++;
    if (shift == 63 && byte > 1) return nullptr;  // past 64 bits
    value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) {
      *v = value;
      return p;
    }
  }
  return nullptr;
}

float wireRoundTrip(float v, DataType type) {
  uint8_t tmp[4];
  putValue(tmp, v, type);
  return wireValue(tmp, type);
}

// Encodes pairs (chunk-relative ascending indices `rel`, values) of a chunk of
// `chunk` elements.
SparseMessage encodeSparse(const std::vector<uint32_t>& rel, const float* values, size_t chunk, DataType type) {
  const size_t valueBytes = elementSize(type);
  size_t indexBytes = 0;
  for (size_t j = 0; j < rel.size(); ++j)
    indexBytes += varintBytes(j == 0 ? rel[0] : rel[j] - rel[j - 1] - 1);
  const size_t sparseBytes = indexBytes + rel.size() * valueBytes;
  const size_t denseBytes = chunk * valueBytes;
  SparseMessage m;
  const bool dense = denseBytes < sparseBytes;
  m.bytes.assign(sizeof(SparseHeader) + (dense ? denseBytes : sparseBytes), 0);
  SparseHeader h{dense ? kDenseFormat : kSparseFormat, static_cast<uint32_t>(rel.size()),
                 static_cast<uint64_t>(dense ? denseBytes : sparseBytes)};
  std::memcpy(m.bytes.data(), &h, sizeof(h));
  uint8_t* out = m.payload();
  if (dense) {
    // zeros of the wire type are all-zero bytes (assigned above)
    for (size_t j = 0; j < rel.size(); ++j) putValue(out + rel[j] * valueBytes, values[j], type);
  } else {
    for (size_t j = 0; j < rel.size(); ++j) out = putVarint(out, j == 0 ? rel[0] : rel[j] - rel[j - 1] - 1);
    for (size_t j = 0; j < rel.size(); ++j) putValue(out + j * valueBytes, values[j], type);
  }
  return m;
}

// ---- COO rows

size_t cooIndexBytes(const int64_t* rows, size_t nnz) {
  size_t bytes = 0;
  for (size_t j = 0; j < nnz; ++j)
    bytes += varintBytes(j == 0 ? static_cast<uint64_t>(rows[0])
                                : static_cast<uint64_t>(rows[j] - rows[j - 1] - 1));
  return bytes;
}

CooHeader cooHeader(const int64_t* rows, size_t nnz, uint64_t rowCount, uint64_t rowElems, DataType dtype,
                    uint64_t shape) {
  CooHeader h{};
  h.shape = shape;
  h.format = kCooFormat;
  h.dtype = static_cast<uint32_t>(dtype);
  h.rowCount = rowCount;
  h.rowElems = rowElems;
  h.nnz = nnz;
  h.indexBytes = cooIndexBytes(rows, nnz);
  h.payloadBytes = cooValuesOffset(h.indexBytes) + nnz * rowElems * elementSize(dtype);
  return h;
}

uint8_t* encodeCooRows(const CooHeader& h, const int64_t* rows, uint8_t* out) {
  uint8_t* p = out;
  for (size_t j = 0; j < h.nnz; ++j)
    p = putVarint(p, j == 0 ? static_cast<uint64_t>(rows[0]) : static_cast<uint64_t>(rows[j] - rows[j - 1] - 1));
  uint8_t* values = out + cooValuesOffset(h.indexBytes);
  if (values > p) std::memset(p, 0, values - p);
  return values;
}

const char* checkCooHeader(const CooHeader& h) {
  if (h.format != kCooFormat) return "format";
  switch (static_cast<DataType>(h.dtype)) {
    case DataType::kFloat32: case DataType::kFloat64: case DataType::kFloat16: case DataType::kBFloat16:
    case DataType::kInt8: case DataType::kInt16: case DataType::kInt32: case DataType::kInt64:
    case DataType::kUInt8: case DataType::kBool:
      break;
    default:
      return "dtype";
  }
  if (h.nnz > h.rowCount) return "more rows than the index space has";
  if (h.nnz > (1ull << 48)) return "row count";
  if (h.indexBytes < h.nnz || h.indexBytes > h.nnz * 10) return "index bytes";
  const uint64_t elem = elementSize(static_cast<DataType>(h.dtype));
  if (h.rowElems > 0 && h.nnz > (~0ull >> 1) / elem / h.rowElems) return "value bytes overflow";
  const uint64_t valueBytes = h.nnz * h.rowElems * elem;
  const uint64_t valuesAt = cooValuesOffset(h.indexBytes);
  if (valueBytes > (~0ull >> 1) - valuesAt || h.payloadBytes != valuesAt + valueBytes) return "payload bytes";
  return nullptr;
}

uint64_t maxCooPayloadBytes(uint64_t rowCount, uint64_t rowElems, DataType dtype) {
  size_t indexBytes = 0, valueBytes = 0, rowBytes = 0, total = 0;
  if (!checkedMul(rowCount, 10, &indexBytes) || !checkedAdd(indexBytes, 15, &indexBytes) ||
      !checkedMul(rowElems, elementSize(dtype), &rowBytes) || !checkedMul(rowCount, rowBytes, &valueBytes) ||
      !checkedAdd(indexBytes / 16 * 16, valueBytes, &total))
    return UINT64_MAX;
  return total;
}

const char* cooScratchLayout(const std::vector<CooHeader>& headers, size_t limit, std::vector<size_t>* offsets,
                             int* culprit) {
  std::vector<uint64_t> sizes(headers.size());
  for (size_t j = 0; j < headers.size(); ++j) sizes[j] = headers[j].payloadBytes;
  if (blockOffsets(sizes, 64, limit, offsets)) return nullptr;
  *culprit = static_cast<int>(std::max_element(sizes.begin(), sizes.end()) - sizes.begin());
  uint64_t sum = 0;
  for (uint64_t s : sizes)
    if (__builtin_add_overflow(sum, s, &sum)) return "the announced payloads add up to more than 2^64 bytes";
  return "the announced payloads add up to more than this host's memory";
}

const char* decodeCooRows(const CooHeader& h, const uint8_t* payload, int64_t* rows) {
  const uint8_t* p = payload;
  const uint8_t* end = payload + h.indexBytes;
  uint64_t row = 0;
  for (uint64_t j = 0; j < h.nnz; ++j) {
    uint64_t gap = 0;
    p = getVarint(p, end, &gap);
    if (p == nullptr) return "row gaps";
    if (j == 0) {
      row = gap;
    } else {
      if (gap >= h.rowCount || row + gap + 1 < row) return "row out of range";
      row += gap + 1;
    }
    if (row >= h.rowCount) return "row out of range";
    rows[j] = static_cast<int64_t>(row);
  }
  if (p != end) return "index bytes";
  return nullptr;
}

}  // namespace pycomm
