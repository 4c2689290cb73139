// Name maps registry (name_map.h).

#include "engine/formats/name_map.h"

#include <algorithm>
#include <deque>

#include "engine/core/error.h"
#include "engine/json/json.h"

namespace ucp::formats {
namespace {

std::deque<NameMap>& NameMaps() {
  static std::deque<NameMap> maps;
  return maps;
}

}  // namespace

namespace internal {
NameMapRegistrar::NameMapRegistrar(NameMap map) {
  NameMaps().push_back(std::move(map));
}
}  // namespace internal

std::vector<std::string> NameMapNames() {
  std::vector<std::string> names;
  for (const NameMap& m : NameMaps()) names.push_back(m.name);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

void CheckNameMapName(std::string_view name) {
  const std::vector<std::string> names = NameMapNames();
  if (std::find(names.begin(), names.end(), name) != names.end()) return;
  std::string known;
  for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--names ", name, ": no such name map (known: ", known, ")");
}

std::vector<std::pair<std::string, std::string>> NameMapSources() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& n : NameMapNames()) {
    std::string from;
    for (const NameMap& m : NameMaps())
      if (m.name == n) from += from.empty() ? m.from : "; " + m.from;
    out.emplace_back(n, std::move(from));
  }
  return out;
}

std::unique_ptr<universal::UniversalInput> MapNames(
    const universal::UniversalInput& input, std::string_view name,
    const layouts::Variables& given) {
  if (auto mapped = MapNamesIfKnown(input, name, given)) return mapped;
  std::string from;
  for (const auto& [n, f] : NameMapSources())
    if (n == name) from = f;
  throw UsageError("--names ", name, ": ", input.path().string(),
                   " is not a model it maps (it maps ", from, ")");
}

std::unique_ptr<universal::UniversalInput> MapNamesIfKnown(
    const universal::UniversalInput& input, std::string_view name,
    const layouts::Variables& given) {
  CheckNameMapName(name);
  for (const NameMap& m : NameMaps()) {
    if (m.name != name) continue;
    std::optional<std::vector<universal::MappedParam>> params =
        m.map(input, given);
    if (!params) continue;
    universal::Model model = input.model();
    model.source.layout = m.layout;
    model.source.names = m.name;
    model.layout_yaml.clear();  // the descriptor of the source's names
    if (m.root) m.root(model);
    return universal::MappedInput(input, std::move(*params), std::move(model));
  }
  return nullptr;
}

}  // namespace ucp::formats
