// FP8 block-scaled weights dequantized while read (hf.h, Fp8Dequantized).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/hf/hf.h"

namespace ucp::hf {
namespace {

namespace fs = std::filesystem;

// float8_e4m3fn (OCP FP8 E4M3, "fn": no infinities): sign, 4 exponent bits
// (bias 7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6); S.1111.111
// is NaN. Every value is exact in float32.
std::array<float, 256> E4m3Table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    float v = 0;
    if ((b & 0x7F) == 0x7F) {
      v = std::nanf("");
    } else if (exponent == 0) {
      v = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);
    } else {
      v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
    }
    t[static_cast<size_t>(b)] = (b & 0x80) != 0 ? -v : v;
  }
  return t;
}

const std::array<float, 256>& E4m3() {
  static const std::array<float, 256> table = E4m3Table();
  return table;
}

}  // namespace

struct Fp8Dequantized::Weight {
  uint64_t begin = 0;  // of its dequantized bytes
  int64_t rows = 0, cols = 0;
  size_t weight_file = 0, scale_file = 0;
  uint64_t weight_at = 0, scale_at = 0;
};

struct Fp8Dequantized::Files {
  std::vector<fs::path> paths;
  std::vector<File> files;
  size_t Of(const fs::path& p) {
    for (size_t i = 0; i < paths.size(); ++i)
      if (paths[i] == p) return i;
    paths.push_back(p);
    files.push_back(File::OpenRead(p));
    return paths.size() - 1;
  }
};

Fp8Dequantized::Fp8Dequantized(DType out, int64_t block_rows,
                               int64_t block_cols)
    : out_(out),
      block_rows_(block_rows),
      block_cols_(block_cols),
      files_(std::make_unique<Files>()) {
  UCP_CHECK(out == DType::kBFloat16 || out == DType::kFloat32,
            "FP8 dequantized to ", DTypeName(out));
  UCP_CHECK(block_rows > 0 && block_cols > 0, "FP8 blocks ", block_rows, "x",
            block_cols);
}

Fp8Dequantized::~Fp8Dequantized() = default;

uint64_t Fp8Dequantized::Add(const fs::path& weight_file, uint64_t weight_at,
                             int64_t rows, int64_t cols,
                             const fs::path& scale_file, uint64_t scale_at) {
  Weight w;
  w.begin = end_;
  w.rows = rows;
  w.cols = cols;
  w.weight_file = files_->Of(weight_file);
  w.scale_file = files_->Of(scale_file);
  w.weight_at = weight_at;
  w.scale_at = scale_at;
  end_ += static_cast<uint64_t>(rows * cols) * ElementSize(out_);
  weights_.push_back(w);
  return w.begin;
}

std::string Fp8Dequantized::Describe() const {
  std::string s = "FP8 weights dequantized from";
  for (const fs::path& p : files_->paths) s += StrCat(" ", p.string());
  return s;
}

void Fp8Dequantized::ReadWeight(const Weight& w, int64_t first, int64_t count,
                                std::byte* dst) const {
  const File& wf = files_->files[w.weight_file];
  const File& sf = files_->files[w.scale_file];
  std::vector<uint8_t> fp8(static_cast<size_t>(count));
  wf.ReadExact(fp8.data(), fp8.size(),
               w.weight_at + static_cast<uint64_t>(first));
  const int64_t scale_cols = (w.cols + block_cols_ - 1) / block_cols_;
  // The scale rows of the weight rows read.
  const int64_t r0 = first / w.cols, r1 = (first + count - 1) / w.cols;
  const int64_t b0 = r0 / block_rows_, b1 = r1 / block_rows_;
  // (safetensors data is little-endian, as ucp's hosts)
  std::vector<float> scale(static_cast<size_t>((b1 - b0 + 1) * scale_cols));
  sf.ReadExact(scale.data(), scale.size() * sizeof(float),
               w.scale_at + static_cast<uint64_t>(b0 * scale_cols) * 4);
  const std::array<float, 256>& table = E4m3();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t e = first + i, r = e / w.cols, c = e % w.cols;
    const float s = scale[static_cast<size_t>(
        (r / block_rows_ - b0) * scale_cols + c / block_cols_)];
    // (float32 multiply, as torch's fp8.float() * scale)
    const float v = table[fp8[static_cast<size_t>(i)]] * s;
    if (out_ == DType::kFloat32) {
      std::memcpy(dst + i * 4, &v, 4);
    } else {
      const uint16_t b = Float32ToBFloat16(v);
      std::memcpy(dst + i * 2, &b, 2);
    }
  }
}

void Fp8Dequantized::Read(uint64_t offset, std::span<std::byte> dst) const {
  const uint64_t es = ElementSize(out_);
  while (!dst.empty()) {
    if (offset >= end_)
      throw InternalError(Describe(), ": read at ", offset, " past ", end_);
    auto it = std::upper_bound(
        weights_.begin(), weights_.end(), offset,
        [](uint64_t o, const Weight& w) { return o < w.begin; });
    const Weight& w = *std::prev(it);
    const uint64_t bytes = static_cast<uint64_t>(w.rows * w.cols) * es;
    const uint64_t in = offset - w.begin;
    const uint64_t n = std::min<uint64_t>(dst.size(), bytes - in);
    // Whole elements covering [in, in + n), bounded per pass.
    constexpr uint64_t kPass = 8u << 20;
    uint64_t done = 0;
    while (done < n) {
      const uint64_t at = in + done;
      const uint64_t first = at / es;
      const uint64_t last =
          std::min<uint64_t>((in + n + es - 1) / es, first + kPass / es);
      const uint64_t skip = at - first * es;
      const uint64_t take =
          std::min<uint64_t>(n - done, (last - first) * es - skip);
      if (skip == 0 && take == (last - first) * es) {
        ReadWeight(w, static_cast<int64_t>(first),
                   static_cast<int64_t>(last - first), dst.data() + done);
      } else {
        std::vector<std::byte> tmp((last - first) * es);
        ReadWeight(w, static_cast<int64_t>(first),
                   static_cast<int64_t>(last - first), tmp.data());
        std::memcpy(dst.data() + done, tmp.data() + skip, take);
      }
      done += take;
    }
    offset += n;
    dst = dst.subspan(n);
  }
}

}  // namespace ucp::hf
