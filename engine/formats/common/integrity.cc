#include "engine/formats/common/integrity.h"

#include <map>
#include <optional>
#include <span>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/core/progress.h"
#include "engine/json/json.h"
#include "engine/torchfile/zip.h"

namespace ucp::formats {
namespace {

namespace fs = std::filesystem;

struct FileDigest {
  uint64_t size = 0;
  bool zip = false;
  std::map<std::string, std::string> records;  // zip: name -> hex xxh3
  std::string whole;                           // not a zip: hex xxh3
};

bool IsZip(const fs::path& f) {
  char magic[4] = {};
  File in = File::OpenRead(f);
  return in.ReadSome(magic, sizeof magic, 0) == sizeof magic &&
         std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4);
}

std::string WholeFileHash(const fs::path& f, Progress& progress) {
  File in = File::OpenRead(f);
  const uint64_t size = in.Size();
  std::vector<char> buf(std::min<uint64_t>(size, uint64_t{8} << 20));
  Xxh3Hasher hasher;
  for (uint64_t done = 0; done < size;) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    in.ReadExact(buf.data(), n, done);
    hasher.Update(buf.data(), n);
    progress.Add(n);
    done += n;
  }
  return HashHex(hasher.Digest());
}

// Reads `f` once: CRC-32 of every zip record (throws on a mismatch) and,
// with `hashes`, the hashes the manifest keeps. Without them, a file that
// is not a zip is not read, nor are the record ranges `known` covers, unless
// `observers` asks to see every record whole.
FileDigest Digest(const fs::path& f, Progress& progress, bool hashes,
                  const torchfile::RecordCrcs* known = nullptr,
                  const torchfile::RecordObservers& observers = {},
                  const ArchivesOf& archives_of = {}) {
  FileDigest d;
  std::error_code ec;
  d.size = fs::file_size(f, ec);
  if (ec) throw IoError("cannot stat ", f.string(), ": ", ec.message());
  std::vector<ArchiveSpan> spans;
  if (archives_of) spans = archives_of(f);
  if (spans.empty()) {
    if (!IsZip(f)) {
      if (hashes) {
        d.whole = WholeFileHash(f, progress);
      } else {
        progress.Add(d.size);
      }
      return d;
    }
    spans.push_back({0, d.size});
  }
  d.zip = true;
  const std::map<std::string, std::vector<torchfile::CrcPiece>>* pieces =
      nullptr;
  const std::string key = f.lexically_normal().string();
  if (known != nullptr && !hashes) {
    auto it = known->find(key);
    if (it != known->end()) pieces = &it->second;
  }
  for (const ArchiveSpan& span : spans) {
    const torchfile::ZipReader zip =
        span.offset == 0 && span.length == d.size
            ? torchfile::ZipReader::Open(f)
            : torchfile::ZipReader::Open(f, span.offset, span.length);
    const std::string prefix =
        span.offset == 0 ? std::string() : StrCat("@", span.offset, "/");
    for (const torchfile::ZipEntry& e : zip.entries()) {
      const std::string name = prefix + e.name;
      try {
        bool crc_ok = false;
        if (hashes || observers) {
          const torchfile::ZipReader::RecordDigest r =
              zip.Digest(e, hashes, observers ? observers(key, name) : nullptr);
          crc_ok = r.crc_ok;
          d.records[name] = hashes ? HashHex(r.xxh3) : std::string();
        } else {
          std::span<const torchfile::CrcPiece> read;
          if (pieces != nullptr) {
            auto it = pieces->find(name);
            if (it != pieces->end()) read = it->second;
          }
          crc_ok = zip.CheckCrc(e, read);
          d.records.emplace(name, std::string());  // counted, not hashed
        }
        if (!crc_ok) {
          throw FormatError(
              "CRC-32 mismatch: the record's bytes changed after the file "
              "was written (a damaged copy or disk)");
        }
      } catch (Error& err) {
        err.AddContext("rank file ", f.string(), " > record ", name);
        throw;
      }
      progress.Add(e.compressed_size);
    }
  }
  return d;
}

uint64_t TotalBytes(const std::vector<fs::path>& files) {
  uint64_t total = 0;
  for (const fs::path& f : files) {
    std::error_code ec;
    const auto n = fs::file_size(f, ec);
    if (!ec) total += n;
  }
  return total;
}

// `f` relative to `dir`, or nothing when it lies outside.
std::optional<std::string> RelativeName(const fs::path& dir,
                                        const fs::path& f) {
  const fs::path rel =
      f.lexically_normal().lexically_relative(dir.lexically_normal());
  if (rel.empty() || *rel.begin() == "..") return std::nullopt;
  return rel.generic_string();
}

std::map<std::string, FileDigest> ReadManifest(const fs::path& path) {
  std::map<std::string, FileDigest> out;
  try {
    const json::Value j = json::Value::Parse(ReadSmallFile(path, 64 << 20));
    if (j.At("format").AsString() != "ucp.manifest") {
      throw FormatError("\"format\" is not \"ucp.manifest\"");
    }
    if (j.At("version").AsInt() != 1) {
      throw FormatError("version ", j.At("version").AsInt(),
                        " is not supported (1 is)");
    }
    if (j.At("hash").AsString() != "xxh3-64") {
      throw FormatError("hash \"", j.At("hash").AsString(),
                        "\" is not supported (xxh3-64 is)");
    }
    for (const auto& [name, v] : j.At("files").members()) {
      FileDigest d;
      const int64_t size = v.At("size").AsInt();
      if (size < 0) throw FormatError("file ", name, ": negative size");
      d.size = static_cast<uint64_t>(size);
      if (const json::Value* r = v.Find("records")) {
        d.zip = true;
        for (const auto& [rec, h] : r->members()) d.records[rec] = h.AsString();
      } else {
        d.whole = v.At("xxh3").AsString();
      }
      out[name] = std::move(d);
    }
  } catch (Error& e) {
    e.AddContext("manifest ", path.string());
    throw;
  }
  return out;
}

void Compare(const fs::path& file, const FileDigest& want,
             const FileDigest& got) {
  if (want.size != got.size) {
    throw FormatError("rank file ", file.string(), " has ", got.size,
                      " bytes, ", kManifestName, " says ", want.size);
  }
  if (want.zip != got.zip) {
    throw FormatError("rank file ", file.string(), " is ",
                      got.zip ? "" : "not ", "a zip archive, ", kManifestName,
                      " says otherwise");
  }
  if (!got.zip) {
    if (want.whole != got.whole) {
      throw FormatError("rank file ", file.string(), ": XXH3-64 ", got.whole,
                        " differs from ", want.whole, " in ", kManifestName);
    }
    return;
  }
  for (const auto& [name, hash] : want.records) {
    auto it = got.records.find(name);
    if (it == got.records.end()) {
      throw FormatError("rank file ", file.string(), " > record ", name,
                        ": listed in ", kManifestName, " but missing");
    }
    if (it->second != hash) {
      throw FormatError("rank file ", file.string(), " > record ", name,
                        ": XXH3-64 ", it->second, " differs from ", hash,
                        " in ", kManifestName);
    }
  }
  for (const auto& [name, hash] : got.records) {
    if (!want.records.count(name)) {
      throw FormatError("rank file ", file.string(), " > record ", name,
                        ": not listed in ", kManifestName);
    }
  }
}

}  // namespace

std::string IntegrityReport::Summary() const {
  return StrCat(records, " records of ", zips,
                " torch.save files match their CRC-32",
                manifest ? StrCat(", ", files, " files match ", kManifestName)
                         : std::string());
}

IntegrityReport CheckIntegrity(const fs::path& dir,
                               const std::vector<fs::path>& files,
                               const torchfile::RecordCrcs* known,
                               const torchfile::RecordObservers& observers,
                               const ArchivesOf& archives) {
  IntegrityReport report;
  std::optional<std::map<std::string, FileDigest>> manifest;
  std::error_code ec;
  if (fs::exists(dir / kManifestName, ec)) {
    manifest = ReadManifest(dir / kManifestName);
    report.manifest = true;
    for (const auto& [name, d] : *manifest) {
      if (!fs::exists(dir / name, ec)) {
        throw FormatError("rank file ", (dir / name).string(), " is listed in ",
                          (dir / kManifestName).string(), " but missing");
      }
    }
  }
  Progress progress(manifest ? "crc-32+xxh3" : "crc-32", TotalBytes(files));
  for (const fs::path& f : files) {
    const FileDigest got =
        Digest(f, progress, manifest.has_value(), known, observers, archives);
    ++report.files;
    if (got.zip) {
      ++report.zips;
      report.records += static_cast<int64_t>(got.records.size());
    }
    if (!manifest) continue;
    const std::optional<std::string> rel = RelativeName(dir, f);
    auto it = rel ? manifest->find(*rel) : manifest->end();
    if (it == manifest->end()) {
      throw FormatError("rank file ", f.string(), " is not listed in ",
                        (dir / kManifestName).string());
    }
    Compare(f, it->second, got);
  }
  progress.Finish();
  return report;
}

universal::IntegrityPass IntegrityPassFor(const fs::path& dir,
                                          const std::vector<fs::path>& files,
                                          IntegrityReport* report,
                                          ArchivesOf archives) {
  universal::IntegrityPass pass;
  std::error_code ec;
  pass.whole_records = fs::exists(dir / kManifestName, ec);
  pass.run = [dir, files, report, archives = std::move(archives)](
                 const torchfile::RecordCrcs& known,
                 const torchfile::RecordObservers& observers) {
    IntegrityReport r = CheckIntegrity(dir, files, &known, observers, archives);
    if (report != nullptr) *report = r;
  };
  return pass;
}

json::Value ManifestEntries(const fs::path& dir,
                            const std::vector<fs::path>& files,
                            const ArchivesOf& archives,
                            IntegrityReport* report) {
  IntegrityReport counts;
  std::vector<std::pair<std::string, json::Value>> list;
  Progress progress("manifest", TotalBytes(files));
  for (const fs::path& f : files) {
    const std::optional<std::string> rel = RelativeName(dir, f);
    if (!rel) {
      throw UsageError("rank file ", f.string(), " lies outside ",
                       dir.string());
    }
    const FileDigest d =
        Digest(f, progress, /*hashes=*/true, nullptr, {}, archives);
    json::Value v;
    v["size"] = d.size;
    if (d.zip) {
      json::Value records = json::Value::Object();
      for (const auto& [name, hash] : d.records) records[name] = hash;
      v["records"] = std::move(records);
      ++counts.zips;
      counts.records += static_cast<int64_t>(d.records.size());
    } else {
      v["xxh3"] = d.whole;
    }
    list.emplace_back(*rel, std::move(v));
    ++counts.files;
  }
  progress.Finish();
  if (report != nullptr) {
    report->files += counts.files;
    report->zips += counts.zips;
    report->records += counts.records;
  }
  return json::Value::FromMembers(std::move(list));
}

void WriteManifestEntries(const fs::path& dir, json::Value entries) {
  json::Value j;
  j["format"] = "ucp.manifest";
  j["version"] = 1;
  j["hash"] = "xxh3-64";
  j["files"] = std::move(entries);
  WriteFileAtomically(dir / kManifestName, j.Dump(1) + "\n");
}

IntegrityReport WriteManifest(const fs::path& dir,
                              const std::vector<fs::path>& files,
                              const ArchivesOf& archives) {
  IntegrityReport report;
  report.manifest = true;
  WriteManifestEntries(dir, ManifestEntries(dir, files, archives, &report));
  return report;
}

}  // namespace ucp::formats
