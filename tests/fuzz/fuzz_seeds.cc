// Writes the seed corpora of the fuzz targets into <dir>/<target>/ (tests/fuzz/corpus): valid
// messages and files of each kind, laid out as each target reads its input (FuzzedDataProvider
// takes integers from the end of the input, strings from the front).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "kvbank/v1/kvbank.pb.h"
#include "proto/shm_control.h"

namespace {

// A target's input: bytes read from the front, and integers in the order the target consumes
// them (FuzzedDataProvider reads them backwards from the end, most significant byte first).
class Input {
 public:
  Input& Front(const std::string& s) {
    front_ += s;
    return *this;
  }
  // A string ConsumeRandomLengthString gives back: backslashes doubled, then "\" + another byte.
  Input& FrontString(const std::string& s) {
    for (char c : s) {
      front_ += c;
      if (c == '\\') front_ += '\\';
    }
    front_ += "\\;";
    return *this;
  }
  Input& Byte(uint8_t v) {
    back_.push_back(v);
    return *this;
  }
  Input& U16(uint16_t v) { return Byte(v >> 8).Byte(v & 0xff); }
  // fuzz::ConsumeCuts: how many, then each offset.
  Input& Cuts(const std::vector<uint16_t>& at) {
    Byte(static_cast<uint8_t>(at.size()));
    for (uint16_t c : at) U16(c);
    return *this;
  }
  std::string Bytes() const { return front_ + std::string(back_.rbegin(), back_.rend()); }

 private:
  std::string front_;
  std::vector<uint8_t> back_;
};

bool Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out << bytes;
  return static_cast<bool>(out);
}

std::string UnknownFields() {  // a varint (7), a fixed32 (8), a length-delimited field (10)
  return std::string("\x38\xac\x02\x45\x01\x02\x03\x04\x52\x03xyz", 13);
}

bool AppendSeeds(const std::string& dir) {
  kvbank::v1::AppendRequest first;
  kvbank::v1::AppendHeader* h = first.mutable_header();
  h->set_model("llama-3.1-8b");
  h->set_sequence_id(7);
  h->set_layer_begin(1);
  h->set_layer_end(3);
  h->set_num_tokens(3);
  h->set_dtype(kvbank::v1::DTYPE_FP16);
  for (uint32_t t : {101u, 102u, 70000u}) h->add_token_ids(t);
  h->set_payload_bytes(48);
  first.set_data(std::string(48, '\x3c'));
  kvbank::v1::AppendRequest data_only;
  data_only.set_data("0123456789abcdef0123456789abcdef");
  kvbank::v1::AppendRequest header_only = first;
  header_only.clear_data();
  // protobuf takes fields in any order: data before the header, unknown fields between.
  const std::string reordered =
      data_only.SerializeAsString() + UnknownFields() + header_only.SerializeAsString();
  bool ok = true;
  ok &= Write(dir, "header_and_data", Input().Front(first.SerializeAsString()).Cuts({}).Bytes());
  ok &= Write(dir, "header_and_data_cut",
              Input().Front(first.SerializeAsString()).Cuts({2, 9, 40, 41}).Bytes());
  ok &= Write(dir, "data_only", Input().Front(data_only.SerializeAsString()).Cuts({5}).Bytes());
  ok &= Write(dir, "header_only", Input().Front(header_only.SerializeAsString()).Cuts({}).Bytes());
  ok &= Write(dir, "reordered", Input().Front(reordered).Cuts({1, 30, 31}).Bytes());
  ok &= Write(dir, "empty", Input().Cuts({}).Bytes());
  // The shared-memory plane: the payload is a region slice, the message the header alone.
  kvbank::v1::AppendRequest from_region = header_only;
  kvbank::v1::RegionSlice* source = from_region.mutable_header()->mutable_source();
  source->set_region_id(3);
  source->set_offset(4096);
  source->set_length(48);
  ok &= Write(dir, "region_source",
              Input().Front(from_region.SerializeAsString()).Cuts({3, 50}).Bytes());
  return ok;
}

bool FetchSeeds(const std::string& dir) {
  kvbank::v1::FetchResponse first;
  kvbank::v1::FetchHeader* h = first.mutable_header();
  h->set_token_begin(16);
  h->set_num_tokens(2);
  h->set_layer_begin(0);
  h->set_layer_end(2);
  h->set_dtype(kvbank::v1::DTYPE_BF16);
  h->set_payload_bytes(40);
  first.set_data(std::string(16, 'a'));
  kvbank::v1::FetchResponse second;
  second.set_data(std::string(16, 'b') + "\\");
  kvbank::v1::FetchResponse third;
  third.set_data(std::string(7, 'c'));
  const std::string m1 = first.SerializeAsString(), m2 = second.SerializeAsString(),
                    m3 = third.SerializeAsString() + UnknownFields();
  bool ok = true;
  // Messages, into a vector (bool false) or a buffer (bool true, then its size), then the cuts.
  ok &= Write(dir, "three_messages",
              Input()
                  .FrontString(m1)
                  .FrontString(m2)
                  .Front(m3)
                  .Byte(2)
                  .Byte(0)
                  .Cuts({3})
                  .Cuts({})
                  .Cuts({1, 2})
                  .Bytes());
  ok &= Write(dir, "three_messages_buffer",
              Input()
                  .FrontString(m1)
                  .FrontString(m2)
                  .Front(m3)
                  .Byte(2)
                  .Byte(1)
                  .U16(64)
                  .Cuts({10})
                  .Cuts({4})
                  .Cuts({})
                  .Bytes());
  kvbank::v1::FetchResponse whole = first;
  whole.mutable_header()->set_payload_bytes(16);
  ok &= Write(dir, "one_message",
              Input().Front(whole.SerializeAsString()).Byte(0).Byte(0).Cuts({7, 8}).Bytes());
  return ok;
}

bool AuthSeeds(const std::string& dir) {
  bool ok = true;
  ok &= Write(dir, "tenants",
              "# token tenant [admin] [max_blocks_fraction=F]\n"
              "s3cr3t-a alice\n"
              "s3cr3t-b bob max_blocks_fraction=0.25\n"
              "\n"
              "  root-token   ops   admin  \n");
  ok &= Write(dir, "one", "tok t\n");
  ok &= Write(dir, "crlf", "tok1 t1 admin\r\ntok2 t2 max_blocks_fraction=1\r\n");
  ok &= Write(dir, "max_sequences", "tok t max_sequences=4\n");
  ok &= Write(dir, "bad_fraction", "tok t max_blocks_fraction=1.5\n");
  return ok;
}

bool ConfigSeeds(const std::string& dir) {
  bool ok = true;
  ok &= Write(dir, "presets",
              "models { name: \"llama\" preset: \"llama-3.1-8b\" }\n"
              "models { name: \"ds\" preset: \"deepseek-v3\" storage_dtype: DTYPE_FP8_E4M3 }\n");
  ok &= Write(dir, "shape",
              "models {\n  name: \"tiny\" num_layers: 4 num_q_heads: 8 num_kv_heads: 2\n"
              "  head_dim: 64 block_tokens: 16 input_dtype: DTYPE_BF16 storage_dtype: DTYPE_INT8\n"
              "  high_precision_layers: 1 pool_bytes: 1048576 max_sequences: 10\n"
              "  enable_prefix_caching: false\n}\n");
  ok &= Write(dir, "layer_dtypes",
              "models { name: \"mixed\" num_layers: 3 num_kv_heads: 1 head_dim: 8\n"
              "  layer_dtypes: [DTYPE_FP16, DTYPE_FP8_E5M2, DTYPE_INT8] }\n");
  ok &= Write(dir, "mla",
              "models { name: \"mla\" kind: ATTENTION_KIND_MLA num_layers: 2 kv_lora_rank: 512\n"
              "  rope_dim: 64 num_q_heads: 16 max_tokens_per_sequence: 4096 }\n");
  // A layer count in the billions: refused before anything is sized by it.
  ok &= Write(dir, "huge_layers",
              "models { name: \"big\" num_layers: 3066666625 num_kv_heads: 1 head_dim: 8\n"
              "  high_precision_layers: 1000000000 }\n");
  return ok;
}

bool PrefixHashSeeds(const std::string& dir) {
  bool ok = true;
  std::string tokens;
  for (uint32_t t = 1; t <= 64; ++t) tokens.append(reinterpret_cast<const char*>(&t), 4);
  // Front: fingerprint, tenant, salt, key values; back: algorithm, block size, key count and
  // kinds, prefix length; the rest are token ids.
  ok &= Write(dir, "sha256_keys",
              Input()
                  .FrontString("fp:llama")
                  .FrontString("alice")
                  .FrontString("salt")
                  .FrontString("lora-a")
                  .Front(tokens)
                  .Byte(0)
                  .Byte(3)
                  .Byte(1)
                  .Byte(0)
                  .Byte(2)
                  .Bytes());
  ok &= Write(dir, "xxh3_plain",
              Input()
                  .FrontString("fp")
                  .FrontString("")
                  .FrontString("")
                  .Front(tokens)
                  .Byte(1)
                  .Byte(15)
                  .Byte(0)
                  .Byte(5)
                  .Bytes());
  return ok;
}

}  // namespace

// shm_hello_fuzz: integers from the back in its order (attach, memfd size, written, sealed,
// split), the bytes sent from the front.
std::string ShmHello(const std::string& bytes, uint8_t attach, uint32_t memfd_size, bool written,
                     bool sealed, uint8_t split) {
  return Input()
      .Front(bytes)
      .Byte(attach)
      .Byte(uint8_t(memfd_size >> 16))
      .Byte(uint8_t(memfd_size >> 8))
      .Byte(uint8_t(memfd_size))
      .Byte(written)
      .Byte(sealed)
      .Byte(split)
      .Bytes();
}

bool ShmHelloSeeds(const std::string& dir) {
  const std::string hello("KVBSHM01", 8);
  bool ok = true;
  ok &= Write(dir, "region", ShmHello(hello, 1, 4096, true, true, 8));
  ok &= Write(dir, "sparse", ShmHello(hello, 1, 65536, false, true, 8));
  ok &= Write(dir, "unsealed", ShmHello(hello, 1, 4096, true, false, 8));
  ok &= Write(dir, "no_descriptor", ShmHello(hello, 0, 0, false, false, 8));
  ok &= Write(dir, "pipe", ShmHello(hello, 2, 0, false, false, 8));
  ok &= Write(dir, "split_hello", ShmHello(hello + "more", 3, 4096, true, true, 3));
  return ok;
}

bool MetricsHttpSeeds(const std::string& dir) {
  bool ok = true;
  ok &= Write(dir, "scrape",
              Input().Front("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").Byte(0).Bytes());
  ok &= Write(dir, "head", Input().Front("HEAD /metrics HTTP/1.0\r\n\r\n").Byte(9).Bytes());
  ok &= Write(
      dir, "post",
      Input().Front("POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").Byte(20).Bytes());
  ok &= Write(dir, "other_path", Input().Front("GET /healthz HTTP/1.1\r\n\r\n").Byte(0).Bytes());
  ok &= Write(dir, "chunked",
              Input()
                  .Front("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello"
                         "\r\n0\r\n\r\n")
                  .Byte(30)
                  .Bytes());
  return ok;
}

bool ShmControlSeeds(const std::string& dir) {
  using namespace kvbank::proto;  // NOLINT: the seeds' one subject
  kvbank::v1::RegionSlice slice;
  slice.set_region_id(3);
  slice.set_length(4096);
  kvbank::v1::AppendHeader append;
  append.set_model("llama");
  append.set_sequence_id(7);
  append.set_num_tokens(2);
  append.add_token_ids(11);
  append.add_token_ids(12);
  *append.mutable_source() = slice;
  kvbank::v1::FetchRequest fetch;
  fetch.set_model("llama");
  fetch.set_sequence_id(7);
  fetch.set_token_end(32);
  fetch.set_wait_ms(100);
  *fetch.mutable_dest() = slice;
  kvbank::v1::FetchBlocksRequest blocks;
  blocks.set_model("llama");
  blocks.add_block_hashes(std::string(32, '\x5a'));
  *blocks.mutable_dest() = slice;
  kvbank::v1::AppendResponse appended;
  appended.mutable_sequence()->set_length(2);
  kvbank::v1::FetchResponse fetched;
  fetched.mutable_header()->set_num_tokens(32);
  auto bytes = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  bool ok = true;
  ok &= Write(dir, "append", bytes(EncodeShmControlRequest({1, append})));
  ok &= Write(dir, "fetch", bytes(EncodeShmControlRequest({2, fetch})));
  ok &= Write(dir, "fetch_blocks", bytes(EncodeShmControlRequest({3, blocks})));
  ok &= Write(dir, "append_reply",
              bytes(EncodeShmControlReply({1, ShmControlOp::kAppend, absl::OkStatus(), appended})));
  ok &= Write(dir, "fetch_reply",
              bytes(EncodeShmControlReply({2, ShmControlOp::kFetch, absl::OkStatus(), fetched})));
  ok &= Write(
      dir, "error_reply",
      bytes(EncodeShmControlReply(
          {3, ShmControlOp::kFetchBlocks, absl::NotFoundError("block 0 is not cached"), {}})));
  return ok;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds <corpus dir> (its <target>/ folders must exist)\n");
    return 2;
  }
  const std::string d = argv[1];
  const bool ok =
      AppendSeeds(d + "/append_message_fuzz") && FetchSeeds(d + "/fetch_decoder_fuzz") &&
      AuthSeeds(d + "/auth_tokens_fuzz") && ConfigSeeds(d + "/server_config_fuzz") &&
      PrefixHashSeeds(d + "/prefix_hash_fuzz") && ShmHelloSeeds(d + "/shm_hello_fuzz") &&
      MetricsHttpSeeds(d + "/metrics_http_fuzz") && ShmControlSeeds(d + "/shm_control_fuzz");
  if (!ok) std::fprintf(stderr, "fuzz_seeds: cannot write under %s\n", d.c_str());
  return ok ? 0 : 1;
}
