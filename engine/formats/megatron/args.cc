#include "engine/formats/megatron/args.h"

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/error.h"

namespace ucp::megatron {
namespace {

using pickle::Kind;
using pickle::Value;

// The attribute dict of a Namespace-like object (BUILD state that is a dict,
// or the first element of a (dict, slots) pair).
Value* StateDict(Value* ns) {
  if (ns == nullptr || ns->kind != Kind::kObject || ns->state == nullptr)
    return nullptr;
  Value* s = ns->state;
  if (s->kind == Kind::kDict) return s;
  if (s->kind == Kind::kTuple && s->items.size() == 2 && s->items[0] &&
      s->items[0]->kind == Kind::kDict)
    return s->items[0];
  return nullptr;
}

std::string_view KindName(const Value* v) {
  return v->kind == Kind::kObject ? "object" : pickle::KindName(v->kind);
}

}  // namespace

ArgsView::ArgsView(const Value* ns, std::string where)
    : ns_(ns), where_(std::move(where)) {
  if (StateDict(const_cast<Value*>(ns)) == nullptr) {
    throw FormatError(where_, ": 'args' is not an argparse.Namespace (",
                      ns ? pickle::Repr(ns, 60) : std::string("missing"), ")");
  }
}

const Value* ArgsView::Find(std::string_view field) const {
  return ns_->Attr(field);
}

std::optional<int64_t> ArgsView::Int(std::string_view field) const {
  const Value* v = Find(field);
  if (v == nullptr || v->kind == Kind::kNone) return std::nullopt;
  if (v->kind == Kind::kBool) return v->b ? 1 : 0;
  if (v->kind == Kind::kInt && v->big.empty()) return v->i;
  throw FormatError(where_, ": args.", field, " is a ", KindName(v),
                    ", expected an int");
}

std::optional<bool> ArgsView::Bool(std::string_view field) const {
  const Value* v = Find(field);
  if (v == nullptr || v->kind == Kind::kNone) return std::nullopt;
  if (v->kind == Kind::kBool) return v->b;
  if (v->kind == Kind::kInt && v->big.empty()) return v->i != 0;
  throw FormatError(where_, ": args.", field, " is a ", KindName(v),
                    ", expected a bool");
}

std::optional<std::string> ArgsView::Str(std::string_view field) const {
  const Value* v = Find(field);
  if (v == nullptr || v->kind == Kind::kNone) return std::nullopt;
  if (v->kind == Kind::kStr) return v->s;
  throw FormatError(where_, ": args.", field, " is a ", KindName(v),
                    ", expected a str");
}

int64_t ArgsView::RequireInt(std::string_view field) const {
  std::optional<int64_t> v = Int(field);
  if (!v) throw FormatError(where_, ": args lack '", field, "'");
  return *v;
}

int64_t RunConfig::OptimizerDp(int64_t dp) const {
  const int64_t n = dp * cp;
  return num_distributed_optimizer_instances > 1
             ? n / num_distributed_optimizer_instances
             : n;
}

BufferOptions RunConfig::DistributedBufferOptions(int64_t dp, int64_t pp_rank,
                                                  int64_t chunk,
                                                  int64_t local_params) const {
  BufferOptions o;
  o.distributed_optimizer = true;
  o.dp = std::max<int64_t>(OptimizerDp(dp), 1);
  o.pad_for_high_nccl_busbw = pad_buckets_for_high_nccl_busbw;
  // Buckets only with --overlap-grad-reduce, on the first pipeline rank's
  // first model chunk, without --overlap-param-gather-with-optimizer-step.
  if (overlap_grad_reduce && pp_rank == 0 && chunk == 0 &&
      !overlap_param_gather_with_optimizer_step) {
    if (ddp_num_buckets && *ddp_num_buckets > 0) {
      o.bucket_size = local_params / *ddp_num_buckets;
    } else if (ddp_bucket_size) {
      o.bucket_size = *ddp_bucket_size;
    } else {
      o.bucket_size = std::max<int64_t>(40000000, 1000000 * dp * cp);
    }
  }
  return o;
}

namespace {

// Mixture of experts: ep / etp, num_experts and moe_layer_freq (an int, or
// Megatron's per-layer list of 0/1 as first dense layers + a frequency).
void ReadExperts(const ArgsView& a, RunConfig& c) {
  auto fail = [&](auto&&... parts) -> FormatError {
    return FormatError(a.where(), ": ", parts...);
  };
  layouts::Topology& t = c.topology;
  t.ep = a.Int("expert_model_parallel_size").value_or(1);
  if (auto etp = a.Int("expert_tensor_parallel_size")) t.etp = *etp;
  if (t.ep < 1 || (t.etp && *t.etp < 1))
    throw fail("bad expert parallel sizes in args (ep ", t.ep, ", etp ",
               t.etp.value_or(0), ")");
  const std::optional<int64_t> experts = a.Int("num_experts");
  if (!experts) return;
  if (*experts < 1) throw fail("num_experts ", *experts);
  c.variables.Set("num_moe_experts", *experts);
  const Value* freq = a.Find("moe_layer_freq");
  if (freq == nullptr || freq->kind == Kind::kNone) return;
  if (freq->kind == Kind::kInt) {
    if (freq->i < 1) throw fail("moe_layer_freq ", freq->i);
    c.variables.Set("moe_first_dense_layers", 0);
    c.variables.Set("moe_layer_freq", freq->i);
    return;
  }
  if (freq->kind != Kind::kList && freq->kind != Kind::kTuple)
    throw fail("moe_layer_freq: neither an int nor a list");
  std::vector<bool> moe;
  for (const Value* x : freq->items) {
    if (x == nullptr || x->kind != Kind::kInt || (x->i != 0 && x->i != 1))
      throw fail("moe_layer_freq: a list of other values than 0 and 1");
    moe.push_back(x->i == 1);
  }
  const int64_t n = static_cast<int64_t>(moe.size());
  int64_t first = 0;
  while (first < n && !moe[static_cast<size_t>(first)]) ++first;
  for (int64_t f = 1; f <= std::max<int64_t>(n, 1); ++f) {
    bool fits = true;
    for (int64_t l = 0; l < n && fits; ++l)
      fits = moe[static_cast<size_t>(l)] == (l >= first && l % f == 0);
    if (fits) {
      c.variables.Set("moe_first_dense_layers", first);
      c.variables.Set("moe_layer_freq", f);
      return;
    }
  }
  throw fail("moe_layer_freq ", pickle::Repr(freq, 200),
             ": not first dense layers then every n-th layer MoE (not "
             "supported)");
}

}  // namespace

RunConfig ReadRunConfig(const ArgsView& a, bool experts) {
  RunConfig c;
  auto fail = [&](auto&&... parts) -> FormatError {
    return FormatError(a.where(), ": ", parts...);
  };
  layouts::Topology& t = c.topology;
  t.tp = a.RequireInt("tensor_model_parallel_size");
  t.pp = a.Int("pipeline_model_parallel_size").value_or(1);
  c.cp = a.Int("context_parallel_size").value_or(1);
  const int64_t num_layers = a.RequireInt("num_layers");
  if (t.tp < 1 || t.pp < 1 || c.cp < 1 || num_layers < 1) {
    throw fail("bad parallel sizes in args (tp ", t.tp, ", pp ", t.pp, ", cp ",
               c.cp, ", num_layers ", num_layers, ")");
  }
  if (auto v = a.Int("virtual_pipeline_model_parallel_size")) {
    t.vpp = *v;
  } else if (auto v2 = a.Int("num_virtual_stages_per_pipeline_rank")) {
    t.vpp = *v2;
  } else if (auto per = a.Int("num_layers_per_virtual_pipeline_stage")) {
    if (*per < 1 || num_layers % (t.pp * *per) != 0)
      throw fail("num_layers_per_virtual_pipeline_stage ", *per,
                 " does not divide num_layers ", num_layers, " / pp ", t.pp);
    t.vpp = num_layers / t.pp / *per;
  }
  if (t.vpp < 1) throw fail("bad virtual pipeline size ", t.vpp);
  if (auto dp = a.Int("data_parallel_size")) {
    t.dp = *dp;
  } else if (auto ws = a.Int("world_size")) {
    t.dp = *ws / (t.tp * t.pp * c.cp);
  }
  if (t.dp < 1) t.dp = 1;
  if (auto f = a.Int("decoder_first_pipeline_num_layers"))
    t.first_stage_layers = *f;
  if (auto l = a.Int("decoder_last_pipeline_num_layers"))
    t.last_stage_layers = *l;
  c.distributed_optimizer = a.Bool("use_distributed_optimizer").value_or(false);

  if (!experts && (a.Int("expert_model_parallel_size").value_or(1) > 1 ||
                   a.Int("num_experts").has_value())) {
    throw fail(
        "mixture-of-experts checkpoints (num_experts / expert parallelism) "
        "are not supported");
  }
  if (experts) ReadExperts(a, c);
  if (const Value* v = a.Find("pipeline_model_parallel_layout");
      v != nullptr && v->kind != Kind::kNone) {
    throw fail("--pipeline-model-parallel-layout is not supported");
  }
  for (const char* f :
       {"account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split", "standalone_embedding_stage"}) {
    if (a.Bool(f).value_or(false))
      throw fail("args.", f, " is set: not supported");
  }

  layouts::Variables& v = c.variables;
  v.Set("num_layers", num_layers);
  for (const char* f : {"hidden_size", "num_attention_heads", "ffn_hidden_size",
                        "kv_channels"}) {
    if (auto x = a.Int(f)) v.Set(f, *x);
  }
  const int64_t heads = a.RequireInt("num_attention_heads");
  const bool gqa = a.Bool("group_query_attention").value_or(false);
  v.Set("num_query_groups",
        gqa ? a.Int("num_query_groups").value_or(heads) : heads);
  v.Set("swiglu", a.Bool("swiglu").value_or(false) ? 1 : 0);
  v.Set("tied",
        a.Bool("untie_embeddings_and_output_weights").value_or(false) ? 0 : 1);
  v.Set("add_bias_linear", a.Bool("add_bias_linear").value_or(true) ? 1 : 0);
  const int64_t div = a.Int("make_vocab_size_divisible_by").value_or(128);
  if (div < 1) throw fail("make_vocab_size_divisible_by ", div);
  v.Set("make_vocab_size_divisible_by", div);
  c.padded_vocab_size = a.Int("padded_vocab_size");
  // megatron/training/tokenizer: the NullTokenizer appends an end-of-document
  // token to --vocab-size; other tokenizers take their size from files.
  if (a.Str("tokenizer_type").value_or("") == "NullTokenizer") {
    if (auto vs = a.Int("vocab_size")) c.true_vocab_size = *vs + 1;
  }

  c.overlap_grad_reduce = a.Bool("overlap_grad_reduce").value_or(false);
  c.ddp_bucket_size = a.Int("ddp_bucket_size");
  c.ddp_num_buckets = a.Int("ddp_num_buckets");
  c.pad_buckets_for_high_nccl_busbw =
      a.Bool("ddp_pad_buckets_for_high_nccl_busbw").value_or(false);
  c.overlap_param_gather_with_optimizer_step =
      a.Bool("overlap_param_gather_with_optimizer_step").value_or(false);
  c.num_distributed_optimizer_instances =
      a.Int("num_distributed_optimizer_instances").value_or(1);
  c.grad_reduce_in_fp32 =
      a.Bool("accumulate_allreduce_grads_in_fp32").value_or(false);
  c.consumed_train_samples = a.Int("consumed_train_samples");
  if (auto o = a.Str("optimizer")) c.optimizer = *o;
  c.rank = a.Int("rank");
  c.local_rank = a.Int("local_rank");
  return c;
}

namespace {

// Budgeted conversion: a hostile pickle can share one container many times
// at every level, so the number of nodes converted is capped (the rest become
// their bounded repr).
json::Value ToJson(const Value* v, int depth, size_t& budget) {
  if (v == nullptr) return json::Value();
  if (budget == 0) return json::Value(pickle::Repr(v, 200));
  --budget;
  switch (v->kind) {
    case Kind::kNone:
      return json::Value();
    case Kind::kBool:
      return json::Value(v->b);
    case Kind::kInt:
      if (v->big.empty()) return json::Value(v->i);
      break;
    case Kind::kFloat:
      return json::Value(v->f);
    case Kind::kStr:
      return json::Value(v->s);
    case Kind::kGlobal:
      return json::Value(v->module + "." + v->name);
    case Kind::kList:
    case Kind::kTuple: {
      if (depth > 8) break;
      json::Value a = json::Value::Array();
      for (const Value* x : v->items) a.Append(ToJson(x, depth + 1, budget));
      return a;
    }
    default:
      if (v->IsDictLike() && depth <= 8) {
        std::vector<std::pair<std::string, json::Value>> members;
        members.reserve(v->entries.size());
        for (const auto& [k, x] : v->entries) {
          members.emplace_back(k != nullptr && k->kind == Kind::kStr
                                   ? k->s
                                   : pickle::Repr(k, 60),
                               ToJson(x, depth + 1, budget));
        }
        return json::Value::FromMembers(std::move(members));
      }
      break;
  }
  return json::Value(pickle::Repr(v, 200));
}

}  // namespace

json::Value ValueToJson(const Value* v, int depth) {
  size_t budget = 100'000;
  return ToJson(v, depth, budget);
}

json::Value ArgsToJson(const ArgsView& args) {
  json::Value out = json::Value::Object();
  const Value* state = StateDict(const_cast<Value*>(args.node()));
  for (const auto& [k, val] : state->entries) {
    if (k == nullptr || k->kind != Kind::kStr) continue;
    out[k->s] = ValueToJson(val);
  }
  return out;
}

int64_t GlobalRank(const layouts::Topology& t, int64_t cp, int64_t tp_rank,
                   int64_t pp_rank) {
  return tp_rank + t.tp * cp * t.dp * pp_rank;
}

void PatchArgs(pickle::Arena& arena, Value* ns, const ArgsPatch& p) {
  Value* dict = StateDict(ns);
  UCP_CHECK(dict != nullptr, "args has no attribute dict");
  auto find = [&](std::string_view name) -> Value** {
    for (auto& [k, v] : dict->entries) {
      if (k != nullptr && k->kind == Kind::kStr && k->s == name) return &v;
    }
    return nullptr;
  };
  auto set = [&](std::string_view name, Value* value, bool add) {
    if (Value** slot = find(name)) {
      *slot = value;
    } else if (add) {
      dict->entries.emplace_back(arena.Str(std::string(name)), value);
    }
  };
  auto opt_int = [&](std::optional<int64_t> x) {
    return x ? arena.Int(*x) : arena.None();
  };
  const layouts::Topology& t = p.topology;
  const int64_t world = t.tp * t.pp * t.dp * p.cp;
  const int64_t rank = GlobalRank(t, p.cp, p.tp_rank, p.pp_rank);
  set("tensor_model_parallel_size", arena.Int(t.tp), true);
  set("pipeline_model_parallel_size", arena.Int(t.pp), true);
  set("transformer_pipeline_model_parallel_size", arena.Int(t.pp), false);
  const bool vpp = t.vpp > 1;
  set("virtual_pipeline_model_parallel_size",
      vpp ? arena.Int(t.vpp) : arena.None(), true);
  // arguments.py:validate_args: at most one of
  // --num-layers-per-virtual-pipeline-stage and
  // --num-virtual-stages-per-pipeline-rank, the latter with uneven stages
  // (or when the source used it).
  const bool uneven = t.first_stage_layers || t.last_stage_layers;
  Value** stages = find("num_virtual_stages_per_pipeline_rank");
  const bool by_stages =
      vpp && stages != nullptr && (uneven || (*stages)->kind != Kind::kNone);
  if (stages != nullptr) *stages = by_stages ? arena.Int(t.vpp) : arena.None();
  set("num_layers_per_virtual_pipeline_stage",  // may add: `stages` invalid
      vpp && !by_stages ? arena.Int(p.num_layers / t.pp / t.vpp) : arena.None(),
      true);
  set("decoder_first_pipeline_num_layers", opt_int(t.first_stage_layers),
      false);
  set("decoder_last_pipeline_num_layers", opt_int(t.last_stage_layers), false);
  // arguments.py: overlap_p2p_comm and (v0.13) align_param_gather default to
  // True and are forced off without a virtual pipeline.
  for (const char* f : {"overlap_p2p_comm", "align_param_gather"}) {
    if (Value** slot = find(f)) {
      if (!vpp) {
        *slot = arena.Bool(false);
      } else if (p.source_vpp == 1) {
        *slot = arena.Bool(true);
      }
    }
  }
  set("data_parallel_size", arena.Int(t.dp), true);
  set("world_size", arena.Int(world), true);
  set("inprocess_active_world_size", arena.Int(world), false);
  set("rank", arena.Int(rank), false);
  if (Value** slot = find("local_rank");
      slot != nullptr && (*slot)->kind != Kind::kNone) {
    *slot = arena.Int(rank % p.gpus_per_node);
  }
  // Mixture of experts: the target's ep and etp (--etp; unset: an etp that
  // followed the source's tp follows the target's).
  set("expert_model_parallel_size", arena.Int(t.ep), false);
  if (Value** slot = find("expert_tensor_parallel_size");
      slot != nullptr && (*slot)->kind == Kind::kInt &&
      (t.etp || (*slot)->i == p.source_tp)) {
    *slot = arena.Int(t.ExpertTp());
  }
  if (t.tp == 1) set("sequence_parallel", arena.Bool(false), false);
  set("padded_vocab_size", arena.Int(p.padded_vocab_size), true);
  set("use_distributed_optimizer", arena.Bool(p.distributed_optimizer), true);
}

bool DescribesGpt(const universal::Model& model) {
  const json::Value& other = model.variables.other;
  if (!other.is_object()) return false;
  for (std::string_view name : {"normalization", "position_embedding_type"}) {
    const json::Value* v = other.Find(name);
    if (v == nullptr || !v->is_string()) return false;
  }
  return true;
}

Value* NewArgs(pickle::Arena& arena, const universal::Model& model,
               const formats::PlacedTarget& placed) {
  const layouts::Variables& vars = placed.vars;
  const json::Value& other = model.variables.other;
  auto text = [&](std::string_view name) -> std::optional<std::string> {
    const json::Value* v = other.is_object() ? other.Find(name) : nullptr;
    if (v == nullptr || !v->is_string()) return std::nullopt;
    return v->AsString();
  };
  auto number = [&](std::string_view name) -> std::optional<double> {
    const json::Value* v = other.is_object() ? other.Find(name) : nullptr;
    if (v == nullptr || !v->is_number()) return std::nullopt;
    return v->AsDouble();
  };
  if (!DescribesGpt(model)) return nullptr;
  const std::optional<std::string> norm = text("normalization");
  const std::optional<std::string> pos = text("position_embedding_type");
  const std::optional<int64_t> layers = vars.Find("num_layers"),
                               hidden = vars.Find("hidden_size"),
                               heads = vars.Find("num_attention_heads");
  if (!norm || !pos || !layers || !hidden || !heads) return nullptr;
  Value* dict = arena.Dict();
  auto set = [&](std::string_view name, Value* value) {
    dict->entries.emplace_back(arena.Str(std::string(name)), value);
  };
  auto flag = [&](std::string_view name, std::string_view var, bool dflt) {
    const std::optional<int64_t> v = vars.Find(var);
    set(name, arena.Bool(v ? *v != 0 : dflt));
  };
  auto int_or_none = [&](std::string_view name, std::string_view var) {
    const std::optional<int64_t> v = vars.Find(var);
    set(name, v ? arena.Int(*v) : arena.None());
  };
  // The topology (PatchArgs sets the sizes and ranks for each file).
  set("tensor_model_parallel_size", arena.Int(1));
  set("pipeline_model_parallel_size", arena.Int(1));
  set("virtual_pipeline_model_parallel_size", arena.None());
  set("num_layers_per_virtual_pipeline_stage", arena.None());
  set("context_parallel_size", arena.Int(1));
  set("expert_model_parallel_size", arena.Int(1));
  set("expert_tensor_parallel_size", arena.Int(1));
  set("data_parallel_size", arena.Int(1));
  set("world_size", arena.Int(1));
  set("rank", arena.Int(0));
  set("local_rank", arena.Int(0));
  set("sequence_parallel", arena.Bool(false));
  set("use_distributed_optimizer", arena.Bool(false));
  // The model (arguments.py's names).
  set("num_layers", arena.Int(*layers));
  set("hidden_size", arena.Int(*hidden));
  int_or_none("ffn_hidden_size", "ffn_hidden_size");
  set("num_attention_heads", arena.Int(*heads));
  const int64_t groups = vars.Find("num_query_groups").value_or(*heads);
  set("group_query_attention", arena.Bool(groups != *heads));
  set("num_query_groups", arena.Int(groups));
  set("kv_channels",
      arena.Int(vars.Find("kv_channels")
                    .value_or(*hidden / std::max<int64_t>(*heads, 1))));
  int_or_none("max_position_embeddings", "max_position_embeddings");
  flag("swiglu", "swiglu", false);
  set("normalization", arena.Str(*norm));
  if (std::optional<double> eps = number("norm_epsilon"))
    set("norm_epsilon", arena.Float(*eps));
  set("apply_layernorm_1p", arena.Bool(false));
  set("position_embedding_type", arena.Str(*pos));
  set("use_rotary_position_embeddings", arena.Bool(*pos == "rope"));
  set("add_position_embedding", arena.Bool(*pos == "learned_absolute"));
  if (std::optional<double> base = number("rotary_base")) {
    // arguments.py: --rotary-base is an int.
    set("rotary_base", *base == static_cast<double>(static_cast<int64_t>(*base))
                           ? arena.Int(static_cast<int64_t>(*base))
                           : arena.Float(*base));
  }
  set("rotary_percent", arena.Float(number("rotary_percent").value_or(1.0)));
  set("rotary_interleaved", arena.Bool(false));
  const std::optional<int64_t> tied = vars.Find("tied");
  set("untie_embeddings_and_output_weights", arena.Bool(tied && *tied == 0));
  flag("add_bias_linear", "add_bias_linear", false);
  flag("add_qkv_bias", "add_qkv_bias", false);
  flag("qk_layernorm", "qk_layernorm", false);
  int_or_none("vocab_size", "vocab_size");
  set("make_vocab_size_divisible_by",
      arena.Int(vars.Find("make_vocab_size_divisible_by").value_or(128)));
  set("padded_vocab_size", arena.Int(placed.PaddedVocabSize()));
  // Mixture of experts (arguments.py: --num-experts ...; moe_layer_freq a
  // 0/1 list when some layer is dense).
  if (placed.layout.experts()) {
    int_or_none("num_experts", "num_moe_experts");
    int_or_none("moe_ffn_hidden_size", "moe_ffn_hidden_size");
    int_or_none("moe_router_topk", "moe_router_topk");
    std::vector<Value*> freq;
    bool dense = false;
    for (int64_t l = 0; l < *layers; ++l) {
      const bool moe = placed.layout.IsMoeLayer(l, vars);
      dense = dense || !moe;
      freq.push_back(arena.Int(moe ? 1 : 0));
    }
    set("moe_layer_freq", dense ? arena.List(std::move(freq)) : arena.Int(1));
    int_or_none("moe_shared_expert_intermediate_size",
                "moe_shared_expert_intermediate_size");
    flag("moe_shared_expert_gate", "moe_shared_expert_gate", false);
    set("moe_router_pre_softmax", arena.Bool(false));
    set("moe_router_score_function",
        arena.Str(text("moe_router_score_function").value_or("softmax")));
    // DeepSeek-V3's router (a transformers Glm4-MoE): the expert bias, the
    // scaled weights, group-limited routing, an fp32 router.
    flag("moe_router_enable_expert_bias", "moe_router_enable_expert_bias",
         false);
    const std::optional<double> scaling =
        number("moe_router_topk_scaling_factor");
    set("moe_router_topk_scaling_factor",
        scaling ? arena.Float(*scaling) : arena.None());
    int_or_none("moe_router_num_groups", "moe_router_num_groups");
    int_or_none("moe_router_group_topk", "moe_router_group_topk");
    const std::optional<std::string> router_dtype = text("moe_router_dtype");
    set("moe_router_dtype",
        router_dtype ? arena.Str(*router_dtype) : arena.None());
    set("moe_grouped_gemm", arena.Bool(false));
  }
  // The weights' dtype; a checkpoint to start from (iteration 0).
  const std::string dtype = model.source.dtype.value_or("float32");
  const bool bf16 = dtype == "bfloat16", fp16 = dtype == "float16";
  set("bf16", arena.Bool(bf16));
  set("fp16", arena.Bool(fp16));
  set("params_dtype", arena.Global("torch", bf16   ? "bfloat16"
                                            : fp16 ? "float16"
                                                   : "float32"));
  // The mcore-llama names are Transformer Engine's (Megatron-LM's default).
  set("transformer_impl", arena.Str("transformer_engine"));
  set("ckpt_format", arena.Str("torch"));
  set("iteration", arena.Int(0));
  set("consumed_train_samples", arena.Int(0));
  set("consumed_valid_samples", arena.Int(0));
  // argparse.Namespace as pickle protocol 2 spells it: NEWOBJ, then BUILD.
  Value* ns =
      arena.Object(pickle::ObjectOp::kNewObj,
                   arena.Global("argparse", "Namespace"), arena.Tuple({}));
  ns->state = dict;
  return ns;
}

}  // namespace ucp::megatron
