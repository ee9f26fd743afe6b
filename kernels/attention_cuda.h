// CUDA decode attention over a device pool (see attention.h for the semantics and the paged view;
// the same DecodeAttentionParams describe the batch, with every pointer in device memory).
//
// Flash-decoding: the attended tokens of each (item, kv head) are split over several CUDA blocks
// when the batch alone does not fill the GPU; each block keeps an online softmax for up to 8 q
// heads of its kv head's group (each K/V row is loaded with vector loads and decoded once for all
// of them, by a group of lanes that keeps its own running max, sum and output in registers) and
// writes a partial (max, sum, unnormalised output) to the workspace; a merge kernel combines the
// splits of each (item, q head) by log-sum-exp and writes out and lse. With one split the split
// kernel writes out and lse itself and the merge is not launched. When token_probs is set, a
// third kernel recomputes the scores and writes the per-token probability sums.
//
// Launchers return cudaError_t (the launch status; faults surface at the next sync) and take the
// stream last. Nothing is allocated: the caller passes a workspace of at least
// DecodeAttentionWorkspaceBytes(p, max_length) bytes.
#ifndef KVBANK_KERNELS_ATTENTION_CUDA_H_
#define KVBANK_KERNELS_ATTENTION_CUDA_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"

namespace kvbank::kernels {

// Workspace bytes DecodeAttentionCuda needs for this batch shape. `max_length`: a host-side bound
// on every item's length (the split count is planned from it; lengths live on the device).
// Reads only the scalar fields of p. 0 for an empty batch.
size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p, uint32_t max_length);

// Decode attention on the device. p: every pointer device memory (kv.layers, kv.indptr,
// kv.indices, kv.lengths and token_probs' pointer array included). REQUIRES: every
// lengths[i] <= max_length, and what ValidateDecodeAttention checks (the launcher checks the
// scalar fields only and returns cudaErrorInvalidValue for a bad one, launching nothing).
// workspace: [workspace_bytes] device memory, >= DecodeAttentionWorkspaceBytes(p, max_length).
cudaError_t DecodeAttentionCuda(const DecodeAttentionParams& p, uint32_t max_length,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_ATTENTION_CUDA_H_
