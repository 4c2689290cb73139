#pragma once
// Internal to engine/universal: splitting an atom's fragments into the
// primaries that cover it once and the replicas to verify.

#include <functional>
#include <utility>
#include <vector>

#include "engine/universal/source_plan.h"
#include "engine/universal/write_universal.h"

namespace ucp::universal::internal {

struct Classified {
  std::vector<const Fragment*> main;  // primaries of the atom
  std::vector<const Fragment*> pad;   // primaries of the pad atom
  std::vector<std::pair<const Fragment*, const Fragment*>>
      replicas;  // (copy, primary)
};

/// Throws FormatError if the primaries do not cover the atom (and its
/// padding rows) exactly or two fragments overlap partially; InternalError
/// for boxes outside their tensors.
Classified Classify(const AtomPlan& atom);

/// Classify for every atom of the plan, in order.
std::vector<Classified> ClassifyAll(const SourcePlan& plan);

/// VerifySource on an already classified plan (`classified` from
/// ClassifyAll(plan)).
VerifySummary VerifyClassified(const SourcePlan& plan,
                               const std::vector<Classified>& classified,
                               const reshape::ExecutorOptions& options,
                               const IntegrityPass& integrity = {});

}  // namespace ucp::universal::internal
