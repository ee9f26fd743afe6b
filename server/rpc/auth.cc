#include "server/rpc/auth.h"

#include <openssl/sha.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvbank::rpc {

namespace {

std::string Digest(absl::string_view token) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d);
  return std::string(reinterpret_cast<const char*>(d), sizeof(d));
}

}  // namespace

Authenticator Authenticator::Disabled() { return Authenticator(); }

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str());
}

absl::StatusOr<Authenticator> Authenticator::FromText(const std::string& text) {
  Authenticator a;
  a.enabled_ = true;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens file line ", line_no, ": expected '<token> <tenant> [admin]'"));
    }
    TenantPolicy p;
    p.tenant = std::string(f[1]);
    for (size_t i = 2; i < f.size(); ++i) {
      absl::string_view v = f[i];
      if (v == "admin") {
        p.admin = true;
      } else if (absl::ConsumePrefix(&v, "max_sequences=")) {
        if (!absl::SimpleAtoi(v, &p.max_sequences) || p.max_sequences == 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tokens file line ", line_no, ": max_sequences must be a positive integer"));
        }
      } else if (absl::ConsumePrefix(&v, "max_blocks_fraction=")) {
        if (!absl::SimpleAtod(v, &p.max_blocks_fraction) || p.max_blocks_fraction < 0 ||
            p.max_blocks_fraction > 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tokens file line ", line_no, ": max_blocks_fraction must be in [0, 1]"));
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("tokens file line ", line_no, ": unknown field '", f[i], "'"));
      }
    }
    if (!a.by_token_digest_.emplace(Digest(f[0]), p).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens file line ", line_no, ": token listed twice"));
    }
  }
  if (a.by_token_digest_.empty()) {
    return absl::InvalidArgumentError("tokens file lists no token");
  }
  return a;
}

absl::StatusOr<Caller> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (!enabled_) return Caller{"", true};
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return FromAuthorization(std::nullopt);
  return FromAuthorization(absl::string_view(it->second.data(), it->second.size()));
}

absl::StatusOr<Caller> Authenticator::FromAuthorization(
    std::optional<absl::string_view> authorization) const {
  if (!enabled_) return Caller{"", true};
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  absl::string_view value = *authorization;
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError("authorization metadata is not 'Bearer <token>'");
  }
  auto p = by_token_digest_.find(Digest(value));
  if (p == by_token_digest_.end()) return absl::UnauthenticatedError("unknown bearer token");
  return Caller{p->second.tenant, p->second.admin};
}

std::vector<std::string> Authenticator::Tenants() const {
  if (!enabled_) return {""};
  std::vector<std::string> out;
  for (const auto& [digest, p] : by_token_digest_) out.push_back(p.tenant);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

uint64_t Authenticator::DefaultMaxSequences(uint64_t model_max_sequences, size_t tenants) {
  if (tenants < 2) return 0;
  return std::max<uint64_t>(1, model_max_sequences / tenants);
}

void Authenticator::ApplyQuotas(SequenceStore& model) const {
  // One entry per tenant (several tokens may share one): the largest limits its lines set.
  absl::flat_hash_map<std::string, TenantPolicy> tenants;
  for (const auto& [digest, p] : by_token_digest_) {
    TenantPolicy& t = tenants[p.tenant];
    t.max_blocks_fraction = std::max(t.max_blocks_fraction, p.max_blocks_fraction);
    t.max_sequences = std::max(t.max_sequences, p.max_sequences);
  }
  const uint64_t share = DefaultMaxSequences(model.options().max_sequences, tenants.size());
  for (const auto& [name, p] : tenants) {
    TenantLimits limits;
    if (p.max_blocks_fraction > 0) {
      const double blocks = p.max_blocks_fraction * double(model.pool().num_blocks());
      limits.max_blocks = std::max<uint64_t>(1, static_cast<uint64_t>(blocks));
    }
    limits.max_sequences = p.max_sequences > 0 ? p.max_sequences : share;
    model.tenants().SetLimits(name, limits);
  }
}

}  // namespace kvbank::rpc
