// torch_dist keys (engine/formats/megatron_torch_dist/keys.h), table-driven
// from Megatron-core's key forms (../shared/reference/megatron.md §4,
// formats_update.md): ShardedTensor keys, the optimizer forms
// (fully_reshardable / non-distributed `optimizer.state.<kind>.<key>`,
// dp_reshardable buckets `optimizer.distributed.dp_group_idx_..`),
// ShardedObject unique keys and the common state. Expected strings come
// from megatron-core 0.16.1 (the tests' venv), run once by hand:
//   ShardedObject(key, None, global_shape, global_offset, replica_id=0)
//       .unique_key   -> the kObjectKeys table below;
//   get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
//     == {'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
//         'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_'};
// and the keys of the real Megatron-core 0.20 save in the shared fixtures.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/formats/dcp/metadata.h"
#include "engine/formats/megatron_torch_dist/keys.h"
#include "tests/testutil/testutil.h"

namespace ucp::torch_dist {
namespace {

struct ObjectKeyCase {
  const char* key;
  std::vector<int64_t> offsets;
  std::vector<int64_t> grid;
  const char* unique_key;  // megatron-core's ShardedObject.unique_key
};

const ObjectKeyCase kObjectKeys[] = {
    {"rng_state", {0, 1}, {2, 4}, "rng_state/shard_0.1_2.4"},
    {"decoder.layers.self_attention.linear_qkv._extra_state",
     {5},
     {32},
     "decoder.layers.self_attention.linear_qkv._extra_state/shard_5_32"},
    {"common_state", {0}, {1}, "common_state/shard_0_1"},
    {"optimizer.distributed.dp_group_idx_3.per_bucket_numel",
     {0},
     {1},
     "optimizer.distributed.dp_group_idx_3.per_bucket_numel/shard_0_1"},
    {"a/b", {11, 2, 0}, {12, 3, 1}, "a/b/shard_11.2.0_12.3.1"},
};

TEST(TorchDistKeysTest, ObjectKeyIsMegatronsUniqueKey) {
  for (const ObjectKeyCase& c : kObjectKeys) {
    EXPECT_EQ(ObjectKey(c.key, c.offsets, c.grid), c.unique_key);
    if (std::string(c.key) == "common_state") continue;
    // And back.
    const KeyInfo k = ClassifyKey(c.unique_key, false);
    EXPECT_EQ(k.kind, KeyInfo::kObject) << c.unique_key;
    EXPECT_EQ(k.model_key, c.key);
    EXPECT_EQ(k.offsets, c.offsets);
    EXPECT_EQ(k.grid, c.grid);
  }
}

struct ClassCase {
  const char* fqn;
  bool tensor;
  KeyInfo::Kind kind;
  const char* model_key;
  const char* state;
  std::vector<int64_t> offsets;
  std::vector<int64_t> grid;
};

TEST(TorchDistKeysTest, ClassifiesMegatronsKeyForms) {
  const ClassCase cases[] = {
      // ShardedTensors of the model.
      {"embedding.word_embeddings.weight",
       true,
       KeyInfo::kModel,
       "embedding.word_embeddings.weight",
       "",
       {},
       {}},
      {"decoder.layers.mlp.linear_fc1.weight",
       true,
       KeyInfo::kModel,
       "decoder.layers.mlp.linear_fc1.weight",
       "",
       {},
       {}},
      {"decoder.final_layernorm.weight",
       true,
       KeyInfo::kModel,
       "decoder.final_layernorm.weight",
       "",
       {},
       {}},
      // fully_reshardable / the non-distributed optimizer / model space.
      {"optimizer.state.exp_avg.output_layer.weight",
       true,
       KeyInfo::kOptimizerState,
       "output_layer.weight",
       "exp_avg",
       {},
       {}},
      {"optimizer.state.param.decoder.layers.self_attention.linear_qkv.weight",
       true,
       KeyInfo::kOptimizerState,
       "decoder.layers.self_attention.linear_qkv.weight",
       "param",
       {},
       {}},
      {"optimizer.state.fp32_param.embedding.word_embeddings.weight",
       true,
       KeyInfo::kOptimizerState,
       "embedding.word_embeddings.weight",
       "fp32_param",
       {},
       {}},
      {"optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight",
       true,
       KeyInfo::kOptimizerState,
       "decoder.layers.mlp.linear_fc2.weight",
       "exp_avg_sq",
       {},
       {}},
      // dp_reshardable / fully_sharded_bucket_space buckets.
      {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
       "torch.float32).bucket_idx_0.exp_avg",
       true,
       KeyInfo::kBucket,
       "",
       "",
       {},
       {}},
      {"optimizer.distributed.dp_group_idx_1.gbuf_idx_2.dtype_(torch.float32, "
       "torch.float32).bucket_idx_3.param",
       true,
       KeyInfo::kBucket,
       "",
       "",
       {},
       {}},
      // ShardedObjects: their objects per bucket group, extra state, rng.
      {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
       "torch.float32).per_bucket_numel_unpadded/shard_0_1",
       false,
       KeyInfo::kObject,
       "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
       "torch.float32).per_bucket_numel_unpadded",
       "",
       {0},
       {1}},
      {"decoder.layers.mlp.linear_fc2._extra_state/shard_3_4",
       false,
       KeyInfo::kObject,
       "decoder.layers.mlp.linear_fc2._extra_state",
       "",
       {3},
       {4}},
      {"rng_state/shard_1.0_2.2",
       false,
       KeyInfo::kObject,
       "rng_state",
       "",
       {1, 0},
       {2, 2}},
      // dp_zero_gather_scatter: one object without a shard suffix.
      {"optimizer.distributed.dp_group_idx_0.param_state",
       false,
       KeyInfo::kObject,
       "optimizer.distributed.dp_group_idx_0.param_state",
       "",
       {},
       {}},
      // The common state (core 0.19+), tensor or not.
      {"common_state/shard_0_1", false, KeyInfo::kCommonState, "", "", {}, {}},
      {"common_state", false, KeyInfo::kCommonState, "", "", {}, {}},
      // Shard suffixes that are not Megatron's: the whole key, no shard.
      {"x/shard_0.1_2", false, KeyInfo::kObject, "x/shard_0.1_2", "", {}, {}},
      {"x/shard_a_1", false, KeyInfo::kObject, "x/shard_a_1", "", {}, {}},
      {"x/shard_0._1", false, KeyInfo::kObject, "x/shard_0._1", "", {}, {}},
      {"x/shard_0_", false, KeyInfo::kObject, "x/shard_0_", "", {}, {}},
      {"x/shard__1", false, KeyInfo::kObject, "x/shard__1", "", {}, {}},
      {"x/shard_01", false, KeyInfo::kObject, "x/shard_01", "", {}, {}},
      {"x/shard_-1_2", false, KeyInfo::kObject, "x/shard_-1_2", "", {}, {}},
      {"x/shard_0_-2", false, KeyInfo::kObject, "x/shard_0_-2", "", {}, {}},
      // Not an optimizer state: no kind, or an empty one.
      {"optimizer.state.nodot",
       true,
       KeyInfo::kModel,
       "optimizer.state.nodot",
       "",
       {},
       {}},
      {"optimizer.state..w",
       true,
       KeyInfo::kModel,
       "optimizer.state..w",
       "",
       {},
       {}},
  };
  int checked = 0;
  for (const ClassCase& c : cases) {
    SCOPED_TRACE(c.fqn);
    const KeyInfo k = ClassifyKey(c.fqn, c.tensor);
    EXPECT_EQ(k.kind, c.kind);
    EXPECT_EQ(k.model_key, c.model_key);
    EXPECT_EQ(k.state, c.state);
    EXPECT_EQ(k.offsets, c.offsets);
    EXPECT_EQ(k.grid, c.grid);
    ++checked;
  }
  EXPECT_EQ(checked, 25);
}

// Every key of Megatron-core 0.20's real save, as torch's own view of its
// .metadata lists them (dump_dcp_metadata.py): 36 tensors (9 model keys,
// fully_reshardable's param, exp_avg and exp_avg_sq of each) and 19 objects
// (16 _extra_state shards of 4 stacked layers, 2 rng_state shards, the
// common state).
TEST(TorchDistKeysTest, EveryKeyOfARealSave) {
  const auto file = testutil::FixturesDir() /
                    "megatron-core-torch-dist/tp2pp1dp1/ckpt/iter_0000010/"
                    ".metadata";
  const dcp::Metadata m = dcp::ParseMetadata(testutil::ReadFile(file), file);
  std::map<KeyInfo::Kind, int> kinds;
  std::map<std::string, int> states;
  for (const dcp::Entry& e : m.entries) {
    SCOPED_TRACE(e.fqn);
    const KeyInfo k = ClassifyKey(e.fqn, e.tensor);
    ++kinds[k.kind];
    if (k.kind == KeyInfo::kOptimizerState) {
      ++states[k.state];
      // Its model key is a model key of the same save, of the same shape.
      const dcp::Entry* model = m.Find(k.model_key);
      ASSERT_NE(model, nullptr);
      EXPECT_EQ(model->size, e.size);
      EXPECT_FALSE(IsFlattenedState(e.size, model->size));
    }
    if (k.kind == KeyInfo::kObject) {
      // Object keys round-trip through Megatron's unique_key form.
      ASSERT_FALSE(k.offsets.empty());
      EXPECT_EQ(ObjectKey(k.model_key, k.offsets, k.grid), e.fqn);
    }
  }
  EXPECT_EQ(kinds[KeyInfo::kModel], 9);
  EXPECT_EQ(kinds[KeyInfo::kOptimizerState], 27);
  EXPECT_EQ(states["param"], 9);
  EXPECT_EQ(states["exp_avg"], 9);
  EXPECT_EQ(states["exp_avg_sq"], 9);
  EXPECT_EQ(kinds[KeyInfo::kObject], 18);
  EXPECT_EQ(kinds[KeyInfo::kCommonState], 1);
  EXPECT_EQ(kinds[KeyInfo::kBucket], 0);
}

// dp_reshardable bucket keys: megatron-core 0.16's f-strings
// (distrib_optimizer.py, sharded_param_state_dp_reshardable:
// f'optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{b}.dtype_{dtype}'
// f'.bucket_idx_{k}' + f'.{state}', dtype the (param, grad) dtype tuple)
// evaluated by Python for these values.
TEST(TorchDistKeysTest, BucketKeysOfDpReshardable) {
  struct BucketCase {
    const char* fqn;
    int64_t group, gbuf, bucket;
    const char* dtype;
    const char* state;
  };
  const BucketCase cases[] = {
      {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
       "torch.float32).bucket_idx_0.exp_avg",
       0, 0, 0, "(torch.bfloat16, torch.float32)", "exp_avg"},
      {"optimizer.distributed.dp_group_idx_12.gbuf_idx_3.dtype_(torch.float32, "
       "torch.float32).bucket_idx_7.param",
       12, 3, 7, "(torch.float32, torch.float32)", "param"},
      {"optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float16, "
       "torch.float32).bucket_idx_2.exp_avg_sq",
       1, 0, 2, "(torch.float16, torch.float32)", "exp_avg_sq"},
  };
  for (const BucketCase& c : cases) {
    SCOPED_TRACE(c.fqn);
    EXPECT_EQ(ClassifyKey(c.fqn, true).kind, KeyInfo::kBucket);
    const std::optional<BucketKey> k = ParseBucketKey(c.fqn);
    ASSERT_TRUE(k.has_value());
    EXPECT_EQ(k->group, c.group);
    EXPECT_EQ(k->gbuf, c.gbuf);
    EXPECT_EQ(k->bucket, c.bucket);
    EXPECT_EQ(k->dtype, c.dtype);
    EXPECT_EQ(k->state, c.state);
  }
  // Not bucket tensors: the bucket group's objects, dp_zero_gather_scatter's
  // state, damaged numbers and parts.
  for (const char* fqn : {
           "optimizer.distributed.dp_group_idx_0.per_bucket_numel",
           "optimizer.distributed.dp_group_idx_0.param_state",
           "optimizer.distributed.dp_group_idx_x.gbuf_idx_0.dtype_(a, "
           "b).bucket_idx_0.param",
           "optimizer.distributed.dp_group_idx_.gbuf_idx_0.dtype_(a, "
           "b).bucket_idx_0.param",
           "optimizer.distributed.dp_group_idx_0.gbuf_idx_-1.dtype_(a, "
           "b).bucket_idx_0.param",
           "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(a, "
           "b).bucket_idx_0.",
           "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(a, "
           "b).bucket_idx_0",
           "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(a, b).param",
           "optimizer.distributed.dp_group_idx_99999999999999999999.gbuf_idx_0."
           "dtype_(a, b).bucket_idx_0.param",
           "optimizer.state.exp_avg.output_layer.weight",
       }) {
    EXPECT_EQ(ParseBucketKey(fqn), std::nullopt) << fqn;
  }
}

TEST(TorchDistKeysTest, FlattenedStateOfCoreUpTo014) {
  // fully_sharded_model_space: [chunk grid..., local numel], one dim more.
  EXPECT_TRUE(IsFlattenedState({4, 2, 1, 128}, {4, 64, 32}));  // stacked
  EXPECT_TRUE(IsFlattenedState({2, 1, 2048}, {128, 32}));
  EXPECT_FALSE(IsFlattenedState({128, 32}, {128, 32}));  // fully_reshardable
  EXPECT_FALSE(IsFlattenedState({64}, {64}));            // 1-D keys keep theirs
  EXPECT_FALSE(IsFlattenedState({1}, {}));               // a scalar
  EXPECT_FALSE(IsFlattenedState({4096}, {128, 32}));
}

TEST(TorchDistKeysTest, StackedLayersAndCanonicalNames) {
  EXPECT_TRUE(IsStacked("decoder.layers.self_attention.linear_proj.weight"));
  EXPECT_FALSE(IsStacked("decoder.layers.3.self_attention.linear_proj.weight"));
  EXPECT_FALSE(IsStacked("decoder.final_layernorm.weight"));
  EXPECT_FALSE(IsStacked("decoder.layers."));
  EXPECT_FALSE(IsStacked("embedding.word_embeddings.weight"));

  struct NameCase {
    const char* key;
    int64_t layer;
    bool local_spec;
    const char* name;
  };
  const NameCase cases[] = {
      {"decoder.layers.mlp.linear_fc1.weight", 3, false,
       "decoder.layers.3.mlp.linear_fc1.weight"},
      {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", 0, false,
       "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"},
      // The local spec's modules (sharded_state_dict_keys_map).
      {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", 0, true,
       "decoder.layers.0.input_layernorm.weight"},
      {"decoder.layers.mlp.linear_fc1.layer_norm_bias", 11, true,
       "decoder.layers.11.pre_mlp_layernorm.bias"},
      {"decoder.layers.mlp.linear_fc1.weight", 2, true,
       "decoder.layers.2.mlp.linear_fc1.weight"},
      // Not stacked: as it is.
      {"output_layer.weight", -1, true, "output_layer.weight"},
      {"decoder.final_layernorm.weight", -1, false,
       "decoder.final_layernorm.weight"},
  };
  for (const NameCase& c : cases) {
    EXPECT_EQ(CanonicalName(c.key, c.layer, c.local_spec), c.name) << c.key;
    const KeyOfName back = ModelKeyOf(c.name);
    EXPECT_EQ(back.key, c.key) << c.name;
    EXPECT_EQ(back.layer, c.layer) << c.name;
  }
  // Names that carry no layer number stay whole.
  for (const char* n : {"decoder.layers.x.w", "decoder.layers..w",
                        "decoder.layers.12", "embedding.position_embeddings"}) {
    const KeyOfName k = ModelKeyOf(n);
    EXPECT_EQ(k.key, n);
    EXPECT_EQ(k.layer, -1);
  }
}

// Mixture-of-experts keys as megatron-core 0.16 saves them
// (tests/tools/make_moe_torch_dist.py's docstring, seen with `describe`):
// stacked [L, E, ...] when every layer is MoE, per layer [E, ...] otherwise;
// their canonical names carry the global layer and expert index.
TEST(TorchDistKeysTest, ExpertKeysAndCanonicalNames) {
  struct AxesCase {
    const char* key;
    bool stacked, experts;
    int64_t layer;
    size_t count;
  };
  const AxesCase axes[] = {
      {"decoder.layers.mlp.experts.experts.linear_fc1.weight", true, true, -1,
       2},
      {"decoder.layers.1.mlp.experts.experts.linear_fc2.weight", false, true, 1,
       1},
      {"decoder.layers.12.mlp.router.weight", false, false, 12, 0},
      {"decoder.layers.mlp.router.weight", true, false, -1, 1},
      {"decoder.layers.0.mlp.linear_fc1.weight", false, false, 0, 0},
      {"output_layer.weight", false, false, -1, 0},
  };
  for (const AxesCase& c : axes) {
    const KeyAxes a = AxesOf(c.key);
    EXPECT_EQ(a.stacked, c.stacked) << c.key;
    EXPECT_EQ(a.experts, c.experts) << c.key;
    EXPECT_EQ(a.layer, c.layer) << c.key;
    EXPECT_EQ(a.count(), c.count) << c.key;
  }
  struct NameCase {
    const char* key;
    int64_t layer, expert;
    bool local_spec;
    const char* name;
    const char* back_key;  // ModelKeyOf(name).key
    int64_t back_layer;
  };
  const NameCase cases[] = {
      {"decoder.layers.mlp.experts.experts.linear_fc1.weight", 1, 3, true,
       "decoder.layers.1.mlp.experts.3.linear_fc1.weight",
       "decoder.layers.mlp.experts.experts.linear_fc1.weight", 1},
      {"decoder.layers.mlp.experts.experts.linear_fc2._extra_state", 0, 2,
       false, "decoder.layers.0.mlp.experts.2.linear_fc2._extra_state",
       "decoder.layers.mlp.experts.experts.linear_fc2._extra_state", 0},
      // Per-layer keys: the key's own layer number.
      {"decoder.layers.1.mlp.experts.experts.linear_fc2.weight", -1, 0, true,
       "decoder.layers.1.mlp.experts.0.linear_fc2.weight",
       "decoder.layers.mlp.experts.experts.linear_fc2.weight", 1},
      {"decoder.layers.1.mlp.linear_fc1.layer_norm_weight", -1, -1, true,
       "decoder.layers.1.pre_mlp_layernorm.weight",
       "decoder.layers.mlp.linear_fc1.layer_norm_weight", 1},
      {"decoder.layers.0.mlp.linear_fc1.weight", -1, -1, true,
       "decoder.layers.0.mlp.linear_fc1.weight",
       "decoder.layers.mlp.linear_fc1.weight", 0},
      {"decoder.layers.1.mlp.shared_experts.linear_fc1.weight", -1, -1, true,
       "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
       "decoder.layers.mlp.shared_experts.linear_fc1.weight", 1},
  };
  for (const NameCase& c : cases) {
    EXPECT_EQ(CanonicalName(c.key, c.layer, c.expert, c.local_spec), c.name)
        << c.key;
    const KeyOfName back = ModelKeyOf(c.name);
    EXPECT_EQ(back.key, c.back_key) << c.name;
    EXPECT_EQ(back.layer, c.back_layer) << c.name;
    EXPECT_EQ(back.expert, c.expert) << c.name;
  }
  // Not an expert index: stays as it is.
  EXPECT_EQ(ModelKeyOf("decoder.layers.1.mlp.experts.x.w").expert, -1);
  // A ChainedOptimizer's dp_reshardable buckets (make_moe_torch_dist.py's
  // docstring: the "chained_<i>." prefix stays) are bucket keys of chain i.
  const auto chained = ParseBucketKey(
      "chained_1.optimizer.distributed.dp_group_idx_3.gbuf_idx_0.dtype_"
      "(torch.bfloat16, torch.float32).bucket_idx_2.exp_avg");
  ASSERT_TRUE(chained.has_value());
  EXPECT_EQ(chained->chain, 1);
  EXPECT_EQ(chained->group, 3);
  EXPECT_EQ(chained->bucket, 2);
  EXPECT_EQ(chained->state, "exp_avg");
  EXPECT_EQ(ParseBucketKey("optimizer.distributed.dp_group_idx_0.gbuf_idx_0."
                           "dtype_(a, b).bucket_idx_0.param")
                ->chain,
            -1);
  EXPECT_FALSE(
      ParseBucketKey("chained_x.optimizer.distributed.dp_group_idx_0."
                     "gbuf_idx_0.dtype_(a, b).bucket_idx_0.param"));
  EXPECT_FALSE(
      ParseBucketKey("chained_-1.optimizer.distributed.dp_group_idx_"
                     "0.gbuf_idx_0.dtype_(a, b).bucket_idx_0.param"));
  EXPECT_EQ(ClassifyKey("chained_1.optimizer.distributed.dp_group_idx_0."
                        "gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)."
                        "bucket_idx_0.param",
                        true)
                .kind,
            KeyInfo::kBucket);
}

// FlatBoxes against enumeration: the boxes cover the flat elements [a, b)
// in row-major order, each box's elements consecutive from its `first`.
TEST(TorchDistKeysTest, FlatBoxesCoverTheRangeInOrder) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int64_t checked = 0;
  for (int iter = 0; iter < 300; ++iter) {
    Shape shape(static_cast<size_t>(rng() % 4));
    int64_t numel = 1;
    for (int64_t& d : shape) {
      d = static_cast<int64_t>(1 + rng() % 5);
      numel *= d;
    }
    int64_t a = static_cast<int64_t>(rng() % static_cast<uint64_t>(numel + 1));
    int64_t b = static_cast<int64_t>(rng() % static_cast<uint64_t>(numel + 1));
    if (a > b) std::swap(a, b);
    SCOPED_TRACE(testing::Message()
                 << ShapeString(shape) << " [" << a << ", " << b << ")");
    const std::vector<FlatBox> boxes = FlatBoxes(shape, a, b);
    int64_t next = a;
    for (const FlatBox& f : boxes) {
      ASSERT_EQ(f.first, next);
      // Enumerate the box row-major: its flat indices must be next, next+1...
      std::vector<int64_t> idx(shape.size(), 0);
      int64_t n = 1;
      for (int64_t s : f.box.size) n *= s;
      ASSERT_GT(n, 0);
      for (int64_t e = 0; e < n; ++e) {
        int64_t rem = e, flat = 0;
        for (size_t d = shape.size(); d-- > 0;) {
          idx[d] = f.box.offset[d] + rem % f.box.size[d];
          rem /= f.box.size[d];
        }
        for (size_t d = 0; d < shape.size(); ++d) {
          ASSERT_LT(idx[d], shape[d]);
          flat = flat * shape[d] + idx[d];
        }
        ASSERT_EQ(flat, next);
        ++next;
        ++checked;
      }
    }
    EXPECT_EQ(next, b);
    if (a == b) {
      EXPECT_TRUE(boxes.empty());
    }
  }
  EXPECT_GE(checked, 300);
  // A 0-d tensor: one empty box.
  const std::vector<FlatBox> scalar = FlatBoxes({}, 0, 1);
  ASSERT_EQ(scalar.size(), 1u);
  EXPECT_TRUE(scalar[0].box.offset.empty());
  // [2, 3, 4] elements [5, 19): the rest of row (0, 1), row (0, 2), row
  // (1, 0), the first 3 of row (1, 1).
  const std::vector<FlatBox> mid = FlatBoxes({2, 3, 4}, 5, 19);
  ASSERT_EQ(mid.size(), 4u);
  EXPECT_EQ(mid[0].box.offset, Shape({0, 1, 1}));
  EXPECT_EQ(mid[0].box.size, Shape({1, 1, 3}));
  EXPECT_EQ(mid[1].box.offset, Shape({0, 2, 0}));
  EXPECT_EQ(mid[1].box.size, Shape({1, 1, 4}));
  EXPECT_EQ(mid[2].box.offset, Shape({1, 0, 0}));
  EXPECT_EQ(mid[2].box.size, Shape({1, 1, 4}));
  EXPECT_EQ(mid[3].box.offset, Shape({1, 1, 0}));
  EXPECT_EQ(mid[3].box.size, Shape({1, 1, 3}));
}

}  // namespace
}  // namespace ucp::torch_dist
