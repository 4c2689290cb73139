// Malformed DeepSpeed checkpoints (make_malformed_deepspeed.py: real fixtures
// with one entry broken each) through discovery, planning and verification
// under ASan + UBSan: each must end in one ucp::Error naming the file that was
// damaged (its path, as the manifest gives it), never a crash or another
// exception.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/json/json.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;

TEST(DeepSpeedMalformedTest, EveryBrokenEntryIsAFormatError) {
  const char* env = std::getenv("UCP_DS_MALFORMED");
  ASSERT_NE(env, nullptr) << "UCP_DS_MALFORMED is not set (run through ctest)";
  const fs::path dir = env;
  const json::Value manifest =
      json::Value::Parse(testutil::ReadFile(dir / "manifest.json"));
  ASSERT_GE(manifest.size(), 30u);
  for (const json::Value& c : manifest.items()) {
    const std::string name = c.At("case").AsString();
    SCOPED_TRACE(name + ": " + c.At("what").AsString());
    std::string message;
    try {
      Checkpoint ck = Discover(dir / name, "");
      universal::SourcePlan plan = PlanSource(ck);
      reshape::ExecutorOptions o;
      o.threads = 2;
      universal::VerifySource(plan, o);
    } catch (const FormatError& e) {
      message = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a format error: " << e.what();
      continue;
    }
    const std::string damaged = (dir / c.At("file").AsString()).string();
    EXPECT_THAT(message, ::testing::HasSubstr(damaged))
        << "accepted, or the damaged file not named";
  }
}

}  // namespace
}  // namespace ucp::deepspeed
