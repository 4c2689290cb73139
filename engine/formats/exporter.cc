#include "engine/formats/exporter.h"

#include <cctype>
#include <map>
#include <mutex>

#include "engine/core/error.h"

namespace ucp::formats {
namespace {

struct ExporterRegistry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Exporter>, std::less<>> exporters;
};

ExporterRegistry& TheExporters() {
  static ExporterRegistry* r = new ExporterRegistry();  // used at exit
  return *r;
}

}  // namespace

void RegisterExporter(std::unique_ptr<Exporter> exporter) {
  ExporterRegistry& r = TheExporters();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string name(exporter->Name());
  UCP_CHECK(!r.exporters.count(name), "exporter ", name, " registered twice");
  r.exporters.emplace(std::move(name), std::move(exporter));
}

const Exporter* FindExporter(std::string_view name) {
  ExporterRegistry& r = TheExporters();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.exporters.find(name);
  return it == r.exporters.end() ? nullptr : it->second.get();
}

uint64_t ParseShardSize(std::string_view text) {
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    if (__builtin_mul_overflow(value, 10u, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(text[i] - '0'),
                               &value))
      throw UsageError("--max-shard-size ", text, ": too large");
    ++i;
  }
  if (i == 0)
    throw UsageError("--max-shard-size ", text, ": not a size (e.g. 5GB)");
  std::string unit;
  for (char c : text.substr(i))
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, uint64_t> kUnits = {
      {"", 1},
      {"B", 1},
      {"KB", 1000ull},
      {"MB", 1000'000ull},
      {"GB", 1000'000'000ull},
      {"TB", 1000'000'000'000ull},
      {"KIB", 1ull << 10},
      {"MIB", 1ull << 20},
      {"GIB", 1ull << 30},
      {"TIB", 1ull << 40}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end())
    throw UsageError("--max-shard-size ", text,
                     ": not a size (e.g. 5GB, 500MB, 1GiB)");
  uint64_t out;
  if (__builtin_mul_overflow(value, it->second, &out) || out == 0)
    throw UsageError("--max-shard-size ", text, ": out of range");
  return out;
}

}  // namespace ucp::formats
