#pragma once
// `ucp export`'s seam: the consolidated model of any universal content,
// written by an exporter that registers itself by name (UCP_REGISTER_EXPORTER
// in its .cc, as drivers do with UCP_REGISTER_DRIVER), so that the CLI
// includes no exporter's header. The one exporter today is "huggingface"
// (export/: safetensors or pytorch_model.bin shards with an index, and with
// `hf` a transformers model folder).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"

namespace ucp::formats {

enum class ExportFormat { kSafetensors, kTorch };

/// How `--hf` writes routed experts (`--hf-experts`): one tensor per expert
/// and matrix (transformers 4's names, what save_pretrained writes), or one
/// 3-D tensor per layer and matrix (transformers 5's in-memory form:
/// `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`).
enum class HfExperts { kPerExpert, kFused };

struct ExportOptions {
  ExportFormat format = ExportFormat::kSafetensors;
  DType dtype = DType::kFloat32;             // float32, bfloat16 or float16
  uint64_t max_shard_bytes = 5'000'000'000;  // "5GB"
  bool exclude_frozen = false;
  /// A transformers model folder (names/hf_llama.h): LlamaForCausalLM's
  /// names, q/k/v and gate/up split, config.json last.
  bool hf = false;
  /// With `hf`, a mixture of experts' routed experts.
  HfExperts hf_experts = HfExperts::kPerExpert;
};

struct ExportSummary {
  int64_t tensors = 0;
  uint64_t total_size = 0;         // bytes of tensor data
  std::vector<std::string> files;  // written, in order (index last)
  std::vector<std::string> notes;
};

class Exporter {
 public:
  virtual ~Exporter() = default;
  /// The registered name ("huggingface").
  virtual std::string_view Name() const = 0;
  /// Writes the model of `input` into `out_dir` (an existing empty folder;
  /// each file under a temporary name, renamed when complete). Throws
  /// UsageError for options the exporter cannot honour (a dtype that is not
  /// floating point, `hf` for a model that is not one), FormatError if a
  /// param has no weights, IoError on write failures.
  virtual ExportSummary Export(
      const universal::UniversalInput& input,
      const std::filesystem::path& out_dir, const ExportOptions& options,
      const reshape::ExecutorOptions& executor) const = 0;
};

/// Registers `exporter` (at start-up, through UCP_REGISTER_EXPORTER). Throws
/// InternalError for a name registered twice.
void RegisterExporter(std::unique_ptr<Exporter> exporter);
/// The exporter registered as `name`; nullptr if none is (not linked).
const Exporter* FindExporter(std::string_view name);

/// Hugging Face shard sizes (`--max-shard-size`): "5GB" = 5e9 bytes,
/// "500MB", "100KB", "1GiB" = 2^30, "1000" bytes (case-insensitive). Throws
/// UsageError naming --max-shard-size for anything else, zero or overflow.
uint64_t ParseShardSize(std::string_view text);

namespace internal {
struct ExporterRegistrar {
  explicit ExporterRegistrar(std::unique_ptr<Exporter> exporter) {
    RegisterExporter(std::move(exporter));
  }
};
}  // namespace internal

}  // namespace ucp::formats

/// In an exporter's .cc: registers one instance of `Type` at start-up.
#define UCP_REGISTER_EXPORTER(Type)                  \
  static ::ucp::formats::internal::ExporterRegistrar \
      ucp_exporter_registrar_##Type {                \
    std::make_unique<Type>()                         \
  }
