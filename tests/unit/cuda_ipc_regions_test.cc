// The CUDA IPC plane's registry (server/plane/cuda_ipc.h) with an injected opener: tenancy, slice
// checks, limits, the lease and when a region is closed. Opening real handles is
// tests/gpu/gpu_cuda_ipc_test.cc.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "server/plane/cuda_ipc.h"

namespace kvbank::plane {
namespace {

// Hands out host buffers as "device" memory and counts closes.
struct FakeOpener {
  std::shared_ptr<int> closed = std::make_shared<int>(0);
  std::vector<std::unique_ptr<uint8_t[]>> buffers;
  DeviceOpener Get() {
    return [this](int, absl::string_view, uint64_t offset,
                  uint64_t size) -> absl::StatusOr<std::shared_ptr<DeviceMapping>> {
      buffers.push_back(std::make_unique<uint8_t[]>(offset + size));
      auto c = closed;
      return std::make_shared<DeviceMapping>(buffers.back().get() + offset, size, [c] { ++*c; });
    };
  }
};

const std::string kHandle(kCudaIpcHandleBytes, '\x07');

TEST(CudaIpcRegionsTest, ARegionIsItsTenantsOnly) {
  FakeOpener f;
  CudaIpcRegions r({}, f.Get());
  auto id = r.Register("a", kHandle, 0, 4096);
  ASSERT_TRUE(id.ok()) << id.status();
  auto ok = r.Resolve("a", *id, 100, 200, "device_dest");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->size, 200u);
  auto other = r.Resolve("b", *id, 0, 1, "device_dest");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "device_dest.region_id"));
  EXPECT_EQ(r.Unregister("b", *id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.num_regions(), 1u);
}

TEST(CudaIpcRegionsTest, BadSlicesAndRequestsAreRefusedNamingThem) {
  FakeOpener f;
  CudaIpcOptions o;
  o.max_region_bytes = 1 << 20;
  o.max_regions = 1;
  CudaIpcRegions r(o, f.Get());
  EXPECT_EQ(r.Register("a", "short", 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", kHandle, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", kHandle, 0, (1 << 20) + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto id = r.Register("a", kHandle, 0, 4096);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(r.Register("a", kHandle, 0, 1).status().code(), absl::StatusCode::kResourceExhausted);
  auto zero = r.Resolve("a", 0, 0, 1, "header.device_source");
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(zero.status().message(), "header.device_source.region_id"));
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 4097}, {4096, 1}, {4097, 0}, {1, ~uint64_t{0}}, {~uint64_t{0}, 2}}) {
    auto s = r.Resolve("a", *id, off, len, "header.device_source");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << off << "+" << len;
    EXPECT_TRUE(absl::StrContains(s.status().message(), "header.device_source")) << off;
  }
  EXPECT_TRUE(r.Resolve("a", *id, 4096, 0, "x").ok());
}

// Each tenant has a share of --cuda-ipc-max-regions (the ledger's); a handle registered again
// answers the region that has it (opened once); registrations racing each other never pass the
// cap, because the place is taken before the (slow) open.
TEST(CudaIpcRegionsTest, TenantsHaveAShareAndAHandleOpensOnce) {
  FakeOpener f;
  CudaIpcOptions o;
  o.max_regions = 4;
  o.ledger = TenantLedger::Create();
  o.ledger->SetCap(Resource::kDeviceRegions, 4);
  o.ledger->SetTenants({"a", "b"});
  CudaIpcRegions r(o, f.Get());
  auto first = r.Register("a", kHandle, 0, 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  for (int i = 0; i < 300; ++i) {
    auto again = r.Register("a", kHandle, 0, 4096);
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_EQ(*again, *first) << "the same handle, another region";
  }
  EXPECT_EQ(f.buffers.size(), 1u) << "one handle opened more than once";
  EXPECT_EQ(o.ledger->Held("a", Resource::kDeviceRegions), 1u);
  const std::string other(kCudaIpcHandleBytes, '\x08'), third(kCudaIpcHandleBytes, '\x09');
  ASSERT_TRUE(r.Register("a", other, 0, 4096).ok());
  auto over = r.Register("a", third, 0, 4096);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_TRUE(absl::StrContains(over.status().message(), "share of 2 device_regions"))
      << over.status();
  // b's share is its own.
  EXPECT_TRUE(r.Register("b", third, 0, 4096).ok());
  ASSERT_TRUE(r.Unregister("a", *first).ok());
  EXPECT_EQ(o.ledger->Held("a", Resource::kDeviceRegions), 1u);
  EXPECT_TRUE(r.Register("a", third, 0, 4096).ok());
}

TEST(CudaIpcRegionsTest, RacingRegistrationsNeverPassTheCap) {
  CudaIpcOptions o;
  o.max_regions = 8;
  std::atomic<int> opened{0};
  CudaIpcRegions r(
      o,
      [&](int, absl::string_view, uint64_t,
          uint64_t size) -> absl::StatusOr<std::shared_ptr<DeviceMapping>> {
        opened.fetch_add(1);
        absl::SleepFor(absl::Milliseconds(20));  // a slow open: every racer is inside it at once
        static uint8_t memory[4096];
        return std::make_shared<DeviceMapping>(memory, size, nullptr);
      });
  std::vector<std::thread> racers;
  std::atomic<int> ok{0}, refused{0};
  for (int i = 0; i < 32; ++i) {
    racers.emplace_back([&, i] {
      const std::string handle(kCudaIpcHandleBytes, char('a' + i));
      auto id = r.Register("t", handle, 0, 64);
      (id.ok() ? ok : refused).fetch_add(1);
    });
  }
  for (std::thread& t : racers) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(refused.load(), 24);
  EXPECT_EQ(opened.load(), 8) << "a refused registration opened its handle";
  EXPECT_EQ(r.num_regions(), 8u);
}

TEST(CudaIpcRegionsTest, ClosedWhenUnregisteredOrExpiredAndNotUnderATransfer) {
  FakeOpener f;
  CudaIpcOptions o;
  o.lease = absl::Seconds(30);
  CudaIpcRegions r(o, f.Get());
  auto a = r.Register("a", kHandle, 0, 64);
  auto b = r.Register("a", std::string(kCudaIpcHandleBytes, '\x08'), 0, 64);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_NE(*a, *b);
  {
    auto held = r.Resolve("a", *a, 0, 64, "x");  // a transfer in flight
    ASSERT_TRUE(held.ok());
    ASSERT_TRUE(r.Unregister("a", *a).ok());
    EXPECT_EQ(*f.closed, 0) << "closed under a transfer";
    EXPECT_EQ(r.Resolve("a", *a, 0, 1, "x").status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(*f.closed, 1);
  // The lease: not before it runs out, then closed.
  EXPECT_EQ(r.Sweep(absl::Now() + absl::Seconds(20)), 0u);
  EXPECT_EQ(r.Sweep(absl::Now() + absl::Seconds(31)), 1u);
  EXPECT_EQ(*f.closed, 2);
  EXPECT_EQ(r.num_regions(), 0u);
}

}  // namespace
}  // namespace kvbank::plane
