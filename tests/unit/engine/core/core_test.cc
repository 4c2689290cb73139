#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/core/aligned_buffer.h"
#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/core/progress.h"
#include "engine/core/strided.h"
#include "tests/testutil/testutil.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(ErrorTest, ContextIsPrependedOuterFirst) {
  try {
    try {
      throw FormatError("bad magic ", 42);
    } catch (Error& e) {
      e.AddContext("param ", "w");
      throw;
    }
  } catch (Error& e) {
    e.AddContext("rank file a.pt");
    EXPECT_STREQ(e.what(), "rank file a.pt > param w > bad magic 42");
    EXPECT_EQ(e.message(), "bad magic 42");
    EXPECT_EQ(e.ExitCode(), 3);
    EXPECT_STREQ(e.kind(), "format error");
  }
}

TEST(ErrorTest, ExitCodesDifferPerClass) {
  std::vector<int> codes = {FormatError("").ExitCode(),
                            LayoutError("").ExitCode(), IoError("").ExitCode(),
                            UsageError("").ExitCode(),
                            InternalError("").ExitCode()};
  std::sort(codes.begin(), codes.end());
  EXPECT_EQ(std::unique(codes.begin(), codes.end()), codes.end());
}

TEST(ErrorTest, CheckThrowsInternalError) {
  EXPECT_THAT([] { UCP_CHECK(1 + 1 == 3, "arith ", 7); },
              ThrowsMessage<InternalError>(HasSubstr("1 + 1 == 3 arith 7")));
  EXPECT_NO_THROW(UCP_CHECK(true));
}

TEST(DTypeTest, NamesRoundTripAndSizes) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    EXPECT_EQ(DTypeFromName(DTypeName(d)), d);
  }
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
  EXPECT_EQ(ElementSize(DType::kComplex128), 16u);
  EXPECT_EQ(DTypeFromName("torch.half"), DType::kFloat16);
  EXPECT_FALSE(DTypeFromName("qint8").has_value());
}

TEST(StridedTest, ExtentOfViews) {
  // base.view(4,6)[1:3, 2:5] -> offset 8, size (2,3), stride (6,1)
  auto r = ViewExtent(Shape{2, 3}, std::vector<int64_t>{6, 1}, 8);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->begin, 8);
  EXPECT_EQ(r->end, 8 + 6 + 2 + 1);
  EXPECT_FALSE(ViewExtent(Shape{0, 3}, std::vector<int64_t>{3, 1}, 0));
  auto scalar = ViewExtent(Shape{}, std::vector<int64_t>{}, 5);
  ASSERT_TRUE(scalar.has_value());
  EXPECT_EQ(scalar->end, 6);
  EXPECT_THROW(ViewExtent(Shape{2}, std::vector<int64_t>{-1}, 0), FormatError);
  EXPECT_THROW(ViewExtent(Shape{1LL << 62, 4}, std::vector<int64_t>{4, 1}, 0),
               FormatError);
}

TEST(StridedTest, GatherMatchesNaiveIndexing) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> storage(4096);
  std::iota(storage.begin(), storage.end(), 0);
  for (int iter = 0; iter < 300; ++iter) {
    int rank = static_cast<int>(rng() % 4);
    Shape shape(rank);
    std::vector<int64_t> stride(rank);
    for (int d = 0; d < rank; ++d) {
      shape[d] = static_cast<int64_t>(rng() % 5);
      stride[d] = static_cast<int64_t>(rng() % 7);
    }
    int64_t offset = static_cast<int64_t>(rng() % 16);
    auto extent = ViewExtent(shape, stride, offset);
    if (extent && extent->end > static_cast<int64_t>(storage.size())) continue;
    int64_t n = NumElements(shape);
    std::vector<int32_t> got(static_cast<size_t>(n));
    GatherStrided(reinterpret_cast<const std::byte*>(storage.data() + offset),
                  4, shape, stride, reinterpret_cast<std::byte*>(got.data()));
    // Naive: enumerate multi-indices in row-major order.
    std::vector<int64_t> idx(rank, 0);
    for (int64_t k = 0; k < n; ++k) {
      int64_t pos = offset;
      for (int d = 0; d < rank; ++d) pos += idx[d] * stride[d];
      ASSERT_EQ(got[k], storage[pos]) << "element " << k;
      for (int d = rank - 1; d >= 0; --d) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
  }
}

TEST(StridedTest, Contiguity) {
  EXPECT_TRUE(IsContiguous(Shape{2, 3}, std::vector<int64_t>{3, 1}));
  EXPECT_FALSE(IsContiguous(Shape{2, 3}, std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(IsContiguous(Shape{1, 3}, std::vector<int64_t>{99, 1}));
  EXPECT_EQ(ContiguousStrides(Shape{2, 3, 4}),
            (std::vector<int64_t>{12, 4, 1}));
}

TEST(FileTest, OutputFileAppearsOnlyOnCommit) {
  testutil::TempDir dir;
  auto final_path = dir / "out.bin";
  {
    OutputFile out(final_path);
    out.file().WriteExact("abc", 3, 0);
    EXPECT_FALSE(std::filesystem::exists(final_path));
  }
  EXPECT_FALSE(std::filesystem::exists(final_path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "temp file left behind";
  {
    OutputFile out(final_path);
    out.file().WriteExact("xyz", 3, 5);
    out.Commit();
  }
  std::string data = ReadSmallFile(final_path);
  EXPECT_EQ(data, std::string("\0\0\0\0\0xyz", 8));
}

TEST(FileTest, ShortReadIsFormatErrorNamingFile) {
  testutil::TempDir dir;
  testutil::WriteFile(dir / "f", "12345");
  File f = File::OpenRead(dir / "f");
  char buf[8];
  EXPECT_THAT([&] { f.ReadExact(buf, 8, 0); },
              ThrowsMessage<FormatError>(HasSubstr("unexpected end of file")));
  EXPECT_THAT([&] { File::OpenRead(dir / "missing"); },
              ThrowsMessage<IoError>(HasSubstr("missing")));
}

TEST(FileTest, OutputFileNamesAMissingFolder) {
  testutil::TempDir dir;
  EXPECT_THAT(
      [&] { OutputFile out(dir / "no" / "such" / "out.bin"); },
      ThrowsMessage<IoError>(testing::AllOf(
          HasSubstr("cannot write " + (dir / "no/such/out.bin").string()),
          HasSubstr("folder " + (dir / "no/such").string() + " does not exist"),
          testing::Not(HasSubstr("ucp-tmp")))));
  testutil::WriteFile(dir / "plain", "x");
  EXPECT_THAT([&] { OutputFile out(dir / "plain" / "out.bin"); },
              ThrowsMessage<IoError>(HasSubstr("is not a folder")));
  EXPECT_FALSE(std::filesystem::exists(dir / "no"));
}

TEST(FileTest, OpenReadRefusesWhatIsNotARegularFile) {
  testutil::TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  // Must not block waiting for a writer.
  EXPECT_THAT([&] { File::OpenRead(dir / "fifo"); },
              ThrowsMessage<IoError>(HasSubstr("not a regular file")));
  EXPECT_THAT([&] { File::OpenRead(dir.path()); },
              ThrowsMessage<IoError>(HasSubstr("is a directory")));
  testutil::WriteFile(dir / "f", "abc");
  File f = File::OpenRead(dir / "f");
  char buf[3];
  f.ReadExact(buf, 3, 0);  // the descriptor reads normally (blocking mode)
  EXPECT_EQ(std::string(buf, 3), "abc");
}

TEST(ProgressTest, DrawsOnlyWhenAskedAndErasesItselfOnFailure) {
  testing::internal::CaptureStderr();
  {
    Progress quiet("quiet", 100, "B", Progress::Mode::kNever);
    quiet.Add(50);
    quiet.Finish();
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");

  testing::internal::CaptureStderr();
  {
    Progress done("copy", 2048, "B", Progress::Mode::kAlways);
    done.Add(2048);
    done.Finish();
  }
  std::string out = testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr("copy: 2.0 KiB in "));
  EXPECT_EQ(out.back(), '\n');

  // Destroyed without Finish (the run failed): the bar is erased, and no
  // total that reads like success is printed before the error message.
  testing::internal::CaptureStderr();
  {
    Progress failed("copy", 2048, "B", Progress::Mode::kAlways);
    failed.Add(1024);
  }
  out = testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, testing::Not(HasSubstr(" in ")));
  EXPECT_THAT(out, testing::EndsWith("\r\033[K"));
}

TEST(ProgressTest, ObserverReceivesInsteadOfTheBar) {
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> calls;
  Progress::SetObserver(
      [&calls](const std::string& label, uint64_t done, uint64_t total) {
        calls.emplace_back(label, done, total);
      });
  testing::internal::CaptureStderr();
  {
    // Reported whatever the mode, and nothing drawn.
    Progress p("copy", 300, "B", Progress::Mode::kNever);
    p.Add(100);
    p.Add(200);
    p.Finish();
  }
  Progress::SetObserver(nullptr);
  {
    Progress after("later", 10, "B", Progress::Mode::kNever);
    after.Add(10);
    after.Finish();
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  ASSERT_GE(calls.size(), 2u);  // the first Add draws, and Finish
  EXPECT_EQ(calls.back(), std::make_tuple(std::string("copy"), 300, 300));
  for (const auto& c : calls) EXPECT_EQ(std::get<0>(c), "copy");
}

TEST(HashTest, Xxh3KnownVectorAndStreaming) {
  EXPECT_EQ(Xxh3("", 0), 0x2D06800538D394C2ULL);  // XXH3_64bits of empty input
  std::string data(100000, 'x');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  Xxh3Hasher h;
  h.Update(data.data(), 333);
  h.Update(data.data() + 333, data.size() - 333);
  EXPECT_EQ(h.Digest(), Xxh3(data.data(), data.size()));
  EXPECT_EQ(HashHex(0xabcULL), "0000000000000abc");
}

TEST(AlignedBufferTest, IsPageAligned) {
  AlignedBuffer b(10000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);
  EXPECT_EQ(b.size(), 10000u);
  AlignedBuffer moved = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(moved.size(), 10000u);
}

TEST(TestUtilTest, Sha256KnownVectors) {
  EXPECT_EQ(testutil::Sha256Hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(testutil::Sha256Hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(testutil::Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
}  // namespace ucp

namespace ucp {
namespace {

TEST(ErrorTest, NulBytesAreSpelledOutSoTheContextSurvives) {
  FormatError e("key ", std::string("sin\0gle", 7), " is bad");
  e.AddContext("rank file x.pt");
  EXPECT_STREQ(e.what(), "rank file x.pt > key sin\\x00gle is bad");
}

}  // namespace
}  // namespace ucp
