// Helpers shared by the fuzz targets: a property check that survives NDEBUG, and a message cut
// into gRPC slices at points the fuzzer chooses (the decoders read slices that are never joined).
#ifndef KVBANK_TESTS_FUZZ_FUZZ_UTIL_H_
#define KVBANK_TESTS_FUZZ_FUZZ_UTIL_H_

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

// A property the target states; a failure is a crash libFuzzer reports with its input.
#define FUZZ_CHECK(cond)                                                               \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

namespace kvbank::fuzz {

// Where to cut a message: up to 7 offsets, taken from the end of the input (FuzzedDataProvider
// reads integers from the back), so a seed is the message's bytes followed by its cuts.
struct Cuts {
  std::vector<uint16_t> at;
};

inline Cuts ConsumeCuts(FuzzedDataProvider& in) {
  Cuts c;
  const int n = in.ConsumeIntegralInRange<int>(0, 7);
  for (int i = 0; i < n; ++i) c.at.push_back(in.ConsumeIntegral<uint16_t>());
  return c;
}

// `bytes` as a ByteBuffer of slices cut at `cuts` (each taken modulo the size + 1; empty slices
// included, as a sender may produce them).
inline grpc::ByteBuffer Sliced(const std::string& bytes, const Cuts& cuts) {
  std::vector<size_t> at;
  for (uint16_t c : cuts.at) at.push_back(c % (bytes.size() + 1));
  std::sort(at.begin(), at.end());
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t c : at) {
    slices.emplace_back(bytes.data() + from, c - from);
    from = c;
  }
  slices.emplace_back(bytes.data() + from, bytes.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace kvbank::fuzz

#endif  // KVBANK_TESTS_FUZZ_FUZZ_UTIL_H_
