// --rng-state (engine/formats/megatron/rng_state.h): numpy's module path in
// the pickled RNG states. Expected spellings are numpy's own: numpy 1 pickles
// an ndarray as `numpy.core.multiarray _reconstruct`, numpy 2 as
// `numpy._core.multiarray _reconstruct`; `numpy ndarray` / `numpy dtype` are
// the same in both. The CLI test (tests/cli/test_megatron_rng_state.py)
// loads the results with torch, numpy and megatron-core.

#include "engine/formats/megatron/rng_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/value.h"

namespace ucp::megatron {
namespace {

using pickle::Arena;
using pickle::ObjectOp;
using pickle::Value;
using testing::HasSubstr;
using testing::Not;

// np.random.get_state() as the numpy whose core package is `core` pickles it
// (the key array's bytes shortened): ('MT19937', _reconstruct(ndarray, (0,),
// b'b') + BUILD, 624, 0, 0.0).
Value* NumpyState(Arena& a, const std::string& core) {
  Value* reconstruct = a.Global(core + ".multiarray", "_reconstruct");
  Value* ndarray = a.Global("numpy", "ndarray");
  Value* arr = a.Object(ObjectOp::kReduce, reconstruct,
                        a.Tuple({ndarray, a.Tuple({a.Int(0)}), a.Bytes("b")}));
  Value* dtype = a.Object(ObjectOp::kReduce, a.Global("numpy", "dtype"),
                          a.Tuple({a.Str("u4"), a.Bool(false), a.Bool(true)}));
  arr->state = a.Tuple({a.Int(1), a.Tuple({a.Int(624)}), dtype, a.Bool(false),
                        a.Bytes(std::string(8, '\x01'))});
  return a.Tuple({a.Str("MT19937"), arr, a.Int(624), a.Int(0), a.Float(0)});
}

// Megatron's rng_state: [{random_rng_state, np_rng_state, ...}].
Value* RngState(Arena& a, Value* np_state) {
  return a.List({a.Dict({{a.Str("random_rng_state"), a.Tuple({a.Int(3)})},
                         {a.Str("np_rng_state"), np_state}})});
}

TEST(RngState, Numpy1PathRespelledForNumpy2) {
  Arena a;
  Value* root = RngState(a, NumpyState(a, "numpy.core"));
  const std::string before = pickle::Pickle(root);
  EXPECT_THAT(before, HasSubstr("cnumpy.core.multiarray\n_reconstruct\n"));

  NumpyPaths found = ApplyRngStateMode(root, RngStateMode::kKeep);
  EXPECT_TRUE(found.numpy1);
  EXPECT_FALSE(found.numpy2);
  EXPECT_EQ(pickle::Pickle(root), before);  // keep changes nothing

  found = ApplyRngStateMode(root, RngStateMode::kNumpy2);
  EXPECT_TRUE(found.numpy1);
  const std::string after = pickle::Pickle(root);
  EXPECT_THAT(after, HasSubstr("cnumpy._core.multiarray\n_reconstruct\n"));
  EXPECT_THAT(after, Not(HasSubstr("numpy.core")));
  EXPECT_THAT(after, HasSubstr("cnumpy\nndarray\n"));
  EXPECT_THAT(after, HasSubstr("cnumpy\ndtype\n"));
  // Only the module's spelling: same length plus one byte.
  EXPECT_EQ(after.size(), before.size() + 1);

  // And back: the original bytes.
  found = ApplyRngStateMode(root, RngStateMode::kNumpy1);
  EXPECT_TRUE(found.numpy2);
  EXPECT_FALSE(found.numpy1);
  EXPECT_EQ(pickle::Pickle(root), before);
}

TEST(RngState, OnlyNumpysCorePackage) {
  Arena a;
  Value* core = a.Global("numpy.core", "x");
  Value* scalar = a.Global("numpy.core.multiarray", "scalar");
  Value* other = a.Global("numpy.corex", "y");
  Value* mine = a.Global("mynumpy.core", "z");
  Value* plain = a.Global("numpy", "dtype");
  Value* list = a.List({core, scalar, other, mine, plain});
  list->items.push_back(list);  // a cycle
  list->items.push_back(core);  // and sharing
  const NumpyPaths found = ApplyRngStateMode(list, RngStateMode::kNumpy2);
  EXPECT_TRUE(found.numpy1);
  EXPECT_EQ(core->module, "numpy._core");
  EXPECT_EQ(scalar->module, "numpy._core.multiarray");
  EXPECT_EQ(scalar->name, "scalar");
  EXPECT_EQ(other->module, "numpy.corex");
  EXPECT_EQ(mine->module, "mynumpy.core");
  EXPECT_EQ(plain->module, "numpy");
  EXPECT_EQ(ApplyRngStateMode(nullptr, RngStateMode::kNumpy2).numpy1, false);
}

TEST(RngState, OptionValues) {
  formats::OptionValues v;
  EXPECT_EQ(ParseRngStateMode(v), RngStateMode::kKeep);
  for (const auto& [text, mode] : {std::pair{"keep", RngStateMode::kKeep},
                                   std::pair{"numpy2", RngStateMode::kNumpy2},
                                   std::pair{"numpy1", RngStateMode::kNumpy1},
                                   std::pair{"drop", RngStateMode::kDrop}}) {
    formats::OptionValues x;
    x.Set(kRngStateOption, text);
    EXPECT_EQ(ParseRngStateMode(x), mode) << text;
  }
  formats::OptionValues bad;
  bad.Set(kRngStateOption, "numpy3");
  try {
    ParseRngStateMode(bad);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("--rng-state 'numpy3'"));
    EXPECT_THAT(e.what(), HasSubstr("keep, numpy2, numpy1 or drop"));
  }
  const formats::OptionSpec spec = RngStateOptionSpec("Megatron");
  EXPECT_EQ(spec.name, "rng-state");
  EXPECT_EQ(spec.type, formats::OptionSpec::Type::kString);
  EXPECT_THAT(spec.help, HasSubstr("--no-load-rng"));
}

TEST(RngState, Notes) {
  EXPECT_THAT(RngStateNote(RngStateMode::kKeep, {.numpy1 = true}, true),
              HasSubstr("--rng-state numpy2"));
  EXPECT_EQ(RngStateNote(RngStateMode::kKeep, {.numpy2 = true}, true), "");
  EXPECT_EQ(RngStateNote(RngStateMode::kKeep, {.numpy1 = true}, false), "");
  EXPECT_EQ(RngStateNote(RngStateMode::kNumpy2, {.numpy2 = true}, true), "");
  EXPECT_THAT(RngStateNote(RngStateMode::kDrop, {}, true),
              HasSubstr("--no-load-rng"));
}

}  // namespace
}  // namespace ucp::megatron
