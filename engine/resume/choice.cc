#include "engine/resume/choice.h"

#include "engine/core/error.h"

namespace ucp::resume {

bool NewerFirst(const CandidateKey& a, const CandidateKey& b) {
  if (a.iteration != b.iteration) return a.iteration > b.iteration;
  if (a.kind != b.kind) return a.kind < b.kind;
  return a.name > b.name;
}

Selection SelectNewestIntact(
    const std::vector<CandidateKey>& ordered,
    const std::function<void(size_t)>& check,
    const std::function<void(const SkippedCheckpoint&)>& on_skipped) {
  Selection out;
  for (size_t i = 0; i < ordered.size(); ++i) {
    try {
      check(i);
      out.chosen = i;
      return out;
    } catch (const Error& e) {
      out.skipped.push_back(
          {ordered[i].name, ordered[i].iteration, std::string(e.what())});
      if (on_skipped) on_skipped(out.skipped.back());
    }
  }
  return out;
}

bool LoadsAsSaved(const FitFacts& facts) {
  return facts.checkpoint_folder && facts.same_format && !facts.renamed &&
         facts.layout_fits;
}

LoadAction ChooseAction(const FitFacts& facts) {
  if (!LoadsAsSaved(facts)) return LoadAction::kReshape;
  if (!facts.has_tracker) return LoadAction::kCheckpointDir;
  return facts.tracked ? LoadAction::kSaveDir : LoadAction::kLinkTracked;
}

std::string LoadFolderName(const LoadFolderParts& parts) {
  std::string out = parts.checkpoint;
  if (parts.topology) {
    const layouts::Topology& t = *parts.topology;
    out += StrCat("-tp", t.tp, "-pp", t.pp, "-vpp", t.vpp, "-dp", t.dp);
    if (t.ep != 1 || t.etp) out += StrCat("-ep", t.ep, "-etp", t.ExpertTp());
  }
  out += parts.options_suffix;
  if (!parts.other_format.empty()) out += "-" + parts.other_format;
  if (!parts.names.empty()) out += "-" + parts.names;
  return out;
}

void CheckDataSkip(const DataSkip& rule) {
  if (rule.global_batch_size && *rule.global_batch_size < 1)
    throw UsageError("the global batch size must be >= 1, not ",
                     *rule.global_batch_size);
  if (rule.steps && *rule.steps < 0)
    throw UsageError("data-skip steps must be >= 0, not ", *rule.steps);
  if (rule.ignore && rule.steps)
    throw UsageError(
        "data-skip steps given and ignored at once: give one of the two");
}

std::optional<int64_t> DataSkipSteps(const DataSkip& rule,
                                     int64_t consumed_samples) {
  if (rule.ignore) return 0;
  if (rule.steps) return *rule.steps;
  if (rule.global_batch_size && *rule.global_batch_size > 0 &&
      consumed_samples >= 0)
    return consumed_samples / *rule.global_batch_size;
  return std::nullopt;
}

}  // namespace ucp::resume
