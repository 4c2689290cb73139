#pragma once
// The "mindspore" record of the universal file (MindSporeExtras), with its
// one serializer (mindspore_extras.cc): module mindspore_extras, kept with
// the name maps because both the MindSpore driver (../mindspore, which
// writes and reads the record) and the maps (MindFormers' AdamW moment
// names, mindformers_llama.cc) take it: a driver may include a family's
// header, a family no driver's.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "engine/json/json.h"
#include "engine/universal/model.h"

namespace ucp::mindspore {

/// The root attribute of the universal file holding the driver's record.
inline constexpr const char* kMetaAttr = "mindspore";

/// A record of a MindSpore file that is neither a param nor a moment
/// (global_step, learning_rate, beta1_power, ...), kept verbatim.
struct OtherRecord {
  std::string tag;
  std::string type;  // its tensor type: "Int32", "Float32", ...
  std::vector<int64_t> dims;
  std::string bytes;  // its data, as the file holds it

  bool operator==(const OtherRecord&) const = default;
};

/// The universal file's "mindspore" attribute, a JSON object written by the
/// reader of a MindSpore checkpoint (every member optional; a record
/// without one, or none at all, is what another framework's content has):
///   records            [{"tag": t, "type": "Int32", "dims": [1],
///                        "hex": "<the bytes in lowercase hex>"}, ...]
///                      the file's other records, in file order
///   order              [tag, ...]: every record of the file, in file order
///                      (a target from a MindSpore source keeps it)
///   exp_avg_prefix     the moment names: "moment1." (nn.Adam) or "adam_m."
///   exp_avg_sq_prefix  (AdamWeightDecay): "moment2." or "adam_v."
///   file               rank 0's file name (absent for a Checkpoint 2.0
///   rank_folder        source); bool: it lay in a rank_0/ folder
///   crc                bool: its CRC trailer was checked
///   files              [name, ...]: every rank's file name (a sharded save)
/// Members it does not know are kept in `other` and written back after these.
struct MindSporeExtras {
  std::optional<std::vector<OtherRecord>> records;
  std::optional<std::vector<std::string>> order;
  std::optional<std::string> exp_avg_prefix;
  std::optional<std::string> exp_avg_sq_prefix;
  std::optional<std::string> file;
  std::optional<bool> rank_folder;
  std::optional<bool> crc;
  std::optional<std::vector<std::string>> files;
  json::Value other = json::Value::Object();
};

/// The model's "mindspore" record; absent if it has none. Throws FormatError
/// "universal file <file> > attribute mindspore > member <key>: ..." if the
/// record is not a JSON object or a member has the wrong type (a record
/// without its tag, hex that is not hex).
std::optional<MindSporeExtras> ReadMindSporeExtras(
    const universal::Model& model, const std::filesystem::path& file);
/// Stores `extras` as the model's "mindspore" record.
void WriteMindSporeExtras(const MindSporeExtras& extras,
                          universal::Model& model);

}  // namespace ucp::mindspore
