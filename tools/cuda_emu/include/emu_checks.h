// Pointer checks of the kvbank kernel argument structs (found by ADL from emu::Launch).
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "kernels/attention.h"
#include "kernels/block_copy.h"

namespace kvbank::kernels {

inline void EmuCheckArg(const PayloadMap& m, const char* k) {
  emu::CheckDevicePtr(m.pool, k, "PayloadMap.pool");
  emu::CheckDevicePtr(m.layers, k, "PayloadMap.layers");
  emu::CheckDevicePtr(m.layer_offset, k, "PayloadMap.layer_offset");
  emu::CheckDevicePtr(m.block_table, k, "PayloadMap.block_table");
  emu::CheckDevicePtr(m.scale_offset, k, "PayloadMap.scale_offset");
}

inline void EmuCheckArg(const DecodeAttentionParams& p, const char* k) {
  emu::CheckDevicePtr(p.kv.pool, k, "kv.pool");
  emu::CheckDevicePtr(p.kv.layers, k, "kv.layers");
  emu::CheckDevicePtr(p.kv.indptr, k, "kv.indptr");
  emu::CheckDevicePtr(p.kv.indices, k, "kv.indices");
  emu::CheckDevicePtr(p.kv.lengths, k, "kv.lengths");
  emu::CheckDevicePtr(p.q, k, "q");
  emu::CheckDevicePtr(p.out, k, "out");
  emu::CheckDevicePtr(p.lse, k, "lse");
  emu::CheckDevicePtr(p.token_probs, k, "token_probs");
  // Device memory is open during a launch: the pointer array can be read directly.
  if (p.token_probs != nullptr && emu::IsDevice(p.token_probs, sizeof(float*) * p.kv.batch)) {
    for (uint32_t i = 0; i < p.kv.batch; ++i) {
      emu::CheckDevicePtr(p.token_probs[i], k, "token_probs[i]");
    }
  }
}

}  // namespace kvbank::kernels
