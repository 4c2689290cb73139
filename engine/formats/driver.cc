#include "engine/formats/driver.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "engine/core/error.h"
#include "engine/formats/emit.h"

namespace ucp::formats {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Driver>, std::less<>> drivers;
};

Registry& TheRegistry() {
  static Registry* r = new Registry();  // never destroyed: used at exit
  return *r;
}

std::string KnownNames() {
  std::string s;
  for (const Driver* d : Drivers())
    s += (s.empty() ? "" : ", ") + std::string(d->Name());
  return s;
}

}  // namespace

namespace {

// "zero stage 2", "distributed optimizer" from the settings.
std::string DescribeSettings(const json::Value& settings) {
  std::string s;
  if (!settings.is_object()) return s;
  for (const auto& [k, v] : settings.members()) {
    std::string name = k;
    for (char& c : name)
      if (c == '_') c = ' ';
    if (v.is_bool()) {
      if (v.AsBool()) s += ", " + name;
    } else if (v.is_string()) {
      s += StrCat(", ", name, " ", v.AsString());
    } else {
      s += StrCat(", ", name, " ", v.Dump());
    }
  }
  return s;
}

}  // namespace

std::string CheckpointInfo::Describe() const {
  std::string s = StrCat(format, " checkpoint ", path.string(), " (");
  s += name.empty() ? StrCat("iteration ", iteration)
                    : StrCat(name, ", step ", iteration);
  s += StrCat(", tp ", topology.tp, ", pp ", topology.pp);
  if (topology.vpp > 1) s += StrCat(", vpp ", topology.vpp);
  s += StrCat(", dp ", topology.dp);
  s += DescribeSettings(settings);
  if (!dtype.empty()) s += ", " + dtype;
  return s + ")";
}

json::Value CheckpointInfo::TopologyJson() const {
  json::Value j = json::Value::Object();
  j["tp"] = topology.tp;
  j["pp"] = topology.pp;
  j["vpp"] = topology.vpp;
  j["dp"] = topology.dp;
  if (settings.is_object())
    for (const auto& [k, v] : settings.members()) j[k] = v;
  return j;
}

json::Value CheckpointInfo::ToJson() const {
  json::Value j = TopologyJson();
  j["format"] = format;
  j["path"] = path.string();
  if (!name.empty()) j["tag"] = name;
  j["iteration"] = iteration;
  if (!dtype.empty()) j["dtype"] = dtype;
  j["rank_files"] = static_cast<int64_t>(files.size());
  return j;
}

Source::NameListing Source::ListNames() const {
  throw UsageError(info().format,
                   " checkpoints have no layout descriptors to check");
}

bool Source::Fits(const TargetOptions&) const { return false; }

std::vector<ArchiveSpan> Source::Archives(const std::filesystem::path&) const {
  return {};
}

json::Value Source::Inventory() const { return json::Value(); }

std::vector<SavedCheckpoint> Driver::ListCheckpoints(
    const std::filesystem::path&) const {
  return {};
}

void Driver::WriteTracker(const std::filesystem::path& dir,
                          const CheckpointInfo&) const {
  throw UsageError("format '", Name(), "' keeps no tracker file (",
                   dir.string(), ")");
}

std::unique_ptr<Source> Driver::Open(const std::filesystem::path& path,
                                     const SourceOptions&) const {
  throw UsageError("format '", Name(), "' cannot be read (", path.string(),
                   ")");
}

std::unique_ptr<TargetPlan> Driver::PlanTarget(const universal::UniversalInput&,
                                               const TargetOptions&) const {
  throw UsageError("format '", Name(), "' cannot be written");
}

TargetSummary WriteTarget(const Driver& driver,
                          const universal::UniversalInput& input,
                          const std::filesystem::path& out_dir,
                          const TargetOptions& options,
                          const reshape::ExecutorOptions& executor,
                          bool manifest) {
  CheckOptions(driver.TargetOptionSpecs(), options.values, driver.Name(),
               "targets");
  const std::unique_ptr<TargetPlan> plan = driver.PlanTarget(input, options);
  EmitOptions o;
  o.executor = executor;
  o.manifest = manifest;
  return Emit(*plan, input, out_dir, o);
}

void RegisterDriver(std::unique_ptr<Driver> driver) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string name(driver->Name());
  UCP_CHECK(!r.drivers.count(name), "driver ", name, " registered twice");
  r.drivers.emplace(std::move(name), std::move(driver));
}

std::vector<const Driver*> Drivers() {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<const Driver*> out;
  for (const auto& [n, d] : r.drivers) out.push_back(d.get());
  return out;
}

const Driver* FindDriver(std::string_view name) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.drivers.find(name);
  return it == r.drivers.end() ? nullptr : it->second.get();
}

const Driver& GetDriver(std::string_view name) {
  if (const Driver* d = FindDriver(name)) return *d;
  throw UsageError("unknown format '", name, "' (known: ", KnownNames(), ")");
}

bool Driver::RefinesFormat(std::string_view name) const {
  for (std::string_view r : Refines())
    if (r == name) return true;
  return false;
}

namespace {

// Whether a driver of `others` other than `d` refines `d`'s format.
template <typename Pairs>
bool IsRefinedByAny(const Driver& d, const Pairs& others) {
  for (const auto& entry : others)
    if (entry.first != &d && entry.first->RefinesFormat(d.Name())) return true;
  return false;
}

}  // namespace

const Driver& DetectDriver(const std::filesystem::path& path,
                           std::string_view from) {
  if (!from.empty()) {
    const Driver& d = GetDriver(from);
    if (!d.CanRead()) throw UsageError("format '", from, "' cannot be read");
    return d;
  }
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw IoError("source ", path.string(), " does not exist");
  }
  // Every driver that recognises the path, less those another of them
  // refines; then the most confident.
  std::vector<std::pair<const Driver*, Confidence>> seen;
  for (const Driver* d : Drivers()) {
    if (!d->CanRead()) continue;
    const Confidence c = d->Probe(path);
    if (c != Confidence::kNo) seen.emplace_back(d, c);
  }
  const Driver* best = nullptr;
  Confidence best_c = Confidence::kNo;
  bool tie = false;
  for (const auto& [d, c] : seen) {
    if (IsRefinedByAny(*d, seen)) continue;
    if (c > best_c) {
      best = d;
      best_c = c;
      tie = false;
    } else if (c == best_c) {
      tie = true;
    }
  }
  if (best == nullptr) {
    throw FormatError(path.string(),
                      ": not a checkpoint of a known format (tried ",
                      KnownNames(), "); pass --from FORMAT to force one");
  }
  if (tie) {
    throw FormatError(path.string(),
                      ": several formats could read it; pass --from FORMAT "
                      "(known: ",
                      KnownNames(), ")");
  }
  return *best;
}

std::vector<ListedCheckpoint> ListSavedCheckpoints(
    const std::filesystem::path& dir) {
  std::vector<std::pair<const Driver*, std::vector<SavedCheckpoint>>> lists;
  for (const Driver* d : Drivers()) {
    if (!d->CanRead()) continue;
    std::vector<SavedCheckpoint> l = d->ListCheckpoints(dir);
    if (!l.empty()) lists.emplace_back(d, std::move(l));
  }
  std::vector<ListedCheckpoint> out;
  for (auto& [d, l] : lists) {
    for (SavedCheckpoint& c : l) {
      // Left out if a driver refining d's format lists the same folder.
      bool refined = false;
      for (const auto& [o, ol] : lists) {
        if (o == d || !o->RefinesFormat(d->Name())) continue;
        for (const SavedCheckpoint& oc : ol) refined |= oc.name == c.name;
      }
      if (!refined) out.push_back({d, std::move(c)});
    }
  }
  return out;
}

}  // namespace ucp::formats
