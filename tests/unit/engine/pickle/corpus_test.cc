// The CPython-written corpus (tests/tools/make_pickle_corpus.py, fixture
// pickle_corpus): every pickle unpickles to the graph Python describes, the
// protocol-2 ones re-pickle byte for byte, and every re-pickled file loads in
// CPython to an object equal to the original.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/pickle/pickle_testutil.h"

namespace ucp::pickle {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Entry {
  fs::path pkl;
  json desc;
};

std::vector<Entry> LoadCorpus() {
  const fs::path dir = testutil::TestDataDir() / "pickle";
  std::vector<Entry> out;
  if (!fs::is_directory(dir)) {
    ADD_FAILURE() << "corpus folder " << dir << " missing";
    return out;
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    Entry entry;
    entry.desc = json::parse(in);
    entry.pkl = dir / entry.desc.at("file").get<std::string>();
    out.push_back(std::move(entry));
  }
  std::sort(out.begin(), out.end(),
            [](const Entry& a, const Entry& b) { return a.pkl < b.pkl; });
  EXPECT_GE(out.size(), 100u) << "corpus in " << dir << " looks incomplete";
  return out;
}

const std::vector<Entry>& Corpus() {
  static const std::vector<Entry>* corpus =
      new std::vector<Entry>(LoadCorpus());
  return *corpus;
}

// Follows one path component the way make_pickle_corpus.py descends.
const Value* Step(const Value* v, const json& component) {
  if (v->IsDictLike()) {
    for (const auto& [k, val] : v->entries) {
      if (component.is_string()) {
        if (k->kind == Kind::kStr && k->s == component.get<std::string>()) {
          return val;
        }
      } else if (component.is_number_integer()) {
        if (k->kind == Kind::kInt && k->AsInt() == component.get<int64_t>()) {
          return val;
        }
      } else if (Repr(k, std::string::npos) ==
                 component.at("key_repr").get<std::string>()) {
        return val;
      }
    }
    return nullptr;
  }
  if ((v->kind == Kind::kList || v->kind == Kind::kTuple) &&
      component.is_number_integer()) {
    const auto index = component.get<size_t>();
    return index < v->items.size() ? v->items[index] : nullptr;
  }
  return nullptr;
}

const Value* Follow(const Value* root, const json& path) {
  const Value* v = root;
  for (const json& component : path) {
    if (v == nullptr) return nullptr;
    v = Step(v, component);
  }
  return v;
}

std::string Clip(const std::string& s) {
  return s.size() <= 300 ? s : s.substr(0, 300) + "...";
}

size_t LengthOf(const Value* v) {
  return v->kind == Kind::kDict || v->IsDictLike() ? v->entries.size()
                                                   : v->items.size();
}

// Whether the dict/list/tuple/OrderedDict edges (the ones the corpus walk
// follows) contain a cycle reachable from `root`.
bool HasTraversalCycle(const Value* root) {
  enum Color { kGrey, kBlack };
  std::unordered_map<const Value*, Color> color;
  std::vector<std::pair<const Value*, size_t>> stack{{root, 0}};
  color[root] = kGrey;
  auto children = [](const Value* v) {
    std::vector<const Value*> out;
    if (v->IsDictLike()) {
      for (const auto& [k, val] : v->entries) out.push_back(val);
    } else if (v->kind == Kind::kList || v->kind == Kind::kTuple) {
      out.assign(v->items.begin(), v->items.end());
    }
    return out;
  };
  std::unordered_map<const Value*, std::vector<const Value*>> kids;
  while (!stack.empty()) {
    auto& [v, next] = stack.back();
    auto it = kids.find(v);
    if (it == kids.end()) it = kids.emplace(v, children(v)).first;
    if (next == it->second.size()) {
      color[v] = kBlack;
      stack.pop_back();
      continue;
    }
    const Value* child = it->second[next++];
    auto c = color.find(child);
    if (c == color.end()) {
      color[child] = kGrey;
      stack.emplace_back(child, 0);
    } else if (c->second == kGrey) {
      return true;
    }
  }
  return false;
}

std::set<std::string> ArenaGlobals(const Arena& arena) {
  std::set<std::string> out;
  for (const Value& v : arena.nodes()) {
    if (v.kind == Kind::kGlobal) out.insert(v.module + "." + v.name);
  }
  return out;
}

TEST(PickleCorpusTest, EveryPickleMatchesPythonsDescription) {
  size_t checked_nodes = 0;
  for (const Entry& e : Corpus()) {
    SCOPED_TRACE(e.pkl.filename().string());
    const std::string data = testutil::ReadFile(e.pkl);
    Arena arena;
    size_t used = 0;
    Value* root = nullptr;
    ASSERT_NO_THROW(root = Unpickle(data, arena, &used));
    EXPECT_EQ(used, data.size());
    // Every node costs at least one input byte.
    EXPECT_LE(arena.size(), data.size());
    const auto globals = e.desc.at("globals").get<std::set<std::string>>();
    EXPECT_EQ(ArenaGlobals(arena), globals);
    if (e.desc.at("malicious").get<bool>()) continue;

    EXPECT_EQ(HasTraversalCycle(root), e.desc.at("has_cycle").get<bool>());
    for (const json& node : e.desc.at("nodes")) {
      const json& path = node.at("path");
      SCOPED_TRACE("path " + path.dump());
      const Value* v = Follow(root, path);
      ASSERT_NE(v, nullptr);
      ++checked_nodes;
      EXPECT_EQ(KindName(v->kind), node.at("kind").get<std::string>());
      if (node.contains("repr")) {
        const std::string got = Repr(v, std::string::npos);
        const std::string want = node.at("repr").get<std::string>();
        EXPECT_TRUE(got == want) << Clip(got) << "\n vs Python's\n"
                                 << Clip(want);
      }
      if (node.contains("len")) {
        EXPECT_EQ(LengthOf(v), node.at("len").get<size_t>());
      }
      if (node.contains("class")) {
        EXPECT_EQ(v->ClassName(), node.at("class").get<std::string>());
      }
      if (node.contains("name")) {
        EXPECT_EQ(v->ClassName(), node.at("name").get<std::string>());
      }
      if (node.contains("set_reprs")) {
        std::vector<std::string> reprs;
        for (const Value* item : v->items) {
          reprs.push_back(Repr(item, std::string::npos));
        }
        std::sort(reprs.begin(), reprs.end());
        EXPECT_EQ(reprs, node.at("set_reprs").get<std::vector<std::string>>());
      }
    }
    // Memo sharing: objects Python sees as one are one node.
    for (const json& pair : e.desc.at("same")) {
      SCOPED_TRACE("same " + pair.dump());
      const Value* a = Follow(root, pair.at(0));
      const Value* b = Follow(root, pair.at(1));
      ASSERT_NE(a, nullptr);
      EXPECT_EQ(a, b);
    }
    EXPECT_TRUE(SuspiciousGlobals(arena).empty())
        << "benign pickle reported: " << SuspiciousGlobals(arena).front();
  }
  EXPECT_GT(checked_nodes, 10000u);
}

TEST(PickleCorpusTest, CorpusCoversEveryOpcodeThatCPythonWrites) {
  std::set<std::string> seen;
  for (const Entry& e : Corpus()) {
    for (const auto& op : e.desc.at("opcodes"))
      seen.insert(op.get<std::string>());
  }
  for (const char* op : {"PROTO",
                         "FRAME",
                         "STOP",
                         "MARK",
                         "POP",
                         "POP_MARK",
                         "NONE",
                         "NEWTRUE",
                         "NEWFALSE",
                         "BININT",
                         "BININT1",
                         "BININT2",
                         "LONG1",
                         "LONG4",
                         "BINFLOAT",
                         "BINUNICODE",
                         "SHORT_BINUNICODE",
                         "BINBYTES",
                         "SHORT_BINBYTES",
                         "BYTEARRAY8",
                         "EMPTY_TUPLE",
                         "TUPLE",
                         "TUPLE1",
                         "TUPLE2",
                         "TUPLE3",
                         "EMPTY_LIST",
                         "APPEND",
                         "APPENDS",
                         "EMPTY_DICT",
                         "SETITEM",
                         "SETITEMS",
                         "EMPTY_SET",
                         "ADDITEMS",
                         "FROZENSET",
                         "GLOBAL",
                         "STACK_GLOBAL",
                         "REDUCE",
                         "BUILD",
                         "NEWOBJ",
                         "NEWOBJ_EX",
                         "BINPUT",
                         "LONG_BINPUT",
                         "MEMOIZE",
                         "BINGET",
                         "LONG_BINGET",
                         "INT",
                         "LONG",
                         "FLOAT",
                         "UNICODE",
                         "PUT",
                         "GET",
                         "DICT",
                         "LIST"}) {
    EXPECT_EQ(seen.count(op), 1u) << op << " never occurs in the corpus";
  }
}

TEST(PickleCorpusTest, SuspiciousGlobalsAreReportedWithoutRunningAnything) {
  size_t malicious = 0;
  for (const Entry& e : Corpus()) {
    if (!e.desc.at("malicious").get<bool>()) continue;
    SCOPED_TRACE(e.pkl.filename().string());
    ++malicious;
    Arena arena;
    Value* root = Unpickle(testutil::ReadFile(e.pkl), arena);
    ASSERT_NE(root, nullptr);
    const std::vector<std::string> reported = SuspiciousGlobals(arena);
    ASSERT_FALSE(reported.empty());
    // What is reported is among what Python says the stream imports.
    const auto globals = e.desc.at("globals").get<std::set<std::string>>();
    for (const std::string& g : reported) EXPECT_EQ(globals.count(g), 1u) << g;
  }
  EXPECT_GE(malicious, 4u);
}

TEST(PickleCorpusTest, Protocol2RoundTripsByteForByte) {
  size_t n = 0;
  for (const Entry& e : Corpus()) {
    if (e.desc.at("protocol").get<int>() != 2) continue;
    SCOPED_TRACE(e.pkl.filename().string());
    const std::string data = testutil::ReadFile(e.pkl);
    Arena arena;
    const std::string again = Pickle(Unpickle(data, arena));
    EXPECT_TRUE(again == data)
        << "re-pickled " << again.size() << " bytes vs " << data.size();
    ++n;
  }
  EXPECT_GE(n, 25u);
}

TEST(PickleCorpusTest, EveryProtocolReloadsEqualInCPython) {
  testutil::TempDir tmp;
  std::vector<std::pair<fs::path, fs::path>> pairs;
  for (const Entry& e : Corpus()) {
    if (e.desc.at("malicious").get<bool>()) continue;  // never loaded
    Arena arena;
    Value* root = Unpickle(testutil::ReadFile(e.pkl), arena);
    const fs::path ours = tmp / (e.pkl.stem().string() + ".ucp.pkl");
    testutil::WriteFile(ours, Pickle(root));
    pairs.emplace_back(e.pkl, ours);
    // Re-reading our own output gives the same graph, except that a dotted
    // global (a nested class named by STACK_GLOBAL) comes back as the
    // getattr(parent, 'name') reduction that protocol 2 must use.
    bool dotted_global = false;
    for (const Value& v : arena.nodes()) {
      dotted_global |=
          v.kind == Kind::kGlobal && v.name.find('.') != std::string::npos;
    }
    Arena again;
    EXPECT_EQ(DeepEqual(root, Unpickle(Pickle(root), again)), !dotted_global)
        << e.pkl.filename();
  }
  ASSERT_GE(pairs.size(), 100u);
  EXPECT_EQ(testing::CheckRoundTrip(pairs), "");
}

TEST(PickleCorpusTest, CopyPreservesSharingAndCycles) {
  for (const Entry& e : Corpus()) {
    if (e.desc.at("malicious").get<bool>()) continue;
    SCOPED_TRACE(e.pkl.filename().string());
    Arena arena;
    Value* root = Unpickle(testutil::ReadFile(e.pkl), arena);
    Arena other;
    Value* copy = other.Copy(root);
    EXPECT_TRUE(DeepEqual(root, copy));
    EXPECT_LE(other.size(), arena.size());
    for (const json& pair : e.desc.at("same")) {
      const Value* a = Follow(copy, pair.at(0));
      ASSERT_NE(a, nullptr);
      EXPECT_EQ(a, Follow(copy, pair.at(1)));
    }
    // A copy pickles to the same bytes as the original graph.
    EXPECT_TRUE(Pickle(copy) == Pickle(root));
  }
}

// A 4 MiB pickle of 100K+ nodes parses and writes back byte for byte. Its
// times are printed, not asserted (performance is the benches' business:
// a timed test fails on a loaded machine, not on a slow parser).
TEST(PickleCorpusTest, LargePickleRoundTrips) {
  const fs::path path = testutil::TestDataDir() / "pickle" / "perf.p2.pkl";
  const std::string data = testutil::ReadFile(path);
  ASSERT_GT(data.size(), 4u << 20);
  Arena arena;
  const auto start = std::chrono::steady_clock::now();
  Value* root = Unpickle(data, arena);
  const double unpickle_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  ASSERT_NE(root, nullptr);
  EXPECT_GT(arena.size(), 100000u);
  const auto start2 = std::chrono::steady_clock::now();
  const std::string again = Pickle(root);
  const double pickle_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start2)
          .count();
  EXPECT_TRUE(again == data);
  std::cout << "perf.p2.pkl: " << data.size() << " bytes, " << arena.size()
            << " nodes, Unpickle " << unpickle_s << " s, Pickle " << pickle_s
            << " s\n";
}

}  // namespace
}  // namespace ucp::pickle
