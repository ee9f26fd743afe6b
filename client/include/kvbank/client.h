// kvbank C++ client SDK.
//
//   auto client = kvbank::Client::Connect("127.0.0.1:50051");
//   auto model = (*client)->EnsurePreset("llama", "llama-3.1-8b");
//   auto seq = (*client)->CreateSequence("llama");
//   (*client)->AppendTensors("llama", seq->id, {.num_tokens = n}, k_bytes, v_bytes);
//
// Every call has a deadline (ClientOptions) and returns absl::Status / absl::StatusOr carrying the
// server's gRPC status code and message. A Client is thread-safe: share one per process.
#ifndef KVBANK_CLIENT_H_
#define KVBANK_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"

namespace kvbank {

// TLS to a kvbankd started with --tls-cert. Each PEM may be given as text (*_pem) or as a file
// (*_path, read by Connect); the text wins when both are set.
struct ClientTlsOptions {
  // CAs that sign the server's certificate; both empty: the system's default roots.
  std::string root_ca_pem;
  std::string root_ca_path;
  // The client's certificate chain and private key, for a server with --tls-client-ca (mutual
  // TLS); give both or neither.
  std::string cert_chain_pem;
  std::string cert_chain_path;
  std::string private_key_pem;
  std::string private_key_path;
  // When not empty: the name the server's certificate is checked against instead of the target's
  // host (tests whose certificate names another host).
  std::string server_name_override;
};

struct ClientOptions {
  absl::Duration call_deadline = absl::Seconds(30);    // unary calls
  absl::Duration stream_deadline = absl::Minutes(10);  // appends and fetches
  uint64_t chunk_bytes = uint64_t{1} << 20;            // payload bytes per append message
  std::string bearer_token;  // sent as "authorization: Bearer <token>" when not empty
  // Set: the connection uses TLS. Unset: plaintext, in which the bearer token travels in clear
  // text (fine on loopback, not across a network).
  std::optional<ClientTlsOptions> tls;
  // NOTE: process-wide. gRPC receives each message into buffers it mallocs and frees per message;
  // under glibc's default trim threshold (128 KiB) the freed heap top goes back to the kernel
  // after every message, so every byte received lands on a fresh page (measured: ~300 page
  // faults per 2 MiB FetchInto; the client spent 35-45% more CPU per fetch). Likewise Fetch's
  // result vectors are mapped fresh per call past the mmap threshold. When true, the first
  // Connect in the process sets glibc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD to 64 MiB (as
  // kvbankd does for itself): up to that much freed heap stays with the process, and blocks
  // under 64 MiB come from the heap. Skipped when MALLOC_TRIM_THRESHOLD_ or
  // MALLOC_MMAP_THRESHOLD_ is set in the environment (the user's own setting wins). glibc only.
  // Set false before the first Connect to leave malloc as it is.
  bool tune_malloc = true;
  // kvbankd's --shm-socket (a Unix socket path on this host): where RegisterRegion hands a
  // shared-memory region over. Empty: RegisterRegion answers FAILED_PRECONDITION.
  std::string shm_socket;
  // Region transfers (AppendFromRegion, FetchToRegion, FetchBlocksToRegion and their device
  // forms) are asked for with a control frame on shm_socket (proto/shm_control.h) instead of a
  // gRPC call, when the server takes them: one Unix-socket round trip. The first such transfer
  // registers a one-page region whose connection carries the frames. false: gRPC always.
  bool shm_control = true;
  // How long a control-frame transfer of at most kShmControlSpinBytes waits for its reply on
  // the CPU (reading the socket without blocking) before it sleeps in poll. A small transfer's
  // reply comes back within tens of microseconds, and a thread that sleeps for it pays a
  // wake-up on top (on a VM, a halted vCPU's: as much as the round trip itself). The cost is
  // that much CPU time a call at most. A larger one of at most kShmControlLoneSpinBytes spins
  // too, longer by its copy's time, when it is the only control-frame transfer this client has
  // in flight; others sleep, leaving the cores to kvbankd's copies. Zero: always sleep.
  absl::Duration shm_control_spin = absl::Microseconds(50);
};

// The largest region transfer that waits for its control-frame reply on the CPU
// (ClientOptions::shm_control_spin): about what kvbankd copies in those 50 microseconds.
inline constexpr uint64_t kShmControlSpinBytes = 256 << 10;
// The largest control-frame transfer that spins when it is this client's only one in flight:
// kvbankd copies such a transfer on its socket's listener when nothing else is under way, so
// its reply comes one copy after the request. It spins for shm_control_spin plus its bytes at
// kShmControlSpinBytesPerSecond (a copy slower than that ends in poll, as before).
inline constexpr uint64_t kShmControlLoneSpinBytes = 4 << 20;
inline constexpr uint64_t kShmControlSpinBytesPerSecond = uint64_t{8} << 30;

// Bytes [offset, offset + length) of a shared-memory region registered with kvbankd.
struct RegionSlice {
  RegionSlice() = default;
  RegionSlice(uint64_t region_id, uint64_t offset, uint64_t length, uint64_t run_bytes = 0,
              std::vector<uint64_t> run_offsets = {})
      : region_id(region_id),
        offset(offset),
        length(length),
        run_bytes(run_bytes),
        run_offsets(std::move(run_offsets)) {}
  uint64_t region_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  // Scattered (shared-memory regions): the payload in runs of run_bytes, run r at region bytes
  // [offset + run_offsets[r], + run_bytes); length is then 0 or run_bytes x the runs. The runs
  // may not overlap. One call moves a payload between kvbankd and pieces an engine keeps apart.
  uint64_t run_bytes = 0;
  std::vector<uint64_t> run_offsets;
  // The bytes the slice holds: length, or run_bytes x the runs.
  uint64_t bytes() const {
    return run_offsets.empty() || length != 0 ? length : run_bytes * run_offsets.size();
  }
};

// A same-host shared-memory region (Client::RegisterRegion): a memfd of this process, sealed
// against shrinking and growing, mapped here and in kvbankd. Appends and fetches that name a
// slice of it copy once, between kvbankd's pool and this memory, with no payload on a socket.
// Only this client's tenant can name it. It stays registered while this object lives: the
// destructor closes the socket connection it was handed over on, and kvbankd then drops it.
// Not copyable (Client::RegisterRegion hands it out in a unique_ptr); data() may be read and
// written from any thread (what a transfer in flight on the same bytes then sees is the
// caller's business).
class ShmRegion {
 public:
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t id() const { return id_; }  // kvbankd's region id
  RegionSlice Slice(uint64_t offset, uint64_t length) const { return {id_, offset, length}; }

 private:
  friend class Client;
  ShmRegion() = default;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t id_ = 0;
  int memfd_ = -1;
  int conn_ = -1;  // the socket connection the region lives by
};

class Client {
 public:
  struct ModelInfo {
    ModelLayout layout;  // layout.name is the model's name
    std::string fingerprint;
    uint64_t block_bytes = 0;
    uint64_t num_blocks = 0;
    uint64_t pool_bytes = 0;
    uint64_t payload_bytes_per_token = 0;
    std::string device;  // where the pool lives: "host" or "cuda:N"
    uint64_t max_sequences = 0;
    uint64_t max_tokens_per_sequence = 0;
    bool created = false;  // EnsureModel / EnsurePreset only
  };
  struct ModelStats {
    std::string model;
    uint64_t blocks_total = 0, blocks_free = 0, blocks_used = 0, block_bytes = 0;
    uint64_t pool_bytes = 0, sequences = 0, tokens_stored = 0, bytes_used = 0;
    uint64_t capacity_tokens = 0, appends = 0, fetches = 0, bytes_appended = 0;
    uint64_t bytes_fetched = 0, leases_expired = 0;
    uint64_t blocks_cached = 0, blocks_pinned = 0, evictions = 0;
    uint64_t prefix_query_tokens = 0, prefix_hit_tokens = 0;
    uint64_t fetches_waiting = 0;  // fetches waiting for their tokens (FetchArgs::wait)
    // Sequences created with CreateArgs::prefix_copy, and the payload bytes appended to them
    // (counted in bytes_appended too): prefixes copied in from other replicas.
    uint64_t prefix_copies_in = 0, prefix_copy_bytes_in = 0;
    // The tiers below the pool (v1::TierStats); unset when the model has none.
    struct Tiers {
      uint64_t host_blocks = 0, host_capacity = 0, disk_blocks = 0, disk_capacity = 0;
      uint64_t spilled_to_host = 0, spilled_to_disk = 0, spilled_at_eviction = 0;
      uint64_t promoted_from_host = 0, promoted_from_disk = 0;
      uint64_t corrupt = 0, spill_dropped = 0, disk_bytes_written = 0, disk_bytes_read = 0;
      uint64_t loaded = 0, load_invalid = 0, unverified = 0;
      bool direct_io = false;
    };
    std::optional<Tiers> tiers;
    struct Tenant {
      std::string tenant;
      uint64_t prefix_query_tokens = 0, prefix_hit_tokens = 0, blocks_referenced = 0;
      uint64_t sequences = 0;
      uint64_t tokens_stored = 0, appends = 0, fetches = 0, bytes_appended = 0;
      uint64_t bytes_fetched = 0, leases_expired = 0;
      uint64_t max_blocks = 0, max_sequences = 0;  // limits; 0: none of its own
    };
    std::vector<Tenant> tenants;  // the caller's own, or every tenant for an admin
    // The caller is not admin: the figures are its own, and the pool-wide ones that move with
    // other tenants' work (free, cached, pinned blocks, evictions) are withheld (0).
    bool tenant_view = false;
  };
  // What a tenant holds of the server-wide caps (waits, Watch streams, regions, queued work):
  // per resource, held now, its share (0: no limit) and its claims refused since start.
  struct TenantUsage {
    struct Resource {
      std::string name;  // "waits", "watch_streams", "shm_regions", "queued_background", ...
      uint64_t held = 0, share = 0, refused = 0;
    };
    std::string tenant;
    std::vector<Resource> resources;
    // The named resource's row (a zero row when there is none).
    Resource Of(const std::string& name) const;
  };
  // How a sequence starts: with a prompt, its cached full blocks are attached.
  struct CreateArgs {
    std::optional<absl::Duration> lease;  // unset: the server's default; zero: no lease
    std::vector<uint32_t> prompt;
    std::string cache_salt;
    std::vector<ExtraKey> extra_keys;
    std::optional<uint32_t> priority;  // 0..100
    // Retention: kind 0 full, 1 sliding window (window, sinks), 2 heavy hitter (budget, window).
    uint32_t retention_kind = 0;
    uint32_t window = 0, sinks = 0, budget = 0;
    // The sequence carries prefix blocks copied from another replica (a Fleet's prefix copy):
    // the server counts it, and the payload appended to it, in ModelStats::prefix_copies_in and
    // prefix_copy_bytes_in. Nothing else about the sequence changes.
    bool prefix_copy = false;
  };
  struct MatchQuery {
    std::vector<uint32_t> tokens;   // either token ids ...
    std::vector<BlockHash> hashes;  // ... or block hashes
    std::string cache_salt;
    std::vector<ExtraKey> extra_keys;
  };
  // Where a query's leading cached tokens are: the server's pool, then the tiers below it.
  struct MatchTiersResult {
    uint64_t tokens = 0;  // pool + host + disk: what a CreateSequence with the prompt attaches
    uint64_t pool_tokens = 0, host_tokens = 0, disk_tokens = 0;
  };
  struct PrefixRootInfo {
    BlockHash root{};
    HashAlgorithm algorithm = HashAlgorithm::kSha256;
    uint32_t block_tokens = 0;
    std::string layout_fingerprint;
    std::string tenant;
  };
  struct Event {
    enum class Type { kStored, kRemoved, kAllCleared };
    Type type = Type::kStored;
    uint64_t sequence = 0;
    std::string tenant;  // admin watchers only
    std::vector<BlockHash> hashes;
    std::optional<BlockHash> parent;
    std::vector<uint32_t> token_ids;
    uint32_t block_size = 0;
    std::string lora;
  };
  struct SequenceInfo {
    std::string model;
    uint64_t id = 0;
    uint64_t length = 0;
    std::vector<uint64_t> layer_lengths;
    uint64_t num_blocks = 0;
    uint64_t cached_tokens = 0;
    absl::Duration lease_ttl = absl::ZeroDuration();  // zero: no lease
    uint64_t compactions = 0;
  };
  // What an append covers. Layers [layer_begin, layer_end); layer_end unset = all layers.
  struct AppendArgs {
    uint32_t layer_begin = 0;
    std::optional<uint32_t> layer_end;
    uint64_t num_tokens = 0;
    // The payload dtype: a layer's storage dtype, the model's input dtype (the server
    // quantizes), or a quantized storage dtype (storage format). Unset: DefaultWireDType.
    std::optional<DType> dtype;
    std::vector<uint32_t> token_ids;  // empty or num_tokens ids
    // KV heads [kv_head_begin, kv_head_end) only: a tensor-parallel rank's share (the payload
    // layout with that many heads). Unset end: num_kv_heads. The ranks of a prefill may append
    // their heads of the same tokens at once; the tokens count once every head holds them.
    uint32_t kv_head_begin = 0;
    std::optional<uint32_t> kv_head_end;
  };
  struct FetchArgs {
    uint64_t token_begin = 0;
    std::optional<uint64_t> token_end;  // unset: every token the layers hold
    uint32_t layer_begin = 0;
    std::optional<uint32_t> layer_end;
    std::optional<DType> dtype;
    // KV heads [kv_head_begin, kv_head_end) only: a tensor-parallel rank's share (the payload
    // layout with that many heads). Unset end: num_kv_heads. MLA's latent head is read whole.
    uint32_t kv_head_begin = 0;
    std::optional<uint32_t> kv_head_end;
    // Layer-wise handoff: with token_end set, wait up to this long (at most 10 minutes) for
    // appends to commit the tokens, then fetch (a decode worker pulling each layer as soon as
    // the prefill worker's append of it commits). DEADLINE_EXCEEDED when they are not
    // committed in time. Zero: no wait (OUT_OF_RANGE past what the sequence holds).
    absl::Duration wait = absl::ZeroDuration();
  };
  struct FetchResult {
    uint64_t token_begin = 0;
    uint64_t num_tokens = 0;
    uint32_t layer_begin = 0;
    uint32_t layer_end = 0;
    uint32_t kv_head_begin = 0;  // the heads the payload holds: [kv_head_begin, kv_head_end)
    uint32_t kv_head_end = 0;
    DType dtype = DType::kFp16;
    std::vector<uint8_t> payload;  // layout of kvbank/layout.h (PayloadLayout); empty for FetchInto
    uint64_t payload_bytes = 0;    // its size (FetchInto: the bytes written at the buffer's start)
  };

  // Connects lazily: the first call opens the channel. `target` is a gRPC target
  // ("host:port", "dns:///name:port", "unix:/path"). INVALID_ARGUMENT, naming the file, when a
  // TLS file cannot be read or holds no PEM block, or when only one of cert and key is given.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Registers a model with this exact layout (idempotent); pool_bytes 0: the server's default.
  // A new model needs an admin caller (PERMISSION_DENIED otherwise); any caller may ensure one
  // that is registered with this layout.
  absl::StatusOr<ModelInfo> EnsureModel(const ModelLayout& layout, uint64_t pool_bytes = 0);
  // Registers a model from a built-in preset; storage unset: the preset's dtype (bf16).
  absl::StatusOr<ModelInfo> EnsurePreset(const std::string& name, const std::string& preset,
                                         std::optional<DType> storage = std::nullopt,
                                         uint64_t pool_bytes = 0, uint32_t block_tokens = 0);
  // Unregisters a model, its sequences and cached blocks (admin only: PERMISSION_DENIED for
  // other tenants; NOT_FOUND for an unknown name).
  absl::Status DropModel(const std::string& name);
  absl::StatusOr<std::vector<ModelInfo>> ListModels();
  // The model's info, from a cache filled by EnsureModel/EnsurePreset/ListModels (one RPC on a
  // miss).
  absl::StatusOr<ModelInfo> GetModel(const std::string& model);
  absl::StatusOr<std::vector<ModelStats>> GetStats(const std::string& model = "");
  // The caller's usage of the server-wide caps; every tenant's for an admin (by name).
  absl::StatusOr<std::vector<TenantUsage>> GetTenantUsage();
  // What the server is and which data planes it serves.
  // What the server is and which data planes it serves (the planes a caller may pick).
  struct ServerInfo {
    std::string version;
    std::string shm_socket;  // kvbankd's --shm-socket; empty when the plane is off
    // The control frames its socket takes (region transfers without a gRPC call); 0: none.
    uint32_t shm_control_version = 0;
    std::string replica;  // kvbankd's --replica-name (default its host name); may be empty
    // The CUDA IPC plane's device N (the pools are in cuda:N memory); unset when it is off.
    std::optional<int> cuda_ipc_device;
    bool nccl = false;     // NcclConnect can form a communicator
    std::string nccl_off;  // why not, when nccl is false
    // The server host's boot id; empty when unknown. OnThisHost() compares it with ours.
    std::string host_id;
    // True when the server runs on this machine (same boot id): CUDA IPC can reach it.
    bool OnThisHost() const;
  };
  absl::StatusOr<ServerInfo> GetServerInfo();

  // lease: unset = the server's default; zero = no lease (lives until freed).
  absl::StatusOr<SequenceInfo> CreateSequence(const std::string& model,
                                              std::optional<absl::Duration> lease = std::nullopt);
  absl::StatusOr<SequenceInfo> CreateSequence(const std::string& model, const CreateArgs& args);
  // Appends a dense payload (kvbank/layout.h order: per layer K then V), streamed in chunks.
  // Atomic: on any error nothing of it is visible.
  absl::StatusOr<SequenceInfo> Append(const std::string& model, uint64_t id, const AppendArgs& args,
                                      absl::Span<const uint8_t> payload);
  // Typed helper: k is [layers][kv_heads][num_tokens][head_dim], v is
  // [layers][kv_heads][num_tokens][head_dim_v] (empty for MLA), both dense in the storage dtype,
  // layers = the range in args. Streams without building the interleaved payload.
  absl::StatusOr<SequenceInfo> AppendTensors(const std::string& model, uint64_t id,
                                             const AppendArgs& args, absl::Span<const uint8_t> k,
                                             absl::Span<const uint8_t> v);
  absl::StatusOr<FetchResult> Fetch(const std::string& model, uint64_t id, const FetchArgs& args);
  // Fetch into the caller's buffer (pinned or otherwise reused memory: no fresh pages to fault
  // in); the result's payload stays empty and payload_bytes says how much of `out` was written.
  // OUT_OF_RANGE naming both sizes when the payload does not fit (the call is cancelled, and
  // what `out` then holds is meaningless).
  absl::StatusOr<FetchResult> FetchInto(const std::string& model, uint64_t id,
                                        const FetchArgs& args, absl::Span<uint8_t> out);
  // Same-host shared-memory plane (kvbankd --shm-socket, ClientOptions::shm_socket).
  // Creates a `size`-byte memfd region, hands it to kvbankd over the socket and registers it for
  // this client's tenant. FAILED_PRECONDITION when shm_socket is not set; UNAVAILABLE when
  // nothing answers on it; the server's refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) as is.
  absl::StatusOr<std::unique_ptr<ShmRegion>> RegisterRegion(uint64_t size);
  // Registers memory the caller already has in a shared file: `fd` names a memfd or another
  // tmpfs file (an engine's host pool, say); pages of it never touched are allocated here (on
  // the caller's memory, no byte changed: MADV_POPULATE_WRITE). The region is the whole
  // file, mapped again here (ShmRegion::data() is that mapping: the same bytes at another
  // address); the SDK keeps a duplicate of `fd`, the caller closes its own. A file not sealed
  // against shrinking is taken, but if its owner truncates it, transfers over it fail with
  // FAILED_PRECONDITION. INVALID_ARGUMENT when `fd` is not such a file (the server's reason for
  // a refused one); else RegisterRegion's errors.
  absl::StatusOr<std::unique_ptr<ShmRegion>> RegisterRegionFd(int fd);
  // Region transfers so far asked for with a control frame on the shm socket (ClientOptions::
  // shm_control); the others went by gRPC.
  uint64_t ShmControlRequests() const;
  // Drops a region at once (destroying the ShmRegion does too). NOT_FOUND when the tenant has no
  // such region.
  absl::Status UnregisterRegion(uint64_t region_id);
  // Append whose payload is `source` (exactly the payload's size); the bytes do not travel on
  // gRPC. Atomic as Append.
  absl::StatusOr<SequenceInfo> AppendFromRegion(const std::string& model, uint64_t id,
                                                const AppendArgs& args, const RegionSlice& source);
  // Pages kept as an engine's own page store keeps them (SGLang HiCache pages, LMCache chunks),
  // many in one call: page i is a sequence of args.num_tokens placeholder token ids (0) whose
  // extra keys are pages[i].extra_keys, so that its block is named by the page's own key, not by
  // what came before it; its payload is appended from pages[i].source (a region slice, runs
  // allowed) unless kvbankd already holds that block; then the sequence is freed (the block
  // stays cached). args.parallel pages at once, on threads of this call (the caller's included).
  // One status a page, in order: OK when kvbankd holds the page afterwards. A page that fails
  // changes nothing of the others.
  struct PagePut {
    std::vector<ExtraKey> extra_keys;
    RegionSlice source;
  };
  struct PutPagesArgs {
    uint64_t num_tokens = 0;              // a page's tokens (the model's block_tokens)
    std::optional<absl::Duration> lease;  // each page's sequence while its append runs
    int parallel = 2;                     // 1..64
  };
  std::vector<absl::Status> PutPagesFromRegion(const std::string& model, const PutPagesArgs& args,
                                               const std::vector<PagePut>& pages);
  // Fetch written into `dest` from its start (the result's payload stays empty; payload_bytes
  // says how much was written, never more than dest's length: a server that claims more is
  // INTERNAL). INVALID_ARGUMENT, nothing written, when dest is smaller than the payload.
  // NOTE: after a call that failed (its deadline passed, it was cancelled) dest's bytes are
  // unspecified: kvbankd writes nothing once the call has ended, but a copy under way at that
  // moment may have written part of it. Reuse the slice for a new fetch, not for its old bytes.
  absl::StatusOr<FetchResult> FetchToRegion(const std::string& model, uint64_t id,
                                            const FetchArgs& args, const RegionSlice& dest);
  // Same-host CUDA IPC plane (a kvbankd with a cuda:N pool). `ipc_handle`: the 64-byte
  // cudaIpcMemHandle_t of a cudaMalloc allocation (cudaIpcGetMemHandle in C++; in Python,
  // kvbank.cuda_ipc_handle(tensor)), `offset` / `size`: the buffer in it. The SDK itself needs no
  // CUDA. The region lives while transfers name it (kvbankd's --cuda-ipc-lease-ms).
  // FAILED_PRECONDITION when the server has no cuda:N pool or no CUDA.
  struct DeviceRegion {
    uint64_t region_id = 0;
    uint64_t size = 0;
    int device = 0;  // the CUDA device kvbankd opened it on
  };
  absl::StatusOr<DeviceRegion> RegisterDeviceRegion(absl::Span<const uint8_t> ipc_handle,
                                                    uint64_t offset, uint64_t size);
  absl::Status UnregisterDeviceRegion(uint64_t region_id);
  // Append whose payload is `source` in a device region (fp32 / fp16 / bf16: converted on the
  // device); Fetch written into `dest` in a device region. As AppendFromRegion / FetchToRegion.
  // NOTE: kvbankd reads and writes the region on its own streams, in its own process: the
  // source's bytes must have landed before the call (synchronize the stream or device that wrote
  // them; a cudaMemcpy from pageable memory or a cudaMemset may still be running when it
  // returns), and nothing may write dest until the fetch returns, when its bytes are in place.
  absl::StatusOr<SequenceInfo> AppendFromDevice(const std::string& model, uint64_t id,
                                                const AppendArgs& args, const RegionSlice& source);
  absl::StatusOr<FetchResult> FetchToDevice(const std::string& model, uint64_t id,
                                            const FetchArgs& args, const RegionSlice& dest);
  // FetchBlocks written into `dest` (args' layer, dtype and head fields apply), as FetchToRegion.
  absl::StatusOr<FetchResult> FetchBlocksToRegion(const std::string& model,
                                                  const std::vector<BlockHash>& hashes,
                                                  const FetchArgs& args, const RegionSlice& dest);
  // FetchBlocks written into `dest` in a device region, as FetchToDevice.
  absl::StatusOr<FetchResult> FetchBlocksToDevice(const std::string& model,
                                                  const std::vector<BlockHash>& hashes,
                                                  const FetchArgs& args, const RegionSlice& dest);

  // NCCL plane (a kvbankd whose pools are on cuda:N, built with NCCL; this SDK built with CUDA
  // and NCCL, else UNIMPLEMENTED). A communicator of two ranks, this process (rank 0, on CUDA
  // device `device`) and kvbankd (rank 1), which payloads then cross GPU to GPU with
  // ncclSend / ncclRecv; gRPC names each transfer. One communicator per Client (connecting
  // again replaces it); its transfers run one at a time. A transfer that fails after the NCCL
  // operation began aborts the communicator (later ones answer FAILED_PRECONDITION): connect
  // again. Nothing of this has run on a GPU yet.
  absl::Status NcclConnect(int device);
  // Drops the communicator (kvbankd's too). A no-op without one.
  void NcclDisconnect();
  // Append whose payload (`bytes`, the payload's exact size, on the NCCL device) goes over
  // NCCL. fp32 / fp16 / bf16 payloads only (FAILED_PRECONDITION for the storage format).
  // Atomic as Append. FAILED_PRECONDITION without NcclConnect.
  absl::StatusOr<SequenceInfo> AppendOverNccl(const std::string& model, uint64_t id,
                                              const AppendArgs& args, const void* device_ptr,
                                              uint64_t bytes);
  // Fetch received over NCCL into `device_ptr` (capacity bytes on the NCCL device); the result's
  // payload stays empty, payload_bytes says how much arrived. INVALID_ARGUMENT, nothing sent,
  // when the payload does not fit.
  absl::StatusOr<FetchResult> FetchOverNccl(const std::string& model, uint64_t id,
                                            const FetchArgs& args, void* device_ptr,
                                            uint64_t capacity);

  // Typed helper: fills k [layers][kv_heads][tokens][head_dim] and v (same, head_dim_v; empty for
  // MLA). REQUIRES: the spans are exactly the size of the range fetched; else INVALID_ARGUMENT.
  absl::Status FetchTensors(const std::string& model, uint64_t id, const FetchArgs& args,
                            absl::Span<uint8_t> k, absl::Span<uint8_t> v);
  absl::StatusOr<SequenceInfo> Fork(const std::string& model, uint64_t id,
                                    std::optional<absl::Duration> lease = std::nullopt);
  absl::StatusOr<SequenceInfo> Truncate(const std::string& model, uint64_t id, uint64_t num_tokens);
  // Returns how many block references the sequence dropped.
  absl::StatusOr<uint64_t> Free(const std::string& model, uint64_t id);
  absl::StatusOr<SequenceInfo> RenewLease(const std::string& model, uint64_t id);
  absl::StatusOr<SequenceInfo> GetSequence(const std::string& model, uint64_t id);

  // Prefix cache (the caller's tenant only). Leading cached tokens per query; no side effects.
  absl::StatusOr<std::vector<uint64_t>> Match(const std::string& model,
                                              const std::vector<MatchQuery>& queries);
  // The same, with the tier each query's tokens are in. prefetch: the server also starts
  // bringing the blocks it found in a tier back into its pool, in the background, so a
  // CreateSequence with the prompt a moment later finds them there (MatchRequest.prefetch).
  absl::StatusOr<std::vector<MatchTiersResult>> MatchTiers(const std::string& model,
                                                           const std::vector<MatchQuery>& queries,
                                                           bool prefetch = false);
  // The longest cached run of leading `hashes`: full blocks, in the payload layout.
  absl::StatusOr<FetchResult> FetchBlocks(const std::string& model,
                                          const std::vector<BlockHash>& hashes,
                                          uint32_t layer_begin = 0,
                                          std::optional<uint32_t> layer_end = std::nullopt);
  // The same with args' layer range, dtype and kv head range (its token range is not used).
  absl::StatusOr<FetchResult> FetchBlocks(const std::string& model,
                                          const std::vector<BlockHash>& hashes,
                                          const FetchArgs& args);
  // Pins (or unpins) cached blocks: by hashes, or the full blocks of a prompt. Returns how many
  // named a cached block.
  absl::StatusOr<uint64_t> Pin(const std::string& model, const MatchQuery& blocks, bool pin = true);
  absl::StatusOr<PrefixRootInfo> GetPrefixRoot(const std::string& model,
                                               const std::string& cache_salt = "");
  // Streams KV events after `after_sequence` (or from now) to `on_batch` until it returns false,
  // the deadline passes or the server ends the stream; returns the stream's status (OK when
  // on_batch stopped it). on_batch also gets the sequence number to resume from.
  absl::Status Watch(const std::string& model, uint64_t after_sequence, bool from_now,
                     absl::Duration deadline,
                     const std::function<bool(const std::vector<Event>&, uint64_t)>& on_batch);

  // Decode attention computed on the server, next to the KV (fused read): for each query
  // ([num_q_heads][head_dim] fp32, one new token) the output [num_q_heads][head_dim_v] and the
  // log-sum-exp per q head over the tokens layer `layer` of the sequence holds.
  struct AttendQuery {
    uint64_t sequence_id = 0;
    uint32_t layer = 0;
    std::vector<float> query;
  };
  struct AttendArgs {
    float softmax_scale = 0;  // 0: 1/sqrt(head_dim)
    uint32_t window = 0;      // 0: every token; else the last `window` ...
    uint32_t sinks = 0;       // ... plus the first `sinks`
  };
  struct AttendOutput {
    std::vector<float> output;  // [num_q_heads][head_dim_v]
    std::vector<float> lse;     // [num_q_heads]
  };
  absl::StatusOr<std::vector<AttendOutput>> Attend(const std::string& model,
                                                   const std::vector<AttendQuery>& queries,
                                                   const AttendArgs& args);
  absl::StatusOr<std::vector<AttendOutput>> Attend(const std::string& model,
                                                   const std::vector<AttendQuery>& queries);

  // OK when grpc.health.v1 reports SERVING within the deadline; else why not, from the last
  // try: UNAVAILABLE with gRPC's reason (connection refused, TLS handshake failed) or a server
  // that answers but is draining, DEADLINE_EXCEEDED when nothing answered at all.
  absl::Status CheckServing(absl::Duration deadline);
  // CheckServing(deadline).ok().
  bool WaitForServing(absl::Duration deadline);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // Maps `fd` (owned from here on), hands it over and registers it.
  absl::StatusOr<std::unique_ptr<ShmRegion>> RegisterMemfd(int fd, uint64_t size, bool populate);
  std::unique_ptr<Impl> impl_;
};

// This machine's boot id (/proc/sys/kernel/random/boot_id): what GetServerInfo's host_id is
// compared with. Empty when it cannot be read.
std::string LocalHostId();

}  // namespace kvbank

#endif  // KVBANK_CLIENT_H_
