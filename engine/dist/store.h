#pragma once
// The key-value store the Coordinator talks to (internal): LibTorch's c10d
// TCPStore, in a module of its own (libucp_c10d_store.so, c10d_store.cc)
// that the Coordinator loads only when a launcher started a job, so that a
// ucp run without one does not load LibTorch (half a second per start).
// Calls throw std::runtime_error with c10d's message (no backtrace).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ucp::dist::internal {

class Store {
 public:
  virtual ~Store() = default;
  virtual void Set(const std::string& key, const std::string& value) = 0;
  virtual std::string Get(const std::string& key) = 0;
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
  virtual bool Check(const std::string& key) = 0;
  /// Sets `key` to `desired` if absent; returns its value after the call.
  virtual std::string SetIfAbsent(const std::string& key,
                                  const std::string& desired) = 0;
};

/// The module's one entry point: hosts the server (and connects to it) when
/// `server`, else connects to host:port, retrying for `timeout_ms`.
using MakeStoreFn = Store* (*)(const char* host, uint16_t port, bool server,
                               int64_t timeout_ms);
inline constexpr const char* kMakeStoreSymbol = "UcpMakeC10dStore";
inline constexpr const char* kStoreModule = "libucp_c10d_store.so";

}  // namespace ucp::dist::internal
