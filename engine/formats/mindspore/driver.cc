// The "mindspore" format driver: MindSpore .ckpt files, read (mindspore.h).

#include "engine/formats/driver.h"

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/formats/placed_target.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

// Whether `have` is the strategy DeriveStrategy gives for `t` (its
// tensors' shapes unknown: only the layouts are compared).
bool IsDerived(const Strategy& have, const layouts::Topology& t) {
  std::vector<DerivedTensor> tensors;
  for (const auto& [name, stages] : have.layouts) {
    const auto moment = MomentOf(name, [&](std::string_view param) {
      return have.layouts.count(std::string(param)) > 0;
    });
    tensors.push_back({name, moment ? moment->first : name,
                       Shape(stages.begin()->second.dims.size(), 0)});
  }
  try {
    std::optional<formats::PlacedTarget> placed;
    if (t.tp > 1 || t.pp > 1) {
      std::vector<std::string> names;
      std::vector<layouts::ParamShape> shapes;
      for (const DerivedTensor& x : tensors) {
        if (x.name != x.param) continue;
        names.push_back(x.name);
        shapes.push_back({x.name, x.shape});
      }
      formats::PlaceRequest request = DerivedPlaceRequest(t, false, names);
      placed =
          formats::PlaceParams(*std::move(request.layout), {}, shapes, request);
    }
    const Strategy want =
        DeriveStrategy(tensors, t, placed ? &*placed : nullptr);
    return want.layouts == have.layouts && want.world() == have.world();
  } catch (const Error&) {
    return false;  // not a layout ucp derives: rewritten
  }
}

class MindSporeSource : public formats::Source {
 public:
  explicit MindSporeSource(Checkpoint c) : c_(std::move(c)) {
    info_.format = "mindspore";
    info_.dir = c_.dir;
    // The folder holding the file.
    info_.path = c_.path.has_parent_path() ? c_.path.parent_path() : ".";
    info_.iteration = c_.iteration;
    info_.name = c_.path.filename().string();
    info_.files = {c_.path};
    if (c_.v2) {
      info_.path = c_.v2->iter_dir;
      info_.name = c_.v2->iter_dir.filename().string();
      info_.files.clear();
      for (const CkptIndex& i : c_.v2->files) info_.files.push_back(i.path);
      info_.settings["ranks"] = c_.v2->world;
      info_.settings["container"] = "Checkpoint 2.0";
    }
    if (c_.strategy) {
      info_.path = c_.dir;
      info_.files.clear();
      for (const CkptIndex& i : c_.ranks) info_.files.push_back(i.path);
      info_.topology.pp = c_.strategy->stages;
      info_.settings["ranks"] = static_cast<int64_t>(c_.ranks.size());
      info_.settings["strategy"] = c_.strategy->path.string();
    }
    for (const CkptEntry& e : c_.index.entries) {
      if (auto d = DTypeOfTensorType(e.tensor_type)) {
        info_.dtype = std::string(DTypeName(*d));
        break;
      }
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override { return PlanSource(c_); }
  // load_checkpoint takes an unsharded file into a network of any layout;
  // a sharded save fits the job its strategy lays out; a Checkpoint 2.0
  // folder, a Checkpoint 2.0 job of any layout.
  bool Fits(const formats::TargetOptions& options) const override {
    const auto s = options.values.String(kStrategyOption);
    // Rank files of the other container are written.
    if (const auto ff = options.values.String(kFileFormatOption);
        ff && !c_.v2 &&
        *ff != (IsSafetensorsName(c_.path) ? "safetensors" : "ckpt"))
      return false;
    // --tp/--pp/--dp: a sharded save laid out as ucp derives that layout.
    const layouts::Topology& t = options.topology;
    if (t.tp * t.pp * t.dp > 1)
      return !s && !c_.v2 && c_.strategy && IsDerived(*c_.strategy, t);
    // MindFormers' load_checkpoint reshards a Checkpoint 2.0 folder to the
    // job's layout: it fits a Checkpoint 2.0 target of any.
    if (c_.v2) return options.values.Flag(kCheckpoint2Option) || !s;
    if (!c_.strategy) return !s.has_value();
    if (!s) return false;
    const Strategy want = ReadStrategy(*s);
    return want.layouts == c_.strategy->layouts &&
           want.world() == c_.strategy->world();
  }
  json::Value Inventory() const override { return mindspore::Inventory(c_); }
  // A .ckpt file holds no torch.save archive.
  std::vector<formats::ArchiveSpan> Archives(const fs::path&) const override {
    return {};
  }

 private:
  Checkpoint c_;
  formats::CheckpointInfo info_;
};

class MindSporeDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "mindspore"; }
  std::string_view Summary() const override {
    return "MindSpore checkpoints (mindspore.save_checkpoint, MindFormers): "
           "a .ckpt file, a folder of them (rank_0/, meta.json), a sharded "
           "save (rank_R/ + strategy file) or a Checkpoint 2.0 folder "
           "(iteration_N/ safetensors + metadata.json), Adam moments as "
           "optimizer state; written as one .ckpt in rank_0/, or per rank "
           "for --strategy (or --tp/--pp/--dp: a strategy ucp derives from "
           "the model's layout, e.g. mindformers-llama, written beside), or "
           "as Checkpoint 2.0 with --checkpoint2";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (fs::is_regular_file(path, ec))
      return LooksLikeCheckpointFile(path) ? formats::Confidence::kYes
                                           : formats::Confidence::kNo;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    // (A sharded save whose ranks share no step is still one: Open says
    // which rank lacks its file.)
    // (ListCheckpoints lists a Checkpoint 2.0 save folder's iterations.)
    return ListCheckpoints(path).empty() && !LooksSharded(path) &&
                   !IsCheckpoint2Folder(path)
               ? formats::Confidence::kNo
               : formats::Confidence::kYes;
  }
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    formats::OptionSpec o;
    o.name = kCheckpointOption;
    o.type = formats::OptionSpec::Type::kString;
    o.help =
        "MindSpore: the .ckpt file of a folder to read (default: the one "
        "meta.json names, else the newest by <epoch>_<step>; of a sharded "
        "save, rank 0's: the other ranks' files of its step are read), or "
        "the iteration_N folder of a Checkpoint 2.0 save (default: the "
        "tracker's)";
    formats::OptionSpec st;
    st.name = kStrategyOption;
    st.type = formats::OptionSpec::Type::kString;
    st.help =
        "MindSpore: the strategy file of a sharded save (rank_0/, rank_1/, "
        "...): the merged file, or the folder of per-rank ones (default: "
        "strategy.ckpt, strategy/ or ../strategy/ beside it)";
    return {o, st};
  }
  std::vector<formats::OptionSpec> TargetOptionSpecs() const override {
    formats::OptionSpec st;
    st.name = kStrategyOption;
    st.type = formats::OptionSpec::Type::kString;
    st.layout = true;
    st.abbrev.push_back('s');  // (GCC 12 -Wrestrict false positive on = "s")
    st.help =
        "MindSpore: write one .ckpt per rank (rank_R/) laid out by this "
        "strategy file (or folder of per-rank ones), copied beside them "
        "(default: one unsharded file; --tp/--pp/--dp instead: ucp derives "
        "the strategy from the model's layout and writes it there too)";
    formats::OptionSpec v2;
    v2.name = kCheckpoint2Option;
    v2.type = formats::OptionSpec::Type::kFlag;
    v2.help =
        "MindSpore: write a MindFormers Checkpoint 2.0 save folder "
        "(iteration_N/ with model-R-W / opt-R-W.safetensors per rank, "
        "common.json, metadata.json for several ranks; the tracker last) "
        "instead of .ckpt files";
    formats::OptionSpec ff;
    ff.name = kFileFormatOption;
    ff.type = formats::OptionSpec::Type::kString;
    ff.layout = true;
    ff.abbrev.append(2, 'f');  // (GCC 12 false positive on = "ff")
    ff.help =
        "MindSpore: the rank files' format, ckpt (.ckpt records) or "
        "safetensors (save_checkpoint(format=\"safetensors\"), which "
        "load_checkpoint(format=\"safetensors\") reads) (default: the "
        "source's, else ckpt)";
    return {st, v2, ff};
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return mindspore::ListCheckpoints(dir);
  }
  bool CanWrite() const override { return true; }
  // --tp/--pp/--dp: a strategy ucp derives from the model's layout.
  formats::TopologyAxes TargetAxes() const override {
    formats::TopologyAxes a;
    a.tp = a.pp = a.dp = true;
    a.dp_required = false;  // none: one unsharded file, or --strategy's
    return a;
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    return mindspore::PlanTarget(input, options);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    return std::make_unique<MindSporeSource>(
        Discover(path, options.values.String(kCheckpointOption).value_or(""),
                 options.values.String(kStrategyOption).value_or("")));
  }
};

UCP_REGISTER_DRIVER(MindSporeDriver);

}  // namespace
}  // namespace ucp::mindspore
