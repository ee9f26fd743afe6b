// The pool memory the store tests run on, so that one suite covers every backend. Chosen by the
// environment variable KVBANK_TEST_MEMORY (ctest registers each store test once per kind):
//   unset or "host"  host memory, streamed (the default backend)
//   "host-staged"    the device data path (staged payloads, every move through PoolMemory) over
//                    host memory with the CPU kernels: runs everywhere
//   "cuda"           cuda:0 (label gpu); every test skips, saying why, without a device
#ifndef KVBANK_TESTS_UNIT_TEST_MEMORY_H_
#define KVBANK_TESTS_UNIT_TEST_MEMORY_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvbank/layout.h"
#include "server/core/block_pool.h"
#include "server/core/pool_memory.h"
#include "server/core/sequence_store.h"

namespace kvbank::testenv {

DeviceSpec TestDevice();

// BlockPool::Create on TestDevice(); a default staging budget becomes 4 KiB (see the .cc).
absl::StatusOr<std::unique_ptr<BlockPool>> CreateTestPool(BlockLayout layout, uint64_t pool_bytes,
                                                          PoolOptions options = {});

// A SequenceStore of `m` over CreateTestPool(..., `blocks` blocks, `pool`), with `events` as its
// event log; the pool's error if it cannot be made.
absl::StatusOr<std::unique_ptr<SequenceStore>> CreateTestStore(
    const ModelLayout& m, uint64_t blocks, StoreOptions store = {}, PoolOptions pool = {},
    std::unique_ptr<KvEventLog> events = nullptr);

}  // namespace kvbank::testenv

#endif  // KVBANK_TESTS_UNIT_TEST_MEMORY_H_
