// NcclConnect's check of the address an ncclUniqueId sends kvbankd to (nccl_bootstrap.h): only
// the caller's own host. The unique ids are laid out as NCCL 2.x lays them out (a 64-bit magic,
// then a sockaddr_in / sockaddr_in6), so this runs without NCCL or a GPU.
#include "server/plane/nccl_bootstrap.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace kvbank::plane {
namespace {

std::string UniqueIdV4(const char* ip, uint16_t port = 12345) {
  std::string id(128, '\0');
  const uint64_t magic = 0x1234abcd;
  std::memcpy(id.data(), &magic, 8);
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(port);
  EXPECT_EQ(inet_pton(AF_INET, ip, &in.sin_addr), 1);
  std::memcpy(id.data() + 8, &in, sizeof(in));
  return id;
}

std::string UniqueIdV6(const char* ip) {
  std::string id(128, '\0');
  sockaddr_in6 in6{};
  in6.sin6_family = AF_INET6;
  in6.sin6_port = htons(4242);
  EXPECT_EQ(inet_pton(AF_INET6, ip, &in6.sin6_addr), 1);
  std::memcpy(id.data() + 8, &in6, sizeof(in6));
  return id;
}

TEST(NcclBootstrapTest, ReadsTheRootAddress) {
  EXPECT_EQ(*NcclBootstrapAddress(UniqueIdV4("10.1.2.3")), "10.1.2.3");
  EXPECT_EQ(*NcclBootstrapAddress(UniqueIdV6("fd00::7")), "fd00::7");
  EXPECT_EQ(*NcclBootstrapAddress(UniqueIdV6("::ffff:10.9.8.7")), "10.9.8.7");
  EXPECT_EQ(NcclBootstrapAddress("short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclBootstrapAddress(std::string(128, '\0')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclBootstrapTest, OnlyTheCallersOwnAddressIsTaken) {
  const std::vector<std::string> local = {"127.0.0.1", "10.0.0.5", "fd00::5"};
  // A remote caller: its own address only.
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV4("10.0.0.9"), "ipv4:10.0.0.9:51234", local).ok());
  const absl::Status elsewhere =
      CheckNcclBootstrap(UniqueIdV4("192.168.7.7"), "ipv4:10.0.0.9:51234", local);
  EXPECT_EQ(elsewhere.code(), absl::StatusCode::kPermissionDenied) << elsewhere;
  EXPECT_NE(elsewhere.message().find("192.168.7.7 is not the caller's (10.0.0.9)"),
            std::string::npos)
      << elsewhere;
  // A remote caller may not name this host's own addresses either.
  EXPECT_EQ(CheckNcclBootstrap(UniqueIdV4("10.0.0.5"), "ipv4:10.0.0.9:1", local).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckNcclBootstrap(UniqueIdV4("127.0.0.1"), "ipv4:10.0.0.9:1", local).code(),
            absl::StatusCode::kPermissionDenied);
  // A caller on this host (loopback, a Unix socket): this host's addresses.
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV4("10.0.0.5"), "ipv4:127.0.0.1:40000", local).ok());
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV4("127.0.0.1"), "ipv6:[::1]:40000", local).ok());
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV6("fd00::5"), "unix:/run/kvbank.sock", local).ok());
  EXPECT_EQ(CheckNcclBootstrap(UniqueIdV4("10.0.0.77"), "ipv4:127.0.0.1:40000", local).code(),
            absl::StatusCode::kPermissionDenied);
  // IPv6 peers, with a zone and v4-mapped.
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV6("fd00::9"), "ipv6:[fd00::9]:5", local).ok());
  EXPECT_TRUE(CheckNcclBootstrap(UniqueIdV4("10.0.0.9"), "ipv6:[::ffff:10.0.0.9]:5", local).ok());
  EXPECT_EQ(CheckNcclBootstrap("short", "ipv4:10.0.0.9:1", local).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclBootstrapTest, LocalAddressesIncludeLoopback) {
  const std::vector<std::string> local = LocalAddresses();
  EXPECT_NE(std::find(local.begin(), local.end(), "127.0.0.1"), local.end());
}

}  // namespace
}  // namespace kvbank::plane
