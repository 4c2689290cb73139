#pragma once
// Megatron-LM legacy checkpoints (`--ckpt-format torch`), as Megatron-core
// v0.13.0 writes them (megatron/training/checkpointing.py, core/optimizer/,
// core/distributed/). Readers also accept v0.7-v0.12 files and Megatron-LM
// 23.x / core <= v0.5 files (legacy `language_model.*` models; optimizer
// groups in their fixed order, param_groups.h; not their distributed
// optimizer files), fp16 / fp32 runs and torch.optim.Adam's per-param
// `step`.
//
// Folders
//   <save>/latest_checkpointed_iteration.txt   "N" or "release"; written last
//   <save>/iter_{N:07d}/ (or release/)
//       mp_rank_{tp:02d}/            PP == 1
//       mp_rank_{tp:02d}_{pp:03d}/   PP > 1
//       mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/   EP > 1 (mixture of experts;
//                                    "mp_rank_00_001" is PP rank 1 or EP rank
//                                    1 as the args' PP and EP say)
//           model_optim_rng.pt       written by expert-DP rank 0 of each
//                                    (tp, pp, ep) (DP rank 0 without EP):
//                                    the dense params and the EP rank's
//                                    local experts
//           distrib_optim.pt         with --use-distributed-optimizer (not
//                                    with --no-save-optim)
//
// Mixture of experts (SequentialMLP, ETP = TP: the legacy loader reads one
// folder per (tp, pp, ep)): a rank file's experts are
// decoder.layers.<l>.mlp.experts.local_experts.<i>.* with i the local
// index (global = ep_rank * E/EP + i); the universal file names them
// decoder.layers.<l>.mlp.experts.<global>.* (layouts/README.md). The
// optimizer is a ChainedOptimizer: 'optimizer' is the list [dense half,
// expert half] of the entries below (the expert half: the expert params, its
// groups is_expert_parallel=True), and distrib_optim.pt the list [dense state
// or None, expert state or None]: each half's DP rank 0 writes its state, so
// the dense one is in the EP rank 0 folders only, the expert one (buffers
// sharded over expert DP = DP / EP) in every folder.
//
// model_optim_rng.pt: a dict, keys in this order (generate_state_dict, then
// save_checkpoint):
//   args                  argparse.Namespace of the run (all CLI args plus
//                         padded_vocab_size, iteration, ... added later)
//   checkpoint_version    3.0
//   iteration             int
//   model | model0..model{V-1}   one state dict per model chunk (VPP > 1);
//                         layer indices local to the chunk (model.md: layer
//                         placement); a dict that holds leaves is an
//                         OrderedDict (module.state_dict()), a dict of dicts
//                         (legacy models' state_dict_for_save_checkpoint) a
//                         plain dict. Leaves: tensors (training dtype),
//                         Transformer Engine `_extra_state` (TE >= 2.x: uint8
//                         tensor, empty without FP8; TE 1.x: io.BytesIO of a
//                         torch.save; fusible-op norms: uint8 tensor of
//                         pickle.dumps({})), None (Megatron's own linears'
//                         `_extra_state`)
//   optimizer             absent in weights-only checkpoints. One of
//     Float16OptimizerWithFloat16Params (bf16/fp16 training):
//       {'optimizer': {'state': {id: {'exp_avg', 'exp_avg_sq'[, 'step']}},
//                      'param_groups': [group...]},
//        ['grad_scaler': {...},]          fp16 / dynamic loss scaling
//        'fp32_from_fp16_params': [[fp32 master per param] per group]}
//     FP32Optimizer (fp32 training): the inner {'state', 'param_groups'}
//     DistributedOptimizer: {'optimizer': {'param_groups': [group without
//                      'params']}, ['grad_scaler']}; the tensors are in
//                      distrib_optim.pt
//     A group is {wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr,
//     max_lr, min_lr, lr, bias_correction, betas, eps, weight_decay[, step],
//     params: [ids]} (_get_param_groups, then the optimizer's defaults, then
//     TE FusedAdam's per-group int `step`, then torch moving `params` last).
//     Groups: keys (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) in
//     order of first appearance over named_parameters() of all chunks (chunk
//     0 first; <= v0.5: fixed order, param_groups.h); wd_mult 0 for names
//     ending ".bias" and 1-D params. State ids count params over the groups
//     in order. torch.optim.Adam (no apex / TE) keeps a 0-d float `step` per
//     param in the state (first key); FusedAdam an int `step` per group.
//     With the distributed optimizer the stored groups are DP rank 0's: a
//     group whose params have no element in DP rank 0's shard never stepped
//     there and has no `step` (FusedAdam); with torch.optim.Adam every group
//     carries the step as a float (distrib_optimizer.py:state_dict).
//   opt_param_scheduler   {max_lr, lr_warmup_steps, num_steps, ...}
//   rerun_state_machine   (v0.10+) {mode, sharded: {...}}
//   rng_state             [ {random_rng_state, np_rng_state, torch_rng_state,
//                         cuda_rng_state, rng_tracker_states} ] per rank
//   num_floating_point_operations_so_far
//
// distrib_optim.pt (save_parameter_state, get_parameter_state_dp_zero):
//   {'buckets_coalesced': True,
//    gbuf_idx (int, chunk order): {(param_dtype, grad_dtype) (torch dtypes):
//        {'param': fp32[n], 'exp_avg': fp32[n], 'exp_avg_sq': fp32[n],
//         'numel_unpadded': n}}}
//   grad_dtype = float32 with accumulate_allreduce_grads_in_fp32 (default
//   for bf16), else the param dtype. The world tensors follow the buffer
//   layout of buffer_layout.h.
//
// Tied embeddings (not untie_embeddings_and_output_weights) with PP > 1: the
// last stage holds a copy of the word embeddings (`output_layer.weight`,
// legacy `word_embeddings_for_head.weight`) with its own optimizer state;
// both copies are `shared_embedding` params (own DistOpt bucket).
//
// What this driver keeps in the universal file (schema: atom_store.h):
//   /params/<canonical>/param        training-dtype weights (bf16/fp16 runs
//                                    with an optimizer: the model tensors)
//   /params/<canonical>/fp32         fp32 master (fp32_from_fp16_params or
//                                    distrib_optim 'param'); the model
//                                    tensors for fp32 and weights-only runs
//   /params/<canonical>/exp_avg, exp_avg_sq [, step (0-d, torch Adam)]
//   /params/<canonical>/pad/<kind>   vocabulary padding rows of the source
//   /opaque/args                     the args Namespace of rank (0, 0)
//   /opaque/optimizer/param_groups   list of the group dicts (no 'params'),
//                                    one per canonical group
//   /opaque/grad_scaler              (fp16) from rank (0, 0)
//   /opaque/rng_state/tpTT_ppPPP     each rank's rng_state entry
//   /opaque/rerun_state_machine      from rank (0, 0)
//   /opaque/extra_state/<canonical>  every opaque model entry (TE
//                                    _extra_state, None), TP rank 0's
//   /opaque/top_level/<key>          every other top-level entry of rank
//                                    (0, 0): checkpoint_version, iteration,
//                                    opt_param_scheduler,
//                                    num_floating_point_operations_so_far, ...
//   root attr "megatron" (JSON): {"top_level_keys": [... "model" for the
//   chunks ...], "entries": [[canonical name, "param"|"buffer"|"opaque"]...]
//   in canonical state-dict order (tied copies left out), "release": bool,
//   "gpus_per_node": n, "optimizer_format": "float16"|"fp32"|"distributed"|
//   "none", "state_keys": per-param state keys in order, "grad_dtype",
//   "vocab_size_known": false when the true vocabulary size was unknown and
//   every stored row (the source's padded size) counts as a real row}.
//   Both Megatron readers (legacy, torch_dist) write it and both Megatron
//   writers read it: the family's record, typed as MegatronExtras below.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/json/json.h"

namespace ucp::universal {
struct Model;
}  // namespace ucp::universal

namespace ucp::megatron {

inline constexpr std::string_view kTrackerFile =
    "latest_checkpointed_iteration.txt";
inline constexpr std::string_view kModelFile = "model_optim_rng.pt";
inline constexpr std::string_view kDistribOptimFile = "distrib_optim.pt";
inline constexpr std::string_view kReleaseDir = "release";
/// The root attribute of the universal file holding the driver's metadata.
inline constexpr std::string_view kMetaAttr = "megatron";
/// The top-level keys of a model_optim_rng.pt Megatron-LM saves today, in
/// its order (what a target writes when the source recorded none).
inline constexpr std::string_view kTopLevelKeys[] = {
    "args",
    "checkpoint_version",
    "iteration",
    "model",
    "optimizer",
    "opt_param_scheduler",
    "rerun_state_machine",
    "rng_state",
    "num_floating_point_operations_so_far"};

/// The "megatron" root attribute, typed (the family's record, see above).
/// An absent member is an empty optional; unknown members stay in `other`.
struct MegatronExtras {
  std::optional<std::vector<std::string>> top_level_keys;
  /// (canonical name, "param" | "buffer" | "opaque") in state-dict order.
  std::optional<std::vector<std::pair<std::string, std::string>>> entries;
  std::optional<bool> release;
  std::optional<int64_t> gpus_per_node;
  /// "float16" | "fp32" | "distributed" | "none".
  std::optional<std::string> optimizer_format;
  std::optional<std::vector<std::string>> state_keys;
  std::optional<std::string> grad_dtype;
  std::optional<bool> vocab_size_known;
  json::Value other = json::Value::Object();

  /// False only when the record says the true vocabulary size was unknown.
  bool VocabSizeKnown() const noexcept {
    return vocab_size_known.value_or(true);
  }
};

/// The model's "megatron" record; absent if it has none. Throws FormatError
/// "universal file <file> > attribute megatron > ..." if a member has the
/// wrong type (an entry that is not [name, kind]).
std::optional<MegatronExtras> ReadMegatronExtras(
    const universal::Model& model, const std::filesystem::path& file);
/// Stores `extras` as the model's "megatron" record.
void WriteMegatronExtras(const MegatronExtras& extras, universal::Model& model);

/// The world tensors of a distrib_optim.pt buffer and the state kinds of the
/// universal file they hold.
struct WorldTensor {
  const char* key;
  const char* kind;
};
inline constexpr WorldTensor kWorldTensors[] = {
    {"param", "fp32"}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}};

/// "iter_0000100", or "release".
std::string IterDirName(int64_t iteration, bool release);
/// N of "iter_N" (digits only); absent for any other name.
std::optional<int64_t> ParseIterDirName(std::string_view name);

/// Which folder of a save folder holds the checkpoint to read, and how it
/// was found (LocateIteration).
struct IterationFolder {
  std::filesystem::path dir;       // the save folder
  std::filesystem::path iter_dir;  // lexically normal
  int64_t iteration = 0;
  /// The release/ folder (a converted checkpoint; iteration 0).
  bool release = false;
  /// False when `path` was neither a save folder (with a tracker) nor an
  /// iter_N (or accepted release/) folder: then it is `iter_dir` itself.
  bool named = true;
};
/// Whether a checkpoint may be Megatron's release/ folder (the tracker saying
/// "release", or the folder itself): the legacy format's converted
/// checkpoints; the DCP-container formats (torch_dist, Megatron-FSDP) take
/// iter_N folders only.
enum class ReleaseFolder : bool { kRefused, kAccepted };
/// The iteration folder of `path`, as Megatron's loader finds it:
/// `iteration`'s in the save folder (`path`, or its parent when `path` is an
/// iteration folder without a tracker); else the tracker's (an iteration
/// number, or "release" when accepted); else `path` itself, `named` telling
/// whether its name is iter_N (its iteration, else 0) or an accepted
/// release. Throws IoError if `path` is not a folder, FormatError naming a
/// tracker that holds no iteration or names a missing folder, UsageError
/// "--iteration N: no iter_N in DIR (iterations here: ...)" for an
/// `iteration` the save folder lacks.
IterationFolder LocateIteration(
    const std::filesystem::path& path, std::optional<int64_t> iteration,
    ReleaseFolder release = ReleaseFolder::kRefused);
/// The universal file's opaque key of a rank's rng state:
/// "rng_state/tp01_pp003".
std::string RngStateKey(int64_t tp_rank, int64_t pp_rank);
/// "mp_rank_01" (pp == 1) or "mp_rank_01_003", then "_EEE" with ep > 1.
std::string RankDirName(int64_t tp_rank, int64_t pp_rank, int64_t pp,
                        int64_t ep_rank = 0, int64_t ep = 1);
/// "rng_state/tp01_pp003", then "_ep002" for ep rank > 0.
std::string RngStateKey(int64_t tp_rank, int64_t pp_rank, int64_t ep_rank);

/// The numbers of "mp_rank_TT[_AAA[_BBB]]"; absent if the name is not one.
struct RankDirNumbers {
  int64_t tp_rank = 0;
  std::optional<int64_t> second;
  std::optional<int64_t> third;
};
std::optional<RankDirNumbers> ParseRankDirName(std::string_view name);

}  // namespace ucp::megatron
