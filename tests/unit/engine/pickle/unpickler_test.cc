// The pickle VM on hand-written opcode streams. Where a stream is not one
// CPython's pickler writes, the expected object is what CPython's
// pickle.loads makes of the same bytes (checked with PythonLoadsAs).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "tests/unit/engine/pickle/pickle_testutil.h"

namespace ucp::pickle {
namespace {

using testing::Bin;
using testing::BinGet;
using testing::BinPut;
using testing::BinUnicode;
using testing::Global;
using ::testing::HasSubstr;
using testing::LE;
using testing::Proto;
using testing::PythonLoadsAs;
using ::testing::ThrowsMessage;

Value* Load(const std::string& data, Arena& arena) {
  return Unpickle(data, arena);
}

// Expects Unpickle to throw FormatError whose message contains `what`.
void ExpectFormatError(const std::string& data, const std::string& what) {
  Arena arena;
  EXPECT_THAT([&] { Unpickle(data, arena); },
              ThrowsMessage<FormatError>(HasSubstr(what)))
      << "stream of " << data.size() << " bytes";
}

TEST(UnpicklerTest, Scalars) {
  Arena a;
  EXPECT_EQ(Load(Proto(2) + "N.", a)->kind, Kind::kNone);
  EXPECT_EQ(Load(Proto(2) + "\x88.", a)->b, true);
  EXPECT_EQ(Load(Proto(2) + "\x89.", a)->b, false);
  EXPECT_EQ(Load(Proto(2) + "K\xff.", a)->AsInt(), 255);
  EXPECT_EQ(Load(Proto(2) + "M\xff\xff.", a)->AsInt(), 65535);
  EXPECT_EQ(Load(Proto(2) + "J" + LE(0xfffffffe, 4) + ".", a)->AsInt(), -2);
  EXPECT_EQ(Load(Proto(2) + Bin("\x8a\x00."), a)->AsInt(), 0);
  EXPECT_EQ(Load(Proto(2) + Bin("\x8a\x02\x00\x80."), a)->AsInt(), -32768);
  Value* big = Load(Proto(2) + "\x8b" + LE(9, 4) +
                        Bin("\x00\x00\x00\x00\x00\x00\x00\x00\x01") + ".",
                    a);
  EXPECT_EQ(Repr(big, 100), "18446744073709551616");
  EXPECT_EQ(Load(Proto(2) + Bin("G\x3f\xf8\x00\x00\x00\x00\x00\x00."), a)->f,
            1.5);
  EXPECT_EQ(Load(Proto(4) + "\x8c\x03" + "abc" + ".", a)->s, "abc");
  EXPECT_EQ(Load(Proto(4) + "\x8d" + LE(2, 8) + "hi" + ".", a)->s, "hi");
  Value* b = Load(Proto(3) + "C\x02" + Bin("\x00\xff") + ".", a);
  EXPECT_EQ(b->kind, Kind::kBytes);
  EXPECT_EQ(b->s, Bin("\x00\xff"));
  EXPECT_EQ(Load(Proto(3) + "B" + LE(1, 4) + "z.", a)->s, "z");
  EXPECT_EQ(Load(Proto(4) + "\x8e" + LE(1, 8) + "y.", a)->s, "y");
  Value* ba = Load(Proto(5) + "\x96" + LE(2, 8) + "ab.", a);
  EXPECT_EQ(ba->kind, Kind::kByteArray);
  EXPECT_EQ(ba->s, "ab");
  // Lone surrogates pass (CPython decodes with 'surrogatepass').
  EXPECT_EQ(Load(Proto(2) + BinUnicode(Bin("\xed\xa0\x80")) + ".", a)->s,
            Bin("\xed\xa0\x80"));
}

TEST(UnpicklerTest, Protocol0And1Opcodes) {
  // (S'a\x41\n\'' I12 I01 L123...L F1.5 V\u20ac\\u t.
  const std::string text =
      "(S'a\\x41\\n\\''\nI12\nI01\nL123456789012345678901234567890L\nF1.5\n"
      "V\\u20ac\\\\u\nt.";
  Arena a;
  Value* t = Load(text, a);
  ASSERT_EQ(t->kind, Kind::kTuple);
  ASSERT_EQ(t->items.size(), 6u);
  EXPECT_EQ(t->items[0]->s, "aA\n'");
  EXPECT_EQ(t->items[1]->AsInt(), 12);
  EXPECT_EQ(t->items[2]->kind, Kind::kBool);
  EXPECT_EQ(Repr(t->items[3], 100), "123456789012345678901234567890");
  EXPECT_EQ(t->items[4]->f, 1.5);
  EXPECT_EQ(t->items[5]->s, "\xe2\x82\xac\\\\u");
  EXPECT_EQ(PythonLoadsAs(text,
                          "('aA\\n\\'', 12, True, "
                          "123456789012345678901234567890, 1.5, "
                          "'\\u20ac\\\\\\\\u')"),
            "");
  // BINSTRING / SHORT_BINSTRING.
  Value* s = Load(Bin("T\x03\x00\x00\x00"
                      "abcU\x02xy\x86."),
                  a);
  EXPECT_EQ(s->items[0]->s, "abc");
  EXPECT_EQ(s->items[1]->s, "xy");
  // Non-UTF-8 Python 2 str stays bytes.
  EXPECT_EQ(Load(Bin("U\x01\xff."), a)->kind, Kind::kBytes);
}

TEST(UnpicklerTest, InstAndObj) {
  const std::string inst = "(iargparse\nNamespace\np0\n(dp1\nVa\np2\nI1\nsb.";
  Arena a;
  Value* ns = Load(inst, a);
  ASSERT_EQ(ns->kind, Kind::kObject);
  EXPECT_EQ(ns->ClassName(), "argparse.Namespace");
  EXPECT_EQ(ns->op, ObjectOp::kNewObj);  // no args: cls.__new__(cls)
  EXPECT_EQ(ns->Attr("a")->AsInt(), 1);
  EXPECT_EQ(PythonLoadsAs(inst, "argparse.Namespace(a=1)", "import argparse"),
            "");
  Value* obj = Load("(cargparse\nNamespace\nI5\no.", a);
  EXPECT_EQ(obj->ClassName(), "argparse.Namespace");
  EXPECT_EQ(obj->op, ObjectOp::kReduce);
  ASSERT_EQ(obj->args->items.size(), 1u);
  EXPECT_EQ(obj->args->items[0]->AsInt(), 5);
}

TEST(UnpicklerTest, MemoSharingAndCycles) {
  // [1, 2, <itself>] written with protocol 0 PUT/GET.
  const std::string text = "(lp0\nI1\naI2\nag0\na.";
  Arena a;
  Value* l = Load(text, a);
  ASSERT_EQ(l->items.size(), 3u);
  EXPECT_EQ(l->items[2], l);
  // MEMOIZE numbers entries by memo size; BINGET shares the node.
  Value* t = Load(Proto(4) + "]\x94" + "\x8c\x01x\x94" + "h\x01\x87.", a);
  ASSERT_EQ(t->kind, Kind::kTuple);
  EXPECT_EQ(t->items[1], t->items[2]);
  EXPECT_EQ(t->items[1]->s, "x");
  EXPECT_EQ(t->items[0]->kind, Kind::kList);
  Value* t2 = Load(Proto(4) + "]\x94" + "0" + Bin("h\x00h\x00\x86."), a);
  EXPECT_EQ(t2->items[0], t2->items[1]);
  // A memo index of 2**32-1 is just a key (no 4e9-entry table).
  Value* n = Load(Proto(2) + "N" + "r" + LE(0xffffffff, 4) + "0" + "j" +
                      LE(0xffffffff, 4) + ".",
                  a);
  EXPECT_EQ(n->kind, Kind::kNone);
}

TEST(UnpicklerTest, StackOpcodes) {
  Arena a;
  // DUP then TUPLE2: the same node twice.
  Value* t = Load(Proto(2) + "]2\x86.", a);
  EXPECT_EQ(t->items[0], t->items[1]);
  // POP_MARK discards back to the mark; POP on an empty frame pops the mark.
  EXPECT_EQ(Load(Proto(2) + "K\x01(K\x02K\x03" + "1.", a)->AsInt(), 1);
  EXPECT_EQ(Load(Proto(2) + "K\x07(0.", a)->AsInt(), 7);
  // FRAME is accepted and ignored.
  EXPECT_EQ(Load(Proto(4) + "\x95" + LE(2, 8) + "N.", a)->kind, Kind::kNone);
}

TEST(UnpicklerTest, ContainersAndSets) {
  Arena a;
  Value* d = Load(Proto(2) + "(K\x01K\x02K\x03K\x04" + "d.", a);
  ASSERT_EQ(d->kind, Kind::kDict);
  ASSERT_EQ(d->entries.size(), 2u);
  EXPECT_EQ(d->entries[1].first->AsInt(), 3);
  Value* l = Load(Proto(2) + "(K\x01K\x02l.", a);
  EXPECT_EQ(l->kind, Kind::kList);
  EXPECT_EQ(l->items.size(), 2u);
  Value* s = Load(Proto(4) + "\x8f(K\x01K\x02\x90.", a);
  EXPECT_EQ(s->kind, Kind::kSet);
  EXPECT_EQ(s->items.size(), 2u);
  Value* fs = Load(Proto(4) + "(K\x01\x91.", a);
  EXPECT_EQ(fs->kind, Kind::kFrozenSet);
  // Protocol 2 spelling of a set: __builtin__.set([1]).
  Value* s2 =
      Load(Proto(2) + Global("__builtin__", "set") + "]K\x01" + "a\x85R.", a);
  EXPECT_EQ(s2->kind, Kind::kSet);
  ASSERT_EQ(s2->items.size(), 1u);
  EXPECT_EQ(s2->items[0]->AsInt(), 1);
  Value* fs2 =
      Load(Proto(2) + Global("__builtin__", "frozenset") + "]\x85R.", a);
  EXPECT_EQ(fs2->kind, Kind::kFrozenSet);
}

TEST(UnpicklerTest, BytesSpelledWithCodecsEncode) {
  Arena a;
  const std::string latin1 = BinUnicode("latin1");
  // b'\x00\xff' in protocol 2.
  Value* b = Load(Proto(2) + Global("_codecs", "encode") +
                      BinUnicode(Bin("\x00\xc3\xbf")) + latin1 + "\x86R.",
                  a);
  EXPECT_EQ(b->kind, Kind::kBytes);
  EXPECT_EQ(b->s, Bin("\x00\xff"));
  Value* empty = Load(Proto(2) + Global("__builtin__", "bytes") + ")R.", a);
  EXPECT_EQ(empty->kind, Kind::kBytes);
  EXPECT_EQ(empty->s, "");
  Value* ba = Load(Proto(2) + Global("__builtin__", "bytearray") +
                       Global("_codecs", "encode") + BinUnicode("ab") + latin1 +
                       "\x86R\x85R.",
                   a);
  EXPECT_EQ(ba->kind, Kind::kByteArray);
  EXPECT_EQ(ba->s, "ab");
  // Text beyond latin-1 or another codec stays an opaque call.
  Value* euro = Load(Proto(2) + Global("_codecs", "encode") +
                         BinUnicode("\xe2\x82\xac") + latin1 + "\x86R.",
                     a);
  EXPECT_EQ(euro->kind, Kind::kObject);
  Value* utf8 = Load(Proto(2) + Global("_codecs", "encode") + BinUnicode("x") +
                         BinUnicode("utf-8") + "\x86R.",
                     a);
  EXPECT_EQ(utf8->kind, Kind::kObject);
  EXPECT_EQ(utf8->ClassName(), "_codecs.encode");
}

TEST(UnpicklerTest, OrderedDictWithMetadataLikeTorchStateDict) {
  // OrderedDict() + SETITEMS + BUILD({'_metadata': OrderedDict()}).
  const std::string data =
      Proto(2) + Global("collections", "OrderedDict") + BinPut(0) + ")R" +
      BinPut(1) + "(" + BinUnicode("w") + "K\x01" + BinUnicode("b") + "K\x02" +
      "u}(" + BinUnicode("_metadata") + BinGet(0) + ")Rub.";
  Arena a;
  Value* sd = Load(data, a);
  ASSERT_TRUE(sd->IsDictLike());
  ASSERT_EQ(sd->entries.size(), 2u);
  EXPECT_EQ(sd->Get("b")->AsInt(), 2);
  ASSERT_NE(sd->Attr("_metadata"), nullptr);
  EXPECT_EQ(sd->Attr("_metadata")->ClassName(), "collections.OrderedDict");
  // APPENDS into an object (list subclass).
  Value* obj = Load(Proto(2) + Global("m", "L") + ")\x81(K\x01K\x02" + "e.", a);
  EXPECT_EQ(obj->items.size(), 2u);
}

TEST(UnpicklerTest, NewObjExAndStackGlobal) {
  const std::string data =
      Proto(4) + "\x8c\x01m\x8c\x01" + "C\x93" + ")}\x8c\x01kK\x01s\x92.";
  Arena a;
  Value* obj = Load(data, a);
  ASSERT_EQ(obj->kind, Kind::kObject);
  EXPECT_EQ(obj->op, ObjectOp::kNewObjEx);
  EXPECT_EQ(obj->ClassName(), "m.C");
  ASSERT_NE(obj->kwargs, nullptr);
  EXPECT_EQ(obj->kwargs->Get("k")->AsInt(), 1);
}

TEST(UnpicklerTest, PersistentIds) {
  Arena a;
  Value* p = Load(Proto(2) + "(" + BinUnicode("storage") + "K\x05tQ.", a);
  ASSERT_EQ(p->kind, Kind::kPersId);
  EXPECT_EQ(p->pid->kind, Kind::kTuple);
  Value* q = Load("P0\n.", a);
  EXPECT_EQ(q->pid->s, "0");
}

TEST(UnpicklerTest, ConsumedAllowsBackToBackPickles) {
  const std::string data = Proto(2) + "K\x01." + Proto(2) + "K\x02.";
  Arena a;
  size_t used = 0;
  EXPECT_EQ(Unpickle(data, a, &used)->AsInt(), 1);
  EXPECT_EQ(used, 5u);
  EXPECT_EQ(Unpickle(std::string_view(data).substr(used), a, &used)->AsInt(),
            2);
}

TEST(UnpicklerTest, DepthLimit) {
  std::string nested = Proto(2);
  for (int k = 0; k < 50; ++k) nested += "]";
  for (int k = 0; k < 49; ++k) nested += "a";
  nested += ".";
  Arena a;
  EXPECT_NE(Unpickle(nested, a), nullptr);
  UnpickleOptions strict;
  strict.max_depth = 49;
  EXPECT_THAT([&] { Unpickle(nested, a, nullptr, strict); },
              ThrowsMessage<FormatError>(HasSubstr("nested deeper than 49")));
  strict.max_depth = 50;
  EXPECT_NE(Unpickle(nested, a, nullptr, strict), nullptr);
}

TEST(UnpicklerTest, ErrorsNameWhatAndWhere) {
  ExpectFormatError("", "truncated at byte 0: no STOP");
  ExpectFormatError(Proto(2) + Bin("X\x05\x00\x00\x00"
                                   "ab"),
                    "truncated BINUNICODE at byte 2");
  ExpectFormatError(Proto(2) + "\xff", "unknown opcode 0xff at byte 2");
  ExpectFormatError(Proto(9), "unsupported protocol 9");
  ExpectFormatError(Proto(2) + "a.", "stack underflow in APPEND at byte 2");
  ExpectFormatError(Proto(2) + "K\x01" + "e.", "APPENDS without MARK");
  ExpectFormatError(Proto(2) + "(K\x01" + "0" + "0" + "0.",
                    "stack underflow in POP at byte 7");
  ExpectFormatError(Proto(2) + "h\x07.", "BINGET of unknown memo index 7");
  ExpectFormatError(Proto(2) + "K\x01K\x02.",
                    "STOP with 2 values on the stack");
  ExpectFormatError(Proto(2) + "(N.", "STOP with an unclosed MARK");
  ExpectFormatError(Proto(2) + "K\x01}b.", "BUILD on a int");
  ExpectFormatError(Proto(2) + "K\x01" + "K\x02" + "a.", "APPEND to a int");
  ExpectFormatError(Proto(2) + "}(K\x01u.", "odd number of items");
  ExpectFormatError(Proto(2) + "(K\x01" + "d.", "odd number of items");
  ExpectFormatError(Proto(2) + Global("m", "f") + "]R.",
                    "REDUCE argument is a list, not a tuple");
  ExpectFormatError(Proto(2) + Global("m", "f") + "N\x81.",
                    "NEWOBJ argument is a None");
  ExpectFormatError(Proto(4) + "K\x01\x8c\x01x\x93.",
                    "STACK_GLOBAL needs str module and name");
  ExpectFormatError(Proto(4) + "\x8d" + LE(uint64_t{1} << 62, 8),
                    "truncated BINUNICODE8 at byte 2 (declares "
                    "4611686018427387904 bytes, 0 remain)");
  ExpectFormatError(Proto(2) + "\x8b" + LE(0x80000000u, 4) + "xx",
                    "LONG4 with negative byte count");
  ExpectFormatError(Proto(2) + "\x8b" + LE(0x7fffffffu, 4) + "xx",
                    "truncated LONG4");
  ExpectFormatError(Proto(3) + "B" + LE(0xffffffffu, 4) + "xx",
                    "declares 4294967295 bytes");
  ExpectFormatError(Proto(2) + BinUnicode(Bin("\xc3\x28")) + ".",
                    "invalid UTF-8 in BINUNICODE");
  ExpectFormatError(Proto(2) + "\x82\x01.", "unsupported opcode EXT1");
  ExpectFormatError(Proto(5) + "\x97.", "unsupported opcode NEXT_BUFFER");
  ExpectFormatError("I12x\n.", "invalid number in INT");
  ExpectFormatError("S'abc\n.", "STRING argument is not quoted");
  ExpectFormatError("p-1\nN.", "bad memo index in PUT");
  ExpectFormatError(Proto(2) + "o.", "OBJ without MARK");
  ExpectFormatError(Proto(2) + "(o.", "OBJ without a class");
  ExpectFormatError(Proto(4) + "](K\x01\x90.", "ADDITEMS on a list");
}

}  // namespace
}  // namespace ucp::pickle
