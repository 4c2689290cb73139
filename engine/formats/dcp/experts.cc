// torchtitan's stacked routed experts (experts.h).

#include "engine/formats/dcp/experts.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <optional>
#include <span>

#include "engine/core/error.h"
#include "engine/core/strided.h"

namespace ucp::dcp {
namespace {

bool IsStem(std::string_view s) { return s == "w1" || s == "w2" || s == "w3"; }

// "w1" or "w1_EFD": the stem and the suffix.
std::optional<std::pair<std::string, std::string>> StemAndSuffix(
    std::string_view base) {
  if (IsStem(base)) return std::make_pair(std::string(base), std::string());
  if (base.size() == 6 && IsStem(base.substr(0, 2)) && base[2] == '_' &&
      std::all_of(base.begin() + 3, base.end(),
                  [](char c) { return std::isupper(c) != 0; }))
    return std::make_pair(std::string(base.substr(0, 2)),
                          std::string(base.substr(2)));
  return std::nullopt;
}

}  // namespace

std::optional<StackedName> SplitStacked(std::string_view name) {
  const size_t at = name.rfind(kExpertsInfix);
  if (at == std::string_view::npos) return std::nullopt;
  if (at != 0 && name[at - 1] != '.') return std::nullopt;
  const size_t end = at + kExpertsInfix.size();
  const auto parts = StemAndSuffix(name.substr(end));
  if (!parts) return std::nullopt;
  return StackedName{std::string(name.substr(0, end)), parts->first,
                     parts->second};
}

std::optional<StackedName> FindStacked(std::string_view key) {
  const size_t at = key.rfind(kExpertsInfix);
  if (at == std::string_view::npos) return std::nullopt;
  const size_t end = at + kExpertsInfix.size();
  const size_t dot = key.find('.', end);
  return SplitStacked(
      key.substr(0, dot == std::string_view::npos ? key.size() : dot));
}

std::string ExpertParam(const StackedName& n, int64_t e) {
  return StrCat(n.prefix, e, ".", n.stem);
}

std::optional<ExpertParamName> SplitExpertParam(std::string_view name) {
  const size_t at = name.rfind(kExpertsInfix);
  if (at == std::string_view::npos) return std::nullopt;
  if (at != 0 && name[at - 1] != '.') return std::nullopt;
  const size_t end = at + kExpertsInfix.size();
  const size_t dot = name.find('.', end);
  if (dot == std::string_view::npos || dot == end) return std::nullopt;
  int64_t e = 0;
  const auto [p, ec] = std::from_chars(name.data() + end, name.data() + dot, e);
  if (ec != std::errc() || p != name.data() + dot || e < 0) return std::nullopt;
  const std::string_view stem = name.substr(dot + 1);
  if (!IsStem(stem)) return std::nullopt;
  return ExpertParamName{std::string(name.substr(0, end)), e,
                         std::string(stem)};
}

void ExpertCoverage(const Shape& size, const std::vector<Chunk>& chunks,
                    std::vector<int64_t>& missing,
                    std::vector<int64_t>& twice) {
  if (size.empty() || size[0] <= 0 || size[0] > (int64_t{1} << 24)) return;
  const std::optional<int64_t> per_or =
      CheckedNumElements(std::span<const int64_t>(size).subspan(1));
  if (!per_or) return;
  const int64_t per = *per_or;
  std::vector<int64_t> held(static_cast<size_t>(size[0]), 0);
  for (const Chunk& c : chunks) {
    if (c.sizes.size() != size.size() || c.offsets.size() != size.size())
      continue;
    bool inside = true;  // chunks outside the tensor are another error's
    for (size_t d = 0; d < size.size(); ++d)
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.sizes[d] > size[d] ||
          c.offsets[d] > size[d] - c.sizes[d])
        inside = false;
    if (!inside) continue;
    int64_t inner = 1;
    for (size_t d = 1; d < c.sizes.size(); ++d) inner *= c.sizes[d];  // <= per
    if (inner <= 0) continue;
    for (int64_t r = std::max<int64_t>(0, c.offsets[0]);
         r < std::min(size[0], c.offsets[0] + c.sizes[0]); ++r)
      held[static_cast<size_t>(r)] += inner;
  }
  for (int64_t e = 0; e < size[0]; ++e) {
    if (held[static_cast<size_t>(e)] < per) missing.push_back(e);
    if (held[static_cast<size_t>(e)] > per) twice.push_back(e);
  }
}

std::string IndexList(const std::vector<int64_t>& v) {
  std::string out;
  for (int64_t e : v) out += StrCat(out.empty() ? "" : ", ", e);
  return out;
}

}  // namespace ucp::dcp
