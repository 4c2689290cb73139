#include "layouts/placement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// ------------------------------------------------------------ vocab padding

// Oracle: Megatron's loop (training/tokenizer/tokenizer.py
// _vocab_size_with_padding): add rows until divisible by div * tp.
int64_t MegatronPadded(int64_t v, int64_t div, int64_t tp) {
  int64_t after = v;
  while (after % (div * tp) != 0) ++after;
  return after;
}

TEST(PaddedVocabSizeTest, MatchesMegatronsLoop) {
  for (int64_t v = 0; v < 600; v += 7) {
    for (int64_t div : {1, 8, 64, 128}) {
      for (int64_t tp : {1, 2, 3, 4, 8}) {
        ASSERT_EQ(PaddedVocabSize(v, div, tp), MegatronPadded(v, div, tp))
            << v << " " << div << " " << tp;
      }
    }
  }
  EXPECT_EQ(PaddedVocabSize(50257, 128, 1), 50304);
  EXPECT_EQ(PaddedVocabSize(50257, 128, 8), 51200);
  EXPECT_EQ(PaddedVocabSize(32000, 128, 2), 32000);
}

TEST(PaddedVocabSizeTest, RejectsBadInput) {
  EXPECT_THAT([] { PaddedVocabSize(-1, 128, 1); },
              ThrowsMessage<LayoutError>(HasSubstr("negative vocab")));
  EXPECT_THAT([] { PaddedVocabSize(10, 0, 1); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("make_vocab_size_divisible_by must be >= 1")));
  EXPECT_THAT([] { PaddedVocabSize(10, 8, 0); },
              ThrowsMessage<LayoutError>(HasSubstr("tp must be >= 1")));
  EXPECT_THAT([] { PaddedVocabSize(INT64_MAX - 3, 128, 8); },
              ThrowsMessage<LayoutError>(HasSubstr("overflows")));
}

// ------------------------------------------------------------ layers

// Oracle: Megatron's offset and layer-count code transcribed
// (transformer_layer.py::get_transformer_layer_offset, core_v0.15.0, and
// transformer_block.py::get_num_layers_to_build, core_v0.12.0; the even
// formulas are those of core_v0.8.0). core_v0.12-v0.14 used pp_rank - 1
// instead of the middle rank for VPP with only the last stage set, which
// overlaps chunks; v0.15 fixed it.
struct MegatronStage {
  int64_t offset;
  int64_t count;
};
MegatronStage Megatron(int64_t L, const Topology& t, int64_t p, int64_t v) {
  const bool vp = t.vpp > 1;
  const bool uneven = t.first_stage_layers || t.last_stage_layers;
  int64_t count;
  if (uneven) {
    int64_t left = L, stages = t.pp;
    if (t.first_stage_layers) left -= *t.first_stage_layers, --stages;
    if (t.last_stage_layers) left -= *t.last_stage_layers, --stages;
    count = stages > 0 ? left / stages : 0;
    if (p == 0 && t.first_stage_layers) count = *t.first_stage_layers;
    if (p == t.pp - 1 && t.last_stage_layers) count = *t.last_stage_layers;
  } else {
    count = L / t.pp;
  }
  if (vp) count /= t.vpp;
  int64_t offset = 0;
  if (t.pp > 1) {
    if (uneven) {
      const int64_t middle_stages =
          t.pp - (t.first_stage_layers ? 1 : 0) - (t.last_stage_layers ? 1 : 0);
      const int64_t first = t.first_stage_layers.value_or(0);
      const int64_t last = t.last_stage_layers.value_or(0);
      const int64_t middle = L - first - last;
      const int64_t middle_rank = t.first_stage_layers ? p - 1 : p;
      if (vp) {
        const int64_t f = first / t.vpp, l = last / t.vpp, m = middle / t.vpp;
        const int64_t total = f + m + l;
        // (Megatron divides by zero here for pp 2 with both stages set; the
        // middle rank is 0 then.)
        const int64_t per_middle = middle_stages > 0 ? m / middle_stages : 0;
        offset = p == 0 ? v * total : v * total + f + middle_rank * per_middle;
      } else {
        const int64_t per = middle_stages > 0 ? middle / middle_stages : 0;
        offset = p == 0 ? 0 : middle_rank * per + first;
      }
    } else {
      const int64_t per_rank = L / t.pp;
      offset = vp ? v * (L / t.vpp) + p * (per_rank / t.vpp) : p * per_rank;
    }
  } else if (vp) {
    offset = v * (L / t.vpp);  // not a Megatron configuration; chunks in order
  }
  return {offset, count};
}

// Every (L, pp, vpp, first, last) that LayerPlacement accepts: a bijection
// between global layers and (pp, vp, local), contiguous per chunk, equal to
// Megatron's formula; and the rejected ones really are invalid.
TEST(LayerPlacementTest, ExhaustiveSmallConfigurations) {
  int accepted = 0, rejected = 0;
  for (int64_t L = 0; L <= 16; ++L) {
    for (int64_t pp = 1; pp <= 5; ++pp) {
      for (int64_t vpp = 1; vpp <= 4; ++vpp) {
        std::vector<std::optional<int64_t>> firsts = {std::nullopt};
        if (pp > 1) {
          for (int64_t f = 0; f <= L; ++f) firsts.push_back(f);
        }
        for (const auto& first : firsts) {
          for (const auto& last : firsts) {
            const Topology t = Topo(1, pp, vpp, 1, first, last);
            SCOPED_TRACE(testing::Message()
                         << "L=" << L << " " << t.ToString());
            // Independent validity: per-stage counts.
            std::vector<int64_t> stage(pp, 0);
            bool valid = true;
            if (!first && !last) {
              valid = L % pp == 0;
              if (valid) std::fill(stage.begin(), stage.end(), L / pp);
            } else {
              const int64_t ms = pp - (first ? 1 : 0) - (last ? 1 : 0);
              const int64_t rest = L - first.value_or(0) - last.value_or(0);
              valid = rest >= 0 && (ms == 0 ? rest == 0 : rest % ms == 0);
              if (valid) {
                std::fill(stage.begin(), stage.end(), ms ? rest / ms : 0);
                if (first) stage.front() = *first;
                if (last) stage.back() = *last;
              }
            }
            for (int64_t n : stage) valid = valid && n % vpp == 0;
            if (!valid) {
              EXPECT_THROW(LayerPlacement(L, t), LayoutError);
              ++rejected;
              continue;
            }
            const LayerPlacement placement(L, t);
            ++accepted;
            std::vector<int> seen(L, 0);
            for (int64_t p = 0; p < pp; ++p) {
              EXPECT_EQ(placement.StageLayers(p), stage[p]);
              for (int64_t v = 0; v < vpp; ++v) {
                const LayerRange r = placement.LayersOf(p, v);
                const MegatronStage m = Megatron(L, t, p, v);
                EXPECT_EQ(r.size(), m.count) << "p=" << p << " v=" << v;
                if (r.size() > 0) {
                  EXPECT_EQ(r.begin, m.offset) << "p=" << p << " v=" << v;
                }
                for (int64_t i = 0; i < r.size(); ++i) {
                  const int64_t g = placement.Global(p, v, i);
                  ASSERT_EQ(g, r.begin + i);  // contiguous
                  ASSERT_GE(g, 0);
                  ASSERT_LT(g, L);
                  ++seen[g];
                  ASSERT_EQ(placement.Locate(g), (LayerLocation{p, v, i}));
                }
                EXPECT_THROW(placement.Global(p, v, r.size()), LayoutError);
              }
            }
            for (int64_t g = 0; g < L; ++g)
              ASSERT_EQ(seen[g], 1) << "layer " << g;
            // Global order is chunk-major, then stage.
            int64_t expect = 0;
            for (int64_t v = 0; v < vpp; ++v) {
              for (int64_t p = 0; p < pp; ++p) {
                EXPECT_EQ(placement.LayersOf(p, v).begin, expect);
                expect += placement.LayersOf(p, v).size();
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(rejected, 1000);
}

TEST(LayerPlacementTest, MegatronDocumentedExample) {
  // transformer_block.py: 8 layers, 2 stages, 4 model chunks:
  // Stage 0: [0] [2] [4] [6]; Stage 1: [1] [3] [5] [7].
  const LayerPlacement a(8, Topo(1, 2, 4));
  EXPECT_EQ(a.LayersOf(0, 2), (LayerRange{4, 5}));
  EXPECT_EQ(a.LayersOf(1, 3), (LayerRange{7, 8}));
  // 8 layers, 2 stages, 2 chunks: Stage 0: [0, 1] [4, 5]; Stage 1: [2, 3] [6,
  // 7].
  const LayerPlacement b(8, Topo(1, 2, 2));
  EXPECT_EQ(b.LayersOf(0, 1), (LayerRange{4, 6}));
  EXPECT_EQ(b.LayersOf(1, 0), (LayerRange{2, 4}));
  EXPECT_EQ(b.Locate(6), (LayerLocation{1, 1, 0}));
  // Uneven: 10 layers, pp 4, first 1, last 3: middle stages hold 3 each.
  const LayerPlacement c(10, Topo(1, 4, 1, 1, 1, 3));
  EXPECT_EQ(c.LayersOf(0, 0), (LayerRange{0, 1}));
  EXPECT_EQ(c.LayersOf(1, 0), (LayerRange{1, 4}));
  EXPECT_EQ(c.LayersOf(2, 0), (LayerRange{4, 7}));
  EXPECT_EQ(c.LayersOf(3, 0), (LayerRange{7, 10}));
}

TEST(LayerPlacementTest, ErrorsNameTheNumbers) {
  EXPECT_THAT([] { LayerPlacement(10, Topo(1, 4)); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("pp 4 does not divide the 10 layers")));
  EXPECT_THAT([] { LayerPlacement(8, Topo(1, 2, 3)); },
              ThrowsMessage<LayoutError>(HasSubstr(
                  "pipeline stage 0 holds 4 layers, not divisible by vpp 3")));
  EXPECT_THAT([] { LayerPlacement(8, Topo(1, 1, 1, 1, 2)); },
              ThrowsMessage<LayoutError>(HasSubstr("need pp > 1")));
  EXPECT_THAT([] { LayerPlacement(8, Topo(1, 3, 1, 1, 3)); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("the 5 layers left for the 2 middle stages")));
  EXPECT_THAT(
      [] { LayerPlacement(8, Topo(1, 2, 1, 1, 6, 3)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "the first and last stages hold 9 layers but the model has 8")));
  EXPECT_THAT([] { LayerPlacement(8, Topo(1, 2, 1, 1, 2, 3)); },
              ThrowsMessage<LayoutError>(HasSubstr("no middle stages")));
  EXPECT_THAT([] { LayerPlacement(8, Topo(0)); },
              ThrowsMessage<LayoutError>(HasSubstr("sizes must be >= 1")));
  EXPECT_THAT(
      [] { LayerPlacement(8, Topo(1, 2, 1, 1, -1)); },
      ThrowsMessage<LayoutError>(HasSubstr("negative stage layer count")));
  const LayerPlacement p(4, Topo(1, 2));
  EXPECT_THAT([&] { p.Locate(4); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("layer 4 out of range (the model has 4 layers)")));
  EXPECT_THAT(
      [&] { p.LayersOf(2, 0); },
      ThrowsMessage<LayoutError>(HasSubstr("pipeline rank 2 out of range")));
  EXPECT_THAT(
      [&] { p.LayersOf(0, 1); },
      ThrowsMessage<LayoutError>(HasSubstr("model chunk 1 out of range")));
  EXPECT_THAT([&] { p.Global(1, 0, 2); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("local layer 2 out of range: chunk 0 of pipeline "
                            "stage 1 holds 2 layers")));
}

// ------------------------------------------------------------ homes and names

constexpr char kLayout[] = R"(name: p
layers: {prefix: "m.layers.", count: n}
defaults: {groups: heads}
rules:
  - name: emb
    match: "m.emb.weight"
    stage: first
    tp: {split: {dim: 0}, vocab: {true_size: vocab, divisible_by: div}}
  - name: head
    match: "m.head.weight"
    stage: last
    tied_to: "m.emb.weight"
    exists_when: "pp > 1"
  - name: qkv
    match: "m.layers.*.qkv.weight"
    tp: {split: {dim: 0}, groups: groups, heads: heads}
  - name: fc1
    match: "m.layers.*.fc1.weight"
    tp: {split: {dim: 0, segments: 2}}
  - name: proj
    match: "m.layers.*.proj.weight"
    tp: {split: {dim: 1}}
  - name: norm
    match: "m.layers.*.norm"
  - name: extra
    match: "m.layers.*._extra_state"
    entry: opaque
  - name: final
    match: "m.final"
    stage: last
)";

TEST(HomeTest, StagesAndLocalNames) {
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  const LayerPlacement placement(8, Topo(1, 2, 2));
  EXPECT_EQ(HomeOf(l, *l.RuleNamed("emb"), "m.emb.weight", placement),
            (Home{0, 0, std::nullopt}));
  EXPECT_EQ(HomeOf(l, *l.RuleNamed("final"), "m.final", placement),
            (Home{1, 1, std::nullopt}));
  EXPECT_EQ(HomeOf(l, *l.RuleNamed("qkv"), "m.layers.5.qkv.weight", placement),
            (Home{0, 1, 1}));
  EXPECT_THAT(
      [&] { HomeOf(l, *l.RuleNamed("qkv"), "m.qkv.weight", placement); },
      ThrowsMessage<LayoutError>(HasSubstr("has no layer index")));
  EXPECT_THAT(
      [&] {
        HomeOf(l, *l.RuleNamed("qkv"), "m.layers.8.qkv.weight", placement);
      },
      ThrowsMessage<LayoutError>(HasSubstr("layer 8 out of range")));
  EXPECT_EQ(LocalName(l, "m.layers.5.qkv.weight", placement),
            "m.layers.1.qkv.weight");
  EXPECT_EQ(LocalName(l, "m.emb.weight", placement), "m.emb.weight");
  EXPECT_EQ(CanonicalName(l, "m.layers.1.qkv.weight", placement, 0, 1),
            "m.layers.5.qkv.weight");
  EXPECT_EQ(CanonicalName(l, "m.layers.1.qkv.weight", placement, 1, 1),
            "m.layers.7.qkv.weight");
  EXPECT_EQ(CanonicalName(l, "m.final", placement, 1, 1), "m.final");
  EXPECT_THAT(
      [&] { CanonicalName(l, "m.layers.2.qkv.weight", placement, 1, 1); },
      ThrowsMessage<LayoutError>(HasSubstr("local layer 2 out of range")));
}

// ------------------------------------------------------------ shards

// A small dense tensor of element ids: the oracle builds local tensors with
// chunk/cat operations as Megatron's converters do, independently of the
// pieces.
struct T {
  Shape shape;
  std::vector<int64_t> v;
};

int64_t Numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

T Iota(const Shape& shape, int64_t base) {
  T t{shape, std::vector<int64_t>(Numel(shape))};
  for (size_t i = 0; i < t.v.size(); ++i)
    t.v[i] = base + static_cast<int64_t>(i);
  return t;
}

T Filled(const Shape& shape, int64_t value) {
  return T{shape, std::vector<int64_t>(Numel(shape), value)};
}

// Calls fn(index) for every index of `shape` in row-major order.
void ForEachIndex(const Shape& shape,
                  const std::function<void(const Shape&)>& fn) {
  if (Numel(shape) == 0) return;
  Shape idx(shape.size(), 0);
  while (true) {
    fn(idx);
    size_t d = shape.size();
    while (d > 0) {
      --d;
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (shape.empty()) return;
  }
}

T Narrow(const T& t, size_t dim, int64_t begin, int64_t size) {
  Shape s = t.shape;
  s[dim] = size;
  T out{s, std::vector<int64_t>(Numel(s))};
  ForEachIndex(s, [&](const Shape& i) {
    Shape src = i;
    src[dim] += begin;
    out.v[Flat(s, i)] = t.v[Flat(t.shape, src)];
  });
  return out;
}

T Cat(const std::vector<T>& parts, size_t dim) {
  Shape s = parts.front().shape;
  s[dim] = 0;
  for (const T& p : parts) s[dim] += p.shape[dim];
  T out{s, std::vector<int64_t>(Numel(s))};
  int64_t at = 0;
  for (const T& p : parts) {
    ForEachIndex(p.shape, [&](const Shape& i) {
      Shape dst = i;
      dst[dim] += at;
      out.v[Flat(s, dst)] = p.v[Flat(p.shape, i)];
    });
    at += p.shape[dim];
  }
  return out;
}

// torch.chunk(t, n, dim)[k] for a dim divisible by n.
T Chunk(const T& t, int64_t n, size_t dim, int64_t k) {
  const int64_t per = t.shape[dim] / n;
  return Narrow(t, dim, k * per, per);
}

// Copies box `from` of `src` to box `to` of `dst` (equal sizes).
void CopyBox(const T& src, const Box& from, T& dst, const Box& to,
             int* writes = nullptr, std::vector<int>* count = nullptr) {
  ASSERT_EQ(from.size, to.size);
  ForEachIndex(from.size, [&](const Shape& i) {
    Shape a = i, b = i;
    for (size_t d = 0; d < i.size(); ++d)
      a[d] += from.offset[d], b[d] += to.offset[d];
    dst.v[Flat(dst.shape, b)] = src.v[Flat(src.shape, a)];
    if (writes) ++*writes;
    if (count) ++(*count)[Flat(dst.shape, b)];
  });
}

bool Inside(const Box& b, const Shape& shape) {
  if (b.offset.size() != shape.size() || b.size.size() != shape.size())
    return false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (b.offset[d] < 0 || b.size[d] < 0 || b.offset[d] + b.size[d] > shape[d])
      return false;
  }
  return true;
}

Rule MakeRule(bool split, int dim, int segments, bool vocab) {
  std::string yaml =
      "name: r\nrules:\n  - name: r\n    match: x\n    stage: first\n";
  if (split) {
    yaml += "    tp: {split: {dim: " + std::to_string(dim) +
            ", segments: " + std::to_string(segments) + "}";
    if (vocab) yaml += ", vocab: {true_size: v, divisible_by: d}";
    yaml += "}\n";
  }
  return Layout::Parse(yaml, "r.yaml").rules().front();
}

// For random shapes, tp, segments and vocab padding: each rank's pieces
// produce exactly the local tensor the chunk/cat oracle builds (zeros where
// it pads beyond the available padding rows); the main pieces of all ranks
// tile the full tensor once (tp times when replicated), the pad pieces the
// usable padding rows once; local boxes never overlap.
TEST(ShardForProperty, PiecesReproduceTheOracleAndTileTheTensor) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % (hi - lo + 1));
  };
  constexpr int64_t kPadBase = 1000000, kFill = -1;
  for (int iter = 0; iter < 3000; ++iter) {
    const int64_t tp = uniform(1, 5);
    const size_t rank = static_cast<size_t>(uniform(1, 3));
    const int kind =
        static_cast<int>(uniform(0, 2));  // replicated, split, vocab
    const int dim = static_cast<int>(uniform(0, rank - 1));
    const int segments = kind == 1 ? static_cast<int>(uniform(1, 3)) : 1;
    Shape full(rank);
    for (size_t d = 0; d < rank; ++d) full[d] = uniform(0, 4);
    int64_t padded = 0, avail = 0;
    if (kind == 1) full[dim] = tp * segments * uniform(0, 3);
    if (kind == 2) {
      full[dim] = uniform(0, 20);
      padded = PaddedVocabSize(full[dim], uniform(1, 4), tp);
      avail = uniform(0, padded - full[dim] + 2);
    }
    const Rule rule = MakeRule(kind != 0, dim, segments, kind == 2);
    SCOPED_TRACE(testing::Message()
                 << "iter " << iter << " tp " << tp << " rule "
                 << rule.tp.ToString() << " padded " << padded << " avail "
                 << avail);
    const T x = Iota(full, 0);
    Shape pad_shape = full;
    pad_shape[dim] = avail;
    const T pad = Iota(pad_shape, kPadBase);
    std::vector<int> main_count(Numel(full), 0), pad_count(Numel(pad_shape), 0);
    for (int64_t r = 0; r < tp; ++r) {
      const LocalShard shard = ShardFor(rule, full, tp, r, padded, avail);
      // The oracle's local tensor.
      T want;
      if (kind == 0) {
        want = x;
      } else if (kind == 1) {
        std::vector<T> parts;
        for (int s = 0; s < segments; ++s)
          parts.push_back(Chunk(Chunk(x, segments, dim, s), tp, dim, r));
        want = Cat(parts, dim);
      } else {
        const int64_t usable = std::min(avail, padded - full[dim]);
        Shape zero_shape = full;
        zero_shape[dim] = padded - full[dim] - usable;
        const T padded_x = Cat(
            {x, Narrow(pad, dim, 0, usable), Filled(zero_shape, kFill)}, dim);
        want = Chunk(padded_x, tp, dim, r);
      }
      ASSERT_EQ(shard.local_shape, want.shape);
      T got = Filled(shard.local_shape, kFill);
      std::vector<int> local_count(Numel(shard.local_shape), 0);
      for (const Piece& p : shard.pieces) {
        ASSERT_TRUE(Inside(p.local, shard.local_shape)) << p.local.ToString();
        ASSERT_EQ(p.local.size, p.global.size);
        if (p.region == Region::kMain) {
          ASSERT_TRUE(Inside(p.global, full)) << p.global.ToString();
          CopyBox(x, p.global, got, p.local, nullptr, &local_count);
          T sink = Filled(full, 0);
          CopyBox(got, p.local, sink, p.global, nullptr, &main_count);
        } else {
          ASSERT_EQ(kind, 2);
          ASSERT_TRUE(Inside(p.global, pad_shape)) << p.global.ToString();
          CopyBox(pad, p.global, got, p.local, nullptr, &local_count);
          T sink = Filled(pad_shape, 0);
          CopyBox(got, p.local, sink, p.global, nullptr, &pad_count);
        }
        ASSERT_GT(p.local.NumElements(), 0);  // no empty pieces
      }
      for (int c : local_count) ASSERT_LE(c, 1);  // local boxes disjoint
      ASSERT_EQ(got.v, want.v);
      // The reader's view: the full shape follows from the local one.
      if (kind != 2 || full[dim] <= shard.local_shape[dim] * tp) {
        Variables vars = {{"v", full[dim]}};
        ASSERT_EQ(FullShapeFromLocal(rule, shard.local_shape, tp, vars), full);
      }
    }
    const int expect_main = kind == 0 ? static_cast<int>(tp) : 1;
    for (int c : main_count) ASSERT_EQ(c, expect_main);
    const int64_t usable = kind == 2 ? std::min(avail, padded - full[dim]) : 0;
    ForEachIndex(pad_shape, [&](const Shape& i) {
      ASSERT_EQ(pad_count[Flat(pad_shape, i)], i[dim] < usable ? 1 : 0);
    });
  }
}

TEST(ShardForTest, SwiGluAndVocabExamples) {
  // fc1 [W; V] with W, V of 4 rows each, tp 2: rank 1 holds [W rows 2-3; V rows
  // 2-3].
  const Rule swiglu = MakeRule(true, 0, 2, false);
  const Shape full = {8, 3};
  const LocalShard s = ShardFor(swiglu, full, 2, 1);
  EXPECT_EQ(s.local_shape, (Shape{4, 3}));
  ASSERT_EQ(s.pieces.size(), 2u);
  EXPECT_EQ(s.pieces[0].local, (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(s.pieces[0].global, (Box{{2, 0}, {2, 3}}));
  EXPECT_EQ(s.pieces[1].local, (Box{{2, 0}, {2, 3}}));
  EXPECT_EQ(s.pieces[1].global, (Box{{6, 0}, {2, 3}}));
  // Vocab 10 rows, padded 16 for tp 2, 4 source padding rows: rank 1 holds
  // rows 8-9, then padding rows 0-3, then 2 filled rows.
  const Rule vocab = MakeRule(true, 0, 1, true);
  const LocalShard v = ShardFor(vocab, Shape{10, 2}, 2, 1, 16, 4);
  EXPECT_EQ(v.local_shape, (Shape{8, 2}));
  ASSERT_EQ(v.pieces.size(), 2u);
  EXPECT_EQ(v.pieces[0],
            (Piece{Box{{0, 0}, {2, 2}}, Box{{8, 0}, {2, 2}}, Region::kMain}));
  EXPECT_EQ(v.pieces[1],
            (Piece{Box{{2, 0}, {4, 2}}, Box{{0, 0}, {4, 2}}, Region::kPad}));
  // Split dim 1 (row-parallel): rank 0 of 2 holds columns 0-1 of 4.
  const Rule proj = MakeRule(true, 1, 1, false);
  const LocalShard p = ShardFor(proj, Shape{3, 4}, 2, 0);
  EXPECT_EQ(p.local_shape, (Shape{3, 2}));
  EXPECT_EQ(p.pieces.front().global, (Box{{0, 0}, {3, 2}}));
}

TEST(ShardForTest, ErrorsNameTheRuleAndNumbers) {
  const Rule split = MakeRule(true, 1, 2, false);
  EXPECT_THAT(
      [&] {
        ShardFor(split, Shape{4, 6}, 2, 0);
      },
      ThrowsMessage<LayoutError>(AllOf(
          HasSubstr("rule 'r' (line 3), shape [4, 6], tp 2"),
          HasSubstr("dim 1 of size 6 is not divisible by tp x segments = 4"))));
  EXPECT_THAT([&] { ShardFor(split, Shape{4}, 2, 0); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("split dim 1 is not a dim of a rank-1 tensor")));
  EXPECT_THAT(
      [&] {
        ShardFor(split, Shape{4, 8}, 2, 2);
      },
      ThrowsMessage<LayoutError>(HasSubstr("tp rank 2 out of range")));
  EXPECT_THAT(
      [&] {
        ShardFor(split, Shape{4, 8}, 0, 0);
      },
      ThrowsMessage<LayoutError>(HasSubstr("tp must be >= 1")));
  const Rule vocab = MakeRule(true, 0, 1, true);
  EXPECT_THAT(
      [&] {
        ShardFor(vocab, Shape{10, 2}, 2, 0, 8);
      },
      ThrowsMessage<LayoutError>(
          HasSubstr("padded size 8 of dim 0 is below the true size 10")));
  EXPECT_THAT(
      [&] {
        ShardFor(vocab, Shape{10, 2}, 4, 0, 14);
      },
      ThrowsMessage<LayoutError>(
          HasSubstr("padded size 14 of dim 0 is not divisible by tp")));
  EXPECT_THAT(
      [&] {
        ShardFor(vocab, Shape{10, 2}, 2, 0, 12, -1);
      },
      ThrowsMessage<LayoutError>(HasSubstr("negative number of padding rows")));
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  EXPECT_THAT([&] { ShardFor(*l.RuleNamed("extra"), Shape{}, 1, 0); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("opaque entries have no tensor placement")));
}

TEST(ShardForTest, TiedCopyUsesTheOriginalsPlacement) {
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  const Rule& head = *l.RuleNamed("head");
  const Rule& emb = *l.RuleNamed("emb");
  for (int64_t r = 0; r < 4; ++r) {
    const LocalShard a = ShardFor(head, Shape{30, 4}, 4, r, 32, 2);
    const LocalShard b = ShardFor(emb, Shape{30, 4}, 4, r, 32, 2);
    EXPECT_EQ(a.local_shape, b.local_shape);
    EXPECT_EQ(a.pieces, b.pieces);
  }
}

TEST(FullShapeFromLocalTest, ReaderView) {
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  const Variables vars = {{"vocab", 30}, {"div", 4}};
  EXPECT_EQ(FullShapeFromLocal(*l.RuleNamed("emb"), Shape{8, 4}, 4, vars),
            (Shape{30, 4}));
  EXPECT_EQ(FullShapeFromLocal(*l.RuleNamed("fc1"), Shape{6, 4}, 4, vars),
            (Shape{24, 4}));
  EXPECT_EQ(FullShapeFromLocal(*l.RuleNamed("proj"), Shape{6, 4}, 2, vars),
            (Shape{6, 8}));
  EXPECT_EQ(FullShapeFromLocal(*l.RuleNamed("norm"), Shape{6}, 2, vars),
            (Shape{6}));
  EXPECT_THAT(
      [&] {
        FullShapeFromLocal(*l.RuleNamed("emb"), Shape{7, 4}, 4, vars);
      },
      ThrowsMessage<LayoutError>(
          HasSubstr("the 4 ranks hold 28 rows along dim 0, fewer than the true "
                    "vocab size 30")));
  EXPECT_THAT(
      [&] {
        FullShapeFromLocal(*l.RuleNamed("fc1"), Shape{5, 4}, 4, vars);
      },
      ThrowsMessage<LayoutError>(
          HasSubstr("dim 0 is not divisible by the 2 segments")));
  EXPECT_THAT(
      [&] { FullShapeFromLocal(*l.RuleNamed("proj"), Shape{6}, 2, vars); },
      ThrowsMessage<LayoutError>(
          HasSubstr("split dim 1 is not a dim of a rank-1 tensor")));
  EXPECT_THAT(
      [&] {
        FullShapeFromLocal(*l.RuleNamed("emb"), Shape{8, 4}, 4, {});
      },
      ThrowsMessage<LayoutError>(HasSubstr("variable 'vocab' is not set")));
  EXPECT_EQ(PaddedDimSize(*l.RuleNamed("emb"), vars, 4), 32);
  EXPECT_EQ(PaddedDimSize(*l.RuleNamed("head"), vars, 3), 36);
  EXPECT_EQ(PaddedDimSize(*l.RuleNamed("qkv"), vars, 4), std::nullopt);
}

// ------------------------------------------------------------ validation

std::vector<ParamShape> Params() {
  std::vector<ParamShape> p = {{"m.emb.weight", {30, 8}}, {"m.final", {8}}};
  for (int i = 0; i < 4; ++i) {
    const std::string l = "m.layers." + std::to_string(i) + ".";
    p.push_back({l + "qkv.weight", {48, 8}});
    p.push_back({l + "fc1.weight", {24, 8}});
    p.push_back({l + "proj.weight", {8, 12}});
    p.push_back({l + "norm", {8}});
    p.push_back({l + "_extra_state", {}});
  }
  return p;
}

TEST(ValidateTopologyTest, AcceptsFittingTopologies) {
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  const Variables vars = {{"n", 4}, {"vocab", 30}, {"div", 8}, {"heads", 4}};
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t pp : {1, 2, 4}) {
      EXPECT_NO_THROW(ValidateTopology(l, Params(), vars, Topo(tp, pp)));
    }
  }
  EXPECT_NO_THROW(ValidateTopology(l, Params(), vars, Topo(1, 2, 2)));
  EXPECT_NO_THROW(ValidateTopology(l, Params(), vars, Topo(1, 3, 1, 1, 2)));
  std::vector<ParamShape> with_copy = Params();
  with_copy.push_back({"m.head.weight", {30, 8}});
  EXPECT_NO_THROW(ValidateTopology(l, with_copy, vars, Topo(2, 2)));
}

void ExpectInvalid(const std::vector<ParamShape>& params, const Variables& vars,
                   const Topology& t, const std::string& want) {
  const Layout l = Layout::Parse(kLayout, "p.yaml");
  EXPECT_THAT([&] { ValidateTopology(l, params, vars, t); },
              ThrowsMessage<LayoutError>(HasSubstr(want)))
      << want;
}

TEST(ValidateTopologyTest, NamesTheParamAndTheProblem) {
  const Variables vars = {{"n", 4}, {"vocab", 30}, {"div", 8}, {"heads", 4}};
  const std::string header =
      "target topology tp=3 pp=1 vpp=1 dp=1 does not fit layout 'p': ";
  // tp 3 divides none of the split dims here: the first problem is named
  // and the others counted.
  ExpectInvalid(Params(), vars, Topo(3),
                header +
                    "param 'm.layers.0.qkv.weight' (rule 'qkv' (line 14)): tp "
                    "3 does not divide the "
                    "query groups (groups = 4) (and 3 more problems)");
  ExpectInvalid(Params(), vars.Merged({{"groups", 2}}), Topo(4),
                "param 'm.layers.0.qkv.weight' (rule 'qkv' (line 14)): tp 4 "
                "does not divide the query "
                "groups (groups = 2)");
  ExpectInvalid(Params(), vars.Merged({{"heads", 6}, {"groups", 4}}), Topo(4),
                "tp 4 does not divide the attention heads (heads = 6)");
  // Query groups and heads are reported before the dims they cause.
  ExpectInvalid(Params(), vars, Topo(5),
                "param 'm.layers.0.qkv.weight' (rule 'qkv' (line 14)): tp 5 "
                "does not divide the query groups (groups = 4)");
  ExpectInvalid(Params(), vars.Merged({{"groups", 5}, {"heads", 10}}), Topo(5),
                "param 'm.layers.0.qkv.weight' (rule 'qkv' (line 14)): tp 5 "
                "does not divide dim 0 of size 48");
  std::vector<ParamShape> p = Params();
  p[3].shape = {20, 8};
  ExpectInvalid(p, vars, Topo(4),
                "param 'm.layers.0.fc1.weight' (rule 'fc1' (line 17)): tp 4 x "
                "2 segments does not divide dim 0 of size 20");
  ExpectInvalid(Params(), vars, Topo(1, 3),
                "target topology tp=1 pp=3 vpp=1 dp=1 does not fit layout 'p': "
                "topology tp=1 pp=3 vpp=1 dp=1: pp 3 "
                "does not divide the 4 layers");
  ExpectInvalid(Params(), vars, Topo(1, 2, 4),
                "pipeline stage 0 holds 2 layers, not divisible by vpp 4");
  ExpectInvalid(
      Params(), vars, Topo(1, 3, 1, 1, std::nullopt, 3),
      "the 1 layers left for the 2 middle stages do not divide evenly");
  ExpectInvalid(Params(), vars.Merged({{"vocab", 31}}), Topology{},
                "param 'm.emb.weight' (rule 'emb' (line 5)): dim 0 holds 30 "
                "but the true vocab size (vocab) is 31");
  ExpectInvalid(Params(), vars.Merged({{"div", 0}}), Topology{},
                "div = 0 must be >= 1");
  p = Params();
  p.push_back({"m.layers.0.fc2.weight", {8, 8}});
  ExpectInvalid(p, vars, Topology{},
                "param 'm.layers.0.fc2.weight': no rule of layout 'p' matches "
                "'m.layers.0.fc2.weight'");
  p = Params();
  p.push_back({"m.layers.4.norm", {8}});
  ExpectInvalid(p, vars, Topology{},
                "param 'm.layers.4.norm' (rule 'norm' (line 23)): layer 4 but "
                "the model has 4 layers");
  p = Params();
  p.push_back({"m.layers.x.norm", {8}});
  ExpectInvalid(
      p, vars, Topology{},
      "(rule 'norm' (line 23)): a layer rule, but the name has no layer index");
  p = Params();
  p[4].shape = {8};
  ExpectInvalid(p, vars, Topology{},
                "param 'm.layers.0.proj.weight' (rule 'proj' (line 20)): split "
                "dim 1 but the shape [8] has 1 dims");
  p = Params();
  p.front().shape = {30};
  p.front().name = "m.final";
  p.erase(p.begin() + 1);
  p.push_back({"m.head.weight", {30, 8}});
  ExpectInvalid(p, vars, Topology{},
                "param 'm.head.weight' (rule 'head' (line 9)): a tied copy of "
                "'m.emb.weight', "
                "which is not among the params");
  p = Params();
  p.push_back({"m.head.weight", {31, 8}});
  ExpectInvalid(p, vars, Topology{},
                "param 'm.head.weight' (rule 'head' (line 9)): dim 0 holds 31 "
                "but the true vocab size");
  p.back().shape = {30, 9};
  ExpectInvalid(p, vars, Topology{},
                "param 'm.head.weight' (rule 'head' (line 9)): shape [30, 9] "
                "differs from its original 'm.emb.weight' [30, 8]");
  ExpectInvalid(Params(), {{"vocab", 30}, {"div", 8}, {"heads", 4}}, Topology{},
                "layers.count > expression 'n': variable 'n' is not set");
  ExpectInvalid(Params(), {{"n", 4}, {"vocab", 30}, {"div", 8}}, Topology{},
                "param 'm.layers.0.qkv.weight' (rule 'qkv' (line 14)): "
                "expression 'groups': variable "
                "'groups' is not set");
}

}  // namespace
}  // namespace ucp::layouts
