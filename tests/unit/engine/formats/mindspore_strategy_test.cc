// MindSpore strategy files (engine/formats/mindspore/strategy.h): files
// written here byte by byte from the spec (mindspore/ccsrc/utils/
// node_strategy.proto, package mindspore.straspb, proto2; the field numbers
// are in ../shared/reference/mindspore_safetensors.md §2; checked once by
// hand: MindSpore's own node_strategy_pb2.ParallelStrategyMap parses
// pb::File's bytes to the layouts written), and each rank's
// box against MindSpore itself: the kBoxes table is what
// dump_mindspore_boxes.py prints (mindspore.parallel._tensor's
// _construct_tensor_layout_for_opt_shard and _load_tensor, the code
// transform_checkpoints runs, cutting np.arange for every rank; mindspore
// of the tests' venv).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/mindspore/strategy.h"
#include "tests/testutil/testutil.h"

namespace ucp::mindspore {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// ---- protobuf, written from the wire format ----
namespace pb {

std::string Varint(uint64_t v) {
  std::string s;
  do {
    uint8_t b = v & 0x7f;
    v >>= 7;
    if (v != 0) b |= 0x80;
    s.push_back(static_cast<char>(b));
  } while (v != 0);
  return s;
}
std::string Tag(int field, int wire) {
  return Varint(static_cast<uint64_t>(field) << 3 |
                static_cast<uint64_t>(wire));
}
std::string Len(int field, const std::string& body) {
  return Tag(field, 2) + Varint(body.size()) + body;
}
std::string U(int field, uint64_t v) { return Tag(field, 0) + Varint(v); }
// int32: a negative value is sign-extended to 64 bits (10 bytes).
std::string I32(int field, int32_t v) {
  return U(field, static_cast<uint64_t>(static_cast<int64_t>(v)));
}
// A message of one repeated scalar `dim` (field 1), unpacked or packed.
std::string Dims(const std::vector<int64_t>& d, bool packed = false) {
  std::string s;
  if (packed) {
    std::string run;
    for (int64_t x : d) run += Varint(static_cast<uint64_t>(x));
    return Len(1, run);
  }
  for (int64_t x : d) s += I32(1, static_cast<int32_t>(x));
  return s;
}

struct Layout {
  std::vector<int64_t> dev;
  std::vector<std::vector<int64_t>> maps;  // one TensorMap each
  int64_t step = 0, size = 0, field = 0;
  std::vector<int64_t> split_shape;
  bool packed = false;
};
std::string LayoutItem(const std::string& name, const Layout& l) {
  std::string ls = Len(1, Dims(l.dev, l.packed));
  for (const auto& m : l.maps) ls += Len(2, Dims(m, l.packed));
  ls += Len(3, Dims(l.split_shape)) + Len(4, "");
  ls += I32(5, static_cast<int32_t>(l.field)) +
        I32(6, static_cast<int32_t>(l.step)) +
        I32(7, static_cast<int32_t>(l.size));
  ls += U(9, 1);  // a field of a newer proto: skipped
  return Len(1, name) + Len(2, ls);
}
// ParallelStrategyMap: current_stage, one ParallelStrategyItem (node_name,
// ParallelStrategys{stage, ParallelStrategy{dim}}), the layout items.
std::string File(int64_t stage,
                 const std::vector<std::pair<std::string, Layout>>& items) {
  std::string s = U(1, static_cast<uint64_t>(stage));
  s += Len(
      2, Len(1, "Default/MatMul-op0") +
             Len(2, U(1, static_cast<uint64_t>(stage)) + Len(2, Dims({2, 1}))));
  for (const auto& [name, l] : items) s += Len(3, LayoutItem(name, l));
  return s;
}

}  // namespace pb

Strategy ReadBytes(const testutil::TempDir& dir, const std::string& bytes,
                   const std::string& name = "strategy.ckpt") {
  testutil::WriteFile(dir / name, bytes);
  return ReadStrategy(dir / name);
}

using Axes = std::vector<std::vector<int64_t>>;

TEST(MindSporeStrategyTest, ReadsTheClassicLayouts) {
  testutil::TempDir dir;
  const Strategy s = ReadBytes(
      dir,
      pb::File(0, {{"model.layers.0.attention.wq.weight", {{2, 4}, {{0, -1}}}},
                   {"model.layers.0.attention.wo.weight", {{2, 4}, {{-1, 0}}}},
                   {"model.norm_out.weight", {{2, 4}, {{-1}}, 4, 2}},
                   {"model.tok_embeddings.embedding_weight",
                    {{2, 4}, {{1, 0}}, 0, 0, 0, {}, /*packed=*/true}}}));
  EXPECT_EQ(s.stages, 1);
  EXPECT_EQ(s.stage_devices, 8);
  EXPECT_EQ(s.world(), 8);
  ASSERT_EQ(s.layouts.size(), 4u);
  const TensorLayout* wq = s.Find("model.layers.0.attention.wq.weight", 5);
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(wq->dev_matrix, std::vector<int64_t>({2, 4}));
  EXPECT_EQ(wq->dims, Axes({{0}, {}}));
  EXPECT_FALSE(wq->extend);
  EXPECT_EQ(wq->opt_shard_step, 0);
  EXPECT_EQ(s.Find("model.layers.0.attention.wo.weight", 0)->dims,
            Axes({{}, {0}}));
  const TensorLayout* norm = s.Find("model.norm_out.weight", 7);
  EXPECT_EQ(norm->dims, Axes({{}}));
  EXPECT_EQ(norm->opt_shard_step, 4);
  EXPECT_EQ(norm->opt_shard_size, 2);
  // Packed repeated fields read the same.
  EXPECT_EQ(s.Find("model.tok_embeddings.embedding_weight", 3)->dims,
            Axes({{1}, {0}}));
  EXPECT_EQ(s.Find("model.tok_embeddings.embedding_weight", 3)->dev_matrix,
            std::vector<int64_t>({2, 4}));
  // Absent: whole on every rank.
  EXPECT_EQ(s.Find("model.nosuch", 0), nullptr);
  EXPECT_TRUE(s.Holds("model.nosuch", 3));
}

TEST(MindSporeStrategyTest, ReadsTheExtendForm) {
  testutil::TempDir dir;
  const Strategy s = ReadBytes(
      dir, pb::File(0, {{"w", {{2, 2, 2}, {{2, 1}, {-1}}}},
                        // A 1-D tensor: its TensorMap and an empty filler.
                        {"b", {{2, 2, 2}, {{0}, {}}}}}));
  const TensorLayout* w = s.Find("w", 0);
  EXPECT_TRUE(w->extend);
  EXPECT_EQ(w->dims, Axes({{2, 1}, {}}));
  const TensorLayout* b = s.Find("b", 0);
  EXPECT_TRUE(b->extend);
  EXPECT_EQ(b->dims, Axes({{0}}));
}

TEST(MindSporeStrategyTest, PipelineStagesMergedAndPerRank) {
  // merge_pipeline_strategys: "<stage>-<name>" in one file.
  testutil::TempDir dir;
  const Strategy merged =
      ReadBytes(dir, pb::File(0, {{"0-embedding", {{2, 2}, {{0, -1}}}},
                                  {"0-layers.0.w", {{2, 2}, {{-1, 0}}}},
                                  {"1-layers.1.w", {{2, 2}, {{0, -1}}}},
                                  {"1-head", {{2, 2}, {{-1, -1}}}}}));
  EXPECT_EQ(merged.stages, 2);
  EXPECT_EQ(merged.stage_devices, 4);
  EXPECT_EQ(merged.world(), 8);
  EXPECT_TRUE(merged.Holds("layers.0.w", 3));
  EXPECT_FALSE(merged.Holds("layers.0.w", 4));
  EXPECT_TRUE(merged.Holds("layers.1.w", 7));
  EXPECT_EQ(merged.Find("layers.1.w", 6)->dims, Axes({{0}, {}}));
  EXPECT_THAT(
      [&] { merged.Find("layers.1.w", 1); },
      ThrowsMessage<FormatError>(
          AllOf(HasSubstr("layers.1.w"), HasSubstr("no layout for stage 0"))));
  // Per-rank files (MindFormers' ckpt_strategy_rank_R.ckpt) with their
  // current_stage; identical layouts of one stage once.
  testutil::TempDir folder;
  testutil::WriteFile(folder / "ckpt_strategy_rank_0.ckpt",
                      pb::File(0, {{"layers.0.w", {{2, 2}, {{-1, 0}}}}}));
  testutil::WriteFile(folder / "ckpt_strategy_rank_1.ckpt",
                      pb::File(0, {{"layers.0.w", {{2, 2}, {{-1, 0}}}}}));
  testutil::WriteFile(folder / "ckpt_strategy_rank_4.ckpt",
                      pb::File(1, {{"layers.1.w", {{2, 2}, {{0, -1}}}}}));
  testutil::WriteFile(folder / "notes.txt", "not a strategy");
  const Strategy ranks = ReadStrategy(folder.path());
  EXPECT_EQ(ranks.stages, 2);
  EXPECT_EQ(ranks.layouts.at("layers.0.w").size(), 1u);
  EXPECT_EQ(ranks.layouts.at("layers.1.w").count(1), 1u);
}

TEST(MindSporeStrategyTest, ReadsTheJsonVariant) {
  testutil::TempDir dir;
  testutil::WriteFile(dir / "strategy.json",
                      R"({"current_stage": 1, "parallel_layout_item": {
            "w": {"dev_matrix": [2, 4], "tensor_map": [0, -1], "field": 0,
                  "opt_weight_shard_step": 0, "opt_weight_shard_size": 0},
            "v": {"dev_matrix": [2, 4], "tensor_map": [[1, 0], -1]},
            "0-e": {"dev_matrix": [2, 4], "tensor_map": [-1, 0],
                    "opt_weight_shard_step": 4, "opt_weight_shard_size": 2}}})");
  const Strategy s = ReadStrategy(dir / "strategy.json");
  EXPECT_EQ(s.stages, 2);
  EXPECT_EQ(s.layouts.at("w").begin()->first, 1);
  EXPECT_EQ(s.layouts.at("w").at(1).dims, Axes({{0}, {}}));
  EXPECT_TRUE(s.layouts.at("v").at(1).extend);
  EXPECT_EQ(s.layouts.at("v").at(1).dims, Axes({{1, 0}, {}}));
  EXPECT_EQ(s.layouts.at("e").at(0).opt_shard_size, 2);
}

// ---- Each rank's box, as MindSpore cuts the tensor. ----
struct BoxCase {
  const char* name;
  std::vector<int64_t> dev;
  Axes dims;
  bool extend;
  int64_t step, size;
  Shape shape;
  std::vector<std::vector<int64_t>> boxes;  // per rank: offsets, then sizes
};

// dump_mindspore_boxes.py (mindspore of the tests' venv).
const std::vector<BoxCase>& Boxes() {
  static const std::vector<BoxCase> cases = {
      {"tp_dim0",
       {2, 4},
       {{0}, {}},
       false,
       0,
       0,
       {8, 6},
       {{0, 0, 2, 6},
        {2, 0, 2, 6},
        {4, 0, 2, 6},
        {6, 0, 2, 6},
        {0, 0, 2, 6},
        {2, 0, 2, 6},
        {4, 0, 2, 6},
        {6, 0, 2, 6}}},
      {"tp_dim1",
       {2, 4},
       {{}, {0}},
       false,
       0,
       0,
       {6, 8},
       {{0, 0, 6, 2},
        {0, 2, 6, 2},
        {0, 4, 6, 2},
        {0, 6, 6, 2},
        {0, 0, 6, 2},
        {0, 2, 6, 2},
        {0, 4, 6, 2},
        {0, 6, 6, 2}}},
      {"dp_and_tp",
       {2, 2},
       {{1}, {0}},
       false,
       0,
       0,
       {4, 6},
       {{0, 0, 2, 3}, {0, 3, 2, 3}, {2, 0, 2, 3}, {2, 3, 2, 3}}},
      {"three_axes",
       {2, 3, 2},
       {{2}, {}, {0}},
       false,
       0,
       0,
       {4, 5, 6},
       {{0, 0, 0, 2, 5, 3},
        {0, 0, 3, 2, 5, 3},
        {0, 0, 0, 2, 5, 3},
        {0, 0, 3, 2, 5, 3},
        {0, 0, 0, 2, 5, 3},
        {0, 0, 3, 2, 5, 3},
        {2, 0, 0, 2, 5, 3},
        {2, 0, 3, 2, 5, 3},
        {2, 0, 0, 2, 5, 3},
        {2, 0, 3, 2, 5, 3},
        {2, 0, 0, 2, 5, 3},
        {2, 0, 3, 2, 5, 3}}},
      {"replicated",
       {4, 2},
       {{}, {}},
       false,
       0,
       0,
       {3, 5},
       {{0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5},
        {0, 0, 3, 5}}},
      {"vector",
       {2, 4},
       {{0}},
       false,
       0,
       0,
       {8},
       {{0, 2}, {2, 2}, {4, 2}, {6, 2}, {0, 2}, {2, 2}, {4, 2}, {6, 2}}},
      {"opt_dp",
       {4, 2},
       {{}, {0}},
       false,
       2,
       4,
       {8, 6},
       {{0, 0, 2, 3},
        {0, 3, 2, 3},
        {2, 0, 2, 3},
        {2, 3, 2, 3},
        {4, 0, 2, 3},
        {4, 3, 2, 3},
        {6, 0, 2, 3},
        {6, 3, 2, 3}}},
      {"opt_dp_part",
       {4, 2},
       {{}, {0}},
       false,
       2,
       2,
       {8, 6},
       {{0, 0, 4, 3},
        {0, 3, 4, 3},
        {4, 0, 4, 3},
        {4, 3, 4, 3},
        {0, 0, 4, 3},
        {0, 3, 4, 3},
        {4, 0, 4, 3},
        {4, 3, 4, 3}}},
      {"opt_all_free",
       {2, 2, 2},
       {{1}, {}},
       false,
       2,
       -1,
       {8, 4},
       {{0, 0, 1, 4},
        {1, 0, 1, 4},
        {4, 0, 1, 4},
        {5, 0, 1, 4},
        {2, 0, 1, 4},
        {3, 0, 1, 4},
        {6, 0, 1, 4},
        {7, 0, 1, 4}}},
      {"opt_middle_axis",
       {2, 2, 2},
       {{2}, {}},
       false,
       4,
       2,
       {8, 4},
       {{0, 0, 2, 4},
        {2, 0, 2, 4},
        {0, 0, 2, 4},
        {2, 0, 2, 4},
        {4, 0, 2, 4},
        {6, 0, 2, 4},
        {4, 0, 2, 4},
        {6, 0, 2, 4}}},
      {"extend_dim0",
       {2, 2, 2},
       {{2, 1}, {}},
       true,
       0,
       0,
       {8, 3},
       {{0, 0, 2, 3},
        {0, 0, 2, 3},
        {2, 0, 2, 3},
        {2, 0, 2, 3},
        {4, 0, 2, 3},
        {4, 0, 2, 3},
        {6, 0, 2, 3},
        {6, 0, 2, 3}}},
      {"extend_two_dims",
       {2, 3, 2},
       {{2}, {1, 0}},
       true,
       0,
       0,
       {4, 12},
       {{0, 0, 2, 2},
        {0, 2, 2, 2},
        {0, 4, 2, 2},
        {0, 6, 2, 2},
        {0, 8, 2, 2},
        {0, 10, 2, 2},
        {2, 0, 2, 2},
        {2, 2, 2, 2},
        {2, 4, 2, 2},
        {2, 6, 2, 2},
        {2, 8, 2, 2},
        {2, 10, 2, 2}}},
      {"extend_opt",
       {2, 2, 2, 2},
       {{1, 0}, {}},
       true,
       4,
       2,
       {8, 2},
       {{0, 0, 1, 2},
        {2, 0, 1, 2},
        {4, 0, 1, 2},
        {6, 0, 1, 2},
        {1, 0, 1, 2},
        {3, 0, 1, 2},
        {5, 0, 1, 2},
        {7, 0, 1, 2},
        {0, 0, 1, 2},
        {2, 0, 1, 2},
        {4, 0, 1, 2},
        {6, 0, 1, 2},
        {1, 0, 1, 2},
        {3, 0, 1, 2},
        {5, 0, 1, 2},
        {7, 0, 1, 2}}},
      {"extend_opt_all",
       {2, 2, 2},
       {{0}, {}},
       true,
       2,
       -1,
       {8, 3},
       {{0, 0, 1, 3},
        {4, 0, 1, 3},
        {1, 0, 1, 3},
        {5, 0, 1, 3},
        {2, 0, 1, 3},
        {6, 0, 1, 3},
        {3, 0, 1, 3},
        {7, 0, 1, 3}}},
      {"opt_size_splits_an_axis",
       {4, 2},
       {{}, {0}},
       false,
       2,
       2,
       {16, 2},
       {{0, 0, 8, 1},
        {0, 1, 8, 1},
        {8, 0, 8, 1},
        {8, 1, 8, 1},
        {0, 0, 8, 1},
        {0, 1, 8, 1},
        {8, 0, 8, 1},
        {8, 1, 8, 1}}},
      {"opt_right_of_tp",
       {2, 2, 2},
       {{2}, {}},
       false,
       4,
       4,
       {16, 2},
       {{0, 0, 2, 2},
        {2, 0, 2, 2},
        {4, 0, 2, 2},
        {6, 0, 2, 2},
        {8, 0, 2, 2},
        {10, 0, 2, 2},
        {12, 0, 2, 2},
        {14, 0, 2, 2}}},
  };
  return cases;
}

TensorLayout LayoutOf(const BoxCase& c) {
  TensorLayout l;
  l.dev_matrix = c.dev;
  l.dims = c.dims;
  l.extend = c.extend;
  l.opt_shard_step = c.step;
  l.opt_shard_size = c.size;
  return l;
}

TEST(MindSporeStrategyTest, EachRanksBoxIsMindSporesSlice) {
  int64_t compared = 0;
  for (const BoxCase& c : Boxes()) {
    SCOPED_TRACE(c.name);
    const TensorLayout l = LayoutOf(c);
    const std::vector<int64_t> counts = SplitCounts(l, c.shape.size(), c.name);
    ASSERT_EQ(counts.size(), c.shape.size());
    for (size_t r = 0; r < c.boxes.size(); ++r) {
      SCOPED_TRACE(testing::Message() << "rank " << r);
      const Box b = RankBox(l, c.shape, static_cast<int64_t>(r), c.name);
      const size_t n = c.shape.size();
      EXPECT_EQ(b.offset, Shape(c.boxes[r].begin(), c.boxes[r].begin() + n));
      EXPECT_EQ(b.size, Shape(c.boxes[r].begin() + n, c.boxes[r].end()));
      for (size_t d = 0; d < n; ++d)
        EXPECT_EQ(b.size[d] * counts[d], c.shape[d]);
      compared += 2 * static_cast<int64_t>(n);
    }
  }
  EXPECT_GE(compared, 300);
}

// Negative control: another opt_weight_shard_size gives other boxes.
TEST(MindSporeStrategyTest, AnotherOptimizerShardIsSeen) {
  const BoxCase& c = Boxes()[6];  // opt_dp
  ASSERT_EQ(std::string(c.name), "opt_dp");
  TensorLayout l = LayoutOf(c);
  l.opt_shard_size = 2;
  EXPECT_NE(RankBox(l, c.shape, 2, "w").offset, Shape({2, 0}));
}

// ---- Damaged or unsupported files: one FormatError naming file and param.
TEST(MindSporeStrategyTest, MalformedFilesNameTheFileAndParam) {
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;
  };
  const std::string good = pb::File(0, {{"w", {{2, 4}, {{0, -1}}}}});
  auto item = [](const std::string& name, const std::string& layouts) {
    return pb::U(1, 0) + pb::Len(3, pb::Len(1, name) + pb::Len(2, layouts));
  };
  const std::vector<Case> cases = {
      {"truncated", good.substr(0, good.size() - 3), "runs past its end"},
      {"a varint that never ends", pb::Tag(1, 0) + std::string(11, '\xff'),
       "a varint longer than 10 bytes"},
      {"wire type 7", pb::Tag(4, 7), "wire type 7"},
      {"no dev_matrix", item("w", pb::Len(2, pb::Dims({0, -1}))),
       "w: a layout without dev_matrix"},
      {"no tensor_map", item("w", pb::Len(1, pb::Dims({2, 4}))),
       "w: a layout without tensor_map"},
      {"no name", pb::Len(3, pb::Len(2, pb::Len(1, pb::Dims({2})))),
       "a layout item without name or layout"},
      {"an axis beyond the dev_matrix",
       pb::File(0, {{"w", {{2, 4}, {{2, -1}}}}}),
       "w: tensor_map names device axis 2 of a 2-axis dev_matrix"},
      {"an axis twice", pb::File(0, {{"w", {{2, 4}, {{0, 0}}}}}),
       "w: tensor_map uses device axis 0 twice"},
      {"a device count of 0", pb::File(0, {{"w", {{2, 0}, {{0, -1}}}}}),
       "w: a dev_matrix size of 0"},
      {"an embedding field", pb::File(0, {{"w", {{2, 4}, {{0, -1}}, 0, 0, 2}}}),
       "w: an embedding field split (field 2): not supported"},
      {"an uneven split",
       pb::File(0, {{"w", {{2, 4}, {{0, -1}}, 0, 0, 0, {3, 5}}}}),
       "w: an uneven split (param_split_shape): not supported"},
      {"stages of other device counts",
       pb::File(0,
                {{"0-w", {{2, 4}, {{0, -1}}}}, {"1-v", {{2, 2}, {{0, -1}}}}}),
       "w: a dev_matrix of 8 devices, others 4"},
      {"no layout at all", pb::U(1, 0), "no parameter layout"},
      {"a dev_matrix of wire type 0", item("w", pb::U(1, 2)),
       "dev_matrix of wire type 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    testutil::TempDir dir;
    testutil::WriteFile(dir / "s.ckpt", c.bytes);
    EXPECT_THAT([&] { ReadStrategy(dir / "s.ckpt"); },
                ThrowsMessage<FormatError>(
                    AllOf(HasSubstr("s.ckpt"), HasSubstr(c.message))));
  }
  // Files of one folder that disagree.
  testutil::TempDir folder;
  testutil::WriteFile(folder / "a.ckpt",
                      pb::File(0, {{"w", {{2, 4}, {{0, -1}}}}}));
  testutil::WriteFile(folder / "b.ckpt",
                      pb::File(0, {{"w", {{2, 4}, {{-1, 0}}}}}));
  EXPECT_THAT([&] { ReadStrategy(folder.path()); },
              ThrowsMessage<FormatError>(
                  AllOf(HasSubstr("b.ckpt > w"),
                        HasSubstr("two different layouts for stage 0"))));
  testutil::TempDir empty;
  EXPECT_THAT([&] { ReadStrategy(empty.path()); },
              ThrowsMessage<FormatError>(HasSubstr("no strategy file")));
  EXPECT_THAT([&] { ReadStrategy(empty / "missing.ckpt"); },
              ThrowsMessage<IoError>(HasSubstr("missing.ckpt")));
  // JSON without its object; a tensor_map that is not a list.
  testutil::WriteFile(empty / "x.json", R"({"other": {}})");
  EXPECT_THAT([&] { ReadStrategy(empty / "x.json"); },
              ThrowsMessage<FormatError>(HasSubstr("no parallel_layout_item")));
  testutil::WriteFile(
      empty / "y.json",
      R"({"parallel_layout_item": {"w": {"dev_matrix": [2]}}})");
  EXPECT_THAT([&] { ReadStrategy(empty / "y.json"); },
              ThrowsMessage<FormatError>(AllOf(HasSubstr("y.json > w"))));
}

TEST(MindSporeStrategyTest, LayoutsThatDoNotFitTheTensor) {
  TensorLayout l;
  l.dev_matrix = {2, 4};
  l.dims = {{0}, {}};
  EXPECT_THAT(
      [&] {
        RankBox(l, {7, 6}, 1, "strategy s > w");
      },
      ThrowsMessage<FormatError>(AllOf(
          HasSubstr("strategy s > w"),
          HasSubstr("dim 0 of [7, 6] does not split into 4 equal parts"))));
  EXPECT_THAT(
      [&] {
        RankBox(l, {8, 6, 2}, 1, "w");
      },
      ThrowsMessage<FormatError>(
          HasSubstr("w: its layout maps 2 dims, the tensor has 3")));
  l.opt_shard_step = 4;
  l.opt_shard_size = 3;
  EXPECT_THAT(
      [&] { SplitCounts(l, 2, "w"); },
      ThrowsMessage<FormatError>(HasSubstr("w: opt_weight_shard_size 3")));
  TensorLayout all;
  all.dev_matrix = {2, 4};
  all.dims = {{1}, {0}};
  all.opt_shard_step = 1;
  all.opt_shard_size = 2;
  EXPECT_THAT([&] { SplitCounts(all, 2, "w"); },
              ThrowsMessage<FormatError>(HasSubstr("no device axis is left")));
}

// What ucp writes (one file per stage) reads back to the same layouts.
TEST(MindSporeStrategyTest, WrittenFilesReadBack) {
  testutil::TempDir dir;
  const Strategy s =
      ReadBytes(dir, pb::File(0, {{"0-a", {{2, 4}, {{0, -1}}}},
                                  {"0-b", {{2, 4}, {{-1}}, 4, 2}},
                                  {"1-c", {{2, 4}, {{-1, 0}}}}}));
  for (int64_t stage : {0, 1}) {
    const Strategy back =
        ReadBytes(dir, StrategyFileBytes(s, stage), "back.ckpt");
    for (const auto& [name, stages] : s.layouts) {
      if (!stages.count(stage)) {
        EXPECT_EQ(back.layouts.count(name), 0u) << name;
        continue;
      }
      ASSERT_EQ(back.layouts.count(name), 1u) << name;
      EXPECT_EQ(back.layouts.at(name).at(stage), stages.at(stage)) << name;
    }
  }
  // The extend form is not written.
  const Strategy ext = ReadBytes(
      dir, pb::File(0, {{"w", {{2, 2, 2}, {{2, 1}, {-1}}}}}), "e.ckpt");
  EXPECT_THAT([&] { StrategyFileBytes(ext, 0); },
              ThrowsMessage<FormatError>(HasSubstr("w: only classic")));
}

}  // namespace
}  // namespace ucp::mindspore
