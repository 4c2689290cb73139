// Opt-in throughput figures (UCP_PERF_TESTS=1): TorchFile reads and
// TorchWriter writes against plain pread/pwrite of the same bytes. Prints
// ratios; not a pass/fail criterion (the machine is shared and noisy).

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "engine/core/aligned_buffer.h"
#include "engine/core/file.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"

namespace ucp::torchfile {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

TEST(TorchFilePerfTest, ReadWriteVersusPlainFileIo) {
  const char* flag = std::getenv("UCP_PERF_TESTS");
  if (flag == nullptr || std::string(flag) != "1") {
    GTEST_SKIP() << "set UCP_PERF_TESTS=1 to measure";
  }
  constexpr int kTensors = 8;
  constexpr size_t kTensorBytes = size_t{128} << 20;  // 1 GiB in all
  constexpr double kTotal = double(kTensors) * kTensorBytes;
  testutil::TempDir dir;
  AlignedBuffer src(kTensorBytes);
  for (size_t i = 0; i < kTensorBytes; i += 8) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(src.data() + i, &v, 8);
  }
  for (int round = 0; round < 2; ++round) {
    // Plain write: the same bytes with pwrite into a reserved temp file.
    ::sync();  // the same writeback state before every timed section
    auto t0 = std::chrono::steady_clock::now();
    {
      OutputFile out(dir / "plain.bin");
      out.file().Allocate(uint64_t{kTensors} * kTensorBytes);
      for (int k = 0; k < kTensors; ++k) {
        out.file().WriteExact(src.data(), kTensorBytes,
                              uint64_t(k) * kTensorBytes);
      }
      out.Commit();
    }
    const double plain_write = kTotal / Seconds(t0) / 1e9;

    ::sync();
    t0 = std::chrono::steady_clock::now();
    {
      TorchWriter w(dir / "ours.pt");
      std::vector<pickle::Value*> items;
      for (int k = 0; k < kTensors; ++k) {
        items.push_back(
            w.NewTensor({DType::kFloat32, {int64_t(kTensorBytes / 4)}}));
      }
      w.Begin(w.arena().List(items));
      for (pickle::Value* t : items) w.WriteTensorData(t, 0, src.span());
      w.Commit();
    }
    const double ours_write = kTotal / Seconds(t0) / 1e9;

    // Reads (page cache warm after the writes).
    AlignedBuffer dst(kTensorBytes);
    ::sync();
    t0 = std::chrono::steady_clock::now();
    {
      File f = File::OpenRead(dir / "plain.bin");
      for (int k = 0; k < kTensors; ++k) {
        f.ReadExact(dst.data(), kTensorBytes, uint64_t(k) * kTensorBytes);
      }
    }
    const double plain_read = kTotal / Seconds(t0) / 1e9;
    ::sync();
    t0 = std::chrono::steady_clock::now();
    {
      TorchFile f = TorchFile::Open(dir / "ours.pt");
      for (const TensorInfo& t : f.tensors()) f.ReadTensor(t, dst.span());
    }
    const double ours_read = kTotal / Seconds(t0) / 1e9;
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), kTensorBytes), 0);

    // Copy: plain (pread + pwrite) versus TorchFile -> TorchWriter.
    ::sync();
    t0 = std::chrono::steady_clock::now();
    {
      File in = File::OpenRead(dir / "plain.bin");
      OutputFile out(dir / "plain_copy.bin");
      out.file().Allocate(uint64_t{kTensors} * kTensorBytes);
      for (int k = 0; k < kTensors; ++k) {
        in.ReadExact(dst.data(), kTensorBytes, uint64_t(k) * kTensorBytes);
        out.file().WriteExact(dst.data(), kTensorBytes,
                              uint64_t(k) * kTensorBytes);
      }
      out.Commit();
    }
    const double plain_copy = kTotal / Seconds(t0) / 1e9;
    ::sync();
    t0 = std::chrono::steady_clock::now();
    WriteCompactCopy(TorchFile::Open(dir / "ours.pt"), dir / "ours_copy.pt");
    const double ours_copy = kTotal / Seconds(t0) / 1e9;

    std::printf(
        "round %d (1 GiB, 8 x 128 MiB fp32, hot cache, fsync included):\n"
        "  write: plain pwrite %.2f GB/s, TorchWriter %.2f GB/s (ratio %.2f)\n"
        "  read:  plain pread  %.2f GB/s, TorchFile   %.2f GB/s (ratio %.2f)\n"
        "  copy:  plain        %.2f GB/s, ours        %.2f GB/s (ratio %.2f)\n",
        round, plain_write, ours_write, ours_write / plain_write, plain_read,
        ours_read, ours_read / plain_read, plain_copy, ours_copy,
        ours_copy / plain_copy);
    std::filesystem::remove(dir / "plain_copy.bin");
    std::filesystem::remove(dir / "ours_copy.pt");
  }
}

}  // namespace
}  // namespace ucp::torchfile
