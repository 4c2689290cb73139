#pragma once
// `ucp export` (exporter "huggingface", formats/exporter.h): the
// consolidated model of any universal content (a universal
// file, or any readable checkpoint through its source plan), in the Hugging
// Face conventions, streamed with memory bounded by the executor's budget.
//
// Files (out_dir):
//   safetensors: model.safetensors, or model-0000i-of-0000N.safetensors +
//     model.safetensors.index.json
//   torch:       pytorch_model.bin, or pytorch_model-0000i-of-0000N.bin +
//     pytorch_model.bin.index.json
// The index is {"metadata": {"total_size": bytes of all tensors},
// "weight_map": {name: file}}, keys sorted, two-space indent (what
// transformers and DeepSpeed's zero_to_fp32 write).
//
// safetensors (huggingface/safetensors): 8 bytes little-endian header size
// N, N bytes of JSON {name: {"dtype": "F32"|"BF16"|..., "shape": [...],
// "data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}} padded with
// spaces to a multiple of 8, then the tensors' row-major little-endian bytes
// back to back in header order (offsets relative to the data start).
// pytorch_model.bin: torch.save of an OrderedDict {name: tensor}.
//
// Shards (huggingface_hub split_state_dict_into_shards): tensors in order; a
// tensor larger than the maximum gets a shard of its own, appended at once;
// otherwise a new shard starts when the current one would exceed it.
//
// What is exported: every param and buffer in canonical order (`order`),
// by its universal name (TP/PP merged, global layer indices, vocabulary at
// its true size); floating tensors in the requested dtype (default float32:
// the fp32 master weights; the training-dtype `param` atom is used as is when
// it already has the requested dtype, and for params without a master);
// integer buffers keep their dtype. Frozen params unless excluded.
// With `hf` the tensors are those of transformers' LlamaForCausalLM instead
// (hf_llama.h; a mixture of experts: Mixtral / Qwen2-MoE / Qwen3-MoE /
// Glm4-MoE, per-expert or fused by `hf_experts`), and config.json is written
// last.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/formats/exporter.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"

namespace ucp::exporting {

using formats::ExportFormat;
using formats::ExportOptions;
using formats::ExportSummary;

/// Writes the model into `out_dir` (an existing empty folder; each file is
/// written under a temporary name and renamed when complete); registered as
/// exporter "huggingface" (formats/exporter.h), which `ucp export` runs. Throws
/// UsageError for a dtype that is not floating point, FormatError if a param
/// has neither a `fp32` nor a `param` atom, IoError on write failures.
ExportSummary Export(const universal::UniversalInput& input,
                     const std::filesystem::path& out_dir,
                     const ExportOptions& options,
                     const reshape::ExecutorOptions& executor);

/// "F32", "BF16", ... Throws UsageError for dtypes safetensors lacks.
std::string_view SafetensorsDType(DType dtype);

}  // namespace ucp::exporting
