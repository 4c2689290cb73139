// Pure pieces of the Megatron driver: folder naming, param groups, nested
// state dicts, the args Namespace (reading and patching).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/value.h"
#include "tests/testutil/testutil.h"

namespace ucp::megatron {
namespace {

using formats::AppendEntry;
using formats::BuildChunk;
using formats::FlattenChunk;
using formats::NewOrderedDict;
using pickle::Arena;
using pickle::Kind;
using pickle::Value;
using testing::HasSubstr;

TEST(MegatronNaming, Folders) {
  // checkpointing.py:get_checkpoint_name
  EXPECT_EQ(IterDirName(100, false), "iter_0000100");
  EXPECT_EQ(IterDirName(12345678, false), "iter_12345678");
  EXPECT_EQ(IterDirName(5, true), "release");
  EXPECT_EQ(RankDirName(1, 0, 1), "mp_rank_01");
  EXPECT_EQ(RankDirName(3, 2, 4), "mp_rank_03_002");
  EXPECT_EQ(RankDirName(12, 0, 2), "mp_rank_12_000");
  auto r = ParseRankDirName("mp_rank_03_002");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->tp_rank, 3);
  EXPECT_EQ(r->second, std::optional<int64_t>(2));
  EXPECT_FALSE(r->third);
  EXPECT_TRUE(ParseRankDirName("mp_rank_00"));
  EXPECT_TRUE(ParseRankDirName("mp_rank_00_001_002")->third);
  for (const char* bad : {"mp_rank_", "mp_rank_x", "mp_rank_00_", "rank_00",
                          "mp_rank_00_001_002_003", "mp_rank_-1"}) {
    EXPECT_FALSE(ParseRankDirName(bad)) << bad;
  }
}

// LocateIteration against Megatron's loader (training/checkpointing.py:
// read_metadata reads the tracker, "release" or an iteration number;
// get_checkpoint_name joins iter_{N:07d} or release; --ckpt-step picks an
// iteration instead of the tracker's).
TEST(MegatronNaming, LocateIterationAsMegatronsLoaderDoes) {
  namespace fs = std::filesystem;
  testutil::TempDir tmp;
  const fs::path save = tmp / "save";
  fs::create_directories(save / "iter_0000100");
  fs::create_directories(save / "iter_0000050");
  fs::create_directories(save / "release");
  fs::create_directories(save / "other");
  const fs::path tracker = save / "latest_checkpointed_iteration.txt";
  testutil::WriteFile(tracker, "100\n");
  IterationFolder f = LocateIteration(save, std::nullopt);
  EXPECT_EQ(f.dir, save);
  EXPECT_EQ(f.iter_dir, save / "iter_0000100");
  EXPECT_EQ(f.iteration, 100);
  EXPECT_TRUE(f.named);
  EXPECT_FALSE(f.release);
  // An explicit iteration, from the save folder or from an iteration folder
  // (whose save folder is its parent); one the folder lacks names those it
  // has, sorted.
  for (const fs::path& from : {save, save / "iter_0000100"}) {
    f = LocateIteration(from, 50);
    EXPECT_EQ(f.dir, save) << from;
    EXPECT_EQ(f.iter_dir, save / "iter_0000050") << from;
    EXPECT_EQ(f.iteration, 50);
  }
  EXPECT_THAT([&] { LocateIteration(save, 70); },
              testing::ThrowsMessage<UsageError>(testing::AllOf(
                  HasSubstr("--iteration 70"), HasSubstr("iter_0000070"),
                  HasSubstr("iterations here: iter_0000050, iter_0000100"))));
  // The release folder: the legacy format's only.
  testutil::WriteFile(tracker, "release");
  f = LocateIteration(save, std::nullopt, ReleaseFolder::kAccepted);
  EXPECT_TRUE(f.release);
  EXPECT_EQ(f.iteration, 0);
  EXPECT_EQ(f.iter_dir, save / "release");
  EXPECT_THAT([&] { LocateIteration(save, std::nullopt); },
              testing::ThrowsMessage<FormatError>(testing::AllOf(
                  HasSubstr(tracker.string()), HasSubstr("'release'"),
                  testing::Not(HasSubstr("or 'release'")))));
  // A tracker that holds no iteration, or names a folder that is not there.
  testutil::WriteFile(tracker, "1OO");
  EXPECT_THAT(
      [&] { LocateIteration(save, std::nullopt, ReleaseFolder::kAccepted); },
      testing::ThrowsMessage<FormatError>(testing::AllOf(
          HasSubstr(tracker.string()), HasSubstr("'1OO'"),
          HasSubstr("an iteration number or 'release'"))));
  testutil::WriteFile(tracker, "30");
  EXPECT_THAT([&] { LocateIteration(save, std::nullopt); },
              testing::ThrowsMessage<FormatError>(testing::AllOf(
                  HasSubstr("iteration 30"), HasSubstr("iter_0000030"))));
  fs::remove(tracker);
  // The folder itself, without a tracker.
  f = LocateIteration(save / "iter_0000100", std::nullopt);
  EXPECT_EQ(f.dir, save);
  EXPECT_EQ(f.iteration, 100);
  EXPECT_TRUE(f.named);
  f = LocateIteration(save / "release", std::nullopt, ReleaseFolder::kAccepted);
  EXPECT_TRUE(f.named && f.release);
  EXPECT_FALSE(LocateIteration(save / "release", std::nullopt).named);
  f = LocateIteration(save / "other", std::nullopt);
  EXPECT_FALSE(f.named);
  EXPECT_EQ(f.iteration, 0);
  EXPECT_THROW(LocateIteration(save / "missing", std::nullopt), IoError);
}

TEST(MegatronGroups, DefaultKeyAndFirstAppearance) {
  // optimizer/__init__.py:_get_param_groups: no weight decay for ".bias"
  // names and 1-D params.
  EXPECT_EQ(
      DefaultGroupKey("decoder.layers.0.mlp.linear_fc1.weight", 2).wd_mult,
      1.0);
  EXPECT_EQ(DefaultGroupKey("decoder.layers.0.mlp.linear_fc1.bias", 1).wd_mult,
            0.0);
  EXPECT_EQ(DefaultGroupKey("x.layer_norm_weight", 1).wd_mult, 0.0);
  EXPECT_EQ(DefaultGroupKey("x.bias", 2).wd_mult, 0.0);
  EXPECT_EQ(DefaultGroupKey("x.nobias", 2).wd_mult, 1.0);
  EXPECT_EQ(DefaultGroupKey("x.weight", 0).wd_mult, 1.0);
  const GroupKey wd{1.0, 1.0, false, false}, nowd{0.0, 1.0, false, false};
  // A later pipeline stage may start with a norm: no-wd comes first there.
  const std::vector<GroupKey> keys = {nowd, wd, nowd, wd, wd};
  Grouping g = GroupParams(keys);
  ASSERT_EQ(g.keys.size(), 2u);
  EXPECT_EQ(g.keys[0], nowd);
  EXPECT_EQ(g.members[0], (std::vector<size_t>{0, 2}));
  EXPECT_EQ(g.members[1], (std::vector<size_t>{1, 3, 4}));
  EXPECT_EQ(g.group_of, (std::vector<size_t>{0, 1, 0, 1, 1}));
  EXPECT_EQ(GroupKey::FromJson(nowd.ToJson()), nowd);
  EXPECT_THROW(GroupKey::FromJson(json::Value("x")), FormatError);
}

TEST(MegatronGroups, LegacyFixedOrder) {
  // Megatron-LM 23.06 / core v0.5 megatron/optimizer/__init__.py:
  // get_param_groups appends wd_no_scale_lr, wd_scale_lr, no_wd_no_scale_lr,
  // no_wd_scale_lr, skipping empty ones.
  const GroupKey wd{1.0, 1.0, false, false}, nowd{0.0, 1.0, false, false},
      wd_scaled{1.0, 2.0, false, false};
  const std::vector<GroupKey> keys = {nowd, wd_scaled, wd, nowd};
  Grouping g = GroupParams(keys, GroupOrder::kLegacyFixed);
  ASSERT_EQ(g.keys.size(), 3u);
  EXPECT_EQ(g.keys[0], wd);
  EXPECT_EQ(g.keys[1], wd_scaled);
  EXPECT_EQ(g.keys[2], nowd);
  EXPECT_EQ(g.members[0], (std::vector<size_t>{2}));
  EXPECT_EQ(g.members[1], (std::vector<size_t>{1}));
  EXPECT_EQ(g.members[2], (std::vector<size_t>{0, 3}));
  EXPECT_EQ(g.group_of, (std::vector<size_t>{2, 1, 0, 2}));
}

TEST(MegatronGroups, OverridesSortedOrder) {
  // Megatron-core v0.16 _get_param_groups: sorted(params_key, key=lambda x:
  // (x[0] is not None, x[0])) over the override tuples: no override first,
  // then (("lr_mult", 2.0),) < (("lr_mult", 2.0), ("wd_mult", 0.0)) <
  // (("wd_mult", 0.0),). A later stage starting with a norm still puts the
  // weight-decayed group first (megatron-core 0.16 saves checked in
  // tests/cli/test_megatron_legacy_real.py).
  const GroupKey wd{1.0, 1.0, false, false}, nowd{0.0, 1.0, false, false},
      wd_scaled{1.0, 2.0, false, false}, nowd_scaled{0.0, 2.0, false, false};
  const std::vector<GroupKey> keys = {nowd, wd, nowd_scaled, wd_scaled, nowd};
  Grouping g = GroupParams(keys, GroupOrder::kOverridesSorted);
  ASSERT_EQ(g.keys.size(), 4u);
  EXPECT_EQ(g.keys[0], wd);
  EXPECT_EQ(g.keys[1], wd_scaled);
  EXPECT_EQ(g.keys[2], nowd_scaled);
  EXPECT_EQ(g.keys[3], nowd);
  EXPECT_EQ(g.members[3], (std::vector<size_t>{0, 4}));
  EXPECT_EQ(g.group_of, (std::vector<size_t>{3, 0, 2, 1, 3}));
}

TEST(MegatronGroups, StoredKey) {
  Arena a;
  Value* d = a.Dict();
  AppendEntry(a, d, "wd_mult", a.Float(0.0));
  AppendEntry(a, d, "lr_mult", a.Float(1.0));
  AppendEntry(a, d, "is_expert_parallel", a.Bool(false));
  AppendEntry(a, d, "params", a.List({}));
  EXPECT_EQ(StoredGroupKey(d), (GroupKey{0.0, 1.0, false, false}));
  AppendEntry(a, d, "is_decoupled_lr", a.Str("yes"));
  EXPECT_THROW(StoredGroupKey(d), FormatError);
  EXPECT_THROW(StoredGroupKey(a.List({})), FormatError);
}

TEST(MegatronStateDict, ContainersFollowModuleStateDicts) {
  Arena a;
  Value* w = a.Int(1);
  Value* b = a.Int(2);
  Value* l = a.Int(3);
  // Legacy nesting: model (dict) > language_model (dict) > embedding (dict)
  // > word_embeddings (OrderedDict, holds leaves); encoder holds leaves.
  Value* root = BuildChunk(
      a, {{{"language_model", "embedding", "word_embeddings", "weight"}, w},
          {{"language_model", "encoder", "layers.0.x"}, b},
          {{"word_embeddings_for_head", "weight"}, l}});
  ASSERT_EQ(root->kind, Kind::kDict);
  ASSERT_EQ(root->entries.size(), 2u);
  const Value* lm = root->Get("language_model");
  ASSERT_TRUE(lm && lm->kind == Kind::kDict);
  const Value* emb = lm->Get("embedding");
  ASSERT_TRUE(emb && emb->kind == Kind::kDict);
  const Value* we = emb->Get("word_embeddings");
  ASSERT_TRUE(we);
  EXPECT_EQ(we->ClassName(), "collections.OrderedDict");
  EXPECT_EQ(we->Get("weight"), w);
  EXPECT_EQ(lm->Get("encoder")->ClassName(), "collections.OrderedDict");
  EXPECT_EQ(root->Get("word_embeddings_for_head")->Get("weight"), l);
  // Flat (Megatron-core) chunks are one OrderedDict in order.
  Value* flat = BuildChunk(a, {{{"b.x"}, b}, {{"a.y"}, w}});
  EXPECT_EQ(flat->ClassName(), "collections.OrderedDict");
  ASSERT_EQ(flat->entries.size(), 2u);
  EXPECT_EQ(flat->entries[0].first->s, "b.x");
  // torch.save's pickler spells an OrderedDict as REDUCE + SETITEMS.
  EXPECT_THAT(pickle::Pickle(flat), HasSubstr("collections\nOrderedDict"));
}

// An argparse.Namespace as protocol 2 pickles it: NEWOBJ + BUILD(dict).
Value* Namespace(Arena& a, std::vector<std::pair<std::string, Value*>> fields) {
  Value* ns = a.Object(pickle::ObjectOp::kNewObj,
                       a.Global("argparse", "Namespace"), a.Tuple({}));
  ns->state = a.Dict();
  for (auto& [k, v] : fields) AppendEntry(a, ns->state, k, v);
  return ns;
}

TEST(MegatronArgs, RunConfig) {
  Arena a;
  Value* ns =
      Namespace(a, {{"tensor_model_parallel_size", a.Int(2)},
                    {"pipeline_model_parallel_size", a.Int(2)},
                    {"num_layers_per_virtual_pipeline_stage", a.Int(2)},
                    {"virtual_pipeline_model_parallel_size", a.None()},
                    {"data_parallel_size", a.Int(4)},
                    {"num_layers", a.Int(8)},
                    {"hidden_size", a.Int(16)},
                    {"num_attention_heads", a.Int(4)},
                    {"group_query_attention", a.Bool(false)},
                    {"num_query_groups", a.Int(1)},  // ignored without GQA
                    {"untie_embeddings_and_output_weights", a.Bool(false)},
                    {"tokenizer_type", a.Str("NullTokenizer")},
                    {"vocab_size", a.Int(129)},
                    {"padded_vocab_size", a.Int(256)},
                    {"use_distributed_optimizer", a.Bool(true)},
                    {"local_rank", a.None()}});
  RunConfig c = ReadRunConfig(ArgsView(ns, "args"));
  EXPECT_EQ(c.topology.tp, 2);
  EXPECT_EQ(c.topology.pp, 2);
  EXPECT_EQ(c.topology.vpp, 2);  // 8 layers / pp 2 / 2 per virtual stage
  EXPECT_EQ(c.topology.dp, 4);
  EXPECT_TRUE(c.distributed_optimizer);
  EXPECT_EQ(c.variables.Get("num_query_groups"), 4);
  EXPECT_EQ(c.variables.Get("tied"), 1);
  EXPECT_EQ(c.variables.Get("make_vocab_size_divisible_by"), 128);
  EXPECT_EQ(c.true_vocab_size, std::optional<int64_t>(130));  // + EOD
  EXPECT_EQ(c.padded_vocab_size, std::optional<int64_t>(256));
  EXPECT_FALSE(c.local_rank);

  Value* moe = Namespace(a, {{"tensor_model_parallel_size", a.Int(1)},
                             {"num_layers", a.Int(2)},
                             {"num_attention_heads", a.Int(2)},
                             {"expert_model_parallel_size", a.Int(2)}});
  EXPECT_THAT([&] { ReadRunConfig(ArgsView(moe, "args")); },
              testing::ThrowsMessage<FormatError>(HasSubstr("experts")));
  Value* bad = Namespace(a, {{"tensor_model_parallel_size", a.Str("2")}});
  EXPECT_THAT([&] { ReadRunConfig(ArgsView(bad, "f.pt > args")); },
              testing::ThrowsMessage<FormatError>(
                  HasSubstr("args.tensor_model_parallel_size is a str")));
  EXPECT_THROW(ArgsView(a.Dict(), "args"), FormatError);
}

// A pickle can share one container at every level (a few hundred bytes
// naming 10^9 paths); the JSON view stops converting after a node budget.
TEST(MegatronArgs, ValueToJsonIsBoundedOnSharedContainers) {
  Arena a;
  Value* level = a.Int(7);
  for (int depth = 0; depth < 6; ++depth) {
    level = a.List(std::vector<Value*>(64, level));  // 64^6 paths
  }
  const std::string dumped = ValueToJson(level).Dump();
  EXPECT_LT(dumped.size(), size_t{50'000'000});
  EXPECT_THAT(dumped, HasSubstr("7"));
  EXPECT_THAT(dumped, HasSubstr("[7, 7"));  // a repr past the budget
}

TEST(MegatronArgs, Patch) {
  Arena a;
  Value* ns =
      Namespace(a, {{"tensor_model_parallel_size", a.Int(4)},
                    {"pipeline_model_parallel_size", a.Int(4)},
                    {"transformer_pipeline_model_parallel_size", a.Int(4)},
                    {"virtual_pipeline_model_parallel_size", a.Int(2)},
                    {"num_layers_per_virtual_pipeline_stage", a.Int(1)},
                    {"overlap_p2p_comm", a.Bool(true)},
                    {"align_param_gather", a.Bool(true)},
                    {"data_parallel_size", a.Int(2)},
                    {"world_size", a.Int(32)},
                    {"rank", a.Int(0)},
                    {"local_rank", a.Int(0)},
                    {"expert_tensor_parallel_size", a.Int(4)},
                    {"sequence_parallel", a.Bool(true)},
                    {"padded_vocab_size", a.Int(256)},
                    {"use_distributed_optimizer", a.Bool(true)}});
  ArgsPatch p;
  p.topology = {1, 2, 1, 4};
  p.num_layers = 8;
  p.tp_rank = 0;
  p.pp_rank = 1;
  p.padded_vocab_size = 160;
  p.source_vpp = 2;
  p.source_tp = 4;
  PatchArgs(a, ns, p);
  ArgsView v(ns, "args");
  EXPECT_EQ(v.Int("tensor_model_parallel_size"), 1);
  EXPECT_EQ(v.Int("pipeline_model_parallel_size"), 2);
  EXPECT_EQ(v.Int("transformer_pipeline_model_parallel_size"), 2);
  EXPECT_FALSE(v.Int("virtual_pipeline_model_parallel_size"));
  EXPECT_FALSE(v.Int("num_layers_per_virtual_pipeline_stage"));
  EXPECT_EQ(v.Bool("overlap_p2p_comm"), false);  // forced off without VPP
  EXPECT_EQ(v.Bool("align_param_gather"), false);
  EXPECT_EQ(v.Int("data_parallel_size"), 4);
  EXPECT_EQ(v.Int("world_size"), 8);
  EXPECT_EQ(v.Int("rank"), 4);  // tp-cp-ep-dp-pp: pp rank 1 of tp 1 x dp 4
  EXPECT_EQ(v.Int("local_rank"), 4);
  EXPECT_EQ(v.Int("expert_tensor_parallel_size"), 1);
  EXPECT_EQ(v.Bool("sequence_parallel"), false);
  EXPECT_EQ(v.Int("padded_vocab_size"), 160);
  EXPECT_EQ(v.Bool("use_distributed_optimizer"), false);
  EXPECT_EQ(v.Find("inprocess_active_world_size"), nullptr);  // not added

  // VPP again (from a source without it): overlap defaults come back on.
  p.topology = {2, 2, 2, 1};
  p.source_vpp = 1;
  PatchArgs(a, ns, p);
  EXPECT_EQ(v.Int("virtual_pipeline_model_parallel_size"), 2);
  EXPECT_EQ(v.Int("num_layers_per_virtual_pipeline_stage"), 2);
  EXPECT_EQ(v.Bool("overlap_p2p_comm"), true);
  EXPECT_EQ(v.Int("rank"), 2);
}

// arguments.py:validate_args allows only one of
// num_layers_per_virtual_pipeline_stage and
// num_virtual_stages_per_pipeline_rank; uneven stages need the latter.
TEST(MegatronArgs, PatchVirtualStages) {
  Arena a;
  auto make = [&](Value* per_stage, Value* stages) {
    return Namespace(a, {{"tensor_model_parallel_size", a.Int(1)},
                         {"pipeline_model_parallel_size", a.Int(2)},
                         {"virtual_pipeline_model_parallel_size", a.Int(2)},
                         {"num_layers_per_virtual_pipeline_stage", per_stage},
                         {"num_virtual_stages_per_pipeline_rank", stages},
                         {"num_layers", a.Int(8)},
                         {"num_attention_heads", a.Int(4)}});
  };
  ArgsPatch p;
  p.topology = {1, 4, 2, 1};
  p.num_layers = 8;
  p.source_vpp = 2;
  // The source gave the stage count: it stays the way VPP is given.
  Value* ns = make(a.None(), a.Int(2));
  PatchArgs(a, ns, p);
  ArgsView v(ns, "args");
  EXPECT_EQ(v.Int("virtual_pipeline_model_parallel_size"), 2);
  EXPECT_FALSE(v.Int("num_layers_per_virtual_pipeline_stage"));
  EXPECT_EQ(v.Int("num_virtual_stages_per_pipeline_rank"), 2);
  EXPECT_EQ(ReadRunConfig(v).topology.vpp, 2);
  // Layers per stage given, uneven target: switches to the stage count.
  ns = make(a.Int(2), a.None());
  p.topology = {1, 2, 2, 1};
  p.topology.first_stage_layers = 2;
  PatchArgs(a, ns, p);
  ArgsView u(ns, "args");
  EXPECT_FALSE(u.Int("num_layers_per_virtual_pipeline_stage"));
  EXPECT_EQ(u.Int("num_virtual_stages_per_pipeline_rank"), 2);
  // Even target: layers per stage, no stage count.
  ns = make(a.Int(2), a.None());
  p.topology.first_stage_layers.reset();
  PatchArgs(a, ns, p);
  ArgsView e(ns, "args");
  EXPECT_EQ(e.Int("num_layers_per_virtual_pipeline_stage"), 2);
  EXPECT_FALSE(e.Int("num_virtual_stages_per_pipeline_rank"));
}

}  // namespace
}  // namespace ucp::megatron
