// Corrupted and hostile pickles, run under ASan + UBSan: every input either
// unpickles or raises ucp::FormatError naming what is wrong and where; never a
// crash, a sanitizer report, another exception type or an allocation out of
// proportion to the input.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "tests/testutil/testutil.h"

namespace ucp::pickle {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string LE(uint64_t v, int n) {
  std::string out;
  for (int k = 0; k < n; ++k) out += static_cast<char>((v >> (8 * k)) & 0xff);
  return out;
}

std::string P2() { return std::string("\x80\x02", 2); }
std::string P4() { return std::string("\x80\x04", 2); }

std::string Hex(std::string_view data, size_t max = 160) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (size_t k = 0; k < data.size() && k < max; ++k) {
    const auto c = static_cast<unsigned char>(data[k]);
    out += kHex[c >> 4];
    out += kHex[c & 0xf];
  }
  if (data.size() > max) out += "...";
  return out;
}

// Opcodes as pickletools documents them (protocols 0-5).
const std::string& KnownOpcodes() {
  static const std::string* ops = new std::string(
      std::string("(.012FIJKLMNPQRSTUVXabcdeghijlopqrstu}])GBC") +
      "\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90"
      "\x91\x92\x93\x94\x95\x96\x97\x98");
  return *ops;
}

// Graphs like the ones checkpoints hold, pickled by ucp's own pickler.
std::vector<std::string> Samples() {
  std::vector<std::string> out;
  {
    // A torch state dict: OrderedDict of _rebuild_tensor_v2 calls with
    // persistent storage ids and the _metadata attribute.
    Arena a;
    Value* sd = a.Object(ObjectOp::kReduce,
                         a.Global("collections", "OrderedDict"), a.Tuple({}));
    Value* rebuild = a.Global("torch._utils", "_rebuild_tensor_v2");
    Value* storage_type = a.Global("torch", "FloatStorage");
    Value* cpu = a.Str("cpu");
    for (int k = 0; k < 6; ++k) {
      Value* pid =
          a.PersId(a.Tuple({a.Str("storage"), storage_type,
                            a.Str(std::to_string(k)), cpu, a.Int(12)}));
      Value* t =
          a.Object(ObjectOp::kReduce, rebuild,
                   a.Tuple({pid, a.Int(0), a.Tuple({a.Int(3), a.Int(4)}),
                            a.Tuple({a.Int(4), a.Int(1)}), a.Bool(false),
                            a.Object(ObjectOp::kReduce,
                                     a.Global("collections", "OrderedDict"),
                                     a.Tuple({}))}));
      sd->entries.emplace_back(a.Str("layers." + std::to_string(k) + ".weight"),
                               t);
    }
    sd->state = a.Dict(
        {{a.Str("_metadata"),
          a.Dict({{a.Str(""), a.Dict({{a.Str("version"), a.Int(1)}})}})}});
    out.push_back(Pickle(
        a.Dict({{a.Str("model"), sd}, {a.Str("iteration"), a.Int(1000)}})));
  }
  {
    // Megatron-ish: args namespace, enums, rng state, bytes, sets, ints.
    Arena a;
    Value* ns = a.Object(ObjectOp::kNewObj, a.Global("argparse", "Namespace"),
                         a.Tuple({}));
    Value* attrs = a.Dict();
    attrs->entries.emplace_back(a.Str("lr"), a.Float(1e-4));
    attrs->entries.emplace_back(a.Str("fp16"), a.Bool(true));
    attrs->entries.emplace_back(a.Str("tokenizer"), a.None());
    attrs->entries.emplace_back(
        a.Str("model_type"),
        a.Object(ObjectOp::kReduce, a.Global("__builtin__", "getattr"),
                 a.Tuple({a.Global("megatron.core.enums", "ModelType"),
                          a.Str("encoder_or_decoder")})));
    ns->state = attrs;
    Value* big = a.BigInt(std::string(20, '\x7f'));
    Value* rng =
        a.Tuple({a.Str("MT19937"), a.Bytes(std::string("\x00\x01\xff\x80", 4)),
                 a.Int(624), a.Int(0), a.Float(0.0)});
    Value* shared = a.List({a.Int(-1), a.Int(70000), a.Int(-3000000000LL)});
    Value* cyclic = a.List({a.Str("self")});
    cyclic->items.push_back(cyclic);
    out.push_back(Pickle(a.Dict({
        {a.Str("args"), ns},
        {a.Str("rng"), rng},
        {a.Str("big"), big},
        {a.Str("set"), a.Set({a.Str("a"), a.Str("b")})},
        {a.Str("frozen"), a.FrozenSet({a.Int(1)})},
        {a.Str("ba"), a.ByteArray("xyz")},
        {a.Str("empty"), a.Bytes("")},
        {a.Str("s1"), shared},
        {a.Str("s2"), shared},
        {a.Str("cycle"), cyclic},
        {a.Str("t4"), a.Tuple({a.Int(1), a.Int(2), a.Int(3), a.Int(4)})},
        {a.Str("nested.Class"), a.Global("pkg", "Outer.Inner")},
    })));
  }
  {
    // Over 256 memo entries (LONG_BINPUT / LONG_BINGET) and long batches.
    Arena a;
    Value* l = a.List({});
    for (int k = 0; k < 300; ++k)
      l->items.push_back(a.Str("s" + std::to_string(k)));
    for (int k = 0; k < 300; k += 7) l->items.push_back(l->items[k]);
    out.push_back(Pickle(l));
  }
  // Protocol 4/5 and protocol 0 spellings written by hand.
  const std::string framed = std::string("}\x94(\x8c\x01m\x94\x8c\x01") +
                             "C\x94\x93\x94)}\x92\x94" + "\x8f(K\x01\x90" +
                             "\x8c\x01k" + "(K\x02\x91" + "C\x02" + "ab" +
                             "\x96" + LE(1, 8) + "zu.";
  out.push_back(P4() + "\x95" + LE(framed.size(), 8) + framed);
  out.push_back(
      "(iargparse\nNamespace\np0\n(dp1\nVkey\np2\n(lp3\nI1\naF2.5\n"
      "aL12345678901234567890L\naS'str'\nag2\nasb.");
  return out;
}

void ExpectFormatError(const std::string& data, const std::string& what) {
  Arena arena;
  try {
    Unpickle(data, arena);
    ADD_FAILURE() << "no error for " << Hex(data);
  } catch (const FormatError& e) {
    EXPECT_THAT(e.what(), HasSubstr(what)) << Hex(data);
    EXPECT_THAT(e.what(), StartsWith("pickle: "));
  }
}

TEST(PickleMalformedTest, SamplesAreValid) {
  for (const std::string& s : Samples()) {
    Arena a;
    EXPECT_NE(Unpickle(s, a), nullptr) << Hex(s);
  }
}

TEST(PickleMalformedTest, TruncatedAtEveryByte) {
  for (const std::string& s : Samples()) {
    for (size_t n = 0; n < s.size(); ++n) {
      Arena a;
      try {
        Unpickle(std::string_view(s).substr(0, n), a);
        ADD_FAILURE() << "prefix of " << n << " bytes parsed: " << Hex(s);
      } catch (const FormatError& e) {
        const std::string msg = e.what();
        EXPECT_THAT(msg, HasSubstr("truncated")) << n;
        EXPECT_THAT(msg, HasSubstr("at byte ")) << n;
      }
    }
  }
}

TEST(PickleMalformedTest, EveryUnknownOpcode) {
  int unknown = 0;
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    if (KnownOpcodes().find(c) != std::string::npos) continue;
    ++unknown;
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", b);
    ExpectFormatError(P2() + c + ".",
                      std::string("unknown opcode ") + code + " at byte 2");
  }
  EXPECT_EQ(unknown, 256 - 68);
}

TEST(PickleMalformedTest, EveryOpcodeOnAnEmptyStack) {
  for (char op : KnownOpcodes()) {
    if (op == ')' || op == ']' || op == '}' || op == 'N' || op == '\x88' ||
        op == '\x89' || op == '\x8f') {
      continue;  // these push a value: a valid pickle
    }
    Arena a;
    try {
      Unpickle(P2() + op + ".", a);
      ADD_FAILURE() << "accepted opcode " << Hex(std::string(1, op));
    } catch (const FormatError& e) {
      EXPECT_THAT(e.what(), HasSubstr("at byte "));
    }
  }
}

TEST(PickleMalformedTest, StackAndMarkMisuse) {
  ExpectFormatError(P2() + "a.", "stack underflow in APPEND at byte 2");
  ExpectFormatError(P2() + "]K\x01" + "(" + "a.", "stack underflow in APPEND");
  ExpectFormatError(P2() + "R.", "stack underflow in REDUCE");
  ExpectFormatError(P2() + "\x86.", "stack underflow in TUPLE2");
  ExpectFormatError(P2() + "K\x01(\x85.", "stack underflow in TUPLE1");
  ExpectFormatError(P2() + "Q.", "stack underflow in BINPERSID");
  ExpectFormatError(P2() + "0.", "stack underflow in POP");
  ExpectFormatError(P2() + "2.", "stack underflow in DUP");
  ExpectFormatError(P2() + std::string("q\x00.", 3),
                    "stack underflow in BINPUT");
  for (const char* op : {"t", "l", "d", "e", "u", "1", "o"}) {
    ExpectFormatError(P2() + "]" + op + ".", "without MARK at byte 3");
  }
  ExpectFormatError(P4() + "\x8f\x90.", "ADDITEMS without MARK");
  ExpectFormatError(P4() + "\x91.", "FROZENSET without MARK");
  ExpectFormatError(P2() + "(.", "STOP with an unclosed MARK");
  ExpectFormatError(P2() + ".", "STOP with 0 values on the stack");
  ExpectFormatError(P2() + "NN.", "STOP with 2 values on the stack");
}

TEST(PickleMalformedTest, MemoMisuse) {
  ExpectFormatError(P2() + "h\x05.",
                    "BINGET of unknown memo index 5 at byte 2");
  ExpectFormatError(P2() + "j" + LE(0xfffffffe, 4) + ".",
                    "LONG_BINGET of unknown memo index 4294967294");
  ExpectFormatError("g12\n.", "GET of unknown memo index 12 at byte 0");
  ExpectFormatError("Ng\n.", "bad memo index in GET");
  // A huge memo index is only a hash key.
  Arena a;
  EXPECT_EQ(Unpickle(P2() + "N" + "r" + LE(0xffffffff, 4) + "j" +
                         LE(0xffffffff, 4) + "\x86.",
                     a)
                ->items.size(),
            2u);
}

TEST(PickleMalformedTest, HugeDeclaredLengths) {
  ExpectFormatError(P4() + "\x8d" + LE(uint64_t{1} << 62, 8) + "ab",
                    "truncated BINUNICODE8 at byte 2 (declares "
                    "4611686018427387904 bytes, 2 remain)");
  ExpectFormatError(P2() + "\x8b" + LE(0x7fffffff, 4) + "ab",
                    "truncated LONG4 at byte 2 (declares 2147483647 bytes");
  ExpectFormatError(P2() + "\x8b" + LE(0x80000000u, 4) + "ab",
                    "LONG4 with negative byte count -2147483648 at byte 2");
  ExpectFormatError(P2() + "B" + LE(0xffffffffu, 4) + "ab",
                    "truncated BINBYTES at byte 2 (declares 4294967295 bytes");
  ExpectFormatError(P4() + "\x8e" + LE(~uint64_t{0}, 8),
                    "truncated BINBYTES8 at byte 2");
  ExpectFormatError(P4() + "\x96" + LE(uint64_t{1} << 63, 8),
                    "truncated BYTEARRAY8 at byte 2");
  ExpectFormatError(P4() + "\x95" + LE(~uint64_t{0}, 8) + "N.",
                    "truncated FRAME at byte 2");
  ExpectFormatError(P2() + "X" + LE(0xffffffffu, 4), "truncated BINUNICODE");
  ExpectFormatError(P2() + "T" + LE(0x7fffffff, 4), "truncated BINSTRING");
  ExpectFormatError(P2() + "T" + LE(0xffffffffu, 4),
                    "BINSTRING with negative length");
  ExpectFormatError(P4() + "\x8c\xff" + "abc", "truncated SHORT_BINUNICODE");
  ExpectFormatError(P2() + "\x8a\xff" + "abc", "truncated LONG1");
  ExpectFormatError("L" + std::string(5000, '9') + "\n.",
                    "LONG has more than 4300 digits");
}

TEST(PickleMalformedTest, WrongKinds) {
  ExpectFormatError(P2() + "K\x01}b.", "BUILD on a int at byte 5");
  ExpectFormatError(P2() + "}(K\x01u.", "SETITEMS with an odd number of items");
  ExpectFormatError(P2() + "]K\x01K\x02s.", "SETITEM on a list at byte 7");
  ExpectFormatError(P2() + "}K\x01" + "a.", "APPEND to a dict at byte 5");
  ExpectFormatError(P2() + "K\x01(N" + "e.", "APPENDS to a int");
  ExpectFormatError(P2() + "cm\nf\nK\x01R.", "REDUCE argument is a int");
  ExpectFormatError(P4() + "cm\nC\n)]\x92.",
                    "NEWOBJ_EX keyword arguments are a list");
  ExpectFormatError(P4() + "\x8c\x02m\nN\x93.", "STACK_GLOBAL needs str");
  ExpectFormatError(P4() + "\x8c\x02m\n\x8c\x01n\x93.",
                    "STACK_GLOBAL name with a newline");
}

TEST(PickleMalformedTest, RecursionBombs) {
  const int n = 200000;
  std::string lists =
      P2() + std::string(n, ']') + std::string(n - 1, 'a') + ".";
  ExpectFormatError(lists, "nested deeper than 1000");
  std::string tuples = P2() + "N" + std::string(n, '\x85') + ".";
  ExpectFormatError(tuples, "nested deeper than 1000");
  // A dict that contains itself 200000 levels down through SETITEM chains.
  std::string dicts = P2();
  for (int k = 0; k < n; ++k) dicts += "}K\x01";  // d_k, key 1
  dicts += "N" + std::string(n, 's') + ".";       // d_k[1] = d_k+1
  ExpectFormatError(dicts, "nested deeper than 1000");
}

TEST(PickleMalformedTest, FloodsStayProportionalToInput) {
  ExpectFormatError(P2() + std::string(1000000, '(') + ".",
                    "STOP with an unclosed MARK");
  std::string mixed = P2();
  for (int k = 0; k < 500000; ++k) mixed += "(]";
  ExpectFormatError(mixed + ".", "STOP with an unclosed MARK");
  ExpectFormatError(P2() + std::string(1000000, ']') + ".",
                    "STOP with 1000000 values");
  ExpectFormatError(P2() + "N" + std::string(1000000, '2') + ".",
                    "STOP with 1000001 values");
  // A list grown with a million references to one node stays one node.
  Arena a;
  Value* v = Unpickle(P2() + "](N" + std::string(999999, '2') + "e.", a);
  EXPECT_EQ(v->items.size(), 1000000u);
  EXPECT_LE(a.size(), 2u);
}

// One 64 KiB int memoised once and fetched 4097 times: writing the graph
// back must not spell the int out 4096 times (256 MiB; with bigger numbers,
// terabytes from a few megabytes).
TEST(PickleMalformedTest, SharedHugeIntIsWrittenOnce) {
  const std::string digits(64 << 10, '\x7f');
  std::string data =
      P2() + "\x8b" + LE(digits.size(), 4) + digits + "q" + LE(0, 1) + "0(";
  for (int k = 0; k < 4097; ++k) data += "h" + LE(0, 1);
  data += "l.";
  Arena a;
  Value* v = Unpickle(data, a);
  ASSERT_EQ(v->items.size(), 4097u);
  const std::string again = Pickle(v);
  EXPECT_LT(again.size(), data.size() + 64);
  Arena b;
  Value* back = Unpickle(again, b);
  EXPECT_TRUE(DeepEqual(v, back));
  EXPECT_EQ(back->items[4096], back->items[0]) << "shared again";
  // Not shared: written in place, as CPython writes ints (never memoised).
  Arena c;
  Value* one = c.List({c.BigInt(digits), c.BigInt(digits)});
  const std::string twice = Pickle(one);
  EXPECT_GT(twice.size(), 2 * digits.size());
  EXPECT_EQ(twice.find('q', 3), twice.rfind('q')) << "only the list is put";
}

TEST(PickleMalformedTest, SetConversionBudgetBoundsCopies) {
  // set(L) applied 20000 times to one 2000-item list must not copy 4e7 items.
  std::string data =
      P2() + "]q" + std::string(1, '\0') + "(" + std::string(2000, 'N') + "e0(";
  const std::string set_of_memo0 =
      "c__builtin__\nset\nh" + std::string(1, '\0') + "\x85R";
  for (int k = 0; k < 20000; ++k) data += set_of_memo0;
  data += "l.";
  Arena a;
  Value* v = Unpickle(data, a);
  ASSERT_EQ(v->items.size(), 20000u);
  size_t copied = 0;
  for (const Value* s : v->items) {
    if (s->kind == Kind::kSet) copied += s->items.size();
  }
  EXPECT_LE(copied, data.size() + 4096);
  EXPECT_EQ(v->items.back()->kind, Kind::kObject);  // kept as set(list)
}

// Random corruption of the samples: flip, overwrite, insert, delete, duplicate
// and splice opcodes.
std::string Mutate(std::string s, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 7) {
      case 0:
        if (pos < s.size())
          s[pos] = static_cast<char>(s[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:
        if (pos < s.size()) s[pos] = static_cast<char>(rng());
        break;
      case 2:
        s.insert(pos, 1, static_cast<char>(rng()));
        break;
      case 3:
        if (pos < s.size()) s.erase(pos, 1 + rng() % 4);
        break;
      case 4: {
        const size_t len = 1 + rng() % 16;
        if (pos + len <= s.size()) s.insert(pos, s.substr(pos, len));
        break;
      }
      case 5: {
        const std::string& ops = KnownOpcodes();
        s.insert(pos, 1, ops[rng() % ops.size()]);
        break;
      }
      default:
        if (pos < s.size()) s.resize(pos);
        break;
    }
  }
  return s;
}

TEST(PickleMalformedTest, SeededMutationFuzz) {
  const uint64_t seed = testutil::Seed();
  std::cout << "UCP_TEST_SEED=" << seed << std::endl;
  SCOPED_TRACE(::testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::string> samples = Samples();
  int parsed = 0;
  int rejected = 0;
  for (int iteration = 0; iteration < 20000; ++iteration) {
    const std::string data = Mutate(samples[rng() % samples.size()], rng);
    Arena arena;
    Value* root = nullptr;
    try {
      root = Unpickle(data, arena);
    } catch (const FormatError& e) {
      ++rejected;
      const std::string msg = e.what();
      if (msg.rfind("pickle: ", 0) != 0 ||
          (msg.find("at byte ") == std::string::npos &&
           msg.find("nested deeper") == std::string::npos)) {
        ADD_FAILURE() << "vague message '" << msg << "' for " << Hex(data);
      }
      continue;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iteration << ": " << typeid(e).name()
                    << ": " << e.what() << " for " << Hex(data);
      continue;
    }
    ++parsed;
    ASSERT_NE(root, nullptr);
    EXPECT_LE(arena.size(), data.size()) << Hex(data);
    // Everything else that walks a graph must cope with what came out.
    (void)Repr(root, 200);
    (void)SuspiciousGlobals(arena);
    Arena copy_arena;
    Value* copy = copy_arena.Copy(root);
    EXPECT_TRUE(DeepEqual(root, copy)) << Hex(data);
    std::string again;
    try {
      again = Pickle(root);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "Pickle failed: " << e.what() << " for " << Hex(data);
      continue;
    }
    Arena back_arena;
    Value* back = nullptr;
    try {
      back = Unpickle(again, back_arena);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "re-read failed: " << e.what() << " for " << Hex(data);
      continue;
    }
    bool dotted_global = false;
    for (const Value& v : arena.nodes()) {
      dotted_global |=
          v.kind == Kind::kGlobal && v.name.find('.') != std::string::npos;
    }
    if (!dotted_global) {
      EXPECT_TRUE(DeepEqual(root, back)) << Hex(data);
    }
  }
  std::cout << parsed << " mutated pickles parsed, " << rejected
            << " rejected with FormatError\n";
  EXPECT_GT(parsed, 100);
  EXPECT_GT(rejected, 1000);
}

}  // namespace
}  // namespace ucp::pickle
