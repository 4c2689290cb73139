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
  enum Kind { kModel, kZ3Model, kOptim, kLayer } kind;
  int64_t dp = 0;
  int64_t mp = 0;
  bool bf16 = false;
};

std::optional<RankFileName> ParseRankFileName(std::string_view s) {
  RankFileName r{};
  std::string_view t = s;
  if (Eat(t, "mp_rank_")) {  // mp_rank_XX_model_states.pt
    auto mp = Digits(t);
    if (mp && t == "_model_states.pt")
      return RankFileName{RankFileName::kModel, 0, *mp, false};
    return std::nullopt;
  }
  if (Eat(t, "layer_")) {  // layer_LL-model_...model_states.pt
    if (Digits(t) && Eat(t, "-model_") && t.ends_with("model_states.pt"))
      return RankFileName{RankFileName::kLayer, 0, 0, false};
    return std::nullopt;
  }
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

}  // namespace

bool HoldsModelStates(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "mp_rank_00_model_states.pt", ec) ||
         fs::is_regular_file(dir / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                             ec);
}

Checkpoint Discover(const fs::path& path, const std::string& tag) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  Checkpoint c;
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
  // The files.
  std::map<int64_t, fs::path> z3_models, optims;
  std::optional<bool> prefix;
  auto no_mp = [](const fs::path& p) {
    return FormatError(p.string(),
                       ": model parallelism (mp rank > 0) is not supported "
                       "for DeepSpeed checkpoints yet");
  };
  for (fs::directory_iterator it(c.tag_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::optional<RankFileName> f = ParseRankFileName(name);
    if (!f) continue;
    if (f->kind == RankFileName::kLayer) {
      throw FormatError(it->path().string(),
                        ": pipeline layer files (PipelineModule / "
                        "Megatron-DeepSpeed) are not supported yet");
    }
    if (f->mp != 0) throw no_mp(it->path());
    if (f->kind == RankFileName::kModel) {
      c.model_files = {it->path()};
    } else if (f->kind == RankFileName::kZ3Model) {
      z3_models[f->dp] = it->path();
    } else {
      if (prefix && *prefix != f->bf16) {
        throw FormatError(it->path().string(),
                          ": optimizer files with and without the bf16_ "
                          "prefix in one tag folder");
      }
      prefix = f->bf16;
      optims[f->dp] = it->path();
    }
  }
  if (ec) throw IoError("cannot list ", c.tag_dir.string(), ": ", ec.message());
  c.bf16_prefix = prefix.value_or(false);
  const fs::path first_model =
      !c.model_files.empty() ? c.model_files[0]
                             : (z3_models.count(0) ? z3_models[0] : fs::path());
  if (first_model.empty()) {
    throw FormatError(c.tag_dir.string(),
                      ": no mp_rank_00_model_states.pt (nor ZeRO-3 "
                      "zero_pp_rank_0_mp_rank_00_model_states.pt)");
  }
  {
    c.first_model = std::make_shared<const torchfile::TorchFile>(
        torchfile::TorchFile::Open(first_model));
    try {
      const pickle::Value* root = c.first_model->root();
      if (root == nullptr || !root->IsDictLike())
        throw FormatError("the file does not hold a dict");
      c.dp = Int(Require(root, "dp_world_size"), "dp_world_size");
      const int64_t mp = Int(Require(root, "mp_world_size"), "mp_world_size");
      if (c.dp < 1) throw FormatError("dp_world_size ", c.dp);
      if (mp != 1) {
        throw FormatError("mp_world_size ", mp,
                          ": model parallelism is not supported for "
                          "DeepSpeed checkpoints yet");
      }
    } catch (Error& e) {
      e.AddContext("rank file ", first_model.string());
      throw;
    }
  }
  // The stage, from the first optimizer file.
  if (optims.empty()) {
    c.wrapper = Wrapper::kTorch;
    c.stage = 0;
    if (!z3_models.empty()) {
      throw FormatError(c.tag_dir.string(),
                        ": ZeRO-3 model files but no optimizer file "
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt");
    }
  } else {
    auto it0 = optims.find(0);
    if (it0 == optims.end()) {
      throw FormatError(c.tag_dir.string(), ": missing ",
                        c.bf16_prefix ? "bf16_" : "",
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt");
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
  // Completeness and one world size.
  if (c.wrapper != Wrapper::kTorch) {
    for (int64_t d = 0; d < c.dp; ++d) {
      if (!optims.count(d)) {
        throw FormatError(c.tag_dir.string(), ": missing ",
                          c.bf16_prefix ? "bf16_" : "", "zero_pp_rank_", d,
                          "_mp_rank_00_optim_states.pt (dp_world_size ", c.dp,
                          ")");
      }
      c.optim_files.push_back(optims[d]);
    }
    if (static_cast<int64_t>(optims.size()) != c.dp) {
      throw FormatError(optims.rbegin()->second.string(),
                        ": more optimizer files than dp_world_size ", c.dp,
                        " (files from mixed world sizes?)");
    }
  }
  if (c.stage == 3) {
    for (int64_t d = 0; d < c.dp; ++d) {
      if (!z3_models.count(d)) {
        throw FormatError(c.tag_dir.string(), ": missing zero_pp_rank_", d,
                          "_mp_rank_00_model_states.pt (ZeRO-3, dp ", c.dp,
                          ")");
      }
      c.model_files.push_back(z3_models[d]);
    }
    if (static_cast<int64_t>(z3_models.size()) != c.dp) {
      throw FormatError(z3_models.rbegin()->second.string(),
                        ": more ZeRO-3 model files than dp_world_size ", c.dp,
                        " (files from mixed world sizes?)");
    }
  } else if (c.model_files.empty()) {
    throw FormatError(c.tag_dir.string(),
                      ": no mp_rank_00_model_states.pt (ZeRO stage ", c.stage,
                      ")");
  }
  return c;
}

}  // namespace ucp::deepspeed
