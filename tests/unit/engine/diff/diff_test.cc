// diff::Compare over two in-memory source plans (PlanInput), windows cut
// smaller than a row and chunks smaller than a window: the differences found
// equal those made by hand, whatever the windowing; states and params one side
// lacks, a shape difference, a derived training-dtype copy and step.

#include "engine/diff/diff.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "engine/universal/input.h"
#include "engine/universal/source_plan.h"

namespace ucp::diff {
namespace {

class BytesSource : public reshape::ByteSource {
 public:
  explicit BytesSource(std::vector<float> v) : v_(std::move(v)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    ASSERT_LE(offset + dst.size(), v_.size() * 4);
    std::memcpy(dst.data(), reinterpret_cast<const char*>(v_.data()) + offset,
                dst.size());
  }
  std::string Describe() const override { return "memory"; }

 private:
  std::vector<float> v_;
};

// Param `name` with state `kind`: one whole fragment over `values`.
void AddAtom(universal::SourcePlan& plan, const std::string& name,
             const std::string& kind, Shape shape, std::vector<float> values) {
  const auto source = static_cast<uint32_t>(plan.sources.size());
  plan.sources.push_back(std::make_unique<BytesSource>(std::move(values)));
  bool known = false;
  for (const atoms::ParamInfo& p : plan.params) known |= p.fqn == name;
  if (!known) {
    atoms::ParamInfo p;
    p.fqn = name;
    p.shape = shape;
    p.order = static_cast<int64_t>(plan.params.size());
    plan.params.push_back(p);
  }
  universal::AtomPlan a;
  a.param = name;
  a.state_kind = kind;
  a.shape = shape;
  universal::Fragment f;
  f.src = {source, 0, DType::kFloat32, shape, {}};
  f.src_box = Box::Whole(shape);
  f.atom_box = Box::Whole(shape);
  f.where = name + " " + kind;
  a.fragments.push_back(std::move(f));
  plan.atoms.push_back(std::move(a));
}

std::vector<float> Ramp(int n, float scale) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i) v.push_back(static_cast<float>(i) * scale);
  return v;
}

const StateDiff& Find(const Report& r, const std::string& param,
                      const std::string& state) {
  for (const ParamDiff& p : r.params)
    for (const StateDiff& s : p.states)
      if (p.name == param && s.state == state) return s;
  ADD_FAILURE() << param << " > " << state << " not in the report";
  static const StateDiff none;
  return none;
}

struct Pair {
  universal::SourcePlan a, b;
};

// t [3, 5, 7] with fp32 and exp_avg on both sides; in B, t's fp32 has
// elements (1, 0, 6) and (2, 3, 4) changed. A also holds a `param` copy of t
// and a 4x2 `u` B holds as 2x4; B also holds a `v` A lacks, and t's step
// (equal to A's iteration 9).
Pair MakePair() {
  Pair p;
  p.a.model.iteration = 9;
  p.b.model.iteration = 9;
  std::vector<float> t = Ramp(105, 0.25f), changed = t;
  changed[1 * 35 + 0 * 7 + 6] = 100.0f;  // was 41 * 0.25 = 10.25
  changed[2 * 35 + 3 * 7 + 4] = -2.0f;   // was 95 * 0.25 = 23.75
  AddAtom(p.a, "t", "fp32", {3, 5, 7}, t);
  AddAtom(p.a, "t", "exp_avg", {3, 5, 7}, Ramp(105, -1));
  AddAtom(p.a, "t", "param", {3, 5, 7}, t);
  AddAtom(p.a, "u", "fp32", {4, 2}, Ramp(8, 1));
  AddAtom(p.b, "t", "fp32", {3, 5, 7}, changed);
  AddAtom(p.b, "t", "exp_avg", {3, 5, 7}, Ramp(105, -1));
  AddAtom(p.b, "t", "step", {}, {9.0f});
  AddAtom(p.b, "u", "fp32", {2, 4}, Ramp(8, 1));
  AddAtom(p.b, "v", "fp32", {2}, {1, 2});
  return p;
}

void ExpectTheDifferences(const Report& r) {
  EXPECT_FALSE(r.equal());
  ASSERT_EQ(r.params.size(), 3u);
  EXPECT_EQ(r.params[2].name, "v");
  EXPECT_FALSE(r.params[2].in_a);
  const StateDiff& t = Find(r, "t", "fp32");
  EXPECT_EQ(t.values.compared, 105);
  EXPECT_EQ(t.values.differing, 2);
  EXPECT_EQ(t.values.first, 41);
  EXPECT_EQ(t.first_index, (Shape{1, 0, 6}));
  EXPECT_EQ(t.values.max_abs, 100.0 - 10.25);  // vs |23.75 - -2| = 25.75
  EXPECT_EQ(t.values.max_rel, 25.75 / 2.0);    // vs 89.75 / 100
  EXPECT_TRUE(Find(r, "t", "exp_avg").equal());
  EXPECT_TRUE(Find(r, "t", "param").derived);  // both hold t's fp32
  EXPECT_TRUE(Find(r, "t", "step").derived);   // 9: A's iteration
  const StateDiff& u = Find(r, "u", "fp32");
  EXPECT_TRUE(u.shape_differs());
  EXPECT_FALSE(u.values_compared);
  EXPECT_EQ(r.elements_compared, 210);
  EXPECT_EQ(r.differing_elements, 2);
  EXPECT_EQ(r.derived_states, 2);
}

TEST(DiffTest, FindsWhatWasChangedWhateverTheWindows) {
  Pair p = MakePair();
  auto a = universal::PlanInput(p.a, "a", {});
  auto b = universal::PlanInput(p.b, "b", {});
  Options o;
  // Windows of 6 elements (cut inside rows of 7: boxes of several rows),
  // chunks of 2 elements.
  o.batch_bytes = 24;
  o.executor.chunk_bytes = 8;
  o.executor.threads = 2;
  ExpectTheDifferences(Compare(*a, *b, o));
  // One window for everything.
  ExpectTheDifferences(Compare(*a, *b, Options{}));
  // Equal to itself.
  const Report same = Compare(*a, *a, o);
  EXPECT_TRUE(same.equal());
  EXPECT_EQ(same.elements_compared, 105 * 3 + 8);
}

TEST(DiffTest, AStepOtherThanTheIterationDiffers) {
  Pair p = MakePair();
  p.a.model.iteration = 10;
  auto a = universal::PlanInput(p.a, "a", {});
  auto b = universal::PlanInput(p.b, "b", {});
  const Report r = Compare(*a, *b, Options{});
  const StateDiff& s = Find(r, "t", "step");
  EXPECT_FALSE(s.derived);
  EXPECT_FALSE(s.equal());
  EXPECT_EQ(s.note, "step 9, A's optimizer step 10");
}

TEST(DiffTest, ToleranceCountsAndItsBounds) {
  Pair p = MakePair();
  auto a = universal::PlanInput(p.a, "a", {});
  auto b = universal::PlanInput(p.b, "b", {});
  Options o;
  o.tolerance.atol = 30;  // 25.75 is within, 89.75 not
  const Report r = Compare(*a, *b, o);
  EXPECT_EQ(Find(r, "t", "fp32").values.differing, 1);
  o.tolerance.atol = -1;
  EXPECT_THROW(Compare(*a, *b, o), UsageError);
}

}  // namespace
}  // namespace ucp::diff
