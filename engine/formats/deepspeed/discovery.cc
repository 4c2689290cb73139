// Finding a DeepSpeed checkpoint on disk (deepspeed.h, deepspeed_format.h).

#include <algorithm>
#include <map>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using namespace internal;

std::string TagsIn(const fs::path& dir) {
  std::vector<std::string> tags;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (HoldsModelStates(it->path()))
      tags.push_back(it->path().filename().string());
  }
  std::sort(tags.begin(), tags.end());
  if (tags.empty()) return "none";
  std::string s;
  for (const auto& t : tags) s += (s.empty() ? "" : ", ") + t;
  return s;
}

bool Eat(std::string_view& s, std::string_view lit) {
  if (s.substr(0, lit.size()) != lit) return false;
  s.remove_prefix(lit.size());
  return true;
}

// Leading decimal digits (at most 9).
std::optional<int64_t> Digits(std::string_view& s) {
  size_t n = 0;
  while (n < s.size() && n < 9 && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 0; i < n; ++i) v = v * 10 + (s[i] - '0');
  s.remove_prefix(n);
  return v;
}

// The DeepSpeed rank-file names (deepspeed_format.h).
struct RankFileName {
  enum Kind { kModel, kZ3Model, kOptim, kLayer, kExpert, kExpertOptim } kind;
  int64_t dp = 0;  // kExpert: the global expert; kExpertOptim: the ep rank
  int64_t mp = 0;  // kLayer: the tp rank
  bool bf16 = false;
  int64_t layer = 0;
};

std::optional<RankFileName> ParseRankFileName(std::string_view s) {
  RankFileName r{};
  std::string_view t = s;
  if (Eat(t, "mp_rank_")) {  // mp_rank_XX_model_states.pt
    auto mp = Digits(t);
    if (mp && t == "_model_states.pt")
      return RankFileName{RankFileName::kModel, 0, *mp, false, 0};
    return std::nullopt;
  }
  // The MoE files: expp_rank_E_mp_rank_XX_optim_states.pt,
  // [layer_L_]expert_G_mp_rank_XX_model_states.pt (L, G unpadded).
  auto expert = [](std::string_view& u, int64_t layer,
                   RankFileName::Kind kind) -> std::optional<RankFileName> {
    auto id = Digits(u);
    if (!id || !Eat(u, "_mp_rank_")) return std::nullopt;
    auto mp = Digits(u);
    const std::string_view tail =
        kind == RankFileName::kExpert ? "_model_states.pt" : "_optim_states.pt";
    if (!mp || u != tail) return std::nullopt;
    return RankFileName{kind, *id, *mp, false, layer};
  };
  if (Eat(t, "expp_rank_")) return expert(t, 0, RankFileName::kExpertOptim);
  if (Eat(t, "layer_")) {
    // layer_LL-model_TT-model_states.pt, layer_LL-model_states.pt (no model
    // axis), layer_LL_expert_EE_mp_rank_XX_model_states.pt (MoE).
    auto idx = Digits(t);
    if (!idx) return std::nullopt;
    if (Eat(t, "_expert_")) return expert(t, *idx, RankFileName::kExpert);
    if (t == "-model_states.pt")
      return RankFileName{RankFileName::kLayer, 0, 0, false, *idx};
    if (!Eat(t, "-model_")) return std::nullopt;
    auto tp = Digits(t);
    if (tp && t == "-model_states.pt")
      return RankFileName{RankFileName::kLayer, 0, *tp, false, *idx};
    return std::nullopt;
  }
  if (Eat(t, "expert_")) return expert(t, -1, RankFileName::kExpert);
  r.bf16 = Eat(t, "bf16_");
  if (!Eat(t, "zero_pp_rank_")) return std::nullopt;
  auto dp = Digits(t);
  if (!dp || !Eat(t, "_mp_rank_")) return std::nullopt;
  auto mp = Digits(t);
  if (!mp) return std::nullopt;
  r.dp = *dp;
  r.mp = *mp;
  if (t == "_optim_states.pt") {
    r.kind = RankFileName::kOptim;
    return r;
  }
  if (t == "_model_states.pt" && !r.bf16) {
    r.kind = RankFileName::kZ3Model;
    return r;
  }
  return std::nullopt;
}

// "_mp_rank_03" as DeepSpeed formats it (%02d).
std::string MpPart(int64_t mp) {
  return StrCat(mp < 10 ? "_mp_rank_0" : "_mp_rank_", mp);
}

bool HoldsRankFiles(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (ParseRankFileName(it->path().filename().string())) return true;
  }
  return false;
}

}  // namespace

std::vector<formats::SavedCheckpoint> ListTags(const fs::path& dir) {
  std::vector<formats::SavedCheckpoint> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->is_directory(ec) || !HoldsRankFiles(it->path())) continue;
    formats::SavedCheckpoint c;
    c.name = it->path().filename().string();
    c.selector.Set(kTagOption, c.name);
    size_t i = c.name.size();
    while (i > 0 && c.name[i - 1] >= '0' && c.name[i - 1] <= '9') --i;
    std::string_view digits = std::string_view(c.name).substr(i);
    if (auto n = Digits(digits); n && digits.empty()) c.iteration = *n;
    out.push_back(std::move(c));
  }
  return out;
}

bool HoldsModelStates(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "mp_rank_00_model_states.pt", ec) ||
         fs::is_regular_file(dir / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                             ec);
}

namespace {

// The rank files of a tag folder.
struct TagFiles {
  std::map<int64_t, fs::path> models;  // mp -> file
  std::map<int64_t, std::map<int64_t, fs::path>> z3_models, optims;  // mp, dp
  std::map<int64_t, std::map<int64_t, fs::path>> layers;  // tp -> idx -> file
  std::optional<bool> bf16_prefix;  // of the optimizer files
  std::map<std::pair<int64_t, int64_t>, fs::path> experts;  // (L, G)
  std::map<int64_t, fs::path> expert_optims;                // ep rank
};

// c.dir, c.tag and c.tag_dir of `path` (a save folder with `latest`, or a
// tag folder) and --tag `tag`.
void ResolveTag(const fs::path& path, const std::string& tag, Checkpoint& c) {
  std::error_code ec;
  if (!tag.empty()) {
    c.dir = path;
    c.tag = tag;
  } else if (fs::exists(path / kLatestFile, ec)) {
    c.dir = path;
    c.tag =
        std::string(TrimWhitespace(ReadSmallFile(path / kLatestFile, 4096)));
    if (c.tag.empty() || c.tag.find('/') != std::string::npos) {
      throw FormatError((path / kLatestFile).string(), ": '", c.tag,
                        "' is not a tag");
    }
  } else if (HoldsModelStates(path)) {
    c.dir = path.parent_path();
    c.tag = path.filename().string();
  } else {
    throw UsageError("no '", kLatestFile, "' file in ", path.string(),
                     " and no --tag given (tags here: ", TagsIn(path), ")");
  }
  c.tag_dir = c.dir / c.tag;
  if (!fs::is_directory(c.tag_dir, ec)) {
    throw FormatError("tag ", c.tag, ": no folder ", c.tag_dir.string(),
                      tag.empty() ? " (named by latest)" : "");
  }
}

TagFiles ListRankFiles(const Checkpoint& c) {
  TagFiles f;
  std::error_code ec;
  for (fs::directory_iterator it(c.tag_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::optional<RankFileName> n = ParseRankFileName(name);
    if (!n) continue;
    switch (n->kind) {
      case RankFileName::kExpert:
      case RankFileName::kExpertOptim:
        if (n->mp != 0) {
          throw FormatError(it->path().string(),
                            ": mixture-of-experts files with model "
                            "parallelism (mp rank ",
                            n->mp, ") are not supported yet");
        }
        if (n->kind == RankFileName::kExpertOptim) {
          f.expert_optims[n->dp] = it->path();
        } else {
          f.experts[{n->layer, n->dp}] = it->path();
        }
        break;
      case RankFileName::kLayer:
        f.layers[n->mp][n->layer] = it->path();
        break;
      case RankFileName::kModel:
        f.models[n->mp] = it->path();
        break;
      case RankFileName::kZ3Model:
        f.z3_models[n->mp][n->dp] = it->path();
        break;
      case RankFileName::kOptim:
        if (f.bf16_prefix && *f.bf16_prefix != n->bf16) {
          throw FormatError(it->path().string(),
                            ": optimizer files with and without the bf16_ "
                            "prefix in one tag folder");
        }
        f.bf16_prefix = n->bf16;
        f.optims[n->mp][n->dp] = it->path();
        break;
    }
  }
  if (ec) throw IoError("cannot list ", c.tag_dir.string(), ": ", ec.message());
  return f;
}

// Opens mp rank 0's model states (c.first_model, its path in
// `first_model`) and reads c.dp; returns mp_world_size.
int64_t ReadWorldSizes(const TagFiles& f, Checkpoint& c,
                       fs::path& first_model) {
  if (auto m = f.models.find(0); m != f.models.end()) {
    first_model = m->second;
  } else if (auto z = f.z3_models.find(0);
             z != f.z3_models.end() && z->second.count(0)) {
    first_model = z->second.at(0);
  }
  if (first_model.empty()) {
    throw FormatError(c.tag_dir.string(),
                      ": no mp_rank_00_model_states.pt (nor ZeRO-3 "
                      "zero_pp_rank_0_mp_rank_00_model_states.pt)");
  }
  int64_t mp_world = 1;
  c.first_model = std::make_shared<const torchfile::TorchFile>(
      torchfile::TorchFile::Open(first_model));
  try {
    const pickle::Value* root = c.first_model->root();
    if (root == nullptr || !root->IsDictLike())
      throw FormatError("the file does not hold a dict");
    c.dp = Int(Require(root, "dp_world_size"), "dp_world_size");
    mp_world = Int(Require(root, "mp_world_size"), "mp_world_size");
    if (c.dp < 1) throw FormatError("dp_world_size ", c.dp);
    if (mp_world < 1 || mp_world > 4096)
      throw FormatError("mp_world_size ", mp_world);
  } catch (Error& e) {
    e.AddContext("rank file ", first_model.string());
    throw;
  }
  return mp_world;
}

// c.pipeline, c.tp, c.pp and c.layer_files: layer files name the tp ranks
// (PipelineModule); without them every mp rank is a tp rank.
void SplitModelParallel(const TagFiles& f, int64_t mp_world,
                        const fs::path& first_model, Checkpoint& c) {
  c.pipeline = !f.layers.empty();
  c.tp = c.pipeline ? static_cast<int64_t>(f.layers.size()) : mp_world;
  for (int64_t t = 0; t < c.tp; ++t) {
    if (c.pipeline && !f.layers.count(t)) {
      throw FormatError(c.tag_dir.string(), ": layer files of tp ranks ",
                        f.layers.begin()->first, "..", f.layers.rbegin()->first,
                        " but none of tp rank ", t);
    }
  }
  if (mp_world % c.tp != 0) {
    throw FormatError(first_model.string(), ": mp_world_size ", mp_world,
                      " is not a multiple of the ", c.tp,
                      " tp ranks of the layer files");
  }
  c.pp = mp_world / c.tp;
  if (c.pipeline) {
    for (const auto& [t, files] : f.layers) {
      c.layer_files.emplace_back(files.begin(), files.end());
      const auto& ref = f.layers.begin()->second;
      for (const auto& [idx, unused_path] : ref) {
        (void)unused_path;
        if (!files.count(idx)) {
          throw FormatError(c.tag_dir.string(), ": missing layer_",
                            idx < 10 ? "0" : "", idx, "-model_",
                            t < 10 ? "0" : "", t, "-model_states.pt (tp rank ",
                            t, " of layer ", idx, ")");
        }
      }
      if (files.size() != ref.size()) {
        throw FormatError(files.rbegin()->second.string(), ": tp rank ", t,
                          " has ", files.size(), " layer files but tp rank ",
                          f.layers.begin()->first, " has ", ref.size());
      }
    }
  }
}

// c.wrapper, c.stage (and c.first_optim) from the first optimizer file.
void ReadStage(TagFiles& f, const std::string& zprefix, Checkpoint& c) {
  if (f.optims.empty()) {
    c.wrapper = Wrapper::kTorch;
    c.stage = 0;
    if (!f.z3_models.empty()) {
      throw FormatError(c.tag_dir.string(),
                        ": ZeRO-3 model files but no optimizer file "
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt");
    }
  } else {
    auto it0 = f.optims[0].find(0);
    if (it0 == f.optims[0].end()) {
      throw FormatError(c.tag_dir.string(), ": missing ", zprefix,
                        "0_mp_rank_00_optim_states.pt");
    }
    c.first_optim = std::make_shared<const torchfile::TorchFile>(
        torchfile::TorchFile::Open(it0->second));
    try {
      const pickle::Value* osd =
          Require(c.first_optim->root(), "optimizer_state_dict");
      const pickle::Value* zs = Get(osd, "zero_stage");
      if (zs == nullptr) {
        c.wrapper = Wrapper::kBf16;  // BF16_Optimizer has no zero_stage
        c.stage = 0;
      } else {
        const std::optional<int64_t> v = ZeroStageOf(zs);
        if (!v || *v < 1 || *v > 3) {
          throw FormatError("unknown ZeRO stage ", pickle::Repr(zs, 60),
                            " (supported: 1, 2, 3)");
        }
        c.wrapper = Wrapper::kZero;
        c.stage = static_cast<int>(*v);
      }
    } catch (Error& e) {
      e.AddContext("rank file ", it0->second.string());
      throw;
    }
  }
}

// c.mp_ranks: every (mp, dp) file the world sizes need, nothing more.
void CollectMpRanks(TagFiles& f, int64_t mp_world, const fs::path& first_model,
                    const std::string& zprefix, Checkpoint& c) {
  auto extra = [&](const std::map<int64_t, fs::path>& files, int64_t count,
                   const char* what) {
    if (static_cast<int64_t>(files.size()) != count) {
      throw FormatError(files.rbegin()->second.string(), ": more ", what,
                        " than dp_world_size ", c.dp,
                        " (files from mixed world sizes?)");
    }
  };
  for (int64_t mp = 0; mp < mp_world; ++mp) {
    Checkpoint::MpRank rank;
    if (c.wrapper != Wrapper::kTorch) {
      for (int64_t d = 0; d < c.dp; ++d) {
        if (!f.optims[mp].count(d)) {
          throw FormatError(c.tag_dir.string(), ": missing ", zprefix, d,
                            MpPart(mp), "_optim_states.pt (dp_world_size ",
                            c.dp, ", mp_world_size ", mp_world, " in ",
                            first_model.string(), ")");
        }
        rank.optim_files.push_back(f.optims[mp][d]);
      }
      extra(f.optims[mp], c.dp, "optimizer files");
    }
    if (c.stage == 3) {
      for (int64_t d = 0; d < c.dp; ++d) {
        if (!f.z3_models[mp].count(d)) {
          throw FormatError(c.tag_dir.string(), ": missing zero_pp_rank_", d,
                            MpPart(mp), "_model_states.pt (ZeRO-3, dp ", c.dp,
                            ")");
        }
        rank.model_files.push_back(f.z3_models[mp][d]);
      }
      extra(f.z3_models[mp], c.dp, "ZeRO-3 model files");
    } else if (f.models.count(mp)) {
      rank.model_files.push_back(f.models[mp]);
    } else {
      throw FormatError(
          c.tag_dir.string(), ": missing mp", MpPart(mp).substr(3),
          "_model_states.pt (mp_world_size ", mp_world,
          c.pipeline ? StrCat(": pp ", c.pp, " x tp ", c.tp) : "", ")");
    }
    c.mp_ranks.push_back(std::move(rank));
  }
  auto beyond = [&](const auto& by_mp, const char* what) {
    if (!by_mp.empty() && by_mp.rbegin()->first >= mp_world) {
      const auto& files = by_mp.rbegin()->second;
      throw FormatError(files.begin()->second.string(), ": ", what,
                        " of mp rank ", by_mp.rbegin()->first,
                        " but mp_world_size is ", mp_world,
                        " (files from mixed runs?)");
    }
  };
  beyond(f.optims, "an optimizer file");
  beyond(f.z3_models, "a ZeRO-3 model file");
  if (!f.models.empty() && f.models.rbegin()->first >= mp_world) {
    throw FormatError(f.models.rbegin()->second.string(), ": mp rank ",
                      f.models.rbegin()->first, " but mp_world_size is ",
                      mp_world, " (files from mixed runs?)");
  }
}

// Mixture of experts: what is read (ZeRO 1/2 and BF16_Optimizer without
// model parallelism), and no expert saved under both names.
void CheckExperts(TagFiles& f, Checkpoint& c) {
  const fs::path& any = !f.experts.empty() ? f.experts.begin()->second
                                           : f.expert_optims.begin()->second;
  if (c.mp_ranks.size() > 1 || c.pipeline) {
    throw FormatError(any.string(),
                      ": mixture-of-experts files with model parallelism are "
                      "not supported yet");
  }
  if (c.stage == 3) {
    throw FormatError(any.string(),
                      ": mixture-of-experts files at ZeRO stage 3 are not "
                      "supported (DeepSpeed itself refuses native MoE there)");
  }
  std::map<int64_t, fs::path> legacy, named;  // G -> a file
  for (const auto& [key, path] : f.experts)
    (key.first < 0 ? legacy : named).emplace(key.second, path);
  for (const auto& [g, path] : legacy) {
    if (auto it = named.find(g); it != named.end()) {
      throw FormatError(c.tag_dir.string(), ": expert ", g, " saved twice: in ",
                        it->second.filename().string(), " and in ",
                        path.filename().string());
    }
  }
  c.expert_files = f.experts;
  c.expert_optim_files = f.expert_optims;
  if (c.wrapper == Wrapper::kTorch) {  // stage 0: a file per ep rank
    c.ep = std::max<int64_t>(1, static_cast<int64_t>(f.expert_optims.size()));
    return;
  }
  if (c.first_optim == nullptr) return;
  try {
    const pickle::Value* osd =
        Require(c.first_optim->root(), "optimizer_state_dict");
    const auto& groups =
        Items(Require(Require(osd, "base_optimizer_state"), "param_groups"),
              "param_groups");
    const auto& counts =
        Items(Require(osd, "partition_count"), "partition_count");
    for (size_t g = 0; g < groups.size() && g < counts.size(); ++g) {
      const pickle::Value* moe = Get(groups[g], "moe");
      if (moe == nullptr || moe->kind != pickle::Kind::kBool || !moe->b)
        continue;
      const int64_t edp = Int(counts[g], "partition_count");
      if (edp < 1 || c.dp % edp != 0) {
        throw FormatError("partition_count[", g, "] ", edp,
                          " of an expert group does not divide dp_world_size ",
                          c.dp);
      }
      c.ep = c.dp / edp;
      break;
    }
  } catch (Error& e) {
    e.AddContext("rank file ", c.first_optim->path().string());
    throw;
  }
}

}  // namespace

Checkpoint Discover(const fs::path& path, const std::string& tag) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  Checkpoint c;
  ResolveTag(path, tag, c);
  TagFiles f = ListRankFiles(c);
  c.bf16_prefix = f.bf16_prefix.value_or(false);
  const std::string zprefix =
      c.bf16_prefix ? "bf16_zero_pp_rank_" : "zero_pp_rank_";
  fs::path first_model;
  const int64_t mp_world = ReadWorldSizes(f, c, first_model);
  SplitModelParallel(f, mp_world, first_model, c);
  ReadStage(f, zprefix, c);
  CollectMpRanks(f, mp_world, first_model, zprefix, c);
  if (!f.experts.empty() || !f.expert_optims.empty()) CheckExperts(f, c);
  c.model_files = c.mp_ranks[0].model_files;
  c.optim_files = c.mp_ranks[0].optim_files;
  return c;
}

}  // namespace ucp::deepspeed
