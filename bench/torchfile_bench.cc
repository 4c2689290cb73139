// Benchmark of engine/torchfile against plain file I/O of the same bytes.
// Each sub-command does one timed operation and prints one JSON line with
// bytes, seconds, GB/s and the process's peak RSS; bench/run.sh drives it.
//
//   torchfile_bench gen FILE MIB          write a ~MIB MiB torch.save file (not
//   timed) torchfile_bench plain-read FILE       pread every byte of FILE
//   torchfile_bench read FILE             TorchFile::Open + ReadTensor of every
//   tensor torchfile_bench plain-write DST MIB   pwrite MIB MiB from memory,
//   fsync torchfile_bench write SRC DST         TorchWriter: write SRC's
//   tensors (held in
//                                         memory, loaded untimed) to DST, fsync
//   torchfile_bench plain-copy SRC DST    pread + pwrite SRC to DST, fsync
//   torchfile_bench copy SRC DST          TorchFile read + TorchWriter write,
//   fsync

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"

namespace {

using namespace ucp;
using Clock = std::chrono::steady_clock;
constexpr size_t kChunk = 16u << 20;

double MaxRssMiB() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

void Report(const char* op, uint64_t bytes, Clock::time_point start) {
  double s = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf(
      "{\"op\": \"%s\", \"bytes\": %llu, \"seconds\": %.4f, \"gbps\": %.3f, "
      "\"max_rss_mib\": %.1f}\n",
      op, static_cast<unsigned long long>(bytes), s, bytes / s / 1e9,
      MaxRssMiB());
}

void Gen(const std::string& path, uint64_t mib) {
  torchfile::TorchWriter w(path);
  pickle::Arena& a = w.arena();
  pickle::Value* model =
      a.Object(pickle::ObjectOp::kReduce,
               a.Global("collections", "OrderedDict"), a.Tuple({}));
  std::vector<std::pair<pickle::Value*, std::vector<std::byte>>> data;
  std::mt19937_64 rng(1234);
  uint64_t total = 0, target = mib << 20;
  for (int i = 0; total < target; ++i) {
    DType dt = i % 3 == 0 ? DType::kFloat32 : DType::kBFloat16;
    int64_t rows = 1024 + static_cast<int64_t>(rng() % 2048);
    Shape shape = {rows, 4096};
    pickle::Value* t = w.NewTensor({dt, shape});
    model->entries.emplace_back(
        a.Str("layers." + std::to_string(i) + ".weight"), t);
    total += static_cast<uint64_t>(rows) * 4096 * ElementSize(dt);
  }
  pickle::Value* root =
      a.Dict({{a.Str("model"), model}, {a.Str("iteration"), a.Int(100)}});
  w.Begin(root);
  for (const pickle::Value* t : w.planned_tensors()) {
    w.WriteTensor(t, [&](uint64_t off, std::span<std::byte> chunk) {
      uint64_t x = off * 0x9E3779B97F4A7C15ull + 1;
      for (size_t k = 0; k + 8 <= chunk.size(); k += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::memcpy(chunk.data() + k, &x, 8);
      }
    });
  }
  w.Commit();
}

void PlainRead(const std::string& path) {
  auto start = Clock::now();
  File f = File::OpenRead(path);
  uint64_t size = f.Size();
  AlignedBuffer buf(kChunk);
  for (uint64_t off = 0; off < size; off += kChunk) {
    f.ReadExact(buf.data(), std::min<uint64_t>(kChunk, size - off), off);
  }
  Report("plain-read", size, start);
}

void Read(const std::string& path) {
  auto start = Clock::now();
  torchfile::TorchFile tf = torchfile::TorchFile::Open(path);
  uint64_t bytes = 0, biggest = 0;
  for (const auto& t : tf.tensors()) biggest = std::max(biggest, t.nbytes);
  AlignedBuffer buf(biggest);
  for (const auto& t : tf.tensors()) {
    tf.ReadTensor(t, std::span<std::byte>(buf.data(), t.nbytes));
    bytes += t.nbytes;
  }
  Report("read-whole", bytes, start);
}

void ReadChunked(const std::string& path) {
  auto start = Clock::now();
  torchfile::TorchFile tf = torchfile::TorchFile::Open(path);
  uint64_t bytes = 0;
  AlignedBuffer buf(kChunk);
  for (const auto& t : tf.tensors()) {
    const int64_t per = static_cast<int64_t>(kChunk / ElementSize(t.dtype));
    for (int64_t e = 0; e < t.numel; e += per) {
      int64_t n = std::min(per, t.numel - e);
      tf.ReadTensorRange(
          t, e, n, std::span<std::byte>(buf.data(), n * ElementSize(t.dtype)));
    }
    bytes += t.nbytes;
  }
  Report("read", bytes, start);
}

void PlainWrite(const std::string& dst, uint64_t mib) {
  uint64_t size = mib << 20;
  AlignedBuffer src(size);
  std::memset(src.data(), 0x5A, size);
  auto start = Clock::now();
  OutputFile out(dst);
  out.file().Allocate(size);
  for (uint64_t off = 0; off < size; off += kChunk) {
    out.file().WriteExact(src.data() + off,
                          std::min<uint64_t>(kChunk, size - off), off);
  }
  out.Commit();
  Report("plain-write", size, start);
}

void Write(const std::string& src_path, const std::string& dst, int threads) {
  torchfile::TorchFile tf = torchfile::TorchFile::Open(src_path);
  std::vector<AlignedBuffer> data;
  for (const auto& t : tf.tensors()) {
    data.emplace_back(t.nbytes);
    tf.ReadTensor(t, data.back().span());
  }
  auto start = Clock::now();
  torchfile::TorchWriter w(dst);
  std::unordered_map<const pickle::Value*, pickle::Value*> swap;
  std::unordered_map<const pickle::Value*, const AlignedBuffer*> bytes_of;
  for (size_t i = 0; i < tf.tensors().size(); ++i) {
    pickle::Value* nt = w.NewTensorLike(tf.tensors()[i]);
    swap[tf.tensors()[i].node] = nt;
    bytes_of[nt] = &data[i];
  }
  pickle::Value* root = w.arena().Copy(tf.root(), [&](const pickle::Value* v) {
    auto it = swap.find(v);
    return it == swap.end() ? nullptr : it->second;
  });
  w.Begin(root);
  // Chunks dealt round-robin to `threads` writers, as ucp's executor does.
  struct Chunk {
    const pickle::Value* t;
    const std::byte* p;
    uint64_t off, n;
  };
  std::vector<Chunk> chunks;
  uint64_t total = 0;
  for (const pickle::Value* t : w.planned_tensors()) {
    const AlignedBuffer* b = bytes_of.at(t);
    for (uint64_t off = 0; off < b->size(); off += kChunk) {
      chunks.push_back({t, b->data() + off, off,
                        std::min<uint64_t>(kChunk, b->size() - off)});
    }
    total += b->size();
  }
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      for (size_t i = static_cast<size_t>(k); i < chunks.size();
           i += static_cast<size_t>(threads)) {
        const Chunk& c = chunks[i];
        w.WriteTensorData(c.t, c.off, std::span<const std::byte>(c.p, c.n));
      }
    });
  }
  for (auto& th : pool) th.join();
  w.Commit();
  Report(threads == 1 ? "write" : "write-parallel", total, start);
}

void PlainCopy(const std::string& src, const std::string& dst) {
  auto start = Clock::now();
  File in = File::OpenRead(src);
  uint64_t size = in.Size();
  OutputFile out(dst);
  out.file().Allocate(size);
  AlignedBuffer buf(kChunk);
  for (uint64_t off = 0; off < size; off += kChunk) {
    uint64_t n = std::min<uint64_t>(kChunk, size - off);
    in.ReadExact(buf.data(), n, off);
    out.file().WriteExact(buf.data(), n, off);
  }
  out.Commit();
  Report("plain-copy", size, start);
}

// Copies every regular file under SRC to the same relative path under DST.
void PlainCopyTree(const std::string& src, const std::string& dst) {
  namespace fs = std::filesystem;
  auto start = Clock::now();
  uint64_t total = 0;
  AlignedBuffer buf(kChunk);
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  for (const fs::path& f : files) {
    fs::path out = fs::path(dst) / fs::relative(f, src);
    fs::create_directories(out.parent_path());
    File in = File::OpenRead(f);
    uint64_t size = in.Size();
    OutputFile o(out);
    o.file().Allocate(size);
    for (uint64_t off = 0; off < size; off += kChunk) {
      uint64_t n = std::min<uint64_t>(kChunk, size - off);
      in.ReadExact(buf.data(), n, off);
      o.file().WriteExact(buf.data(), n, off);
    }
    o.Commit();
    total += size;
  }
  Report("plain-copy-tree", total, start);
}

void Copy(const std::string& src, const std::string& dst) {
  auto start = Clock::now();
  torchfile::TorchFile tf = torchfile::TorchFile::Open(src);
  uint64_t bytes = 0;
  for (const auto& t : tf.tensors()) bytes += t.nbytes;
  torchfile::WriteCompactCopy(tf, dst, {}, kChunk);
  Report("copy", bytes, start);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() == 3 && a[0] == "gen") {
      Gen(a[1], std::stoull(a[2]));
    } else if (a.size() == 2 && a[0] == "plain-read") {
      PlainRead(a[1]);
    } else if (a.size() == 2 && a[0] == "read") {
      ReadChunked(a[1]);
    } else if (a.size() == 2 && a[0] == "read-whole") {
      Read(a[1]);
    } else if (a.size() == 3 && a[0] == "plain-write") {
      PlainWrite(a[1], std::stoull(a[2]));
    } else if ((a.size() == 3 || a.size() == 4) && a[0] == "write") {
      Write(a[1], a[2], a.size() == 4 ? std::stoi(a[3]) : 1);
    } else if (a.size() == 3 && a[0] == "plain-copy") {
      PlainCopy(a[1], a[2]);
    } else if (a.size() == 3 && a[0] == "plain-copy-tree") {
      PlainCopyTree(a[1], a[2]);
    } else if (a.size() == 3 && a[0] == "copy") {
      Copy(a[1], a[2]);
    } else {
      std::fprintf(
          stderr,
          "usage: see the comment at the top of bench/torchfile_bench.cc\n");
      return 2;
    }
  } catch (const ucp::Error& e) {
    std::fprintf(stderr, "torchfile_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
