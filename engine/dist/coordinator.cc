#include "engine/dist/coordinator.h"

#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "engine/dist/store.h"

namespace ucp::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The c10d store module's factory, loaded once: UCP_C10D_STORE if set, else
// the module beside the running binary, else where the build put it.
internal::MakeStoreFn LoadStoreModule() {
  static std::mutex mu;
  static internal::MakeStoreFn fn = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (fn != nullptr) return fn;
  std::vector<std::string> candidates;
  if (const char* v = std::getenv("UCP_C10D_STORE")) candidates.push_back(v);
  char exe[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    dir = dir.substr(0, dir.rfind('/') + 1);
    candidates.push_back(dir + internal::kStoreModule);
  }
#ifdef UCP_C10D_STORE_PATH
  candidates.push_back(UCP_C10D_STORE_PATH);
#endif
  std::string errors;
  for (const std::string& path : candidates) {
    // Lazy binding: LibTorch's tables resolved as used (0.4 s instead of
    // 1 s to load it).
    void* handle = ::dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (handle == nullptr) {
      errors += StrCat(errors.empty() ? "" : "; ", ::dlerror());
      continue;
    }
    fn = reinterpret_cast<internal::MakeStoreFn>(
        ::dlsym(handle, internal::kMakeStoreSymbol));
    if (fn != nullptr) return fn;
    errors += StrCat(errors.empty() ? "" : "; ", path, ": no ",
                     internal::kMakeStoreSymbol);
  }
  throw IoError("cannot load ", internal::kStoreModule,
                " (LibTorch's c10d TCPStore, which a job of several "
                "processes needs; UCP_C10D_STORE names it): ",
                errors);
}

// Seconds from an environment variable, or `fallback`.
milliseconds Seconds(const char* name, milliseconds fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  const std::string text(v);
  double s = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, s);
  if (text.empty() || ec != std::errc() || p != end || !(s > 0)) {
    throw UsageError("environment: ", name, "='", text,
                     "' is not a positive number of seconds");
  }
  return milliseconds(static_cast<int64_t>(s * 1000));
}

// The error key's value: "<exit code>\t<kind>\t<rank>\t<message>".
RemoteError DecodeError(const std::string& v) {
  const size_t a = v.find('\t');
  const size_t b = a == std::string::npos ? a : v.find('\t', a + 1);
  const size_t c = b == std::string::npos ? b : v.find('\t', b + 1);
  if (c == std::string::npos) return RemoteError("error", 1, v);
  int code = 1;
  std::from_chars(v.data(), v.data() + a, code);
  return RemoteError(v.substr(a + 1, b - a - 1), code,
                     StrCat("process ", v.substr(b + 1, c - b - 1),
                            " failed: ", v.substr(c + 1)));
}

void DefaultAbort(const Error& e) {
  std::string line = e.what();
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::fprintf(stderr, "ucp: %s: %s\n", e.kind(), line.c_str());
  std::fflush(stderr);
  ::_exit(e.ExitCode());
}

// Waits (polling every 20 ms, at most `timeout`) until host:port accepts a
// TCP connection: c10d's client retries a refused connection only once a
// second, which a job whose rank 0 starts a little later would pay.
void WaitForListener(const std::string& host, uint16_t port,
                     milliseconds timeout) {
  const Clock::time_point until = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  while (Clock::now() < until) {
    addrinfo* found = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints,
                      &found) == 0) {
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        const bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        ::close(fd);
        if (ok) {
          ::freeaddrinfo(found);
          return;
        }
      }
      ::freeaddrinfo(found);
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  // c10d's own attempt then reports the failure.
}

}  // namespace

RemoteError::RemoteError(std::string kind, int code, std::string message)
    : Error(std::move(message)), kind_(std::move(kind)), code_(code) {}

CoordinatorOptions CoordinatorOptions::FromEnvironment() {
  CoordinatorOptions o;
  o.timeout = Seconds("UCP_DIST_TIMEOUT", o.timeout);
  o.connect_timeout = Seconds("UCP_DIST_CONNECT_TIMEOUT", o.connect_timeout);
  o.dead_after = Seconds("UCP_DIST_DEAD_AFTER", o.dead_after);
  o.heartbeat = std::min(o.heartbeat, o.dead_after / 4);
  return o;
}

struct Coordinator::Impl {
  Job job;
  std::string prefix;
  CoordinatorOptions options;
  std::unique_ptr<internal::Store> store;  // the main thread's client
  std::unique_ptr<internal::Store> beats;  // the heartbeat thread's client
  std::thread beater;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::atomic<bool> waiting{false};
  std::atomic<bool> failed{false};  // this process reported its failure
  std::atomic<int64_t> messages{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<int64_t> polls{0};
  // This process's progress (SetProgress) and what was last published.
  std::mutex progress_mu;
  std::string progress_label;
  uint64_t progress_done = 0, progress_total = 0;
  bool progress_set = false;
  std::string progress_sent;
  ProgressSink progress_sink;
  Clock::time_point progress_read{};
  // Rank 0: the others' last progress ("done total label").
  std::vector<std::string> progress_of;
  // Each other process's heartbeat count and when it last changed.
  std::vector<std::pair<int64_t, Clock::time_point>> peers;
  Clock::time_point last_peer_check{};

  std::string Key(std::string_view what) const { return StrCat(prefix, what); }
  std::string Where() const {
    return StrCat(job.store_host, ":", job.store_port);
  }

  // Runs one store call, translating LibTorch's failures.
  template <typename F>
  auto Call(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw IoError("lost the coordination store at ", Where(), " (",
                    job.Describe(), "): ", e.what());
    }
  }

  void Count(std::string_view key, size_t value_bytes) {
    ++messages;
    bytes += key.size() + value_bytes;
  }

  void Set(const std::string& key, std::string_view value) {
    Count(key, value.size());
    Call([&] { store->Set(key, std::string(value)); });
  }
  std::string Get(const std::string& key) {
    std::string v = Call([&] { return store->Get(key); });
    Count(key, v.size());
    return v;
  }
  bool Check(const std::string& key) {
    ++polls;
    return Call([&] { return store->Check(key); });
  }
  int64_t Peek(const std::string& key) {
    ++polls;
    return Call([&] { return store->Add(key, 0); });
  }

  // Throws the first error if one was reported.
  void CheckError() {
    if (!Check(Key("error"))) return;
    throw DecodeError(Get(Key("error")));
  }

  // Throws IoError naming a process whose heartbeat stalled.
  void CheckPeers() {
    const Clock::time_point now = Clock::now();
    if (now - last_peer_check < options.heartbeat) return;
    last_peer_check = now;
    for (int r = 0; r < job.world; ++r) {
      if (r == job.rank) continue;
      const int64_t beat = Peek(Key(StrCat("beat/", r)));
      auto& [seen, when] = peers[static_cast<size_t>(r)];
      if (beat != seen) {
        seen = beat;
        when = now;
      } else if (beat == 0 && now - when > options.connect_timeout) {
        throw IoError("process ", r, " of ", job.world, " did not join within ",
                      options.connect_timeout.count() / 1000.0,
                      " s (UCP_DIST_CONNECT_TIMEOUT)");
      } else if (beat != 0 && now - when > options.dead_after) {
        throw IoError(
            "process ", r, " of ", job.world,
            " stopped responding (no heartbeat for ",
            std::chrono::duration_cast<milliseconds>(now - when).count() /
                1000.0,
            " s: killed, or its host is gone)");
      }
    }
  }

  // Polls until ready() (which may call the store), checking the error key
  // and the peers. Throws RemoteError, IoError (lost store, stalled peer,
  // timeout).
  template <typename F>
  void WaitFor(std::string_view what, F&& ready) {
    waiting = true;
    struct Reset {
      std::atomic<bool>& w;
      ~Reset() { w = false; }
    } reset{waiting};
    const Clock::time_point start = Clock::now();
    milliseconds pause(2);
    for (;;) {
      try {
        if (ready()) return;
        CheckError();
        CheckPeers();
      } catch (...) {
        // The main thread fails with it: the heartbeat thread must not end
        // the process meanwhile (it leaves the job on its way out).
        failed = true;
        throw;
      }
      if (Clock::now() - start > options.timeout) {
        failed = true;
        throw IoError(job.Describe(), ": timed out after ",
                      options.timeout.count() / 1000.0, " s waiting for ", what,
                      " (UCP_DIST_TIMEOUT)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, milliseconds(100));
    }
  }

  // The heartbeat's way out of the job (the destructor's, which the
  // abort skips): counted as left; rank 0 waits a little for the others.
  void LeaveBeforeAbort() noexcept {
    try {
      beats->Add(Key("left"), 1);
      if (job.rank != 0) return;
      const Clock::time_point until =
          Clock::now() +
          std::min<milliseconds>(options.dead_after, std::chrono::seconds(10));
      while (beats->Add(Key("left"), 0) < job.world && Clock::now() < until)
        std::this_thread::sleep_for(milliseconds(20));
    } catch (const std::exception&) {
      // The store is gone: nothing to tell.
    }
  }

  // With the beat: this process's progress when it changed; rank 0 reads
  // the others' (once a second) and passes the sums to the sink.
  void BeatProgress(internal::Store& st, bool read_now) {
    std::string mine;
    ProgressSink sink;
    std::string label;
    uint64_t done = 0, total = 0;
    {
      std::lock_guard<std::mutex> lock(progress_mu);
      if (!progress_set) return;
      mine = StrCat(progress_done, " ", progress_total, " ", progress_label);
      sink = progress_sink;
      label = progress_label;
      done = progress_done;
      total = progress_total;
    }
    if (job.rank != 0) {
      if (mine == progress_sent) return;
      ++polls;
      st.Set(Key(StrCat("progress/", job.rank)), mine);
      progress_sent = mine;
      return;
    }
    if (!sink) return;
    const Clock::time_point now = Clock::now();
    if (read_now || now - progress_read >= std::chrono::seconds(1)) {
      progress_read = now;
      progress_of.resize(static_cast<size_t>(job.world));
      for (int r = 1; r < job.world; ++r) {
        const std::string key = Key(StrCat("progress/", r));
        ++polls;
        if (st.Check(key)) progress_of[static_cast<size_t>(r)] = st.Get(key);
      }
    }
    int reporting = 1;
    for (int r = 1; r < static_cast<int>(progress_of.size()); ++r) {
      const std::string& p = progress_of[static_cast<size_t>(r)];
      unsigned long long d = 0, t = 0;  // NOLINT(runtime/int): sscanf
      if (std::sscanf(p.c_str(), "%llu %llu", &d, &t) != 2) continue;
      done += d;
      total += t;
      ++reporting;
    }
    sink(label, done, total, reporting);
  }

  void Beat() {
    const std::string beat = Key(StrCat("beat/", job.rank));
    const std::string error = Key("error");
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      std::optional<RemoteError> remote;
      std::optional<IoError> lost;
      lock.unlock();
      try {
        beats->Add(beat, 1);
        ++polls;
        if (beats->Check(error)) remote = DecodeError(beats->Get(error));
        if (!remote) BeatProgress(*beats, false);
      } catch (const std::exception& e) {
        lost.emplace("lost the coordination store at ", Where(), " (",
                     job.Describe(), "): ", e.what());
      }
      lock.lock();
      if (stop) break;
      if ((remote || lost) && !waiting && !failed) {
        // The main thread is busy (writing): end the process here, leaving
        // the job first (rank 0, whose exit takes the store, lets the others
        // read the first error).
        if (remote) {
          LeaveBeforeAbort();
          options.abort(*remote);
        }
        if (lost) options.abort(*lost);
      }
      if (lost) break;
      cv.wait_for(lock, options.heartbeat);
    }
  }
};

Coordinator::Coordinator(Job job, std::string_view scope,
                         CoordinatorOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.job = std::move(job);
  m.options = std::move(options);
  if (!m.options.abort) m.options.abort = DefaultAbort;
  m.prefix = StrCat("ucp/", m.job.run_id, "/", scope, "/");
  m.peers.assign(static_cast<size_t>(m.job.world), {0, Clock::now()});
  const internal::MakeStoreFn make = LoadStoreModule();
  auto connect = [&](bool server) {
    try {
      return std::unique_ptr<internal::Store>(
          make(m.job.store_host.c_str(), m.job.store_port, server,
               m.options.connect_timeout.count()));
    } catch (const std::exception& e) {
      if (server) {
        throw IoError(
            "cannot host the coordination store on port ", m.job.store_port,
            " (", m.job.Describe(),
            "; another program's port? set UCP_STORE_PORT): ", e.what());
      }
      throw IoError("cannot reach the coordination store at ", m.Where(), " (",
                    m.job.Describe(), ") within ",
                    m.options.connect_timeout.count() / 1000.0,
                    " s (UCP_DIST_CONNECT_TIMEOUT): ", e.what());
    }
  };
  if (m.job.rank != 0)
    WaitForListener(m.job.store_host, m.job.store_port,
                    m.options.connect_timeout);
  m.store = connect(m.job.rank == 0);
  m.beats = connect(false);
  m.Count(m.Key("joined"), 0);
  m.Call([&] { return m.store->Add(m.Key("joined"), 1); });
  m.beater = std::thread([&m] { m.Beat(); });
}

Coordinator::~Coordinator() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stop = true;
  }
  m.cv.notify_all();
  m.beater.join();
  try {
    // The last progress: published before leaving; rank 0 reads it once
    // every process left.
    if (m.job.rank != 0) m.BeatProgress(*m.store, false);
    m.store->Add(m.Key("left"), 1);
    if (m.job.rank == 0) {
      // Others read the store's last word (an error, the commit) before it
      // goes: wait for them a little.
      const Clock::time_point until =
          Clock::now() + std::min<milliseconds>(m.options.dead_after,
                                                std::chrono::seconds(10));
      while (m.store->Add(m.Key("left"), 0) < m.job.world &&
             Clock::now() < until)
        std::this_thread::sleep_for(milliseconds(20));
      m.BeatProgress(*m.store, true);
    }
  } catch (const std::exception&) {
    // The store is gone: nothing to tell.
  }
  m.beats.reset();
  m.store.reset();
}

const Job& Coordinator::job() const noexcept { return impl_->job; }

void Coordinator::Barrier(std::string_view name) {
  Impl& m = *impl_;
  const std::string key = m.Key(StrCat("barrier/", name));
  m.Count(key, 8);
  m.Call([&] { return m.store->Add(key, 1); });
  m.WaitFor(StrCat("every process at ", name),
            [&] { return m.Peek(key) >= m.job.world; });
}

void Coordinator::Publish(std::string_view name, std::string_view value) {
  impl_->Set(impl_->Key(StrCat("value/", name)), value);
}

std::string Coordinator::Fetch(std::string_view name) {
  Impl& m = *impl_;
  const std::string key = m.Key(StrCat("value/", name));
  m.WaitFor(StrCat("rank 0's ", name), [&] { return m.Check(key); });
  return m.Get(key);
}

std::vector<std::string> Coordinator::Gather(std::string_view name,
                                             std::string_view payload) {
  Impl& m = *impl_;
  const std::string base = m.Key(StrCat("gather/", name, "/"));
  if (m.job.rank != 0) {
    m.Set(StrCat(base, m.job.rank), payload);
    return {};
  }
  std::vector<std::string> out(static_cast<size_t>(m.job.world));
  out[0] = std::string(payload);
  int next = 1;
  m.WaitFor(StrCat("every process's ", name), [&] {
    while (next < m.job.world && m.Check(StrCat(base, next))) {
      out[static_cast<size_t>(next)] = m.Get(StrCat(base, next));
      ++next;
    }
    return next == m.job.world;
  });
  return out;
}

void Coordinator::ReportError(const Error& error) noexcept {
  if (dynamic_cast<const RemoteError*>(&error) != nullptr) {
    impl_->failed = true;
    return;
  }
  ReportError(error.kind(), error.ExitCode(), error.what());
}

void Coordinator::ReportError(std::string_view kind, int code,
                              std::string_view message) noexcept {
  Impl& m = *impl_;
  m.failed = true;
  try {
    const std::string key = m.Key("error");
    const std::string value =
        StrCat(code, "\t", kind, "\t", m.job.rank, "\t", message);
    m.Count(key, value.size());
    m.store->SetIfAbsent(key, value);
  } catch (const std::exception&) {
    // The store is gone: the others learn it themselves.
  }
}

void Coordinator::SetProgress(std::string_view label, uint64_t done,
                              uint64_t total) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.progress_mu);
  m.progress_label = std::string(label);
  m.progress_done = done;
  m.progress_total = total;
  m.progress_set = true;
}

void Coordinator::SetProgressSink(ProgressSink sink) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.progress_mu);
  m.progress_sink = std::move(sink);
}

StoreStats Coordinator::stats() const {
  return StoreStats{impl_->messages.load(), impl_->bytes.load(),
                    impl_->polls.load()};
}

}  // namespace ucp::dist
