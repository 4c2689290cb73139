// Golden test against checkpoints written by Megatron-LM 23.06 itself
// (shared/fixtures/megatron-23.06): slicing the full reference tensors by the
// pieces of the megatron-gpt-legacy layout reproduces every tensor of the
// TP 2 rank files and of the TP 1 / PP 2 rank files bit for bit, and placing
// the rank tensors by the same pieces rebuilds the reference. The tensors are
// dumped by dump_megatron_fixture.py (torch), which also maps Megatron's
// converter names to state-dict names; nothing here comes from ucp code.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/core/box.h"
#include "engine/core/error.h"
#include "layouts/layout.h"
#include "layouts/placement.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using json = nlohmann::json;

struct Tensor {
  Shape shape;
  std::vector<float> v;
};

// Copies box `from` of `src` into box `to` of `dst`.
void Copy(const Tensor& src, const Box& from, Tensor& dst, const Box& to) {
  ASSERT_EQ(from.size, to.size);
  if (from.NumElements() == 0) return;
  Shape i(from.size.size(), 0);
  while (true) {
    Shape a = i, b = i;
    for (size_t d = 0; d < i.size(); ++d)
      a[d] += from.offset[d], b[d] += to.offset[d];
    dst.v[Flat(dst.shape, b)] = src.v[Flat(src.shape, a)];
    size_t d = i.size();
    while (d > 0) {
      --d;
      if (++i[d] < from.size[d]) break;
      i[d] = 0;
      if (d == 0) return;
    }
    if (i.empty()) return;
  }
}

Tensor Read(const std::filesystem::path& dir, const json& entry) {
  Tensor t;
  t.shape = entry.at("shape").get<Shape>();
  const std::string bytes =
      testutil::ReadFile(dir / entry.at("file").get<std::string>());
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), n * 4);
  t.v.resize(n);
  std::memcpy(t.v.data(), bytes.data(), bytes.size());
  return t;
}

// Rows [begin, begin + n) of dim 0.
Tensor Rows(const Tensor& t, int64_t begin, int64_t n) {
  Tensor out;
  out.shape = t.shape;
  out.shape[0] = n;
  const int64_t row = t.v.size() / t.shape[0];
  out.v.assign(t.v.begin() + begin * row, t.v.begin() + (begin + n) * row);
  return out;
}

class MegatronFixtureTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testutil::TempDir();
    const std::string cmd =
        testutil::ShellQuote(testutil::Python()) + " " +
        testutil::ShellQuote((testutil::SourceDir() /
                              "tests/unit/layouts/dump_megatron_fixture.py")
                                 .string()) +
        " --fixtures " +
        testutil::ShellQuote(
            (testutil::FixturesDir() / "megatron-23.06").string()) +
        " --out " + testutil::ShellQuote(dir_->path().string());
    std::string output;
    status_ = testutil::RunCommand(cmd, &output);
    output_ = new std::string(output);
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete output_;
  }
  void SetUp() override {
    ASSERT_EQ(status_, 0) << *output_;
    index_ = json::parse(testutil::ReadFile(dir_->path() / "index.json"));
  }

  // Runs the check with this true vocabulary size (rows of the reference
  // beyond it are the source's padding rows).
  void CheckAll(int64_t true_vocab);

  static testutil::TempDir* dir_;
  static std::string* output_;
  static int status_;
  json index_;
};

testutil::TempDir* MegatronFixtureTest::dir_ = nullptr;
std::string* MegatronFixtureTest::output_ = nullptr;
int MegatronFixtureTest::status_ = -1;

void MegatronFixtureTest::CheckAll(int64_t true_vocab) {
  const Layout layout = Layout::Builtin("megatron-gpt-legacy");
  std::map<std::string, Tensor> reference;
  for (const json& r : index_.at("reference")) {
    reference[r.at("name").get<std::string>()] = Read(dir_->path(), r);
  }
  ASSERT_EQ(reference.size(), 28u);
  for (const json& ckpt : index_.at("checkpoints")) {
    SCOPED_TRACE(ckpt.at("dir").get<std::string>());
    Variables vars;
    for (const auto& [k, v] : ckpt.at("variables").items())
      vars.Set(k, v.get<int64_t>());
    ASSERT_EQ(vars.Get("vocab_size"),
              512);  // NullTokenizer 511 + end of document
    vars.Set("vocab_size", true_vocab);
    const int64_t tp = ckpt.at("tp").get<int64_t>();
    const Topology topology = Topo(tp, ckpt.at("pp").get<int64_t>());
    const LayerPlacement placement(layout.NumLayers(vars), topology);
    ValidateTopology(
        layout,
        [&] {
          std::vector<ParamShape> params;
          for (const auto& [name, t] : reference) {
            Shape s = t.shape;
            if (name == "language_model.embedding.word_embeddings.weight")
              s[0] = true_vocab;
            params.push_back({name, s});
          }
          return params;
        }(),
        vars, topology);

    // Assembled from the rank files: main tensors, padding rows, coverage.
    std::map<std::string, Tensor> assembled;
    std::map<std::string, std::vector<int>> covered;
    std::set<std::string> seen_names;
    Tensor pad_assembled;
    for (const json& rank : ckpt.at("ranks")) {
      const int64_t tp_rank = rank.at("tp_rank").get<int64_t>();
      const int64_t pp_rank = rank.at("pp_rank").get<int64_t>();
      SCOPED_TRACE(rank.at("dir").get<std::string>());
      for (const json& entry : rank.at("tensors")) {
        const std::vector<std::string> path =
            entry.at("path").get<std::vector<std::string>>();
        const std::string local_name = layout.FromKeyPath(path);
        ASSERT_EQ(layout.KeyPath(local_name), path);
        const std::string name =
            CanonicalName(layout, local_name, placement, pp_rank, 0);
        SCOPED_TRACE(name);
        ASSERT_EQ(LocalName(layout, name, placement), local_name);
        const Rule& rule = layout.Match(name, vars);
        seen_names.insert(name);
        // Stage ownership.
        const Home home = HomeOf(layout, rule, name, placement);
        EXPECT_EQ(home.pp_rank, pp_rank);
        EXPECT_EQ(home.vp_chunk, 0);
        EXPECT_TRUE(rule.Exists(layout.Resolve(vars), topology));
        const std::string original = rule.tied_to.value_or(name);
        ASSERT_TRUE(reference.count(original)) << original;
        const Tensor& ref = reference.at(original);
        const Tensor local = Read(dir_->path(), entry);
        // Full (true) tensor and padding rows of the reference.
        Tensor full = ref, pad;
        int64_t padded = 0, pad_rows = 0;
        if (rule.tp.vocab) {
          full = Rows(ref, 0, true_vocab);
          pad_rows = ref.shape[0] - true_vocab;
          pad = Rows(ref, true_vocab, pad_rows);
          padded = *PaddedDimSize(rule, layout.Resolve(vars), tp);
          EXPECT_EQ(padded, 512);  // args.padded_vocab_size
          EXPECT_EQ(FullShapeFromLocal(rule, local.shape, tp, vars),
                    full.shape);
        } else {
          EXPECT_EQ(FullShapeFromLocal(rule, local.shape, tp, vars),
                    full.shape);
        }
        const LocalShard shard =
            ShardFor(rule, full.shape, tp, tp_rank, padded, pad_rows);
        ASSERT_EQ(shard.local_shape, local.shape);
        // Writer direction: the pieces of the reference give the rank tensor.
        Tensor want{shard.local_shape,
                    std::vector<float>(local.v.size(), 0.0f)};
        for (const Piece& p : shard.pieces) {
          Copy(p.region == Region::kMain ? full : pad, p.global, want, p.local);
        }
        EXPECT_EQ(
            0, std::memcmp(want.v.data(), local.v.data(), local.v.size() * 4))
            << "rank tensor differs from the reference sliced by the pieces";
        // Reader direction: place the rank tensor into the full tensor.
        if (rule.tied_to) continue;  // a copy: the universal file keeps one
        Tensor& a =
            assembled
                .try_emplace(name, Tensor{full.shape, std::vector<float>(
                                                          full.v.size(), NAN)})
                .first->second;
        std::vector<int>& count =
            covered.try_emplace(name, std::vector<int>(full.v.size(), 0))
                .first->second;
        if (pad_assembled.v.empty() && rule.tp.vocab) {
          pad_assembled =
              Tensor{pad.shape, std::vector<float>(pad.v.size(), NAN)};
        }
        for (const Piece& p : shard.pieces) {
          if (p.region == Region::kPad) {
            Copy(local, p.local, pad_assembled, p.global);
            continue;
          }
          Tensor ones{full.shape, std::vector<float>(full.v.size(), 0.0f)};
          Tensor src{local.shape, std::vector<float>(local.v.size(), 1.0f)};
          Copy(local, p.local, a, p.global);
          Copy(src, p.local, ones, p.global);
          for (size_t i = 0; i < ones.v.size(); ++i)
            count[i] += static_cast<int>(ones.v[i]);
        }
      }
    }
    // Every reference tensor was found and is rebuilt exactly.
    for (const auto& [name, ref] : reference) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(assembled.count(name));
      const Rule& rule = layout.Match(name, vars);
      const int replicas = rule.tp.split ? 1 : static_cast<int>(tp);
      for (int c : covered.at(name)) ASSERT_EQ(c, replicas);
      Tensor full = rule.tp.vocab ? Rows(ref, 0, true_vocab) : ref;
      EXPECT_EQ(0, std::memcmp(full.v.data(), assembled.at(name).v.data(),
                               full.v.size() * 4));
      if (rule.tp.vocab && true_vocab < 512) {
        const Tensor pad = Rows(ref, true_vocab, 512 - true_vocab);
        EXPECT_EQ(0, std::memcmp(pad.v.data(), pad_assembled.v.data(),
                                 pad.v.size() * 4));
      }
    }
    // The tied copy exists exactly where the layout says.
    const bool has_copy =
        seen_names.count("word_embeddings_for_head.weight") > 0;
    EXPECT_EQ(has_copy, layout.Match("word_embeddings_for_head.weight", vars)
                            .Exists(vars, topology));
  }
}

TEST_F(MegatronFixtureTest, PiecesReproduceTheRankFiles) { CheckAll(512); }

// The same with the last reference row treated as the source's padding row
// (as if the tokenizer had 511 ids): exercises the pad region on real data.
TEST_F(MegatronFixtureTest, PaddingRowsGoThroughThePadRegion) { CheckAll(511); }

TEST_F(MegatronFixtureTest, TopologiesMegatronWouldRefuse) {
  const Layout layout = Layout::Builtin("megatron-gpt-legacy");
  const json& ckpt = index_.at("checkpoints").at(0);
  Variables vars;
  for (const auto& [k, v] : ckpt.at("variables").items())
    vars.Set(k, v.get<int64_t>());
  std::vector<ParamShape> params;
  for (const json& r : index_.at("reference")) {
    params.push_back(
        {r.at("name").get<std::string>(), r.at("shape").get<Shape>()});
  }
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t pp : {1, 2})
      EXPECT_NO_THROW(ValidateTopology(layout, params, vars, Topo(tp, pp)));
  }
  EXPECT_THAT([&] { ValidateTopology(layout, params, vars, Topo(3)); },
              testing::ThrowsMessage<LayoutError>(testing::HasSubstr(
                  "param "
                  "'language_model.encoder.layers.0.self_attention.query_key_"
                  "value.weight' (rule 'qkv'")));
  EXPECT_THAT([&] { ValidateTopology(layout, params, vars, Topo(1, 4)); },
              testing::ThrowsMessage<LayoutError>(
                  testing::HasSubstr("pp 4 does not divide the 2 layers")));
}

}  // namespace
}  // namespace ucp::layouts
