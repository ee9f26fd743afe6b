#include "server/plane/nccl_bootstrap.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvbank::plane {
namespace {

constexpr size_t kUniqueIdBytes = 128;
constexpr size_t kAddressAt = 8;  // after the handle's 64-bit magic

std::string Text(int family, const void* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  return inet_ntop(family, addr, buf, sizeof(buf)) != nullptr ? std::string(buf) : std::string();
}

// A v4-mapped IPv6 address as its IPv4 text, else the text as it is.
std::string Canonical(const std::string& ip) {
  absl::string_view v = ip;
  if (absl::ConsumePrefix(&v, "::ffff:") && v.find('.') != absl::string_view::npos) {
    return std::string(v);
  }
  return ip;
}

bool IsLoopback(const std::string& ip) { return absl::StartsWith(ip, "127.") || ip == "::1"; }

}  // namespace

absl::StatusOr<std::string> NcclBootstrapAddress(absl::string_view unique_id) {
  if (unique_id.size() != kUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("unique_id has ", unique_id.size(), " bytes, not ", kUniqueIdBytes));
  }
  const char* p = unique_id.data() + kAddressAt;
  sa_family_t family;
  std::memcpy(&family, p, sizeof(family));
  if (family == AF_INET) {
    sockaddr_in in;
    std::memcpy(&in, p, sizeof(in));
    return Text(AF_INET, &in.sin_addr);
  }
  if (family == AF_INET6) {
    sockaddr_in6 in6;
    std::memcpy(&in6, p, sizeof(in6));
    return Canonical(Text(AF_INET6, &in6.sin6_addr));
  }
  return absl::InvalidArgumentError(
      "unique_id names no IPv4 or IPv6 bootstrap address (make it with ncclGetUniqueId)");
}

absl::Status CheckNcclBootstrap(absl::string_view unique_id, absl::string_view grpc_peer,
                                const std::vector<std::string>& local_addresses) {
  auto boot = NcclBootstrapAddress(unique_id);
  if (!boot.ok()) return boot.status();
  // gRPC's peer: "ipv4:a.b.c.d:port", "ipv6:[addr]:port", "unix:path" (or "unix-abstract:").
  std::string peer;
  bool local = false;
  absl::string_view v = grpc_peer;
  if (absl::ConsumePrefix(&v, "ipv4:")) {
    peer = std::string(v.substr(0, v.rfind(':')));
  } else if (absl::ConsumePrefix(&v, "ipv6:")) {
    v = v.substr(0, v.rfind(':'));
    absl::ConsumePrefix(&v, "[");
    absl::ConsumeSuffix(&v, "]");
    peer = Canonical(std::string(v.substr(0, v.find('%'))));
  } else if (absl::StartsWith(v, "unix")) {
    local = true;
  }
  if (!peer.empty() && peer == *boot) return absl::OkStatus();
  local = local || IsLoopback(peer);
  if (local && (IsLoopback(*boot) || std::find(local_addresses.begin(), local_addresses.end(),
                                               *boot) != local_addresses.end())) {
    return absl::OkStatus();  // a caller on this host, bootstrapping on one of its addresses
  }
  return absl::PermissionDeniedError(
      absl::StrCat("unique_id's bootstrap address ", *boot, " is not the caller's (",
                   peer.empty() ? std::string(grpc_peer) : peer,
                   "): kvbankd joins only communicators whose root is the calling host"));
}

std::vector<std::string> LocalAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (a->ifa_addr->sa_family == AF_INET) {
      out.push_back(Text(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr));
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      out.push_back(
          Canonical(Text(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr)));
    }
  }
  freeifaddrs(list);
  return out;
}

}  // namespace kvbank::plane
