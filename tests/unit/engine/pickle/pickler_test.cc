// The protocol-2 pickler on hand-built graphs, byte for byte against what
// CPython's pickle.dumps(..., protocol=2) writes for the same objects.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "tests/unit/engine/pickle/pickle_testutil.h"

namespace ucp::pickle {
namespace {

using testing::CPythonPickle;
using ::testing::HasSubstr;
using testing::PythonLoadsAs;
using ::testing::ThrowsMessage;

TEST(PicklerTest, PlainValuesLikeCPython) {
  Arena a;
  Value* root = a.Dict({
      {a.Str("a"), a.List({a.Int(1), a.Int(2)})},
      {a.Str("b"), a.Tuple({a.Int(1)})},
      {a.Str("c"), a.None()},
      {a.Str("d"), a.Float(1.5)},
      {a.Str("e"), a.Str("x\xc3\xa9")},
      {a.Str("f"), a.Bytes(std::string("\x00\xff", 2))},
      {a.Str("g"), a.Bytes("")},
      {a.Str("h"), a.Bool(true)},
      {a.Str("i"), a.Tuple({})},
      {a.Str("j"), a.Tuple({a.Int(1), a.Int(2), a.Int(3), a.Int(4)})},
  });
  EXPECT_EQ(Pickle(root),
            CPythonPickle("{'a': [1, 2], 'b': (1,), 'c': None, 'd': 1.5, "
                          "'e': 'x\\u00e9', 'f': b'\\x00\\xff', 'g': b'', "
                          "'h': True, 'i': (), 'j': (1, 2, 3, 4)}"));
}

TEST(PicklerTest, IntsAtEveryOpcodeBoundary) {
  Arena a;
  Value* list = a.List({});
  std::string expr = "[";
  for (int k : {7, 8, 15, 16, 31, 32, 62}) {
    for (int64_t base : {int64_t{1} << k, -(int64_t{1} << k)}) {
      for (int64_t d : {-1, 0, 1}) {
        list->items.push_back(a.Int(base + d));
        expr += std::to_string(base + d) + ", ";
      }
    }
  }
  list->items.push_back(a.Int(INT64_MAX));
  list->items.push_back(a.Int(INT64_MIN));
  expr += "2**63 - 1, -2**63, 0]";
  list->items.push_back(a.Int(0));
  EXPECT_EQ(Pickle(list), CPythonPickle(expr));
}

TEST(PicklerTest, SharingAndGlobalMemo) {
  Arena a;
  Value* s = a.Str("shared");
  // Two distinct global nodes naming one class are one object in Python.
  Value* root =
      a.List({s, s, a.Tuple({s}), a.Global("collections", "OrderedDict"),
              a.Global("collections", "OrderedDict")});
  EXPECT_EQ(Pickle(root), CPythonPickle("[s, s, (s,), collections.OrderedDict, "
                                        "collections.OrderedDict]",
                                        "import collections\ns = 'shared'"));
}

TEST(PicklerTest, Python3NamesAreWrittenWithPython2Spelling) {
  Arena a;
  Value* root =
      a.List({a.Global("builtins", "set"), a.Global("builtins", "range"),
              a.Global("builtins", "ConnectionError"),
              a.Global("copyreg", "_reconstructor")});
  EXPECT_EQ(
      Pickle(root),
      CPythonPickle("[set, range, ConnectionError, copyreg._reconstructor]",
                    "import copyreg"));
}

TEST(PicklerTest, SetsAndByteArrays) {
  Arena a;
  Value* root = a.List({a.Set({a.Int(1), a.Int(2)}), a.FrozenSet({}),
                        a.ByteArray("ab"), a.ByteArray("")});
  EXPECT_EQ(Pickle(root),
            CPythonPickle("[{1, 2}, frozenset(), bytearray(b'ab'), "
                          "bytearray()]"));
}

TEST(PicklerTest, RecursiveTuples) {
  Arena a;
  Value* l = a.List({});
  Value* t = a.Tuple({l});
  l->items.push_back(t);
  Value* l4 = a.List({});
  Value* t4 = a.Tuple({l4, a.Int(1), a.Int(2), a.Int(3)});
  l4->items.push_back(t4);
  EXPECT_EQ(Pickle(a.List({t, t4})),
            CPythonPickle("[t, t4]",
                          "l = []\nt = (l,)\nl.append(t)\n"
                          "l4 = []\nt4 = (l4, 1, 2, 3)\nl4.append(t4)"));
}

TEST(PicklerTest, BatchesOfAThousand) {
  Arena a;
  for (int n : {1, 2, 1000, 1001, 2000}) {
    Value* d = a.Dict();
    Value* l = a.List({});
    for (int k = 0; k < n; ++k) {
      d->entries.emplace_back(a.Int(k), a.Int(-k));
      l->items.push_back(a.Int(k));
    }
    const std::string range = "range(" + std::to_string(n) + ")";
    EXPECT_EQ(Pickle(d), CPythonPickle("{k: -k for k in " + range + "}")) << n;
    EXPECT_EQ(Pickle(l), CPythonPickle("list(" + range + ")")) << n;
    // OrderedDict contents follow the iterator batching.
    Value* od = a.Object(ObjectOp::kReduce,
                         a.Global("collections", "OrderedDict"), a.Tuple({}));
    od->entries = d->entries;
    EXPECT_EQ(
        Pickle(od),
        CPythonPickle("collections.OrderedDict((k, -k) for k in " + range + ")",
                      "import collections"))
        << n;
  }
}

TEST(PicklerTest, NestedClassUsesGetattrBelowProtocol4) {
  Arena a;
  Value* root = a.List({a.Global("ucp_corpus_types", "Outer.Inner"),
                        a.Global("ucp_corpus_types", "Outer.Inner")});
  EXPECT_EQ(Pickle(root), CPythonPickle("[ucp_corpus_types.Outer.Inner] * 2",
                                        "import ucp_corpus_types"));
}

TEST(PicklerTest, NewObjExFallsBackToCopyregNewObjEx) {
  Arena a;
  Value* obj =
      a.Object(ObjectOp::kNewObjEx, a.Global("ucp_corpus_types", "KwOnly"),
               a.Tuple({a.Int(1), a.Int(2)}));
  obj->kwargs = a.Dict({{a.Str("scale"), a.Int(3)}});
  obj->state = a.Dict({{a.Str("scale"), a.Int(3)},
                       {a.Str("args"), a.Tuple({a.Int(1), a.Int(2)})}});
  EXPECT_EQ(PythonLoadsAs(Pickle(obj), "ucp_corpus_types.KwOnly(1, 2, scale=3)",
                          "import ucp_corpus_types"),
            "");
}

TEST(PicklerTest, PersistentIdsAreNotMemoised) {
  Arena a;
  Value* key = a.Str("0");
  Value* pid1 = a.PersId(a.Tuple({a.Str("storage"), key}));
  Value* pid2 = a.PersId(a.Tuple({a.Str("storage"), key}));
  Value* root = a.List({pid1, pid2, pid1});
  const std::string out = Pickle(root);
  Arena b;
  Value* back = Unpickle(out, b);
  ASSERT_EQ(back->items.size(), 3u);
  EXPECT_TRUE(DeepEqual(root, back));
  // Three BINPERSIDs; the shared key is written once and fetched twice.
  EXPECT_EQ(std::count(out.begin(), out.end(), 'Q'), 3);
  EXPECT_EQ(back->items[0]->pid->items[1], back->items[1]->pid->items[1]);
  EXPECT_NE(back->items[0], back->items[2]);
}

TEST(PicklerTest, DeepGraphsNeedNoRecursion) {
  Arena a;
  Value* v = a.Int(1);
  for (int k = 0; k < 200000; ++k) v = a.List({v});
  const std::string out = Pickle(v);
  Arena b;
  UnpickleOptions options;
  options.max_depth = 300000;
  EXPECT_TRUE(DeepEqual(v, Unpickle(out, b, nullptr, options)));
  Arena c;
  EXPECT_THAT([&] { Unpickle(out, c); },
              ThrowsMessage<FormatError>(HasSubstr("nested deeper than 1000")));
}

TEST(PicklerTest, MalformedGraphsAreInternalErrors) {
  Arena a;
  EXPECT_THAT([&] { Pickle(a.List({nullptr})); },
              ThrowsMessage<InternalError>(HasSubstr("null Value")));
  Value* obj = a.Object(ObjectOp::kReduce, a.Global("m", "f"), a.List({}));
  EXPECT_THAT([&] { Pickle(obj); },
              ThrowsMessage<InternalError>(HasSubstr("must be a tuple")));
  Value* no_callable = a.Object(ObjectOp::kReduce, nullptr, a.Tuple({}));
  EXPECT_THAT([&] { Pickle(no_callable); },
              ThrowsMessage<InternalError>(HasSubstr("without a callable")));
  EXPECT_THAT([&] { Pickle(a.Global("m\nx", "f")); },
              ThrowsMessage<InternalError>(HasSubstr("newline")));
  PickleOptions p4;
  p4.protocol = 4;
  EXPECT_THAT([&] { Pickle(a.None(), p4); },
              ThrowsMessage<InternalError>(HasSubstr("only protocol 2")));
}

}  // namespace
}  // namespace ucp::pickle
