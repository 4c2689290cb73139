// The exporter registry (formats/exporter.h) `ucp export` runs, and the
// Hugging Face shard sizes it parses. Expected sizes from the two Hugging
// Face parsers, not from ucp's table: huggingface_hub's parse_size_to_int
// (serialization/_base.py: "KB" = 10^3, "MB" = 10^6, "GB" = 10^9,
// "TB" = 10^12, the unit upper-cased) and transformers'
// convert_file_size_to_int (utils/hub.py: "KiB" = 2^10, "MiB" = 2^20, "GiB" =
// 2^30).

#include "engine/formats/exporter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/error.h"

namespace ucp::formats {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(ExporterRegistryTest, TheLinkedExporterRegistersItself) {
  const Exporter* e = FindExporter("huggingface");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Name(), "huggingface");
  EXPECT_EQ(FindExporter("nosuch"), nullptr);
  EXPECT_EQ(FindExporter(""), nullptr);
}

TEST(ExporterRegistryTest, ShardSizesInHuggingFaceUnits) {
  const std::vector<std::pair<std::string, uint64_t>> cases = {
      {"5GB", 5'000'000'000ull},     {"5gb", 5'000'000'000ull},
      {"500MB", 500'000'000ull},     {"100KB", 100'000ull},
      {"2TB", 2'000'000'000'000ull}, {"1GiB", 1ull << 30},
      {"3MiB", 3ull << 20},          {"1KiB", 1024}};
  for (const auto& [text, bytes] : cases)
    EXPECT_EQ(ParseShardSize(text), bytes) << text;
  EXPECT_GE(cases.size(), 8u);
}

TEST(ExporterRegistryTest, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "GB", "5XB", "-5GB", "5 GB", "0", "0GB"}) {
    EXPECT_THAT([&] { ParseShardSize(bad); },
                ThrowsMessage<UsageError>(HasSubstr("--max-shard-size")))
        << "'" << bad << "'";
  }
  EXPECT_THAT([] { ParseShardSize("99999999999999999999"); },
              ThrowsMessage<UsageError>(HasSubstr("too large")));
  EXPECT_THAT([] { ParseShardSize("20000000000TB"); },
              ThrowsMessage<UsageError>(HasSubstr("out of range")));
}

}  // namespace
}  // namespace ucp::formats
