#pragma once
// The JSON attributes of universal content (atom_store.h RootInfo,
// ParamInfo::tied_copies): read in a driver's writer, written in its reader.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "layouts/variables.h"

namespace ucp::formats {

/// The attribute's JSON; an empty object for empty text. Throws FormatError
/// "universal file <path> > attribute <what> > ..." if it does not parse.
json::Value ParseJsonAttr(const std::string& text, const char* what,
                          const std::filesystem::path& path);

/// The model variables of the `model` attribute (`text`): its integers,
/// and its booleans as 0/1. Throws like ParseJsonAttr.
layouts::Variables ModelVariables(const std::string& text,
                                  const std::filesystem::path& path);

/// A param's row of a universal::SourcePlan, its tied copies as the JSON
/// list the schema keeps.
struct ParamRowSpec {
  std::string fqn;
  Shape shape;
  DType dtype = DType::kFloat32;
  std::string rule;
  bool buffer = false;
  int64_t group = -1;
  int64_t order = 0;
  bool frozen = false;
  std::vector<std::string> tied_copies;
};
atoms::ParamInfo ParamRow(const ParamRowSpec& spec);

/// The hyper-parameters of a torch optimizer param group dict (`group`)
/// into `out`, the optimizer attribute's group object: numbers, booleans
/// and tuples / lists of numbers (Adam's betas) by name; "params" and other
/// values are left out. Never throws.
void GroupHyperparamsJson(const pickle::Value* group, json::Value& out);
/// One entry of such a dict (`key`: `v`). Never throws.
void GroupHyperparamJson(const std::string& key, const pickle::Value* v,
                         json::Value& out);
/// The inverse for a target that keeps no pickled groups of the source: the
/// torch param group dict of the optimizer attribute's group object `group`
/// (numbers as floats, booleans, arrays of numbers as tuples), "params" and
/// any other member left out; nullptr if it holds no hyper-parameter. Never
/// throws.
pickle::Value* GroupHyperparamsDict(const json::Value& group,
                                    pickle::Arena& arena);

}  // namespace ucp::formats
