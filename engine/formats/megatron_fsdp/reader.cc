// Finding and reading a Megatron-FSDP fsdp_dtensor checkpoint
// (megatron_fsdp.h).

#include <algorithm>
#include <map>
#include <system_error>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_fsdp/megatron_fsdp.h"
#include "engine/json/json.h"
#include "layouts/layout.h"

namespace ucp::megatron_fsdp {
namespace {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

constexpr std::string_view kModule = "module.";
constexpr std::string_view kGroupMeta = "optimizer.param_to_group_meta.";

// A complete DCP folder that is not torch_dist's (which writes common.pt
// and, last, metadata.json).
bool IsDcpIterFolder(const fs::path& dir) {
  std::error_code ec;
  return dcp::IsCheckpointFolder(dir) &&
         !fs::exists(dir / "metadata.json", ec) &&
         !fs::exists(dir / "common.pt", ec);
}

// SwiGLU's split halves: the canonical fc1 param, and whether this is the
// second (up) half.
std::optional<std::pair<std::string, bool>> SwigluHalf(std::string_view n) {
  for (std::string_view p : {".linear_fc1.weight", ".linear_fc1.bias"}) {
    for (bool up : {false, true}) {
      const std::string suffix = StrCat(p, up ? "_v" : "_w");
      if (n.ends_with(suffix))
        return std::make_pair(std::string(n.substr(0, n.size() - 2)), up);
    }
  }
  return std::nullopt;
}

class Planner {
 public:
  Planner(const Checkpoint& c, const formats::SourceOptions& o)
      : c_(c), o_(o) {}
  universal::SourcePlan Run();

 private:
  const Value* Object(const std::string& fqn);
  void PlanLayout();
  void PadVocabulary(const std::string& param, int64_t rows);
  void PlanGroups();
  void PlanObjects();
  void PlanRoot();

  const Checkpoint& c_;
  const formats::SourceOptions& o_;
  universal::SourcePlan plan_;
  dcp::FileCache files_;
  std::map<std::string, std::shared_ptr<const torchfile::TorchFile>> objects_;
  const std::optional<megatron::RunConfig>& run_ = c_.run;
  std::optional<layouts::Layout> layout_;
  layouts::Variables vars_;
  std::string vocab_source_;
  std::vector<universal::ParamGroup> groups_;
};

const Value* Planner::Object(const std::string& fqn) {
  const dcp::ItemKey key{fqn, std::nullopt};
  const auto it = c_.dcp.items.find(key);
  if (it == c_.dcp.items.end() || it->second.empty()) return nullptr;
  auto& f = objects_[fqn];
  if (!f) f = dcp::OpenItem(it->second.front(), key, files_);
  return f->root();
}

void Planner::PlanLayout() {
  std::vector<std::string> names;
  for (const atoms::ParamInfo& p : plan_.params) names.push_back(p.fqn);
  if (o_.layout.empty() && layouts::Layout::DetectBuiltins(names).empty()) {
    throw LayoutError(c_.iter_dir.string(), ": the param names (first: ",
                      names.empty() ? std::string("none") : names[0],
                      ") match no built-in layout (give --layout NAME|FILE; "
                      "ucp layout list)");
  }
  layout_ = layouts::Layout::FromSpec(o_.layout, names);
  layouts::Variables vars;
  if (run_) vars = run_->variables;
  int64_t layers = 0;
  for (const std::string& n : names)
    if (auto l = layout_->SplitLayer(n))
      layers = std::max(layers, l->index + 1);
  if (!vars.Has("num_layers")) vars.Set("num_layers", layers);
  if (vars.Get("num_layers") != layers) {
    throw FormatError(c_.iter_dir.string(), ": args say ",
                      vars.Get("num_layers"), " layers, the model keys hold ",
                      layers);
  }
  std::optional<int64_t> vocab = o_.true_vocab_size;
  vocab_source_ = "option";
  if (!vocab && run_ && run_->true_vocab_size) {
    vocab = run_->true_vocab_size;
    vocab_source_ = "tokenizer (NullTokenizer vocab_size + 1)";
  }
  if (vocab) vars.Set("vocab_size", *vocab);
  vars_ = layout_->Resolve(vars);
  for (const atoms::ParamInfo& p : plan_.params) {
    const layouts::Rule* r = layout_->Find(p.fqn, vars_);
    if (r == nullptr || !r->tp.vocab || p.shape.empty()) continue;
    if (!vocab) {  // the stored rows, true size unknown
      vocab = p.shape[0];
      vocab_source_ = "the stored rows (true size unknown)";
      vars_.Set("vocab_size", *vocab);
    }
    if (*vocab > p.shape[0]) {
      throw FormatError(c_.iter_dir.string(), " > ", p.fqn, ": ", p.shape[0],
                        " rows, fewer than the vocabulary's ", *vocab, " (",
                        vocab_source_, ")");
    }
    if (*vocab < p.shape[0]) PadVocabulary(p.fqn, *vocab);
  }
}

// Rows from `rows` on are padding: pad atoms (kept verbatim, not the model's).
void Planner::PadVocabulary(const std::string& param, int64_t rows) {
  for (atoms::ParamInfo& p : plan_.params)
    if (p.fqn == param) p.shape[0] = rows;
  for (universal::AtomPlan& a : plan_.atoms) {
    if (a.param != param || a.shape.empty()) continue;
    a.pad_shape = a.shape;
    a.pad_shape[0] -= rows;
    a.shape[0] = rows;
    std::vector<universal::Fragment> out;
    for (universal::Fragment& f : a.fragments) {
      const int64_t begin = f.atom_box.offset[0];
      const int64_t end = begin + f.atom_box.size[0];
      if (begin < rows) {
        universal::Fragment m = f;
        m.atom_box.size[0] = std::min(end, rows) - begin;
        m.src_box.size[0] = m.atom_box.size[0];
        out.push_back(std::move(m));
      }
      if (end > rows) {
        const int64_t skip = std::max<int64_t>(0, rows - begin);
        universal::Fragment pad = f;
        pad.pad = true;
        pad.atom_box.offset[0] = begin + skip - rows;
        pad.atom_box.size[0] = end - begin - skip;
        pad.src_box.offset[0] += skip;
        pad.src_box.size[0] = pad.atom_box.size[0];
        out.push_back(std::move(pad));
      }
    }
    a.fragments = std::move(out);
  }
}

// Each param's group meta (optimizer.param_to_group_meta.<name>.<key>):
// params of equal hyper-parameters are a group, in the order of their first
// param.
void Planner::PlanGroups() {
  std::map<std::string, std::vector<std::pair<std::string, const Value*>>>
      metas;  // canonical name -> entries
  std::vector<std::string> order;
  for (const dcp::Entry& e : c_.dcp.metadata.entries) {
    if (e.tensor || !e.fqn.starts_with(kGroupMeta)) continue;
    const std::string rest = e.fqn.substr(kGroupMeta.size());
    const size_t dot = rest.rfind('.');
    if (dot == std::string::npos) continue;
    std::string name = CanonicalName(rest.substr(0, dot));
    if (auto half = SwigluHalf(name)) name = half->first;
    auto [it, fresh] = metas.try_emplace(name);
    if (fresh) order.push_back(name);
    const std::string key = rest.substr(dot + 1);
    if (std::none_of(it->second.begin(), it->second.end(),
                     [&](const auto& kv) { return kv.first == key; }))
      it->second.emplace_back(key, Object(e.fqn));
  }
  std::map<std::string, size_t> group_of;  // hyper-parameters' JSON -> group
  for (const std::string& name : order) {
    json::Value hp = json::Value::Object();
    auto entries = metas[name];
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [k, v] : entries) formats::GroupHyperparamJson(k, v, hp);
    const std::string text = hp.Dump();
    auto [it, fresh] = group_of.try_emplace(text, groups_.size());
    if (fresh) {
      universal::ParamGroup& g = groups_.emplace_back();
      for (const auto& [k, v] : entries) formats::AddGroupHyperparam(k, v, g);
      g.params.emplace();
    }
    groups_[it->second].params->push_back(name);
  }
  std::map<std::string, int64_t> index;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (const std::string& n : *groups_[g].params)
      index.emplace(n, static_cast<int64_t>(g));
  for (atoms::ParamInfo& p : plan_.params)
    if (auto it = index.find(p.fqn); it != index.end()) p.group = it->second;
}

// The objects: args and the top-level scalars as a Megatron source keeps
// them; the rest (nested ones, flattened by torch) under megatron_fsdp/.
void Planner::PlanObjects() {
  std::vector<universal::OpaqueBlob> kept;
  for (universal::OpaqueBlob& b : plan_.opaque) {
    if (!b.key.starts_with("dcp/bytes/")) continue;  // dcp's own extras
    const std::string fqn = b.key.substr(10);
    if (fqn.starts_with(kGroupMeta)) continue;  // the groups above
    const auto& pds = c_.dcp.metadata.planner_data;
    const auto pd = std::find_if(pds.begin(), pds.end(),
                                 [&](const auto& p) { return p.first == fqn; });
    const bool top = pd != pds.end() ? pd->second.size() == 1
                                     : fqn.find('.') == std::string::npos;
    if (fqn == "args") {
      kept.push_back({"args", std::move(b.bytes)});
    } else if (top) {
      kept.push_back({"top_level/" + fqn, std::move(b.bytes)});
    } else {
      kept.push_back({"megatron_fsdp/" + fqn, std::move(b.bytes)});
    }
  }
  plan_.opaque = std::move(kept);
}

void Planner::PlanRoot() {
  universal::Model& model = plan_.model;
  if (const Value* it = Object("iteration"); it && it->kind == Kind::kInt)
    model.iteration = it->i;
  else
    model.iteration = c_.iteration;
  model.consumed_samples =
      run_ ? run_->consumed_train_samples.value_or(-1) : -1;
  const universal::SourceInfo dcp_source = std::move(model.source);
  universal::SourceInfo& src = model.source;
  src = universal::SourceInfo{};
  src.framework = "megatron-lm";
  src.framework_version = "megatron-core (Megatron-FSDP fsdp_dtensor)";
  src.format = "fsdp_dtensor";
  const layouts::Topology t = run_ ? run_->topology : layouts::Topology{};
  src.tp = t.tp;
  src.pp = 1;
  src.vpp = 1;
  src.dp = run_ ? t.dp : c_.dcp.world;
  src.cp = run_ ? run_->cp : 1;
  src.distributed_optimizer = true;
  src.other["optimizer_sharding"] = "fsdp_dtensor";
  src.other["vocab_size_from"] = vocab_source_;
  src.dtype = dcp_source.dtype;
  src.layout = layout_->name();
  src.other["iteration_dir"] = c_.iter_dir.filename().string();
  model.variables = universal::ModelInfo{};
  for (const auto& [k, v] : vars_.values()) model.variables.Set(k, v);
  if (auto v = vars_.Find("vocab_size"))
    model.variables.Set("true_vocab_size", *v);
  model.layout_yaml = layout_->yaml();
  model.args =
      c_.args != nullptr
          ? megatron::ArgsToJson(megatron::ArgsView(c_.args->root(), "args"))
          : json::Value::Object();
  universal::OptimizerInfo& opt = model.optimizer;
  if (opt.state_kinds) {
    opt.type = run_ ? run_->optimizer : std::string("adam");
    opt.groups = groups_;
  }
  // The DCP key list names the source's keys: this content is Megatron's.
  model.extras.erase(dcp::kMetaAttr);
  universal::TrainingInfo& training =
      model.training ? *model.training : model.training.emplace();
  training.step = model.iteration;
  training.global_samples = model.consumed_samples;
}

universal::SourcePlan Planner::Run() {
  plan_ = dcp::PlanSource(
      c_.dcp,
      [](const std::string& key, const std::string& name, const Shape& size) {
        // Model and optimizer tensors only: the rest (get_rng_state's
        // generators, flattened by torch) are objects.
        if (!key.starts_with("model.") && !key.starts_with("optimizer.state."))
          return dcp::ParamPlace{};
        dcp::ParamPlace place{CanonicalName(name), size, {}};
        if (auto half = SwigluHalf(place.param)) {
          place.param = half->first;
          if (!size.empty()) {
            place.shape[0] *= 2;
            place.offset.assign(size.size(), 0);
            if (half->second) place.offset[0] = size[0];
          }
        }
        return place;
      });
  for (const atoms::ParamInfo& p : plan_.params) {
    if (p.fqn.find(".experts.") != std::string::npos) {
      throw FormatError(c_.iter_dir.string(), " > ", p.fqn,
                        ": a mixture-of-experts param (not read)");
    }
  }
  PlanGroups();
  PlanLayout();
  PlanObjects();
  PlanRoot();
  return std::move(plan_);
}

}  // namespace

std::string CanonicalName(std::string_view name) {
  while (name.starts_with(kModule)) name.remove_prefix(kModule.size());
  return std::string(name);
}

bool IsFsdpFolder(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::exists(dir / megatron::kTrackerFile, ec)) {
    // A complete fsdp_dtensor iteration, and none of torch_dist's (whose
    // unfinished saves look alike until metadata.json is written).
    bool complete = false;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
         it.increment(ec)) {
      if (!megatron::ParseIterDirName(it->path().filename().string())) continue;
      std::error_code e2;
      if (fs::exists(it->path() / "metadata.json", e2)) return false;
      complete = complete || IsDcpIterFolder(it->path());
    }
    return complete;
  }
  return megatron::ParseIterDirName(dir.filename().string()) &&
         IsDcpIterFolder(dir) &&
         fs::exists(dir.parent_path() / megatron::kTrackerFile, ec);
}

bool HoldsFsdpFiles(const fs::path& iter_dir) {
  // An unfinished save (no .metadata yet) is one: Open says so.
  std::error_code ec;
  if (fs::exists(iter_dir / "metadata.json", ec) ||
      fs::exists(iter_dir / "common.pt", ec))
    return false;
  bool distcp = IsDcpIterFolder(iter_dir);
  for (fs::directory_iterator f(iter_dir, ec), fe; !distcp && !ec && f != fe;
       f.increment(ec))
    distcp = f->path().extension() == ".distcp";
  return distcp;
}

Checkpoint Discover(const fs::path& path, std::optional<int64_t> iteration) {
  Checkpoint c;
  megatron::IterationFolder f = megatron::LocateIteration(path, iteration);
  if (!f.named) {
    throw FormatError(path.string(), ": neither a Megatron save folder (no ",
                      megatron::kTrackerFile, ") nor an iter_N folder");
  }
  c.dir = std::move(f.dir);
  c.iter_dir = std::move(f.iter_dir);
  c.iteration = f.iteration;
  std::error_code ec;
  if (fs::exists(c.iter_dir / "metadata.json", ec)) {
    throw FormatError(c.iter_dir.string(),
                      ": a torch_dist checkpoint (metadata.json), not "
                      "Megatron-FSDP's fsdp_dtensor (read it with --from "
                      "megatron-torch-dist)");
  }
  c.dcp = dcp::Discover(c.iter_dir, "");
  c.dcp.iteration = c.iteration;
  c.topology.dp = c.dcp.world;
  const dcp::ItemKey args{"args", std::nullopt};
  if (auto it = c.dcp.items.find(args);
      it != c.dcp.items.end() && !it->second.empty()) {
    dcp::FileCache files;
    c.args = dcp::OpenItem(it->second.front(), args, files);
    const megatron::ArgsView view(c.args->root(),
                                  StrCat(c.iter_dir.string(), " > args"));
    if (auto format = view.Str("ckpt_format");
        format && *format != "fsdp_dtensor") {
      throw FormatError(view.where(), ": ckpt_format '", *format,
                        "' (Megatron's torch_dcp keys its optimizer state by "
                        "param index: not read; only fsdp_dtensor is)");
    }
    c.run = megatron::ReadRunConfig(view);
    if (c.run->topology.pp > 1) {
      throw FormatError(view.where(), ": pipeline_model_parallel_size ",
                        c.run->topology.pp,
                        " (Megatron-FSDP's stages each number their layers "
                        "from 0 in the model keys: not read)");
    }
    c.topology = c.run->topology;
  }
  return c;
}

universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const formats::SourceOptions& options) {
  Planner p(checkpoint, options);
  return p.Run();
}

}  // namespace ucp::megatron_fsdp
