// A second, independent oracle for the archives TorchWriter produces:
// LibTorch's own reader (caffe2::serialize::PyTorchStreamReader, miniz) must
// list the same records at the same offsets with the same bytes. The only
// translation unit of the repository that includes a LibTorch header.

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>

#include <cstring>

#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"

namespace ucp::torchfile {
namespace {

// Compares every record as LibTorch and ZipReader see them.
void ExpectLibTorchAgrees(const std::filesystem::path& path) {
  SCOPED_TRACE(path.string());
  ZipReader ours = ZipReader::Open(path);
  const std::string prefix = ours.entries().front().name.substr(
      0, ours.entries().front().name.find('/') + 1);
  try {
    caffe2::serialize::PyTorchStreamReader reader(path.string());
    EXPECT_EQ(reader.version(), 3u);
    std::vector<std::string> names = reader.getAllRecords();
    ASSERT_EQ(names.size(), ours.entries().size());
    for (size_t i = 0; i < names.size(); ++i) {
      const ZipEntry& e = ours.entries()[i];
      EXPECT_EQ(prefix + names[i], e.name);
      ASSERT_TRUE(reader.hasRecord(names[i]));
      EXPECT_EQ(reader.getRecordOffset(names[i]), ours.DataOffset(e));
      auto [data, size] = reader.getRecord(names[i]);
      ASSERT_EQ(size, e.uncompressed_size);
      const std::string mine = ours.ReadRecord(e);
      EXPECT_TRUE(size == 0 || std::memcmp(data.get(), mine.data(), size) == 0)
          << names[i];
    }
  } catch (const c10::Error& e) {
    ADD_FAILURE() << "LibTorch rejects " << path << ": "
                  << e.what_without_backtrace();
  }
}

TEST(LibTorchOracleTest, ReadsFilesWrittenFromScratch) {
  testutil::TempDir dir;
  for (bool zip64 : {false, true}) {
    const std::filesystem::path path = dir / (zip64 ? "z64.pt" : "plain.pt");
    TorchWriterOptions options;
    options.zip.force_zip64 = zip64;
    TorchWriter w(path, options);
    pickle::Arena& a = w.arena();
    std::vector<pickle::Value*> tensors;
    std::vector<pickle::Value*> items;
    for (int i = 0; i < 12; ++i) {
      pickle::Value* t =
          w.NewTensor({i % 2 ? DType::kBFloat16 : DType::kFloat32, {i, 3}});
      tensors.push_back(t);
      items.push_back(t);
    }
    w.Begin(a.List(items));
    for (pickle::Value* t : tensors) {
      std::string bytes(w.TensorBytes(t), '\0');
      for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<char>(k);
      w.WriteTensorData(t, 0, std::as_bytes(std::span<const char>(bytes)));
    }
    w.Commit();
    ExpectLibTorchAgrees(path);
  }
}

TEST(LibTorchOracleTest, ReadsCompactCopiesOfTheFixtures) {
  testutil::TempDir dir;
  int n = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(testutil::TestDataDir() / "torch")) {
    if (entry.path().extension() != ".pt") continue;
    const std::filesystem::path out = dir.path() / entry.path().filename();
    WriteCompactCopy(TorchFile::Open(entry.path()), out);
    ExpectLibTorchAgrees(out);
    ++n;
  }
  EXPECT_GE(n, 15);
}

}  // namespace
}  // namespace ucp::torchfile
