#pragma once
// What drivers share for universal content (universal::Model, atoms::
// ParamInfo): model variables, param rows, and torch param groups to and from
// typed param groups.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "engine/universal/model.h"
#include "layouts/variables.h"

namespace ucp::formats {

/// The model variables (`model`): its integers, and its booleans as 0/1.
layouts::Variables ModelVariables(const universal::ModelInfo& model);

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
/// Hyper-parameter `key` = `v` of a torch param group into `group`: lr,
/// eps, weight_decay (numbers) and betas (a pair of numbers) typed, others
/// as GroupHyperparamJson keeps them into `group.other`. Never throws.
void AddGroupHyperparam(const std::string& key, const pickle::Value* v,
                        universal::ParamGroup& group);

/// The inverse for a target that keeps no pickled groups of the source: the
/// torch param group dict of param group `group` (lr, betas, eps,
/// weight_decay, then its other members that are numbers (as floats),
/// booleans or arrays of numbers (as tuples)), "params" left out; nullptr if
/// it holds no hyper-parameter. Never throws.
pickle::Value* GroupHyperparamsDict(const universal::ParamGroup& group,
                                    pickle::Arena& arena);

}  // namespace ucp::formats
