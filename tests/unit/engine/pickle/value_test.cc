// Value graph helpers: accessors, names, Copy, DeepEqual, Repr, suspicious
// globals. Expected reprs are CPython 3.11's repr() of the same values.

#include "engine/pickle/value.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "tests/unit/engine/pickle/pickle_testutil.h"

namespace ucp::pickle {
namespace {

using testing::Bin;

using ::testing::ElementsAre;
using ::testing::IsEmpty;

Value* Ns(Arena& a, std::vector<std::pair<Value*, Value*>> attrs) {
  Value* obj = a.Object(ObjectOp::kNewObj, a.Global("argparse", "Namespace"),
                        a.Tuple({}));
  obj->state = a.Dict(std::move(attrs));
  return obj;
}

TEST(ValueTest, Accessors) {
  Arena a;
  EXPECT_EQ(a.Int(-5)->AsInt(), -5);
  EXPECT_EQ(a.Bool(true)->AsInt(), 1);
  EXPECT_EQ(a.Str("x")->AsInt(), std::nullopt);
  EXPECT_EQ(a.Int(3)->AsFloat(), 3.0);
  EXPECT_EQ(a.Float(2.5)->AsFloat(), 2.5);
  EXPECT_EQ(a.Str("abc")->AsStr(), "abc");
  EXPECT_EQ(a.Bytes("abc")->AsStr(), std::nullopt);
  Value* big = a.BigInt(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\x01", 9));
  EXPECT_EQ(big->AsInt(), std::nullopt);
  EXPECT_EQ(big->AsFloat(), std::nullopt);
}

TEST(ValueTest, BigIntNormalisesToInt64WhenItFits) {
  Arena a;
  // -1 spelled with redundant sign bytes.
  EXPECT_EQ(a.BigInt(std::string("\xff\xff\xff", 3))->AsInt(), -1);
  EXPECT_EQ(a.BigInt("")->AsInt(), 0);
  EXPECT_EQ(a.BigInt(std::string("\xff\x00", 2))->AsInt(), 255);
  EXPECT_EQ(
      a.BigInt(std::string("\x00\x00\x00\x00\x00\x00\x00\x80", 8))->AsInt(),
      std::numeric_limits<int64_t>::min());
  // 2**63 needs 9 bytes.
  Value* v =
      a.BigInt(std::string("\x00\x00\x00\x00\x00\x00\x00\x80\x00\x00", 10));
  EXPECT_EQ(v->big, std::string("\x00\x00\x00\x00\x00\x00\x00\x80\x00", 9));
}

TEST(ValueTest, GlobalNamesAreNormalised) {
  Arena a;
  Value* g = a.Global("__builtin__", "set");
  EXPECT_TRUE(g->IsGlobal("builtins", "set"));
  EXPECT_TRUE(g->IsGlobal("__builtin__", "set"));
  EXPECT_FALSE(g->IsGlobal("builtins", "frozenset"));
  EXPECT_EQ(g->ClassName(), "builtins.set");
  EXPECT_EQ(a.Global("copy_reg", "_reconstructor")->ClassName(),
            "copyreg._reconstructor");
  // NAME_MAPPING: xrange is range, Python 2 exceptions are builtins.
  EXPECT_EQ(a.Global("__builtin__", "xrange")->ClassName(), "builtins.range");
  EXPECT_EQ(a.Global("exceptions", "ValueError")->ClassName(),
            "builtins.ValueError");
  EXPECT_TRUE(
      a.Global("UserDict", "UserDict")->IsGlobal("collections", "UserDict"));
  EXPECT_EQ(a.Str("x")->ClassName(), "");
}

TEST(ValueTest, ClassNameFollowsReconstructors) {
  Arena a;
  // numpy: _reconstruct(ndarray, (0,), b'b') is an ndarray.
  Value* arr = a.Object(ObjectOp::kReduce,
                        a.Global("numpy.core.multiarray", "_reconstruct"),
                        a.Tuple({a.Global("numpy", "ndarray"),
                                 a.Tuple({a.Int(0)}), a.Bytes("b")}));
  EXPECT_EQ(arr->ClassName(), "numpy.ndarray");
  // Python 3.11 enum members: getattr(cls, 'name').
  Value* member =
      a.Object(ObjectOp::kReduce, a.Global("__builtin__", "getattr"),
               a.Tuple({a.Global("megatron.core.enums", "ModelType"),
                        a.Str("encoder_or_decoder")}));
  EXPECT_EQ(member->ClassName(), "megatron.core.enums.ModelType");
  // copyreg._reconstructor(cls, object, None).
  Value* rec =
      a.Object(ObjectOp::kReduce, a.Global("copy_reg", "_reconstructor"),
               a.Tuple({a.Global("m", "C"), a.Global("__builtin__", "object"),
                        a.None()}));
  EXPECT_EQ(rec->ClassName(), "m.C");
  // An instance of a nested class pickled below protocol 4: NEWOBJ of
  // getattr(Outer, 'Inner').
  Value* inner = a.Object(ObjectOp::kNewObj, member, a.Tuple({}));
  member->args->items[1] = a.Str("Inner");
  member->args->items[0] = a.Global("pkg.mod", "Outer");
  EXPECT_EQ(inner->ClassName(), "pkg.mod.Outer.Inner");
  Value* plain = a.Object(ObjectOp::kReduce,
                          a.Global("collections", "OrderedDict"), a.Tuple({}));
  EXPECT_EQ(plain->ClassName(), "collections.OrderedDict");
}

TEST(ValueTest, DictLikeGetAndAttr) {
  Arena a;
  Value* od = a.Object(ObjectOp::kReduce,
                       a.Global("collections", "OrderedDict"), a.Tuple({}));
  od->entries = {{a.Str("w"), a.Int(1)}, {a.Str("b"), a.Int(2)}};
  EXPECT_TRUE(od->IsDictLike());
  ASSERT_NE(od->Get("b"), nullptr);
  EXPECT_EQ(od->Get("b")->AsInt(), 2);
  EXPECT_EQ(od->Get("zz"), nullptr);
  Value* d = a.Dict({{a.Str("k"), a.Str("v")}});
  EXPECT_TRUE(d->IsDictLike());
  EXPECT_EQ(d->Get("k")->AsStr(), "v");
  EXPECT_FALSE(a.List({})->IsDictLike());
  EXPECT_EQ(a.List({})->Get("k"), nullptr);

  Value* ns = Ns(a, {{a.Str("lr"), a.Float(0.1)}});
  EXPECT_EQ(ns->Attr("lr")->AsFloat(), 0.1);
  EXPECT_EQ(ns->Attr("missing"), nullptr);
  EXPECT_FALSE(ns->IsDictLike());
  // __slots__ objects: state (None, {slot: value}).
  Value* slotted = a.Object(ObjectOp::kNewObj, a.Global("m", "S"), a.Tuple({}));
  slotted->state = a.Tuple({a.None(), a.Dict({{a.Str("a"), a.Int(7)}})});
  EXPECT_EQ(slotted->Attr("a")->AsInt(), 7);
}

TEST(ValueTest, CopyPreservesSharingAndCycles) {
  Arena src;
  Value* shared = src.List({src.Int(1)});
  Value* root = src.List({shared, shared});
  root->items.push_back(root);  // cycle
  Arena dst;
  Value* copy = dst.Copy(root);
  ASSERT_EQ(copy->items.size(), 3u);
  EXPECT_NE(copy, root);
  EXPECT_EQ(copy->items[0], copy->items[1]);
  EXPECT_NE(copy->items[0], shared);
  EXPECT_EQ(copy->items[2], copy);
  EXPECT_TRUE(DeepEqual(root, copy));
  EXPECT_EQ(dst.size(), 3u);  // root, shared, 1
}

TEST(ValueTest, CopyWithSubstitute) {
  Arena src;
  Value* pid = src.PersId(src.Tuple({src.Str("storage"), src.Str("0")}));
  Value* root = src.Dict({{src.Str("t"), pid}, {src.Str("u"), pid}});
  Arena dst;
  Value* replacement = dst.Str("replaced");
  Value* copy = dst.Copy(root, [&](const Value* v) -> Value* {
    return v->kind == Kind::kPersId ? replacement : nullptr;
  });
  EXPECT_EQ(copy->entries[0].second, replacement);
  EXPECT_EQ(copy->entries[1].second, replacement);
  // The pid tuple was not visited.
  EXPECT_EQ(dst.size(), 4u);  // replacement, dict, two keys
}

TEST(ValueTest, CopyOfDeepGraphIsIterative) {
  Arena src;
  Value* v = src.None();
  for (int k = 0; k < 200000; ++k) v = src.List({v});
  Arena dst;
  Value* copy = dst.Copy(v);
  EXPECT_TRUE(DeepEqual(v, copy));
  EXPECT_LE(Repr(copy, 20).size(), 20u);
}

TEST(ValueTest, DeepEqual) {
  Arena a;
  EXPECT_TRUE(DeepEqual(a.Float(NAN), a.Float(NAN)));
  EXPECT_FALSE(DeepEqual(a.Float(0.0), a.Float(-0.0)));
  EXPECT_FALSE(DeepEqual(a.Int(1), a.Float(1.0)));
  EXPECT_FALSE(DeepEqual(a.Int(1), a.Bool(true)));
  EXPECT_FALSE(DeepEqual(a.Str("a"), a.Bytes("a")));
  EXPECT_TRUE(
      DeepEqual(a.Global("__builtin__", "set"), a.Global("builtins", "set")));
  Value* x = a.List({a.Int(1)});
  Value* shared = a.List({x, x});
  Value* copies = a.List({a.List({a.Int(1)}), a.List({a.Int(1)})});
  EXPECT_TRUE(DeepEqual(shared, copies));  // sharing is not compared
  EXPECT_FALSE(DeepEqual(a.List({a.Int(1)}), a.List({a.Int(2)})));
  EXPECT_FALSE(DeepEqual(a.List({a.Int(1)}), a.Tuple({a.Int(1)})));
  Value* c1 = a.List({a.Int(1)});
  c1->items.push_back(c1);
  Value* c2 = a.List({a.Int(1)});
  c2->items.push_back(c2);
  EXPECT_TRUE(DeepEqual(c1, c2));
  Value* c3 = a.List({a.Int(2)});
  c3->items.push_back(c3);
  EXPECT_FALSE(DeepEqual(c1, c3));
  EXPECT_FALSE(DeepEqual(Ns(a, {{a.Str("a"), a.Int(1)}}),
                         Ns(a, {{a.Str("a"), a.Int(2)}})));
  EXPECT_TRUE(DeepEqual(nullptr, nullptr));
  EXPECT_FALSE(DeepEqual(a.None(), nullptr));
}

TEST(ValueTest, ReprScalarsMatchPython) {
  Arena a;
  const size_t kAll = std::string::npos;
  EXPECT_EQ(Repr(a.None(), kAll), "None");
  EXPECT_EQ(Repr(a.Bool(false), kAll), "False");
  EXPECT_EQ(Repr(a.Int(-42), kAll), "-42");
  EXPECT_EQ(Repr(a.BigInt(Bin("\0\0\0\0\0\0\0\0\1")), kAll),
            "18446744073709551616");
  EXPECT_EQ(
      Repr(a.BigInt(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f\xff", 9)),
           kAll),
      "-9223372036854775809");
  struct {
    double f;
    const char* repr;
  } floats[] = {{1.0, "1.0"},
                {1e-05, "1e-05"},
                {1e16, "1e+16"},
                {1.2345678901234568e+17, "1.2345678901234568e+17"},
                {0.0001, "0.0001"},
                {1e15, "1000000000000000.0"},
                {-0.0, "-0.0"},
                {5e-324, "5e-324"},
                {1.7976931348623157e308, "1.7976931348623157e+308"},
                {0.1, "0.1"},
                {1.0 / 3, "0.3333333333333333"},
                {2.5e-7, "2.5e-07"},
                {1e22, "1e+22"},
                {INFINITY, "inf"},
                {-INFINITY, "-inf"},
                {NAN, "nan"}};
  for (const auto& [f, repr] : floats) {
    EXPECT_EQ(Repr(a.Float(f), kAll), repr) << repr;
  }
  EXPECT_EQ(Repr(a.Str("it's"), kAll), "\"it's\"");
  EXPECT_EQ(Repr(a.Str("say \"hi\""), kAll), "'say \"hi\"'");
  EXPECT_EQ(Repr(a.Str("both ' and \""), kAll), "'both \\' and \"'");
  EXPECT_EQ(Repr(a.Str(Bin("\x00\t\n\r\x7f\xc2\x80\xc2\xa0\xc2\xad "
                           "\xc3\xa9\xe2\x80\xa8\xf0\x9f\x98\x80"
                           "\xed\xa0\x80")),
                 kAll),
            "'\\x00\\t\\n\\r\\x7f\\x80\\xa0\\xad "
            "\xc3\xa9\\u2028\xf0\x9f\x98\x80\\ud800'");
  EXPECT_EQ(Repr(a.Bytes(std::string("\x00\x01\xff", 3)), kAll),
            "b'\\x00\\x01\\xff'");
  EXPECT_EQ(Repr(a.Bytes("it's"), kAll), "b\"it's\"");
  EXPECT_EQ(Repr(a.Bytes("both ' and \""), kAll), "b'both \\' and \"'");
  EXPECT_EQ(Repr(a.ByteArray("ab"), kAll), "bytearray(b'ab')");
}

TEST(ValueTest, ReprContainers) {
  Arena a;
  const size_t kAll = std::string::npos;
  EXPECT_EQ(Repr(a.Tuple({a.Int(1)}), kAll), "(1,)");
  EXPECT_EQ(Repr(a.Tuple({}), kAll), "()");
  EXPECT_EQ(Repr(a.List({a.Int(1), a.Str("a")}), kAll), "[1, 'a']");
  EXPECT_EQ(Repr(a.Dict({{a.Str("k"), a.None()}}), kAll), "{'k': None}");
  EXPECT_EQ(Repr(a.Set({}), kAll), "set()");
  EXPECT_EQ(Repr(a.Set({a.Int(1)}), kAll), "{1}");
  EXPECT_EQ(Repr(a.FrozenSet({}), kAll), "frozenset()");
  Value* self = a.List({a.Int(1)});
  self->items.push_back(self);
  EXPECT_EQ(Repr(self, kAll), "[1, [...]]");
  EXPECT_EQ(Repr(Ns(a, {{a.Str("lr"), a.Float(0.1)}}), kAll),
            "argparse.Namespace(lr=0.1)");
  EXPECT_EQ(Repr(a.Global("torch", "float16"), kAll), "<global torch.float16>");
  // Cut to max_len.
  Value* long_list = a.List({});
  for (int k = 0; k < 1000; ++k) long_list->items.push_back(a.Int(k));
  const std::string r = Repr(long_list, 30);
  EXPECT_EQ(r.size(), 30u);
  EXPECT_EQ(r.substr(0, 10), "[0, 1, 2, ");
  EXPECT_EQ(r.substr(27), "...");
  EXPECT_EQ(Repr(a.Str(std::string(1 << 20, 'x')), 12), "'xxxxxxxx...");
}

TEST(ValueTest, SuspiciousGlobals) {
  EXPECT_TRUE(IsSuspiciousGlobal("os", "system"));
  EXPECT_TRUE(IsSuspiciousGlobal("posix", "system"));
  EXPECT_TRUE(IsSuspiciousGlobal("nt", "system"));
  EXPECT_TRUE(IsSuspiciousGlobal("subprocess", "Popen"));
  EXPECT_TRUE(IsSuspiciousGlobal("__builtin__", "eval"));
  EXPECT_TRUE(IsSuspiciousGlobal("builtins", "exec"));
  EXPECT_TRUE(IsSuspiciousGlobal("builtins", "__import__"));
  EXPECT_TRUE(IsSuspiciousGlobal("commands", "getoutput"));
  EXPECT_TRUE(IsSuspiciousGlobal("importlib.util", "spec_from_file_location"));
  EXPECT_TRUE(IsSuspiciousGlobal("pickle", "loads"));
  EXPECT_TRUE(IsSuspiciousGlobal("_pickle", "load"));
  EXPECT_TRUE(IsSuspiciousGlobal("marshal", "loads"));
  EXPECT_TRUE(IsSuspiciousGlobal("runpy", "run_path"));
  EXPECT_TRUE(IsSuspiciousGlobal("ctypes", "CDLL"));
  EXPECT_TRUE(IsSuspiciousGlobal("codecs", "open"));
  // What real checkpoints use.
  EXPECT_FALSE(IsSuspiciousGlobal("__builtin__", "getattr"));
  EXPECT_FALSE(IsSuspiciousGlobal("__builtin__", "set"));
  EXPECT_FALSE(IsSuspiciousGlobal("__builtin__", "bytes"));
  EXPECT_FALSE(IsSuspiciousGlobal("_codecs", "encode"));
  EXPECT_FALSE(IsSuspiciousGlobal("collections", "OrderedDict"));
  EXPECT_FALSE(IsSuspiciousGlobal("torch._utils", "_rebuild_tensor_v2"));
  EXPECT_FALSE(IsSuspiciousGlobal("numpy.core.multiarray", "_reconstruct"));
  EXPECT_FALSE(IsSuspiciousGlobal("argparse", "Namespace"));
  EXPECT_FALSE(IsSuspiciousGlobal("ossify", "system"));  // module prefix only

  Arena a;
  a.Global("posix", "system");
  a.Global("collections", "OrderedDict");
  a.Global("posix", "system");
  a.Global("__builtin__", "eval");
  EXPECT_THAT(SuspiciousGlobals(a),
              ElementsAre("__builtin__.eval", "posix.system"));
  Arena clean;
  clean.Global("_codecs", "encode");
  EXPECT_THAT(SuspiciousGlobals(clean), IsEmpty());
}

}  // namespace
}  // namespace ucp::pickle
