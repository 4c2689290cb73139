#pragma once
// Name maps: the same model under another framework's param names
// (`--names NAME` of convert, reshape and resume). A map turns universal
// content whose names it knows into a universal::MappedInput under its names
// (renames, fused weights split or joined, every optimizer state with them).
// Formats register the maps they know (UCP_REGISTER_NAME_MAP in their .cc);
// several may register one name for different source models, and the first
// that knows the source's names wins.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/universal/input.h"
#include "engine/universal/mapped_input.h"
#include "layouts/variables.h"

namespace ucp::formats {

struct NameMap {
  /// What --names takes ("mindformers-llama").
  std::string name;
  /// For --help and errors: the source models it maps ("a Megatron-core
  /// GPTModel (mcore-llama)").
  std::string from;
  /// The mapped params (`given`: model variables the source does not
  /// record, --model-var), or absent when the input is not a model this map
  /// knows. Throws UsageError (starting "--names <name>") naming the param
  /// when it is one but cannot be mapped (a shape or setting the target model
  /// does not have).
  std::function<std::optional<std::vector<universal::MappedParam>>(
      const universal::UniversalInput&, const layouts::Variables& given)>
      map;
  /// The built-in layout the mapped names follow ("" if none): the view's
  /// root names it as the source's layout.
  std::string layout;
  /// What else of the model the target model's framework names its own way
  /// (its optimizer's state names, say); may be empty.
  std::function<void(universal::Model&)> root = nullptr;
};

/// `input` under the names of map `name`. `input` must outlive the result.
/// Throws UsageError for an unknown name (listing the known ones) or a source
/// no map of that name knows (naming what they map), and what the map throws.
std::unique_ptr<universal::UniversalInput> MapNames(
    const universal::UniversalInput& input, std::string_view name,
    const layouts::Variables& given = {});

/// The same, or nullptr when no map of that name knows the source's names
/// (MapNames' "not a model it maps"). Throws the rest as MapNames.
std::unique_ptr<universal::UniversalInput> MapNamesIfKnown(
    const universal::UniversalInput& input, std::string_view name,
    const layouts::Variables& given = {});

/// Throws UsageError "--names <name>: no such name map (known: ...)" unless
/// a map of that name is registered.
void CheckNameMapName(std::string_view name);

/// The registered maps' names, sorted, once each.
std::vector<std::string> NameMapNames();
/// Each name with what it maps from (its maps' `from`, "; "-joined).
std::vector<std::pair<std::string, std::string>> NameMapSources();

namespace internal {
struct NameMapRegistrar {
  explicit NameMapRegistrar(NameMap map);
};
}  // namespace internal

}  // namespace ucp::formats

/// In a format's .cc: registers a NameMap at start-up (`id` names the static).
#define UCP_REGISTER_NAME_MAP(id, ...)                                  \
  static ::ucp::formats::internal::NameMapRegistrar ucp_name_map_##id { \
    __VA_ARGS__                                                         \
  }
