// ucp export: the consolidated model (Hugging Face safetensors or
// pytorch_model.bin, sharded with an index) from a universal file or any
// readable checkpoint: the successor of DeepSpeed's zero_to_fp32.

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/formats/exporter.h"
#include "engine/formats/name_map.h"
#include "engine/formats/target_layout.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/mapped_input.h"
#include "engine/universal/output_dir.h"
#include "layouts/layout.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kExportHelp =
    "usage: ucp export SRC -o DIR [--format safetensors|torch]\n"
    "                  [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]\n"
    "                  [--exclude-frozen] [--hf [--hf-experts "
    "per-expert|fused]]\n"
    "                  [--tag T | --iteration N] "
    "[options]\n"
    "\n"
    "Writes the consolidated model of SRC (a universal file, or a checkpoint "
    "of any\n"
    "readable format: DeepSpeed of any ZeRO stage, Megatron-LM with TP/PP "
    "merged)\n"
    "in the Hugging Face layout: model.safetensors, or "
    "model-0000i-of-0000N.safetensors\n"
    "+ model.safetensors.index.json (--format torch: pytorch_model.bin, or "
    "shards +\n"
    "pytorch_model.bin.index.json). Every parameter and buffer under its "
    "full\n"
    "(canonical) name, TP shards merged, vocabulary padding removed. The "
    "default\n"
    "dtype fp32 gives the fp32 master weights; bf16/fp16 round them to "
    "nearest even\n"
    "(or take the training-dtype weights when they already have that "
    "dtype).\n"
    "Streaming: memory stays within --memory whatever the model size.\n"
    "Under torchrun / srun / mpirun the processes write the files between "
    "them\n"
    "(see ucp convert --help; rank 0 writes the index and config.json).\n"
    "\n"
    "examples:\n"
    "  ucp export /ckpt/ds -o hf/                      # like zero_to_fp32\n"
    "  ucp export gpt.ucp.h5 -o hf/ --dtype bf16 --max-shard-size 2GB\n"
    "  ucp export /ckpt/ds --tag global_step100 -o out/ --format torch\n"
    "  ucp export /ckpt/gpt -o llama-hf/ --hf --dtype bf16   # "
    "from_pretrained\n"
    "\n"
    "options";

DType ParseDType(const std::string& s) {
  if (s == "fp32" || s == "float32") return DType::kFloat32;
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  if (s == "fp16" || s == "float16" || s == "half") return DType::kFloat16;
  throw UsageError("--dtype ", s, ": use fp32, bf16 or fp16");
}

// A lower bound of the export's size: every trainable param at the target
// dtype.
uint64_t ExportBytes(const universal::UniversalInput& input,
                     const formats::ExportOptions& o) {
  uint64_t total = 0;
  for (const atoms::StoredParam& p : input.params()) {
    if (p.info.kind == atoms::ParamKind::kParam && !p.info.frozen)
      total += static_cast<uint64_t>(NumElements(p.info.shape)) *
               ElementSize(o.dtype);
  }
  return total;
}

// --hf maps a Megatron-core GPTModel, placed by its layout. Content without
// one is given the views a Megatron target gets (target_layout.h): a LLaMA
// under another framework's names (MindFormers', transformers' own) read
// under Megatron-core's first (name map mcore-llama), then the layout its
// names match (a Megatron model read from DCP, say). Content with a layout
// but without the variables --model-var gives (a torch_dist checkpoint
// written from another framework's: no args) is viewed with them. None when
// it holds a layout and nothing is given, or its names match none (--hf then
// says what it is not).
std::vector<std::unique_ptr<universal::UniversalInput>> HfViews(
    const universal::UniversalInput& input, const formats::ExportOptions& o,
    const layouts::Variables& given) {
  std::vector<std::unique_ptr<universal::UniversalInput>> views;
  if (!o.hf) return views;
  if (!input.model().layout_yaml.empty()) {
    if (given.values().empty()) return views;
    universal::Model model = input.model();
    for (const auto& [k, v] : given.values()) model.variables.Set(k, v);
    std::vector<universal::MappedParam> params;
    for (const atoms::StoredParam& p : input.params())
      params.push_back(universal::WholeParam(p, p.info.fqn));
    views.push_back(
        universal::MappedInput(input, std::move(params), std::move(model)));
    return views;
  }
  if (auto mapped = formats::MapNamesIfKnown(input, "mcore-llama", given))
    views.push_back(std::move(mapped));
  const universal::UniversalInput& named = views.empty() ? input : *views[0];
  std::vector<std::string> names;
  for (const atoms::StoredParam& p : named.params())
    names.push_back(p.info.fqn);
  if (!layouts::Layout::DetectBuiltins(names).empty())
    views.push_back(formats::WithTargetLayout(named, "", given));
  return views;
}

}  // namespace

int RunExport(const std::vector<std::string>& args) {
  po::options_description desc(kExportHelp);
  std::string output, format = "safetensors", dtype = "fp32", shard = "5GB";
  std::string hf_experts = "per-expert";
  bool exclude_frozen = false, hf = false;
  SourceArgs src;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the folder to create")(
      "format", po::value<std::string>(&format)->default_value("safetensors"),
      "safetensors or torch (pytorch_model.bin)")(
      "dtype", po::value<std::string>(&dtype)->default_value("fp32"),
      "fp32 (the master weights), bf16 or fp16")(
      "max-shard-size", po::value<std::string>(&shard)->default_value("5GB"),
      "largest shard, Hugging Face units (5GB = 5e9 bytes, 1GiB)")(
      "exclude-frozen", po::bool_switch(&exclude_frozen),
      "leave out frozen parameters")(
      "hf", po::bool_switch(&hf),
      "a transformers model folder: LlamaForCausalLM's names (q/k/v and "
      "gate/up split from Megatron's fused weights) and config.json, for "
      "from_pretrained; mixtures of experts as MixtralForCausalLM, "
      "Qwen2/Qwen3MoeForCausalLM or Glm4MoeForCausalLM (DeepSeek-V3's router; "
      "without args: --model-var moe_router_topk=K) "
      "(Megatron-core LLaMA-style GPT models, also read "
      "from DCP; MindFormers' LLaMA too; where the source does not record "
      "the heads: --model-var num_attention_heads=N --model-var "
      "num_query_groups=N)")(
      "hf-experts",
      po::value<std::string>(&hf_experts)->default_value("per-expert"),
      "with --hf, a mixture of experts' routed experts: per-expert "
      "(mlp.experts.J.gate_proj, Mixtral's block_sparse_moe.experts.J.w1) or "
      "fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])");
  std::vector<std::string> model_var_args;
  AddModelVarOption(desc, model_var_args, "for --hf");
  src.Add(desc);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"source"}, vm)) return 0;
  src.Read(vm);
  if (!vm.count("source")) throw UsageError("export needs a source");
  const layouts::Variables given = ParseModelVars(model_var_args);
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  formats::ExportOptions o;
  if (format == "safetensors") {
    o.format = formats::ExportFormat::kSafetensors;
  } else if (format == "torch" || format == "bin") {
    o.format = formats::ExportFormat::kTorch;
  } else {
    throw UsageError("--format ", format, ": use safetensors or torch");
  }
  o.dtype = ParseDType(dtype);
  o.max_shard_bytes = formats::ParseShardSize(shard);
  o.exclude_frozen = exclude_frozen;
  o.hf = hf;
  if (!hf && !vm["hf-experts"].defaulted())
    throw UsageError("--hf-experts ", hf_experts, ": only with --hf");
  if (hf_experts == "per-expert") {
    o.hf_experts = formats::HfExperts::kPerExpert;
  } else if (hf_experts == "fused") {
    o.hf_experts = formats::HfExperts::kFused;
  } else {
    throw UsageError("--hf-experts ", hf_experts, ": use per-expert or fused");
  }
  const formats::Exporter* found = formats::FindExporter("huggingface");
  UCP_CHECK(found != nullptr, "no exporter huggingface linked");
  const formats::Exporter& exporter = *found;
  SetProgressMode(run.quiet, run.progress);
  StartJob("export", output);
  const auto start = std::chrono::steady_clock::now();
  const fs::path source = vm["source"].as<std::string>();
  std::error_code ec;
  if (!fs::exists(source, ec)) {
    throw IoError("cannot open ", source.string(),
                  ": no such file or directory");
  }
  JobOutput out(output);
  formats::ExportSummary s;
  json::Value from;
  // The content as exported (the --hf views over it, if any).
  auto write = [&](const universal::UniversalInput& input) {
    const auto views = HfViews(input, o, given);
    const universal::UniversalInput& content =
        views.empty() ? input : *views.back();
    if (out.owner()) universal::CheckFreeSpace(output, ExportBytes(content, o));
    s = exporter.Export(content, out.path(), o, executor);
  };
  ReportingFailures([&] {
    if (!fs::is_directory(source, ec) && atoms::IsHdf5File(source)) {
      atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(source);
      write(*universal::StoreInput(store));
      from["format"] = "universal";
      from["path"] = source.string();
    } else {
      std::unique_ptr<formats::Source> c = src.Open(source);
      universal::SourcePlan plan = c->Plan();
      write(*universal::PlanInput(plan, c->info().path, executor,
                                  JobReplicaShare()));
      from = c->info().ToJson();
    }
  });
  out.Commit();
  if (!PrintsResult()) return 0;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (run.json) {
    json::Value j;
    j["command"] = "export";
    j["source"] = std::move(from);
    j["output"] = output;
    j["format"] = format;
    j["dtype"] = std::string(DTypeName(o.dtype));
    j["tensors"] = s.tensors;
    j["total_size"] = s.total_size;
    json::Value files = json::Value::Array();
    for (const auto& f : s.files) files.Append(f);
    j["files"] = std::move(files);
    json::Value notes = json::Value::Array();
    for (const auto& n : s.notes) notes.Append(n);
    j["notes"] = std::move(notes);
    j["seconds"] = seconds;
    const json::Value processes = JobProcesses();
    if (!processes.is_null()) j["processes"] = processes;
    PrintJson(j);
  } else {
    std::printf("wrote %s: %lld tensors, %s in %zu file(s), %s, in %.1f s\n",
                output.c_str(), static_cast<long long>(s.tensors),
                HumanBytes(s.total_size).c_str(), s.files.size(),
                std::string(DTypeName(o.dtype)).c_str(), seconds);
    for (const auto& n : s.notes) std::printf("note: %s\n", n.c_str());
  }
  return 0;
}

int RunFormats(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: ucp formats [--json]\n\nThe checkpoint formats this ucp reads "
      "and writes (the\nnames --from and --format take).\n\noptions");
  bool json_out = false;
  desc.add_options()("json", po::bool_switch(&json_out), "JSON output");
  po::variables_map vm;
  if (!Parse(args, desc, {}, vm)) return 0;
  json::Value list = json::Value::Array();
  for (const formats::Driver* d : formats::Drivers()) {
    if (json_out) {
      json::Value e;
      e["name"] = std::string(d->Name());
      e["read"] = d->CanRead();
      e["write"] = d->CanWrite();
      e["summary"] = std::string(d->Summary());
      auto specs = [](const std::vector<formats::OptionSpec>& v) {
        json::Value a = json::Value::Array();
        for (const formats::OptionSpec& o : v) {
          json::Value x;
          x["name"] = o.name;
          x["type"] = o.type == formats::OptionSpec::Type::kFlag  ? "flag"
                      : o.type == formats::OptionSpec::Type::kInt ? "int"
                                                                  : "string";
          x["help"] = o.help;
          a.Append(std::move(x));
        }
        return a;
      };
      e["source_options"] = specs(d->SourceOptionSpecs());
      if (d->CanWrite()) {
        const formats::TopologyAxes ax = d->TargetAxes();
        json::Value t = json::Value::Array();
        if (ax.tp) t.Append("tp");
        if (ax.pp) t.Append("pp");
        if (ax.vpp) t.Append("vpp");
        if (ax.dp) t.Append("dp");
        if (ax.ep) t.Append("ep");
        if (ax.etp) t.Append("etp");
        e["target_topology"] = std::move(t);
        e["target_options"] = specs(d->TargetOptionSpecs());
      }
      list.Append(std::move(e));
    } else {
      std::printf("%-22s %-11s %s\n", std::string(d->Name()).c_str(),
                  d->CanRead() && d->CanWrite() ? "read/write"
                  : d->CanRead()                ? "read"
                                                : "write",
                  std::string(d->Summary()).c_str());
    }
  }
  if (json_out) {
    PrintJson(list);
  } else {
    std::printf("\nname maps (--names MAP of convert, reshape, resume):\n");
    for (const auto& [name, from] : formats::NameMapSources())
      std::printf("%-22s from %s\n", name.c_str(), from.c_str());
  }
  return 0;
}

}  // namespace ucp::cli
