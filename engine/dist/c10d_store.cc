// libucp_c10d_store.so: internal::Store on LibTorch's c10d TCPStore (the
// only file of engine/dist that includes a torch header).

#include <c10/util/Exception.h>

#include <chrono>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "engine/dist/store.h"

namespace ucp::dist::internal {
namespace {

std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string Text(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

// c10d's errors without their backtrace.
template <typename F>
auto Translate(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

class C10dStore : public Store {
 public:
  C10dStore(const char* host, uint16_t port, bool server, int64_t timeout_ms) {
    c10d::TCPStoreOptions o;
    o.port = port;
    o.isServer = server;
    o.waitWorkers = false;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    store_ = Translate(
        [&] { return std::make_unique<c10d::TCPStore>(std::string(host), o); });
  }
  void Set(const std::string& key, const std::string& value) override {
    Translate([&] { store_->set(key, Bytes(value)); });
  }
  std::string Get(const std::string& key) override {
    return Translate([&] { return Text(store_->get(key)); });
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    return Translate([&] { return store_->add(key, delta); });
  }
  bool Check(const std::string& key) override {
    return Translate([&] { return store_->check({key}); });
  }
  std::string SetIfAbsent(const std::string& key,
                          const std::string& desired) override {
    return Translate(
        [&] { return Text(store_->compareSet(key, {}, Bytes(desired))); });
  }

 private:
  std::unique_ptr<c10d::TCPStore> store_;
};

}  // namespace
}  // namespace ucp::dist::internal

extern "C" ucp::dist::internal::Store* UcpMakeC10dStore(const char* host,
                                                        uint16_t port,
                                                        bool server,
                                                        int64_t timeout_ms) {
  return new ucp::dist::internal::C10dStore(host, port, server, timeout_ms);
}
