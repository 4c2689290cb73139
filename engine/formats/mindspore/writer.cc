// Writing a MindSpore checkpoint from universal content (mindspore.h): one
// .ckpt file of Checkpoint records (ckpt.h) in rank_0/, and meta.json last.

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/strided.h"
#include "engine/formats/common/safetensors.h"
#include "engine/formats/common/train_state.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/formats/placed_target.h"
#include "engine/json/json.h"
#include "layouts/layout.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

// np.array_split's rule for save_checkpoint's slices: a tensor of more than
// 512 MiB is cut along dim 0 into ceil(KiB / (512 * 1024)) parts, the first
// rows % n of them one row longer.
constexpr uint64_t kSliceKiB = 512 * 1024;

void Varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void Field(std::string& out, int field, std::string_view bytes) {
  Varint(out, static_cast<uint64_t>(field) << 3 | 2);
  Varint(out, bytes.size());
  out.append(bytes);
}

// The bytes of one record up to its content, whose `content` bytes follow.
std::string RecordHead(const std::string& tag, const Shape& dims,
                       const std::string& type, uint64_t content) {
  std::string tensor;
  for (int64_t d : dims) {
    Varint(tensor, 1 << 3 | 0);
    Varint(tensor, static_cast<uint64_t>(d));
  }
  Field(tensor, 2, type);
  Varint(tensor, 3 << 3 | 2);
  Varint(tensor, content);
  const uint64_t tensor_size = tensor.size() + content;
  std::string value;
  Field(value, 1, tag);
  Varint(value, 2 << 3 | 2);
  Varint(value, tensor_size);
  const uint64_t value_size = value.size() + tensor_size;
  std::string out;
  Varint(out, 1 << 3 | 2);
  Varint(out, value_size);
  return out + value + tensor;
}

class MindSporePlan : public formats::TargetPlan {
 public:
  MindSporePlan(const universal::UniversalInput& input,
                const formats::TargetOptions& options)
      : input_(input) {
    meta_ = ReadMindSporeExtras(input.model(), input.path())
                .value_or(MindSporeExtras{});
    if (meta_.file) {
      file_ = *meta_.file;
    } else {
      file_ = StrCat("ucp_rank_0-1_", input.model().iteration, ".ckpt");
    }
    // The container: --file-format, else the source file's, else .ckpt.
    const auto ff = options.values.String(kFileFormatOption);
    if (ff && *ff != "ckpt" && *ff != "safetensors") {
      throw UsageError("--file-format ", *ff,
                       ": MindSpore rank files are ckpt or safetensors");
    }
    safetensors_ = ff ? *ff == "safetensors" : IsSafetensorsName(file_);
    file_ = InContainer(file_);
    folder_ =
        meta_.rank_folder.value_or(true) ? fs::path("rank_0") : fs::path();
    specs_ = Specs();  // the same records (sliced) in every rank's file
    const layouts::Topology& t = options.topology;
    const bool axes = t.tp * t.pp * t.dp > 1;
    if (auto s = options.values.String(kStrategyOption)) {
      if (axes) {
        throw UsageError("--strategy ", *s,
                         " lays out the ranks itself: give it or --tp/--pp/"
                         "--dp, not both");
      }
      strategy_ = ReadStrategy(*s);
      strategy_bytes_ = ReadFiles(*s);
    } else if (axes) {
      strategy_ = DeriveStrategy(t);
      derived_ = StrCat("--tp ", t.tp, " --pp ", t.pp, " --dp ", t.dp);
      for (int64_t stage = 0; stage < t.pp; ++stage) {
        strategy_bytes_.emplace_back(
            t.pp == 1
                ? fs::path("strategy.ckpt")
                : fs::path("strategy") / StrCat("ckpt_strategy_rank_",
                                                stage * t.tp * t.dp, ".ckpt"),
            StrategyFileBytes(*strategy_, stage));
      }
    }
    if (strategy_) {
      world_ = strategy_->world();
      folder_ = "rank_0";
      // The source's rank file names when it had as many ranks; else
      // rank 0's name with its rank_0 renamed, else MindFormers' pattern.
      const std::optional<std::vector<std::string>>& names = meta_.files;
      for (int64_t r = 0; r < world_; ++r) {
        std::string n;
        if (names && static_cast<int64_t>(names->size()) == world_) {
          n = (*names)[static_cast<size_t>(r)];
        } else if (const size_t at = file_.find("rank_0");
                   at != std::string::npos) {
          n = file_;
          n.replace(at, 6, StrCat("rank_", r));
        } else {
          n = StrCat("ucp_rank_", r, "-1_", input.model().iteration, ".ckpt");
        }
        names_.push_back(InContainer(n));
      }
      CheckNames();
    } else {
      names_.push_back(file_);
    }
    v2_ = options.values.Flag(kCheckpoint2Option);
    if (v2_ && ff) {
      throw UsageError(
          "--checkpoint2 writes safetensors files of its own "
          "names: --file-format is for rank files");
    }
    if (v2_ || safetensors_) {
      const char* what = v2_ ? "--checkpoint2" : "--file-format safetensors";
      for (const Spec& s : specs_) {
        if (s.raw != nullptr) {
          throw UsageError(what, ": ", input.path().string(),
                           " holds a map tensor (", s.tag,
                           "), which a safetensors file cannot");
        }
        if (s.atom == nullptr && !DTypeOfTensorType(s.type)) {
          throw UsageError(what, ": record ", s.tag, " of type ", s.type,
                           " has no safetensors dtype");
        }
      }
    }
    if (v2_) iter_folder_ = IterationFolderName(input.model().iteration);
  }
  size_t units() const override { return static_cast<size_t>(world_) + 1; }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override {
    std::vector<std::unique_ptr<formats::PlannedFile>> out;
    if (v2_) return PlanCheckpoint2(i);
    if (i < static_cast<size_t>(world_)) {
      out.push_back(File(static_cast<int64_t>(i)));
      return out;
    }
    // Last: the strategy, then each rank's meta.json.
    for (const auto& [name, bytes] : strategy_bytes_)
      out.push_back(formats::TextFile(name, bytes));
    for (int64_t r = 0; r < world_; ++r) {
      json::Value m = json::Value::Object();
      m["last_epoch"] = 1;
      m["last_step"] = input_.model().iteration;
      m["last_ckpt_file"] = names_[static_cast<size_t>(r)];
      out.push_back(formats::TextFile(Folder(r) / "meta.json", m.Dump()));
    }
    return out;
  }
  fs::path checkpoint_dir() const override {
    return v2_ ? fs::path(iter_folder_) : strategy_ ? fs::path() : folder_;
  }
  formats::TargetSummary Summary() const override {
    formats::TargetSummary s;
    s.notes = notes_;
    if (v2_) {
      s.resume_hint = StrCat(
          "MindFormers: load_checkpoint(\"<output>\", network, optimizer) "
          "(Checkpoint 2.0: the tracker names ",
          iter_folder_, "; ", world_, " rank(s)",
          world_ > 1 ? ", metadata.json places their slices" : "",
          "); MindFormers reshards it to the job's layout");
      s.details["world"] = world_;
      s.details["container"] = "Checkpoint 2.0";
      return s;
    }
    if (strategy_) {
      std::string name = names_[0];
      if (const size_t at = name.find("rank_0"); at != std::string::npos)
        name.replace(at, 6, "rank_R");
      s.resume_hint = StrCat(
          "MindSpore: rank R loads mindspore.load_checkpoint(\"<output>/"
          "rank_R/",
          name, "\"", safetensors_ ? ", format=\"safetensors\"" : "",
          ") in a job of ", world_, " devices laid out by ",
          !derived_.empty() ? StrCat("the strategy ucp wrote for ", derived_)
                            : strategy_->path.string(),
          !derived_.empty() ? " (in <output>)"
                            : " (the strategy is copied into <output>)",
          "; ",
          strategy_bytes_.size() == 1
              ? StrCat("transform_checkpoints(\"<output>\", dst, prefix, "
                       "\"<output>/",
                       strategy_bytes_[0].first.string(), "\", None)")
              : std::string("merge_pipeline_strategys(\"<output>/strategy\", "
                            "\"merged.ckpt\"), then transform_checkpoints("
                            "\"<output>\", dst, prefix, \"merged.ckpt\", "
                            "None)"),
          " merges it");
      s.details["world"] = world_;
      return s;
    }
    s.resume_hint =
        StrCat("MindSpore: mindspore.load_checkpoint(\"<output>/",
               (folder_ / file_).string(), "\"",
               safetensors_ ? ", format=\"safetensors\"" : "",
               ") into params, then load_param_into_net(net, params) and "
               "load_param_into_net(optimizer, params)");
    return s;
  }
  std::string label() const override {
    if (v2_) return StrCat("writing ", iter_folder_);
    return strategy_ ? StrCat("writing ", world_, " rank files")
                     : "writing " + file_;
  }

 private:
  // A record of the file: a slot (param, state kind) or known bytes.
  struct Spec {
    const atoms::DatasetInfo* atom = nullptr;
    const atoms::DatasetInfo* raw = nullptr;  // a map tensor's records
    std::string param;
    std::string tag;
    std::string type;
    Shape dims;
    std::string bytes;  // verbatim records
  };

  // The strategy must lay out this checkpoint's params: none of them named
  // is a mismatch (another model's strategy, or names of another
  // framework), refused; some unnamed are written whole on every rank, and
  // names the checkpoint lacks are ignored: both said in the summary.
  void CheckNames() {
    std::vector<std::string> whole;
    size_t named = 0;
    for (const atoms::StoredParam& p : input_.params()) {
      if (strategy_->layouts.count(p.info.fqn))
        ++named;
      else
        whole.push_back(p.info.fqn);
    }
    auto is_moment = [](std::string_view n) {
      for (const auto& [prefix, kind] : kMomentPrefixes)
        if (n.starts_with(prefix)) return true;
      return false;
    };
    std::string first = strategy_->layouts.begin()->first;
    for (const auto& [name, stages] : strategy_->layouts) {
      if (!is_moment(name)) {
        first = name;
        break;
      }
    }
    if (named == 0 && !input_.params().empty()) {
      throw UsageError("strategy file ", strategy_->path.string(),
                       " names none of the ", input_.params().size(),
                       " params of ", input_.path().string(),
                       " (first: ", input_.params()[0].info.fqn,
                       "; the strategy's first: ", first,
                       "): a strategy of another model, or of other names");
    }
    auto some = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 3; ++i)
        s += (i ? ", " : "") + v[i];
      return v.size() > 3 ? s + ", ..." : s;
    };
    if (!whole.empty()) {
      notes_.push_back(StrCat(whole.size(),
                              " params the strategy does not name are written "
                              "whole on every rank: ",
                              some(whole)));
    }
    std::vector<std::string> unknown;
    for (const auto& [name, stages] : strategy_->layouts) {
      if (!is_moment(name) && input_.FindParam(name) == nullptr)
        unknown.push_back(name);
    }
    if (!unknown.empty()) {
      notes_.push_back(StrCat(unknown.size(),
                              " names of the strategy are not params of the "
                              "checkpoint (ignored): ",
                              some(unknown)));
    }
  }

  // The strategy of --tp/--pp/--dp (DeriveStrategy), placed by the
  // universal file's layout and model variables when it has one, else by
  // the built-in layout its names match (formats::PlaceTarget).
  Strategy DeriveStrategy(const layouts::Topology& t) const {
    std::vector<DerivedTensor> tensors;
    std::vector<std::string> names;
    for (const atoms::StoredParam& p : input_.params()) {
      tensors.push_back({p.info.fqn, p.info.fqn, p.info.shape});
      names.push_back(p.info.fqn);
    }
    for (const Spec& spec : specs_) {
      if (spec.atom != nullptr && spec.tag != spec.param)
        tensors.push_back({spec.tag, spec.param, spec.dims});
    }
    if (t.tp == 1 && t.pp == 1)
      return mindspore::DeriveStrategy(tensors, t, nullptr);
    const formats::PlacedTarget placed = formats::PlaceTarget(
        input_,
        DerivedPlaceRequest(t, !input_.model().layout_yaml.empty(), names));
    return mindspore::DeriveStrategy(tensors, t, &placed);
  }

  // A rank file name with the container's extension.
  std::string InContainer(const std::string& name) const {
    return fs::path(name)
        .replace_extension(safetensors_ ? ".safetensors" : ".ckpt")
        .string();
  }

  fs::path Folder(int64_t r) const {
    return strategy_ ? fs::path(StrCat("rank_", r)) : folder_;
  }

  // The strategy file(s) given, as output path -> bytes: a file as
  // strategy.<ext>, a folder's files under strategy/.
  static std::vector<std::pair<fs::path, std::string>> ReadFiles(
      const fs::path& p) {
    std::vector<std::pair<fs::path, std::string>> out;
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      for (fs::directory_iterator it(p, ec), end; !ec && it != end;
           it.increment(ec)) {
        const auto ext = it->path().extension();
        if (it->is_regular_file() && (ext == ".ckpt" || ext == ".json"))
          out.emplace_back(fs::path("strategy") / it->path().filename(),
                           ReadSmallFile(it->path(), 256ull << 20));
      }
      std::sort(out.begin(), out.end());
    } else {
      out.emplace_back(
          fs::path("strategy")
              .replace_extension(p.extension() == ".json" ? ".json" : ".ckpt"),
          ReadSmallFile(p, 256ull << 20));
    }
    return out;
  }

  std::vector<Spec> Specs() {
    std::vector<Spec> specs;
    const std::string m1 = meta_.exp_avg_prefix.value_or("moment1.");
    const std::string m2 = meta_.exp_avg_sq_prefix.value_or("moment2.");
    for (const atoms::StoredParam& p : input_.params()) {
      const std::string& n = p.info.fqn;
      const atoms::DatasetInfo* w = input_.FindAtom(n, "fp32");
      if (w == nullptr) w = input_.FindAtom(n, "param");
      if (w == nullptr) {
        throw FormatError("universal file ", input_.path().string(),
                          " > param ", n, ": no weights to write");
      }
      specs.push_back({w, nullptr, n, n, TensorTypeOf(w->dtype), w->shape, {}});
    }
    for (const atoms::StoredParam& p : input_.params()) {
      if (const auto* a = input_.FindAtom(p.info.fqn, "exp_avg"))
        specs.push_back({a,
                         nullptr,
                         p.info.fqn,
                         m1 + p.info.fqn,
                         TensorTypeOf(a->dtype),
                         a->shape,
                         {}});
    }
    for (const atoms::StoredParam& p : input_.params()) {
      if (const auto* a = input_.FindAtom(p.info.fqn, "exp_avg_sq"))
        specs.push_back({a,
                         nullptr,
                         p.info.fqn,
                         m2 + p.info.fqn,
                         TensorTypeOf(a->dtype),
                         a->shape,
                         {}});
    }
    bool has_step = false;
    if (meta_.records) {
      for (const OtherRecord& r : *meta_.records) {
        Spec s;
        s.tag = r.tag;
        s.type = r.type;
        s.dims = Shape(r.dims.begin(), r.dims.end());
        s.bytes = r.bytes;
        has_step = has_step || s.tag == "global_step";
        specs.push_back(std::move(s));
      }
    }
    // A MindSpore source keeps exactly its records; others get nn.Adam's.
    const bool from_mindspore = meta_.order.has_value();
    if (!has_step && !from_mindspore && !input_.params().empty()) {
      // nn.Adam's step counter: the optimizer's step (else the iteration).
      const auto step =
          static_cast<int32_t>(formats::OptimizerStep(input_.model()));
      specs.push_back({nullptr, nullptr, "", "global_step", "Int32", Shape{1},
                       std::string(reinterpret_cast<const char*>(&step), 4)});
    }
    if (!from_mindspore)
      for (Spec& s : AdamScalars(specs)) specs.push_back(std::move(s));
    // Map tensors, their raw records.
    const std::string_view map_key = kMapTensorKey;
    for (const atoms::DatasetInfo& d : input_.datasets()) {
      if (d.kind != atoms::DatasetKind::kOpaque || !d.fqn.starts_with(map_key))
        continue;
      if (strategy_) {
        throw FormatError("universal file ", input_.path().string(), " > ",
                          d.fqn,
                          ": a map tensor (MapParameter) cannot be laid out "
                          "by a strategy file: not supported");
      }
      Spec s;
      s.raw = &d;
      s.tag = d.fqn.substr(map_key.size());
      specs.push_back(std::move(s));
    }
    // The source's record order, when it was a MindSpore file; new ones last.
    std::map<std::string, size_t> rank;
    if (meta_.order)
      for (const std::string& t : *meta_.order) rank.emplace(t, rank.size());
    std::stable_sort(
        specs.begin(), specs.end(), [&](const Spec& a, const Spec& b) {
          const auto x = rank.find(a.tag), y = rank.find(b.tag);
          const size_t rx = x == rank.end() ? rank.size() : x->second;
          const size_t ry = y == rank.end() ? rank.size() : y->second;
          return rx < ry;
        });
    return specs;
  }

  // nn.Adam's learning_rate, beta1_power and beta2_power (float32 scalars)
  // when the source had Adam's moments but not these records (a torch
  // optimizer's state): the first group's lr, and beta^step multiplied up
  // in float32 step by step, as nn.Adam updates them (torch Adam's default
  // betas, said in a note, when the source records none; without an lr, no
  // learning_rate: nn.Adam keeps the one it is built with).
  std::vector<Spec> AdamScalars(const std::vector<Spec>& have) {
    std::vector<Spec> out;
    auto has = [&](const char* tag) {
      return std::any_of(have.begin(), have.end(),
                         [&](const Spec& s) { return s.tag == tag; });
    };
    bool moments = false;
    for (const atoms::StoredParam& p : input_.params())
      moments = moments || input_.FindAtom(p.info.fqn, "exp_avg") != nullptr;
    if (!moments) return out;
    const universal::OptimizerInfo& opt = input_.model().optimizer;
    universal::ParamGroup g = opt.groups && !opt.groups->empty()
                                  ? opt.groups->front()
                                  : universal::ParamGroup{};
    std::set<std::string> notes;
    static constexpr const char* kBetas[] = {"betas"};
    formats::CompleteAdamGroup(g, kBetas, notes);
    auto scalar = [](const char* tag, Shape shape, float x) {
      return Spec{nullptr,
                  nullptr,
                  "",
                  tag,
                  "Float32",
                  std::move(shape),
                  std::string(reinterpret_cast<const char*>(&x), 4)};
    };
    if (g.lr && !has("learning_rate")) {
      out.push_back(scalar("learning_rate", {}, static_cast<float>(*g.lr)));
    } else if (!has("learning_rate")) {
      notes.insert(
          "the source records no learning rate: no learning_rate record "
          "written (nn.Adam keeps the one it is built with)");
    }
    const std::array<double, 2>& betas = *g.betas;  // completed above
    if (!has("beta1_power") && !has("beta2_power")) {
      const int64_t step = formats::OptimizerStep(input_.model());
      const char* tags[] = {"beta1_power", "beta2_power"};
      for (size_t i = 0; i < 2; ++i) {
        out.push_back(
            scalar(tags[i], Shape{}, formats::BetaPower(betas[i], step)));
      }
    }
    notes_.insert(notes_.end(), notes.begin(), notes.end());
    return out;
  }

  // Rank r's region of a spec's atom; absent if its stage does not hold
  // it (a record the strategy does not name is whole on every rank, as
  // MindSpore treats it).
  std::optional<Box> Region(const Spec& s, int64_t r) const {
    const Shape shape = s.atom != nullptr ? s.atom->shape : s.dims;
    if (strategy_ && !strategy_->Holds(s.tag, r)) return std::nullopt;
    if (strategy_ && s.atom != nullptr && !shape.empty()) {
      if (const TensorLayout* l = strategy_->Find(s.tag, r)) {
        return RankBox(
            *l, shape, r,
            StrCat("strategy file ", strategy_->path.string(), " > ", s.tag));
      }
    }
    return Box::Whole(shape);
  }

  // Checkpoint 2.0 (checkpoint2.h): per rank unit, its model file (the
  // params) and its optimizer file (moments and the other records); last,
  // common.json, metadata.json for several ranks, then the tracker.
  std::string V2Name(bool model, int64_t r) const {
    std::string idx = std::to_string(r), n = std::to_string(world_);
    idx.insert(0, 7 - std::min<size_t>(7, idx.size()), '0');
    n.insert(0, 7 - std::min<size_t>(7, n.size()), '0');
    return StrCat(model ? "model-" : "opt-", idx, "-", n, ".safetensors");
  }
  static bool IsModel(const Spec& s) {
    return s.atom != nullptr && s.tag == s.param;
  }

  std::vector<std::unique_ptr<formats::PlannedFile>> PlanCheckpoint2(
      size_t i) const {
    std::vector<std::unique_ptr<formats::PlannedFile>> out;
    const fs::path dir(iter_folder_);
    if (i < static_cast<size_t>(world_)) {
      const auto r = static_cast<int64_t>(i);
      for (bool model : {true, false}) {
        std::vector<std::pair<const Spec*, Box>> held;
        for (const Spec& s : specs_) {
          if (IsModel(s) != model) continue;
          if (auto b = Region(s, r)) held.emplace_back(&s, *b);
        }
        if (held.empty() && !model) continue;
        out.push_back(SafetensorsFile(dir / V2Name(model, r), held));
      }
      return out;
    }
    json::Value common = json::Value::Object();
    const int64_t it = input_.model().iteration;
    const int64_t consumed = input_.model().consumed_samples;
    common["epoch_num"] = 1;
    common["step_num"] = it;
    common["global_step"] = it;
    common["loss_scale"] = 1.0;
    common["global_batch_size"] = consumed >= 0 && it > 0 && consumed % it == 0
                                      ? json::Value(consumed / it)
                                      : json::Value();
    common["consumed_samples"] =
        consumed >= 0 ? json::Value(consumed) : json::Value();
    common["ckpt_status"] = json::Value();
    out.push_back(formats::TextFile(dir / "common.json", common.Dump(4)));
    if (world_ > 1)
      out.push_back(
          formats::TextFile(dir / "metadata.json", Checkpoint2Metadata()));
    out.push_back(formats::TextFile("latest_checkpointed_iteration.txt",
                                    std::to_string(it)));
    return out;
  }

  // metadata.json (MindFormers' save_metadata): each record's global shape
  // and slices, and the file of every rank holding each slice.
  std::string Checkpoint2Metadata() const {
    std::vector<std::pair<std::string, json::Value>> sdm, storage;
    std::map<std::string, size_t> storage_at;
    for (const Spec& s : specs_) {
      const Shape shape = s.atom != nullptr ? s.atom->shape : s.dims;
      const DType dtype =
          s.atom != nullptr ? s.atom->dtype : *DTypeOfTensorType(s.type);
      json::Value chunks = json::Value::Array();
      std::set<std::vector<int64_t>> seen;
      Shape frag;
      for (int64_t r = 0; r < world_; ++r) {
        const std::optional<Box> b = Region(s, r);
        if (!b) continue;
        if (frag.empty()) {
          for (size_t d = 0; d < shape.size(); ++d)
            frag.push_back(b->size[d] > 0 ? shape[d] / b->size[d] : 1);
        }
        const std::vector<int64_t> off(b->offset.begin(), b->offset.end());
        if (seen.insert(off).second) {
          json::Value c = json::Value::Object();
          json::Value o = json::Value::Array(), l = json::Value::Array();
          for (int64_t x : b->offset) o.Append(x);
          for (int64_t x : b->size) l.Append(x);
          c["global_offset"] = std::move(o);
          c["local_shape"] = std::move(l);
          chunks.Append(std::move(c));
        }
        const std::string id = ShardId(s.tag, off);
        auto [at, fresh] = storage_at.try_emplace(id, storage.size());
        if (fresh) storage.emplace_back(id, json::Value::Array());
        json::Value f = json::Value::Object();
        f["file_name"] = V2Name(IsModel(s), r);
        f["storage_rank"] = r;
        json::Value group = json::Value::Array();
        for (int64_t g = 0; g < world_; ++g) group.Append(g);
        f["rank_group"] = std::move(group);
        storage[at->second].second.Append(std::move(f));
      }
      std::string ms_dtype = TensorTypeOf(dtype);
      for (char& ch : ms_dtype) ch = static_cast<char>(std::tolower(ch));
      json::Value props = json::Value::Object();
      props["dtype"] = ms_dtype;
      props["replica_id"] = 0;
      props["allow_shape_mismatch"] = false;
      props["allow_to_save"] = true;
      json::Value e = json::Value::Object();
      e["properties"] = std::move(props);
      json::Value gs = json::Value::Array(), af = json::Value::Array();
      for (int64_t x : shape) gs.Append(x);
      for (int64_t x : frag) af.Append(x);
      e["global_shape"] = std::move(gs);
      e["axis_fragmentations"] = std::move(af);
      e["layout"] = json::Value();
      e["chunk"] = std::move(chunks);
      sdm.emplace_back(s.tag, std::move(e));
    }
    std::vector<std::pair<std::string, json::Value>> top;
    top.emplace_back("state_dict_metadata",
                     json::Value::FromMembers(std::move(sdm)));
    top.emplace_back("storage_data",
                     json::Value::FromMembers(std::move(storage)));
    return json::Value::FromMembers(std::move(top)).Dump();
  }

  // A safetensors file of the records `held` (each with its region):
  // header (format "ms", as MindSpore writes it), then the data in order.
  std::unique_ptr<formats::PlannedFile> SafetensorsFile(
      const fs::path& path,
      const std::vector<std::pair<const Spec*, Box>>& held) const {
    std::vector<formats::SafetensorsTensor> tensors;
    for (const auto& [s, box] : held) {
      formats::SafetensorsTensor t;
      t.name = s->tag;
      t.dtype =
          s->atom != nullptr ? s->atom->dtype : *DTypeOfTensorType(s->type);
      t.shape = box.size;
      t.bytes = s->atom != nullptr
                    ? static_cast<uint64_t>(NumElements(box.size)) *
                          ElementSize(t.dtype)
                    : s->bytes.size();
      tensors.push_back(std::move(t));
    }
    json::Value meta = json::Value::Object();
    meta["format"] = "ms";
    auto f = std::make_unique<formats::RawFile>(path);
    f->AddBytes(formats::SafetensorsHeader(tensors, meta));
    for (const auto& [s, box] : held) {
      if (s->atom == nullptr) {
        f->AddBytes(s->bytes);
        continue;
      }
      reshape::TargetTensor t;
      t.name = s->tag;
      t.dtype = s->atom->dtype;
      t.shape = box.size;
      reshape::CopyOp op;
      op.src = input_.Tensor(*s->atom);
      op.src_box = box;
      op.dst_box = Box::Whole(box.size);
      t.ops.push_back(std::move(op));
      f->AddTensor(std::move(t));
    }
    return f;
  }

  // Rank r's file: its slice of every record its stage holds.
  std::unique_ptr<formats::PlannedFile> File(int64_t r) const {
    if (safetensors_) {  // every record in one safetensors file
      std::vector<std::pair<const Spec*, Box>> held;
      for (const Spec& s : specs_)
        if (auto b = Region(s, r)) held.emplace_back(&s, *b);
      return SafetensorsFile(Folder(r) / names_[static_cast<size_t>(r)], held);
    }
    auto f = std::make_unique<formats::RawFile>(Folder(r) /
                                                names_[static_cast<size_t>(r)]);
    for (const Spec& s : specs_) {
      if (s.raw != nullptr) {  // a map tensor's records, verbatim
        f->AddBytes(input_.ReadBlob(*s.raw));
        continue;
      }
      if (s.atom == nullptr) {
        f->AddBytes(RecordHead(s.tag, s.dims, s.type, s.bytes.size()) +
                    s.bytes);
        continue;
      }
      const atoms::DatasetInfo& d = *s.atom;
      const std::optional<Box> held = Region(s, r);  // the rank's region
      if (!held) continue;
      const Box& region = *held;
      const Shape& local = region.size;
      const uint64_t bytes =
          static_cast<uint64_t>(NumElements(local)) * ElementSize(d.dtype);
      const int64_t rows = local.empty() ? 1 : local[0];
      const uint64_t kib = bytes / 1024;
      const int64_t parts =
          local.empty() || kib <= kSliceKiB
              ? 1
              : std::min<int64_t>(rows, static_cast<int64_t>(
                                            (kib + kSliceKiB - 1) / kSliceKiB));
      int64_t at = 0;
      for (int64_t k = 0; k < parts; ++k) {
        const int64_t n = rows / parts + (k < rows % parts ? 1 : 0);
        Shape shape = local;
        Box box = region;
        if (!shape.empty()) {
          shape[0] = n;
          box.offset[0] = region.offset[0] + at;
          box.size[0] = n;
        }
        reshape::TargetTensor t;
        t.name = StrCat(s.tag, parts > 1 ? StrCat(" part ", k) : "");
        t.dtype = d.dtype;
        t.shape = shape;
        reshape::CopyOp op;
        op.src = input_.Tensor(d);
        op.src_box = box;
        op.dst_box = Box::Whole(shape);
        t.ops.push_back(std::move(op));
        const uint64_t content =
            static_cast<uint64_t>(NumElements(shape)) * ElementSize(d.dtype);
        f->AddBytes(RecordHead(s.tag, local, s.type, content));
        f->AddTensor(std::move(t));
        at += n;
      }
    }
    return f;
  }

  const universal::UniversalInput& input_;
  MindSporeExtras meta_;
  std::string file_;
  fs::path folder_;
  std::optional<Strategy> strategy_;
  std::string derived_;  // the --tp/--pp/--dp ucp derived strategy_ for
  int64_t world_ = 1;
  std::vector<std::string> names_;  // per rank
  std::vector<Spec> specs_;
  std::vector<std::pair<fs::path, std::string>> strategy_bytes_;
  std::vector<std::string> notes_;
  bool v2_ = false;           // --checkpoint2
  bool safetensors_ = false;  // rank files as safetensors (--file-format)
  std::string iter_folder_;   // iteration_N
};

}  // namespace

std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options) {
  return std::make_unique<MindSporePlan>(input, options);
}

}  // namespace ucp::mindspore
