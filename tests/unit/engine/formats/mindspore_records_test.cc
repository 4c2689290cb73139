// What the MindSpore reader takes each record for (records.h), against
// MindSpore's own naming, written here by hand: nn.Adam keeps a param p's
// moments as moment1.p / moment2.p (mindspore/nn/optim/adam.py, clone
// with prefix "moment1" / "moment2"), AdamWeightDecay (MindFormers) as
// adam_m.p / adam_v.p; the optimizer's scalars global_step, learning_rate,
// beta1_power / beta2_power are records of their own; a network's
// non-trainable Parameters (BatchNorm's moving_mean) have no moments.

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "engine/formats/mindspore/records.h"

namespace ucp::mindspore {
namespace {

CkptEntry Rec(std::string tag, std::string type, std::vector<int64_t> dims,
              bool map = false) {
  CkptEntry e;
  e.tag = std::move(tag);
  e.tensor_type = std::move(type);
  e.dims = std::move(dims);
  e.map_tensor = map;
  return e;
}

const RecordRole& RoleOf(const RecordIndex& x,
                         const std::vector<RecordRole>& roles,
                         const std::string& tag) {
  for (size_t i = 0; i < x.entries.size(); ++i)
    if (x.entries[i]->tag == tag) return roles[i];
  ADD_FAILURE() << tag << " not indexed";
  static const RecordRole none;
  return none;
}

TEST(MindSporeRecordsTest, AdamCheckpointOfTwoRanks) {
  CkptIndex r0, r1;
  r0.entries = {Rec("fc.weight", "Float32", {4, 2}),
                Rec("fc.bias", "Float32", {4}),
                Rec("bn.moving_mean", "Float32", {4}),
                Rec("counter", "Int32", {3}),
                Rec("moment1.nothing", "Float32", {2}),
                Rec("moment1.fc.weight", "Float32", {4, 2}),
                Rec("moment2.fc.weight", "Float32", {4, 2}),
                Rec("moment1.fc.bias", "Float32", {4}),
                Rec("moment2.fc.bias", "Float32", {4}),
                Rec("global_step", "Int32", {1}),
                Rec("learning_rate", "Float32", {}),
                Rec("beta1_power", "Float32", {1}),
                Rec("note", "str", {}),
                Rec("table", "Float32", {8, 4}, true)};
  r1.entries = {Rec("fc.weight", "Float32", {4, 2}),
                Rec("half.weight", "Float16", {2})};
  const std::vector<const CkptIndex*> files = {&r0, &r1};
  const RecordIndex x = IndexRecords(files);
  // First appearances in file order, rank 0's first.
  ASSERT_EQ(x.entries.size(), 15u);
  EXPECT_EQ(x.entries[0]->tag, "fc.weight");
  EXPECT_EQ(x.entries[13]->tag, "table");
  EXPECT_EQ(x.entries[14]->tag, "half.weight");
  ASSERT_EQ(x.held.at("fc.weight").size(), 2u);
  EXPECT_EQ(x.held.at("fc.weight")[1].rank, 1u);
  EXPECT_EQ(x.held.at("fc.weight")[1].entry, &r1.entries[0]);
  EXPECT_EQ(x.held.at("half.weight")[0].rank, 1u);
  EXPECT_TRUE(x.has_optimizer());
  EXPECT_EQ(x.with_moments, (std::set<std::string>{"fc.bias", "fc.weight"}));

  const std::vector<RecordRole> roles = ClassifyRecords(x);
  ASSERT_EQ(roles.size(), x.entries.size());
  int checked = 0;
  auto param = [&](const char* tag, bool buffer, const char* kind) {
    const RecordRole& r = RoleOf(x, roles, tag);
    EXPECT_EQ(r.kind, RecordRole::kParam) << tag;
    EXPECT_EQ(r.param, tag);
    EXPECT_EQ(r.buffer, buffer) << tag;
    EXPECT_EQ(r.state_kind, kind) << tag;
    EXPECT_FALSE(r.verbatim) << tag;
    ++checked;
  };
  param("fc.weight", false, "fp32");
  param("fc.bias", false, "fp32");
  param("bn.moving_mean", true, "param");   // no moments: not trained
  param("counter", true, "param");          // not floating point
  param("moment1.nothing", true, "param");  // no param "nothing"
  param("half.weight", true, "param");      // rank 1's, no moments
  auto moment = [&](const char* tag, const char* of, const char* kind) {
    const RecordRole& r = RoleOf(x, roles, tag);
    EXPECT_EQ(r.kind, RecordRole::kMoment) << tag;
    EXPECT_EQ(r.param, of) << tag;
    EXPECT_EQ(r.state_kind, kind) << tag;
    EXPECT_FALSE(r.verbatim) << tag;
    ++checked;
  };
  moment("moment1.fc.weight", "fc.weight", "exp_avg");
  moment("moment2.fc.weight", "fc.weight", "exp_avg_sq");
  moment("moment1.fc.bias", "fc.bias", "exp_avg");
  moment("moment2.fc.bias", "fc.bias", "exp_avg_sq");
  for (const char* tag :
       {"global_step", "learning_rate", "beta1_power", "note", "table"}) {
    const RecordRole& r = RoleOf(x, roles, tag);
    EXPECT_EQ(r.kind, RecordRole::kOther) << tag;
    EXPECT_TRUE(r.verbatim) << tag;
    ++checked;
  }
  EXPECT_FALSE(RoleOf(x, roles, "note").dtype.has_value());
  EXPECT_EQ(RoleOf(x, roles, "counter").dtype, DType::kInt32);
  EXPECT_EQ(checked, 15);
}

TEST(MindSporeRecordsTest, WithoutMomentsEveryFloatIsTrained) {
  CkptIndex f;
  f.entries = {Rec("w", "Float32", {2}), Rec("h", "Float16", {2}),
               Rec("b", "BFloat16", {2}), Rec("i", "Int64", {2})};
  const std::vector<const CkptIndex*> files = {&f};
  const RecordIndex x = IndexRecords(files);
  EXPECT_FALSE(x.has_optimizer());
  const std::vector<RecordRole> roles = ClassifyRecords(x);
  ASSERT_EQ(roles.size(), 4u);
  EXPECT_FALSE(roles[0].buffer);
  EXPECT_EQ(roles[0].state_kind, "fp32");
  EXPECT_FALSE(roles[1].buffer);  // trained, its atom `param` (float16)
  EXPECT_EQ(roles[1].state_kind, "param");
  EXPECT_FALSE(roles[2].buffer);
  EXPECT_TRUE(roles[3].buffer);
}

TEST(MindSporeRecordsTest, AdamWeightDecayNames) {
  CkptIndex f;
  f.entries = {Rec("w", "Float32", {2}), Rec("adam_m.w", "Float32", {2}),
               Rec("adam_v.w", "Float32", {2}),
               Rec("adam_x.w", "Float32", {2})};
  const std::vector<const CkptIndex*> files = {&f};
  const RecordIndex x = IndexRecords(files);
  const std::vector<RecordRole> roles = ClassifyRecords(x);
  EXPECT_EQ(roles[1].kind, RecordRole::kMoment);
  EXPECT_EQ(roles[1].state_kind, "exp_avg");
  EXPECT_EQ(roles[2].kind, RecordRole::kMoment);
  EXPECT_EQ(roles[2].state_kind, "exp_avg_sq");
  // Not a moment prefix: a param of its own (untrained: no moments).
  EXPECT_EQ(roles[3].kind, RecordRole::kParam);
  EXPECT_TRUE(roles[3].buffer);
  ASSERT_TRUE(x.Moment("adam_v.w").has_value());
  EXPECT_FALSE(x.Moment("adam_v.v").has_value());
}

}  // namespace
}  // namespace ucp::mindspore
