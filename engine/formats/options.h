#pragma once
// Options owned by format drivers: each driver declares the command-line
// options it takes (name, type, default, help) for reading a checkpoint
// (`--iteration`, `--tag`) and for writing one (`--distributed-optimizer`,
// `--zero-stage`); the CLI adds them to --help, parses them generically and
// hands each driver the values of its own options. Nothing outside a
// driver's folder names one of them.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/json/json.h"

namespace ucp::formats {

struct OptionSpec {
  enum class Type : uint8_t { kFlag, kInt, kString };
  std::string name;  // without dashes: "zero-stage"
  Type type = Type::kString;
  std::string help;  // one line for --help
  /// The default as --help shows it ("" when there is none to show).
  std::string default_text;
  /// Part of the layout a target is written for (shown in summaries, in
  /// --json's target_topology, and in `ucp resume`'s load-folder names as
  /// `-<abbrev>` for a flag or `-<abbrev><value>` for a value).
  bool layout = false;
  std::string abbrev;
  /// A string option's value when it is given without one (`--dequantize`
  /// alone: "bf16"); "" when a value is required. The next word is its
  /// value unless it is an option, holds a '/' or names an existing path
  /// (`--dequantize fp32`, `--dequantize=fp32`; `--dequantize SRC` takes
  /// none).
  std::string implicit_text;
  /// Allowed range of an integer option (inclusive).
  int64_t min = INT64_MIN;
  int64_t max = INT64_MAX;
};

/// The values of one driver's options, as given (absent when not given).
/// Flags are "true" when given.
class OptionValues {
 public:
  void Set(std::string name, std::string value);
  bool Has(std::string_view name) const;
  /// Throws InternalError if the option was given a value of another type
  /// (the CLI checks types against the specs).
  std::optional<std::string> String(std::string_view name) const;
  std::optional<int64_t> Int(std::string_view name) const;
  bool Flag(std::string_view name) const;
  const std::map<std::string, std::string, std::less<>>& values() const {
    return values_;
  }
  bool empty() const { return values_.empty(); }

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

/// Checks `values` against `specs`: every name declared, every value of the
/// declared type and range. Throws UsageError naming the option, the format
/// `driver` and the options it takes.
void CheckOptions(const std::vector<OptionSpec>& specs,
                  const OptionValues& values, std::string_view driver,
                  std::string_view what);

/// The layout options among `values` (OptionSpec::layout): "zero stage 2",
/// "distributed optimizer", comma-separated; "" if none.
std::string DescribeLayoutOptions(const std::vector<OptionSpec>& specs,
                                  const OptionValues& values);
/// The same as JSON members: flags as booleans (false when not given),
/// values when given; names with '_' for '-' ("zero_stage").
void LayoutOptionsJson(const std::vector<OptionSpec>& specs,
                       const OptionValues& values, json::Value& out);
/// "-do", "-z2": the abbreviations of the layout options given.
std::string LayoutOptionsSuffix(const std::vector<OptionSpec>& specs,
                                const OptionValues& values);

}  // namespace ucp::formats
