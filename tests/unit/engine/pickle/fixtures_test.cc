// The data.pkl of every real framework checkpoint in ../shared/fixtures
// (DeepSpeed 0.14.5, Megatron-LM 23.06, torch 2.6 torch.save): unpickles,
// re-pickles byte for byte, and reports no suspicious global. Python's zipfile
// extracts the records (the zip reader is torchfile's business, not ours).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "engine/pickle/pickle.h"
#include "tests/testutil/testutil.h"

namespace ucp::pickle {
namespace {

namespace fs = std::filesystem;

// Extracts every data.pkl under the fixtures into `out` (one file each) and
// copies the legacy (non-zip) files there as legacy_<n>.pt.
void Extract(const fs::path& out) {
  const std::string script =
      "import sys, os, zipfile, shutil\n"
      "root, out = sys.argv[1], sys.argv[2]\n"
      "n = 0\n"
      "for d, _, files in sorted(os.walk(root)):\n"
      "    for f in sorted(files):\n"
      "        p = os.path.join(d, f)\n"
      "        if not f.endswith('.pt'):\n"
      "            continue\n"
      "        n += 1\n"
      "        if zipfile.is_zipfile(p):\n"
      "            z = zipfile.ZipFile(p)\n"
      "            for name in z.namelist():\n"
      "                if name.endswith('/data.pkl'):\n"
      "                    with open(os.path.join(out, '%03d.pkl' % n), 'wb') "
      "as o:\n"
      "                        o.write(z.read(name))\n"
      "        else:\n"
      "            shutil.copy(p, os.path.join(out, 'legacy_%03d.pt' % n))\n";
  testutil::WriteFile(out / "extract.py", script);
  std::string output;
  ASSERT_EQ(testutil::RunCommand(
                testutil::ShellQuote(testutil::Python()) + " " +
                    testutil::ShellQuote((out / "extract.py").string()) + " " +
                    testutil::ShellQuote(testutil::FixturesDir().string()) +
                    " " + testutil::ShellQuote(out.string()),
                &output),
            0)
      << output;
}

TEST(PickleFixturesTest, RealCheckpointsRoundTripByteForByte) {
  testutil::TempDir tmp;
  Extract(tmp.path());
  size_t pickles = 0;
  std::set<std::string> classes;
  size_t sets = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    if (e.path().extension() != ".pkl") continue;
    SCOPED_TRACE(e.path().filename().string());
    const std::string data = testutil::ReadFile(e.path());
    Arena arena;
    Value* root = nullptr;
    ASSERT_NO_THROW(root = Unpickle(data, arena));
    EXPECT_TRUE(Pickle(root) == data);
    EXPECT_THAT(SuspiciousGlobals(arena), ::testing::IsEmpty());
    for (const Value& v : arena.nodes()) {
      if (v.kind == Kind::kObject) classes.insert(v.ClassName());
      if (v.kind == Kind::kSet) ++sets;  // DeepSpeed's module-name sets
    }
    ++pickles;
  }
  EXPECT_GE(pickles, 90u);
  // The framework classes these files carry are recognised by class.
  for (const char* cls : {"argparse.Namespace", "collections.OrderedDict",
                          "megatron.core.enums.ModelType",
                          "deepspeed.runtime.zero.config.ZeroStageEnum",
                          "deepspeed.utils.tensor_fragment.fragment_address",
                          "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                          "torch._utils._rebuild_tensor_v2",
                          "torch._utils._rebuild_parameter", "torch.Size"}) {
    EXPECT_EQ(classes.count(cls), 1u) << cls;
  }
  EXPECT_GT(sets, 0u);
}

TEST(PickleFixturesTest, LegacyTorchFormatIsFivePicklesBackToBack) {
  testutil::TempDir tmp;
  Extract(tmp.path());
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    if (e.path().extension() != ".pt") continue;
    SCOPED_TRACE(e.path().filename().string());
    ++files;
    const std::string data = testutil::ReadFile(e.path());
    std::string_view rest = data;
    Arena arena;
    size_t used = 0;
    // Magic number 0x1950a86a20f9469cfc6c, protocol version 1001, sys info.
    Value* magic = Unpickle(rest, arena, &used);
    EXPECT_EQ(Repr(magic, 100), "119547037146038801333356");
    rest.remove_prefix(used);
    EXPECT_EQ(Unpickle(rest, arena, &used)->AsInt(), 1001);
    rest.remove_prefix(used);
    Value* info = Unpickle(rest, arena, &used);
    ASSERT_TRUE(info->IsDictLike());
    EXPECT_EQ(info->Get("protocol_version")->AsInt(), 1001);
    rest.remove_prefix(used);
    Value* object = Unpickle(rest, arena, &used);
    ASSERT_NE(object, nullptr);
    rest.remove_prefix(used);
    Value* keys = Unpickle(rest, arena, &used);
    EXPECT_EQ(keys->kind, Kind::kList);
    EXPECT_FALSE(keys->items.empty());
  }
  EXPECT_GE(files, 1u);
}

}  // namespace
}  // namespace ucp::pickle
