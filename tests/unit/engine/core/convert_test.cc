#include "engine/core/convert.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "tests/testutil/testutil.h"

namespace ucp {
namespace {

// Oracle: PyTorch's own float32 -> bfloat16/float16 casts, run by Debian's
// python3-torch on random bit patterns (incl. NaN, inf, subnormals, ties).
TEST(ConvertTest, MatchesTorchRoundingOnRandomBitPatterns) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> bits;
  const uint32_t specials[] = {
      0u,          0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
      0x7F800001u, 0x00000001u, 0x477FF000u, 0x477FEFFFu, 0x38800000u,
      0x387FFFFFu, 0x33000000u, 0x3F808000u, 0x3F818000u, 0x3F80FFFFu};
  bits.assign(std::begin(specials), std::end(specials));
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    if (i % 3 == 0) b &= 0xFFFF8000u | (b & 0x7FFFu);  // near ties
    if (i % 5 == 0) b = (b & 0x807FFFFFu) | ((100 + rng() % 60) << 23);
    bits.push_back(b);
  }
  testutil::TempDir dir;
  testutil::WriteFile(
      dir / "in.bin",
      std::string(reinterpret_cast<const char*>(bits.data()), bits.size() * 4));
  const std::string script =
      "import sys, torch\n"
      "d = sys.argv[1]\n"
      "x = torch.frombuffer(bytearray(open(d + '/in.bin','rb').read()), "
      "dtype=torch.int32).view(torch.float32)\n"
      "open(d + '/bf16.bin','wb').write(x.to(torch.bfloat16).view(torch.int16)"
      ".numpy().tobytes())\n"
      "open(d + '/f16.bin','wb').write(x.to(torch.float16).view(torch.int16)"
      ".numpy().tobytes())\n";
  testutil::WriteFile(dir / "conv.py", script);
  std::string out;
  ASSERT_EQ(testutil::RunCommand(
                testutil::Python() + " " +
                    testutil::ShellQuote((dir / "conv.py").string()) + " " +
                    testutil::ShellQuote(dir.path().string()),
                &out),
            0)
      << out;
  std::string bf = testutil::ReadFile(dir / "bf16.bin");
  std::string hf = testutil::ReadFile(dir / "f16.bin");
  ASSERT_EQ(bf.size(), bits.size() * 2);
  ASSERT_EQ(hf.size(), bits.size() * 2);
  std::vector<uint16_t> got_bf(bits.size()), got_hf(bits.size());
  ConvertElements(DType::kFloat32, bits.data(), DType::kBFloat16, got_bf.data(),
                  bits.size());
  ConvertElements(DType::kFloat32, bits.data(), DType::kFloat16, got_hf.data(),
                  bits.size());
  int bad = 0;
  for (size_t i = 0; i < bits.size() && bad < 10; ++i) {
    uint16_t want_bf, want_hf;
    std::memcpy(&want_bf, bf.data() + 2 * i, 2);
    std::memcpy(&want_hf, hf.data() + 2 * i, 2);
    float f;
    std::memcpy(&f, &bits[i], 4);
    bool nan = f != f;
    // NaN payloads may differ; both must be NaN.
    bool bf_ok = nan ? ((got_bf[i] & 0x7F80) == 0x7F80 && (got_bf[i] & 0x7F))
                     : got_bf[i] == want_bf;
    bool hf_ok = nan ? ((got_hf[i] & 0x7C00) == 0x7C00 && (got_hf[i] & 0x3FF))
                     : got_hf[i] == want_hf;
    if (!bf_ok || !hf_ok) {
      ++bad;
      ADD_FAILURE() << std::hex << "input 0x" << bits[i] << ": bf16 got 0x"
                    << got_bf[i] << " want 0x" << want_bf << ", f16 got 0x"
                    << got_hf[i] << " want 0x" << want_hf;
    }
  }
}

TEST(ConvertTest, WideningIsExactInverse) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t b = static_cast<uint16_t>(h);
    float fb = BFloat16ToFloat32(b);
    if (fb == fb) {
      EXPECT_EQ(Float32ToBFloat16(fb), b);
    }
    float fh = Float16ToFloat32(b);
    if (fh == fh) {
      EXPECT_EQ(Float32ToFloat16(fh), b) << std::hex << h;
    }
  }
  EXPECT_FALSE(CanConvert(DType::kInt32, DType::kFloat32));
}

}  // namespace
}  // namespace ucp
