// The MindSpore sample of the conformance suite: a MindFormers-style folder
// (rank_0/net_rank_0-1_2.ckpt) written here from the Checkpoint protobuf
// spec (engine/formats/mindspore/ckpt.h, ../shared/reference/
// mindspore_safetensors.md §1), independently of ucp's reader: two Dense
// layers' weights and biases, nn.Adam's moment1/moment2, global_step 2 and
// learning_rate. (tests/cli/test_mindspore_cli.py reads the real MindSpore's
// files.)

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/conformance/conformance.h"

namespace ucp::formats::conformance {
namespace {

namespace fs = std::filesystem;

void Varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void Field(std::string& out, int field, const std::string& bytes) {
  Varint(out, static_cast<uint64_t>(field) << 3 | 2);
  Varint(out, bytes.size());
  out += bytes;
}

// One record: Checkpoint{value: Value{tag, tensor: TensorProto}}.
std::string Record(const std::string& tag, const std::vector<int64_t>& dims,
                   const std::string& type, const std::string& content) {
  std::string tensor;
  for (int64_t d : dims) {
    Varint(tensor, 1 << 3 | 0);
    Varint(tensor, static_cast<uint64_t>(d));
  }
  Field(tensor, 2, type);
  Field(tensor, 3, content);
  std::string value;
  Field(value, 1, tag);
  Field(value, 2, tensor);
  std::string record;
  Field(record, 1, value);
  return record;
}

std::string Floats(size_t n, float start) {
  std::string s(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float v = start + 0.25f * static_cast<float>(i);
    std::memcpy(s.data() + 4 * i, &v, 4);
  }
  return s;
}

std::string Checkpoint() {
  struct P {
    const char* name;
    std::vector<int64_t> dims;
  };
  const P params[] = {{"fc1.weight", {13, 7}},
                      {"fc1.bias", {13}},
                      {"fc2.weight", {5, 13}},
                      {"fc2.bias", {5}}};
  std::string out;
  float start = 1;
  for (const char* prefix : {"", "moment1.", "moment2."}) {
    for (const P& p : params) {
      size_t n = 1;
      for (int64_t d : p.dims) n *= static_cast<size_t>(d);
      out += Record(std::string(prefix) + p.name, p.dims, "Float32",
                    Floats(n, start));
      start += 100;
    }
  }
  const int32_t step = 2;
  out += Record("global_step", {1}, "Int32",
                std::string(reinterpret_cast<const char*>(&step), 4));
  out += Record("learning_rate", {}, "Float32", Floats(1, 0.01f));
  return out;
}

TargetOptions Ranks(int64_t n) {
  TargetOptions o;
  o.topology.dp = n;
  return o;
}

const bool kRegistered = RegisterSample({
    .driver = "mindspore",
    .make =
        [](const fs::path& dir) {
          fs::create_directories(dir / "rank_0");
          testutil::WriteFile(dir / "rank_0" / "net_rank_0-1_2.ckpt",
                              Checkpoint());
          return dir;
        },
    .same = Ranks(1),
    .other = Ranks(2),
    // The rewrite adds MindFormers' record of its save.
    .not_reproduced = {"meta.json"},
    // An unsharded file does not fit a job of --dp 2: ucp writes its ranks.
    .loads_at_any_layout = false,
});

}  // namespace
}  // namespace ucp::formats::conformance
