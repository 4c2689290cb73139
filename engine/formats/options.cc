#include "engine/formats/options.h"

#include <charconv>

#include "engine/core/error.h"

namespace ucp::formats {
namespace {

const OptionSpec* FindSpec(const std::vector<OptionSpec>& specs,
                           std::string_view name) {
  for (const OptionSpec& s : specs)
    if (s.name == name) return &s;
  return nullptr;
}

std::optional<int64_t> ParseInt(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || p != end || text.empty()) return std::nullopt;
  return v;
}

std::string Spaced(std::string_view name) {
  std::string s(name);
  for (char& c : s)
    if (c == '-') c = ' ';
  return s;
}

std::string Underscored(std::string_view name) {
  std::string s(name);
  for (char& c : s)
    if (c == '-') c = '_';
  return s;
}

}  // namespace

void OptionValues::Set(std::string name, std::string value) {
  values_[std::move(name)] = std::move(value);
}

bool OptionValues::Has(std::string_view name) const {
  return values_.find(name) != values_.end();
}

std::optional<std::string> OptionValues::String(std::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::optional<int64_t> OptionValues::Int(std::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  std::optional<int64_t> v = ParseInt(it->second);
  UCP_CHECK(v.has_value(), "option --", name, " holds '", it->second,
            "', not an integer");
  return v;
}

bool OptionValues::Flag(std::string_view name) const {
  auto it = values_.find(name);
  return it != values_.end() && it->second == "true";
}

void CheckOptions(const std::vector<OptionSpec>& specs,
                  const OptionValues& values, std::string_view driver,
                  std::string_view what) {
  for (const auto& [name, value] : values.values()) {
    const OptionSpec* spec = FindSpec(specs, name);
    if (spec == nullptr) {
      std::string known;
      for (const OptionSpec& s : specs)
        known += StrCat(known.empty() ? "" : ", ", "--", s.name);
      throw UsageError("--", name, " is not an option of format '", driver,
                       "' ", what, " (",
                       known.empty() ? std::string("it takes none")
                                     : StrCat("it takes ", known),
                       ")");
    }
    if (spec->type == OptionSpec::Type::kInt) {
      const std::optional<int64_t> v = ParseInt(value);
      if (!v)
        throw UsageError("--", name, " takes an integer, not '", value, "'");
      if (*v < spec->min || *v > spec->max) {
        throw UsageError(
            "--", name, " ", *v, " is out of range (",
            spec->min == INT64_MIN ? std::string("..")
                                   : StrCat(spec->min, ".."),
            spec->max == INT64_MAX ? std::string() : StrCat(spec->max), ")");
      }
    }
  }
}

std::string DescribeLayoutOptions(const std::vector<OptionSpec>& specs,
                                  const OptionValues& values) {
  std::string out;
  for (const OptionSpec& s : specs) {
    if (!s.layout || !values.Has(s.name)) continue;
    if (s.type == OptionSpec::Type::kFlag && !values.Flag(s.name)) continue;
    out += out.empty() ? "" : ", ";
    out += Spaced(s.name);
    if (s.type != OptionSpec::Type::kFlag)
      out += StrCat(" ", *values.String(s.name));
  }
  return out;
}

void LayoutOptionsJson(const std::vector<OptionSpec>& specs,
                       const OptionValues& values, json::Value& out) {
  for (const OptionSpec& s : specs) {
    if (!s.layout) continue;
    const std::string key = Underscored(s.name);
    switch (s.type) {
      case OptionSpec::Type::kFlag:
        out[key] = values.Flag(s.name);
        break;
      case OptionSpec::Type::kInt:
        if (values.Has(s.name)) out[key] = *values.Int(s.name);
        break;
      case OptionSpec::Type::kString:
        if (values.Has(s.name)) out[key] = *values.String(s.name);
        break;
    }
  }
}

std::string LayoutOptionsSuffix(const std::vector<OptionSpec>& specs,
                                const OptionValues& values) {
  std::string out;
  for (const OptionSpec& s : specs) {
    if (!s.layout || !values.Has(s.name)) continue;
    const std::string abbrev = s.abbrev.empty() ? s.name : s.abbrev;
    if (s.type == OptionSpec::Type::kFlag) {
      if (values.Flag(s.name)) out += StrCat("-", abbrev);
    } else {
      out += StrCat("-", abbrev, *values.String(s.name));
    }
  }
  return out;
}

}  // namespace ucp::formats
