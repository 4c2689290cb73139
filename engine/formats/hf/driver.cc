// The "hf" format driver: Hugging Face transformers model folders, read
// (hf.h).

#include "engine/formats/driver.h"

#include "engine/core/error.h"
#include "engine/formats/hf/hf.h"

namespace ucp::hf {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDequantizeOption = "dequantize";

class HfSource : public formats::Source {
 public:
  HfSource(Folder f, std::optional<DType> dequantize)
      : f_(std::move(f)), dequantize_(dequantize) {
    info_.format = "hf";
    info_.dir = f_.dir;
    info_.path = f_.dir;
    info_.settings["architecture"] = f_.config.architecture;
    info_.settings["layers"] = f_.config.layers;
    info_.settings["files"] = static_cast<int64_t>(f_.files.size());
    for (const WeightFile& w : f_.files) {
      info_.files.push_back(w.path);
      if (info_.dtype.empty() && !w.tensors.empty())
        info_.dtype = std::string(DTypeName(w.tensors.front().dtype));
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    return PlanSource(f_, dequantize_);
  }
  // from_pretrained loads a model folder whatever the parallel layout.
  bool Fits(const formats::TargetOptions&) const override { return true; }
  json::Value Inventory() const override { return hf::Inventory(f_); }
  // The tensors' names under transformers' own plan (NamesLayoutYaml), once
  // they are the architecture's (a missing tensor, one with no place or a
  // shape config.json disagrees with: what Plan throws).
  NameListing ListNames() const override {
    // (the universal names: fused experts per expert, FP8 scales left out,
    // whatever dtype FP8 weights would be dequantized to)
    const universal::SourcePlan plan =
        PlanSource(f_, dequantize_.value_or(DType::kBFloat16));
    NameListing l;
    for (const atoms::ParamInfo& p : plan.params) l.names.push_back(p.fqn);
    l.variables.Set("num_layers", f_.config.layers);
    l.variables.Set("vocab_size", f_.config.vocab);
    l.variables.Set("tied", f_.config.tied ? 1 : 0);
    l.layout_name = StrCat("transformers-", f_.config.model_type);
    l.layout_yaml = NamesLayoutYaml(f_.config);
    return l;
  }

 private:
  Folder f_;
  std::optional<DType> dequantize_;
  formats::CheckpointInfo info_;
};

class HfDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "hf"; }
  std::string_view Summary() const override {
    return "Hugging Face transformers model folder (config.json + "
           "model.safetensors or shards with model.safetensors.index.json, "
           "or pytorch_model.bin and its shards; "
           "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
           "Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
           "Qwen3MoeForCausalLM, Glm4MoeForCausalLM), read: "
           "weights only, under transformers' names (--names mcore-llama "
           "for a Megatron target)";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    return LooksLikeFolder(path) ? formats::Confidence::kYes
                                 : formats::Confidence::kNo;
  }
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    formats::OptionSpec init;
    init.name = "init-optimizer";
    init.type = formats::OptionSpec::Type::kFlag;
    init.help =
        "hf: give the model fresh optimizer state (Adam's exp_avg / exp_avg_sq "
        "zeros, a float32 master copy, step 0) for a target that keeps one";
    formats::OptionSpec deq;
    deq.name = kDequantizeOption;
    deq.type = formats::OptionSpec::Type::kString;
    deq.implicit_text = "bf16";
    deq.help =
        "hf: dequantize FP8 block-scaled weights (quantization_config fp8) "
        "while reading, to bf16 (--dequantize, --dequantize bf16) or fp32 "
        "(--dequantize fp32), their scales dropped";
    return {init, deq};
  }
  // A model folder is one checkpoint (no iterations).
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    if (!LooksLikeFolder(dir)) return {};
    formats::SavedCheckpoint c;
    c.name = dir.filename().string();
    return {c};
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
      throw FormatError(path.string(),
                        ": not a folder (a transformers model folder holds "
                        "config.json and model.safetensors)");
    }
    std::optional<DType> dequantize;
    if (const std::optional<std::string> d =
            options.values.String(kDequantizeOption)) {
      if (*d == "bf16") {
        dequantize = DType::kBFloat16;
      } else if (*d == "fp32") {
        dequantize = DType::kFloat32;
      } else {
        throw UsageError("--dequantize ", *d, ": expected bf16 or fp32");
      }
    }
    Folder folder = OpenFolder(path);
    folder.init_optimizer = options.values.Flag("init-optimizer");
    return std::make_unique<HfSource>(std::move(folder), dequantize);
  }
};

UCP_REGISTER_DRIVER(HfDriver);

}  // namespace
}  // namespace ucp::hf
