#include "engine/torchfile/zip.h"

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "engine/core/checked.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/torchfile/crc32_fast.h"

namespace ucp::torchfile {

uint32_t Crc32(std::span<const std::byte> data, uint32_t crc) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t n = data.size();
  if (n >= 256 && internal::HaveFastCrc32()) {
    const size_t folded = n & ~size_t{15};
    crc = internal::HaveWideCrc32() ? internal::Crc32Wide(crc, p, folded)
                                    : internal::Crc32Folded(crc, p, folded);
    p += folded;
    n -= folded;
  }
  return static_cast<uint32_t>(crc32_z(crc, p, n));
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) noexcept {
  return static_cast<uint32_t>(
      crc32_combine(crc_a, crc_b, static_cast<z_off_t>(len_b)));
}

namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kEocdSize = 22;
constexpr size_t kZip64EocdSize = 56;
constexpr size_t kZip64LocatorSize = 20;
constexpr uint64_t k32Max = 0xFFFFFFFFu;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint16_t kPaddingExtraId = 0x4246;  // "FB", as torch writes it
constexpr uint16_t kUtf8Flag = 0x0800;
// deflate cannot compress by more than about 1032:1.
constexpr uint64_t kMaxDeflateRatio = 1032;
// The end records of an archive are looked for in its last kTailProbe bytes
// first (a torch.save archive's directory is a few hundred bytes), then in
// the last 22 + 65535 (the longest comment); an archive of up to kWholeRead
// bytes is read whole. A local header outside the cache is read with the
// kHeaderWindow bytes after it (the next records' headers and small
// records), until ReleaseCache.
constexpr uint64_t kTailProbe = 4096;
constexpr uint64_t kWholeRead = 65536;
constexpr uint64_t kHeaderWindow = 4096;

uint16_t Get16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
uint32_t Get32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t Get64(const unsigned char* p) {
  return static_cast<uint64_t>(Get32(p)) |
         (static_cast<uint64_t>(Get32(p + 4)) << 32);
}

void Put16(std::string& out, uint64_t v) {
  out.push_back(static_cast<char>(v & 0xFF));
  out.push_back(static_cast<char>((v >> 8) & 0xFF));
}
void Put32(std::string& out, uint64_t v) {
  Put16(out, v & 0xFFFF);
  Put16(out, (v >> 16) & 0xFFFF);
}
void Put64(std::string& out, uint64_t v) {
  Put32(out, v & k32Max);
  Put32(out, v >> 32);
}

}  // namespace

// --- Reader ------------------------------------------------------------------

struct ZipReader::Impl {
  std::shared_ptr<const File> file;
  uint64_t offset = 0;
  uint64_t size = 0;
  std::vector<ZipEntry> entries;
  std::unordered_map<std::string_view, size_t> by_name;
  // End of the space available to each entry's data (the next local header
  // or the central directory), relative to the archive.
  std::vector<uint64_t> limits;
  // Relative data offset of each entry once its local header was read; 0 =
  // not yet (a data offset is never 0).
  std::unique_ptr<std::atomic<uint64_t>[]> data_offsets;
  // Bytes of the archive read with the end records (kTail) and with a local
  // header or given to Open (kHeaders): the small reads that follow
  // (directory, local headers, pickles) are served from them.
  struct Window {
    uint64_t at = 0;  // archive offset of bytes[0]
    std::vector<unsigned char> bytes;
  };
  static constexpr size_t kTail = 0, kHeaders = 1;
  mutable std::mutex cache_mu;
  mutable Window cache[2];
  std::atomic<bool> cache_live{true};

  std::string Describe() const {
    std::string s = file->path().string();
    if (offset != 0 || size != file_size) {
      s += StrCat(" (archive at bytes ", offset, "..", offset + size, ")");
    }
    return s;
  }
  uint64_t file_size = 0;

  template <typename... Args>
  [[noreturn]] void Fail(Args&&... args) const {
    throw FormatError(Describe(), ": ", std::forward<Args>(args)...);
  }

  void ReadAt(void* dst, size_t n, uint64_t rel) const {
    if (!FromCache(dst, n, rel)) file->ReadExact(dst, n, offset + rel);
  }
  // Copies [rel, rel + n) from the cache if it holds them.
  bool FromCache(void* dst, size_t n, uint64_t rel) const {
    if (!cache_live.load(std::memory_order_acquire) || n > kWholeRead) {
      return false;
    }
    std::lock_guard<std::mutex> lock(cache_mu);
    for (const Window& w : cache) {
      if (rel >= w.at && FitsWithin(rel - w.at, n, w.bytes.size())) {
        std::memcpy(dst, w.bytes.data() + (rel - w.at), n);
        return true;
      }
    }
    return false;
  }
  // Reads [rel, rel + n) into window `slot` (replacing it) unless released.
  void Cache(size_t slot, uint64_t rel, size_t n) const {
    std::vector<unsigned char> bytes(n);
    file->ReadExact(bytes.data(), n, offset + rel);
    if (!cache_live.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(cache_mu);
    cache[slot].bytes = std::move(bytes);
    cache[slot].at = rel;
  }

  size_t IndexOf(const ZipEntry& entry) const {
    const ZipEntry* base = entries.data();
    UCP_CHECK(&entry >= base && &entry < base + entries.size(),
              "entry does not belong to this ZipReader");
    return static_cast<size_t>(&entry - base);
  }

  // Reads the central directory into `entries`, `by_name` and `limits`.
  // Throws FormatError if the archive is corrupt or unsupported.
  void Parse();
  // Parse's steps.
  // The end of central directory record's fields (zip64's where present).
  struct EndRecord {
    uint64_t eocd = 0;  // where the (32-bit) record starts
    uint64_t disk = 0, cd_disk = 0, entries_on_disk = 0, num_entries = 0;
    uint64_t cd_size = 0, cd_offset = 0;
    uint64_t cd_end_limit = 0;  // the directory must end before this
  };
  EndRecord ReadEndRecord() const;
  // Replaces the fields by the zip64 record's when a locator precedes the
  // end record.
  void ReadZip64EndRecord(EndRecord& d) const;
  // Entry `i` of directory `cd` (at archive offset `cd_offset`), its header
  // at `pos`; advances `pos` past it.
  ZipEntry ReadCentralEntry(std::span<const unsigned char> cd, size_t& pos,
                            uint64_t i, uint64_t cd_offset) const;
  // The zip64 sizes and offset of `ent` from its extra fields [x, x_end).
  void ReadExtraFields(ZipEntry& ent, const unsigned char* x,
                       const unsigned char* x_end) const;
  // Refuses an encrypted entry, inconsistent sizes, data outside the area
  // before the directory.
  void CheckEntry(const ZipEntry& ent, size_t name_len,
                  uint64_t cd_offset) const;
  // `by_name`, each entry's data limit, overlapping entries refused.
  void IndexEntries(uint64_t cd_offset);
  uint64_t DataOffset(size_t index) const;
  void Inflate(const ZipEntry& entry, std::byte* dst) const;
};

void ZipReader::Impl::Parse() {
  EndRecord d = ReadEndRecord();
  ReadZip64EndRecord(d);
  if (d.disk != 0 || d.cd_disk != 0 || d.entries_on_disk != d.num_entries) {
    Fail("multi-disk zip archives are not supported");
  }
  if (!FitsWithin(d.cd_offset, d.cd_size, d.cd_end_limit)) {
    Fail("central directory (offset ", d.cd_offset, ", ", d.cd_size,
         " bytes) lies outside the archive");
  }
  // Each entry has a 46-byte header and at most 3 x 65535 bytes of name,
  // extra field and comment: a directory larger than that for its entry
  // count is corrupt (and is not read into memory).
  constexpr uint64_t kMaxCentralEntry = kCentralHeaderSize + 3 * 0xFFFF;
  if (d.num_entries > d.cd_size / kCentralHeaderSize ||
      d.cd_size / kMaxCentralEntry > d.num_entries) {
    Fail("central directory of ", d.cd_size, " bytes cannot hold ",
         d.num_entries, " entries");
  }
  std::vector<unsigned char> cd(d.cd_size);
  ReadAt(cd.data(), cd.size(), d.cd_offset);

  entries.reserve(d.num_entries);
  size_t pos = 0;
  for (uint64_t i = 0; i < d.num_entries; ++i)
    entries.push_back(ReadCentralEntry(cd, pos, i, d.cd_offset));
  IndexEntries(d.cd_offset);
}

ZipReader::Impl::EndRecord ZipReader::Impl::ReadEndRecord() const {
  if (size < kEocdSize) Fail("not a zip archive (only ", size, " bytes)");
  // The end of central directory record is in the last 22 + 65535 bytes.
  // Prefer a record whose comment ends exactly at the end of the archive (a
  // comment may itself contain the signature), else the last one that fits.
  // A shorter tail is scanned first, in the same order: a record ending
  // exactly there is the one the whole tail would give.
  const uint64_t max_tail = std::min<uint64_t>(size, kEocdSize + 0xFFFF);
  const uint64_t probe = size <= kWholeRead ? size : kTailProbe;
  std::optional<uint64_t> eocd;
  for (const uint64_t tail_len : {std::min(probe, max_tail), max_tail}) {
    const uint64_t tail_start = size - tail_len;
    const Window& h = cache[kHeaders];
    if (tail_start >= h.at &&
        FitsWithin(tail_start - h.at, tail_len, h.bytes.size())) {
      const auto from = h.bytes.begin() + (tail_start - h.at);
      cache[kTail].bytes.assign(from, from + tail_len);
      cache[kTail].at = tail_start;
    } else {
      Cache(kTail, tail_start, static_cast<size_t>(tail_len));
    }
    const std::vector<unsigned char>& tail = cache[kTail].bytes;
    std::optional<uint64_t> fits;
    for (uint64_t p = tail_len - kEocdSize + 1; p-- > 0;) {
      const unsigned char* q = tail.data() + p;
      if (Get32(q) != kEocdSig) continue;
      const uint64_t end = p + kEocdSize + Get16(q + 20);
      if (end == tail_len) {
        eocd = tail_start + p;
        break;
      }
      if (end < tail_len && !fits) fits = tail_start + p;
    }
    if (eocd || tail_len == max_tail) {
      if (!eocd) eocd = fits;
      break;
    }
  }
  if (!eocd) Fail("not a zip archive (no end of central directory record)");
  const unsigned char* e =
      cache[kTail].bytes.data() + (*eocd - cache[kTail].at);
  EndRecord d;
  d.eocd = *eocd;
  d.disk = Get16(e + 4);
  d.cd_disk = Get16(e + 6);
  d.entries_on_disk = Get16(e + 8);
  d.num_entries = Get16(e + 10);
  d.cd_size = Get32(e + 12);
  d.cd_offset = Get32(e + 16);
  d.cd_end_limit = *eocd;
  return d;
}

void ZipReader::Impl::ReadZip64EndRecord(EndRecord& d) const {
  if (d.eocd < kZip64LocatorSize) return;
  unsigned char loc[kZip64LocatorSize];
  ReadAt(loc, sizeof(loc), d.eocd - kZip64LocatorSize);
  if (Get32(loc) != kZip64LocatorSig) return;
  uint64_t z64 = Get64(loc + 8);
  if (Get32(loc + 4) != 0 || Get32(loc + 16) > 1) {
    Fail("multi-disk zip archives are not supported");
  }
  if (!FitsWithin(z64, kZip64EocdSize, d.eocd - kZip64LocatorSize)) {
    Fail("zip64 end of central directory at ", z64,
         " lies outside the archive");
  }
  unsigned char r[kZip64EocdSize];
  ReadAt(r, sizeof(r), z64);
  if (Get32(r) != kZip64EocdSig) {
    Fail("bad zip64 end of central directory signature at ", z64);
  }
  d.disk = Get32(r + 16);
  d.cd_disk = Get32(r + 20);
  d.entries_on_disk = Get64(r + 24);
  d.num_entries = Get64(r + 32);
  d.cd_size = Get64(r + 40);
  d.cd_offset = Get64(r + 48);
  d.cd_end_limit = z64;
}

ZipEntry ZipReader::Impl::ReadCentralEntry(std::span<const unsigned char> cd,
                                           size_t& pos, uint64_t i,
                                           uint64_t cd_offset) const {
  const uint64_t cd_size = cd.size();
  if (cd_size - pos < kCentralHeaderSize) {
    Fail("central directory entry ", i, " is truncated");
  }
  const unsigned char* h = cd.data() + pos;
  if (Get32(h) != kCentralSig) {
    Fail("bad central directory signature for entry ", i);
  }
  ZipEntry ent;
  ent.flags = Get16(h + 8);
  ent.method = Get16(h + 10);
  ent.crc32 = Get32(h + 16);
  ent.compressed_size = Get32(h + 20);
  ent.uncompressed_size = Get32(h + 24);
  const size_t name_len = Get16(h + 28);
  const size_t extra_len = Get16(h + 30);
  const size_t comment_len = Get16(h + 32);
  const uint16_t start_disk = Get16(h + 34);
  ent.local_header_offset = Get32(h + 42);
  if (cd_size - pos - kCentralHeaderSize < name_len + extra_len + comment_len) {
    Fail("central directory entry ", i, " is truncated");
  }
  ent.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderSize),
                  name_len);
  const unsigned char* x = h + kCentralHeaderSize + name_len;
  ReadExtraFields(ent, x, x + extra_len);
  if (start_disk != 0 && start_disk != 0xFFFF) {
    Fail("multi-disk zip archives are not supported");
  }
  CheckEntry(ent, name_len, cd_offset);
  pos += kCentralHeaderSize + name_len + extra_len + comment_len;
  return ent;
}

void ZipReader::Impl::ReadExtraFields(ZipEntry& ent, const unsigned char* x,
                                      const unsigned char* x_end) const {
  while (x_end - x >= 4) {
    const uint16_t id = Get16(x);
    const size_t len = Get16(x + 2);
    x += 4;
    if (static_cast<size_t>(x_end - x) < len) {
      Fail("entry ", ent.name, ": extra field runs past its header");
    }
    if (id == kZip64ExtraId) {
      const unsigned char* f = x;
      const unsigned char* f_end = x + len;
      auto next = [&](uint64_t& field) {
        if (field != k32Max) return;
        if (f_end - f < 8) {
          Fail("entry ", ent.name, ": zip64 extra field is too short");
        }
        field = Get64(f);
        f += 8;
      };
      next(ent.uncompressed_size);
      next(ent.compressed_size);
      next(ent.local_header_offset);
    }
    x += len;
  }
}

void ZipReader::Impl::CheckEntry(const ZipEntry& ent, size_t name_len,
                                 uint64_t cd_offset) const {
  if (ent.flags & 0x0041) Fail("entry ", ent.name, " is encrypted");
  if (ent.method == kZipStored &&
      ent.compressed_size != ent.uncompressed_size) {
    Fail("stored entry ", ent.name, " has compressed size ",
         ent.compressed_size, " but uncompressed size ", ent.uncompressed_size);
  }
  if (ent.method == kZipDeflated &&
      ent.uncompressed_size / kMaxDeflateRatio > ent.compressed_size + 1) {
    Fail("deflated entry ", ent.name, " claims ", ent.uncompressed_size,
         " bytes from ", ent.compressed_size, " compressed bytes");
  }
  const uint64_t min_header = kLocalHeaderSize + name_len;
  if (ent.local_header_offset > cd_offset ||
      !FitsWithin(min_header, ent.compressed_size,
                  cd_offset - ent.local_header_offset)) {
    Fail("entry ", ent.name, " (local header at ", ent.local_header_offset,
         ", ", ent.compressed_size,
         " bytes) lies outside the archive's data area");
  }
}

void ZipReader::Impl::IndexEntries(uint64_t cd_offset) {
  by_name.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!by_name.emplace(entries[i].name, i).second) {
      Fail("duplicate entry ", entries[i].name);
    }
  }
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return entries[a].local_header_offset < entries[b].local_header_offset;
  });
  limits.assign(entries.size(), cd_offset);
  for (size_t k = 0; k + 1 < order.size(); ++k) {
    const ZipEntry& a = entries[order[k]];
    const ZipEntry& b = entries[order[k + 1]];
    const uint64_t a_end = a.local_header_offset + kLocalHeaderSize +
                           a.name.size() + a.compressed_size;
    if (a_end > b.local_header_offset) {
      Fail("entries ", a.name, " and ", b.name, " overlap");
    }
    limits[order[k]] = b.local_header_offset;
  }
  data_offsets = std::make_unique<std::atomic<uint64_t>[]>(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) data_offsets[i].store(0);
}

uint64_t ZipReader::Impl::DataOffset(size_t index) const {
  uint64_t cached = data_offsets[index].load(std::memory_order_acquire);
  if (cached != 0) return offset + cached;
  const ZipEntry& ent = entries[index];
  std::string header(kLocalHeaderSize + ent.name.size(), '\0');
  if (!FromCache(header.data(), header.size(), ent.local_header_offset)) {
    if (cache_live.load(std::memory_order_acquire)) {
      // The headers near the start of the archive in one read.
      const uint64_t lho = ent.local_header_offset;
      const uint64_t start = lho < kHeaderWindow ? 0 : lho;
      const uint64_t end = std::min<uint64_t>(
          size, std::max<uint64_t>(start + kHeaderWindow, lho + header.size()));
      Cache(kHeaders, start, static_cast<size_t>(end - start));
    }
    ReadAt(header.data(), header.size(), ent.local_header_offset);
  }
  const auto* h = reinterpret_cast<const unsigned char*>(header.data());
  if (Get32(h) != kLocalSig) {
    Fail("bad local header signature for entry ", ent.name, " at ",
         ent.local_header_offset);
  }
  const size_t name_len = Get16(h + 26);
  const size_t extra_len = Get16(h + 28);
  if (name_len != ent.name.size() ||
      header.compare(kLocalHeaderSize, name_len, ent.name) != 0) {
    Fail("local header of entry ", ent.name, " names another file");
  }
  const uint64_t data =
      ent.local_header_offset + kLocalHeaderSize + name_len + extra_len;
  if (!FitsWithin(data, ent.compressed_size, limits[index])) {
    Fail("data of entry ", ent.name, " runs past the next entry");
  }
  data_offsets[index].store(data, std::memory_order_release);
  return offset + data;
}

void ZipReader::Impl::Inflate(const ZipEntry& ent, std::byte* dst) const {
  const uint64_t src = DataOffset(IndexOf(ent));
  z_stream zs;
  std::memset(&zs, 0, sizeof(zs));
  if (inflateInit2(&zs, -MAX_WBITS) != Z_OK) {
    throw InternalError("inflateInit2 failed");
  }
  struct Guard {
    z_stream* zs;
    ~Guard() { inflateEnd(zs); }
  } guard{&zs};
  std::vector<unsigned char> in(
      std::min<uint64_t>(ent.compressed_size, uint64_t{1} << 20));
  uint64_t read = 0;
  uint64_t produced = 0;
  for (;;) {
    if (zs.avail_in == 0 && read < ent.compressed_size) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(in.size(), ent.compressed_size - read));
      file->ReadExact(in.data(), n, src + read);
      read += n;
      zs.next_in = in.data();
      zs.avail_in = static_cast<uInt>(n);
    }
    // Once the declared size is reached, offer one scratch byte: any output
    // there means the record inflates to more than it declares.
    unsigned char scratch = 0;
    const bool full = produced == ent.uncompressed_size;
    const uInt chunk =
        full ? 1
             : static_cast<uInt>(std::min<uint64_t>(
                   ent.uncompressed_size - produced, uint64_t{1} << 30));
    zs.next_out = full ? &scratch : reinterpret_cast<Bytef*>(dst + produced);
    zs.avail_out = chunk;
    const uInt in_before = zs.avail_in;
    const int rc = inflate(&zs, Z_NO_FLUSH);
    const uInt out_n = chunk - zs.avail_out;
    if (full && out_n > 0) {
      Fail("deflated entry ", ent.name, " inflates to more than ",
           ent.uncompressed_size, " bytes");
    }
    if (!full) produced += out_n;
    if (rc == Z_STREAM_END) break;
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      Fail("deflated entry ", ent.name, " is corrupt (",
           zs.msg != nullptr ? zs.msg : "inflate error", ")");
    }
    if (out_n == 0 && zs.avail_in == in_before && zs.avail_in == 0 &&
        read == ent.compressed_size) {
      Fail("deflated entry ", ent.name, " is truncated");
    }
  }
  if (produced != ent.uncompressed_size) {
    Fail("deflated entry ", ent.name, " inflates to ", produced,
         " bytes, expected ", ent.uncompressed_size);
  }
}

ZipReader::ZipReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ZipReader::ZipReader(ZipReader&&) noexcept = default;
ZipReader& ZipReader::operator=(ZipReader&&) noexcept = default;
ZipReader::~ZipReader() = default;

ZipReader ZipReader::Open(const std::filesystem::path& path, uint64_t offset,
                          std::optional<uint64_t> length) {
  auto file = std::make_shared<File>(File::OpenRead(path));
  const uint64_t file_size = file->Size();
  if (offset > file_size) {
    throw FormatError(path.string(), ": archive offset ", offset,
                      " is past the end of the file (", file_size, " bytes)");
  }
  return Open(std::move(file), offset, length.value_or(file_size - offset));
}

ZipReader ZipReader::Open(std::shared_ptr<const File> file, uint64_t offset,
                          uint64_t length, std::span<const std::byte> head) {
  auto impl = std::make_unique<Impl>();
  if (!head.empty() && head.size() <= std::min<uint64_t>(length, kWholeRead)) {
    const auto* h = reinterpret_cast<const unsigned char*>(head.data());
    impl->cache[Impl::kHeaders].bytes.assign(h, h + head.size());
  }
  impl->file_size = file->Size();
  if (!FitsWithin(offset, length, impl->file_size)) {
    throw FormatError(file->path().string(), ": archive at bytes ", offset,
                      " + ", length, " exceeds the file (", impl->file_size,
                      " bytes)");
  }
  impl->file = std::move(file);
  impl->offset = offset;
  impl->size = length;
  impl->Parse();
  return ZipReader(std::move(impl));
}

const std::filesystem::path& ZipReader::path() const noexcept {
  return impl_->file->path();
}
const std::shared_ptr<const File>& ZipReader::file() const noexcept {
  return impl_->file;
}
uint64_t ZipReader::archive_offset() const noexcept { return impl_->offset; }
uint64_t ZipReader::archive_size() const noexcept { return impl_->size; }
const std::vector<ZipEntry>& ZipReader::entries() const noexcept {
  return impl_->entries;
}

const ZipEntry* ZipReader::Find(std::string_view name) const noexcept {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->entries[it->second];
}

uint64_t ZipReader::DataOffset(const ZipEntry& entry) const {
  return impl_->DataOffset(impl_->IndexOf(entry));
}

std::string ZipReader::ReadRecord(const ZipEntry& entry,
                                  uint64_t max_bytes) const {
  if (entry.uncompressed_size > max_bytes) {
    impl_->Fail("entry ", entry.name, " is ", entry.uncompressed_size,
                " bytes, more than the ", max_bytes, " accepted");
  }
  std::string out(static_cast<size_t>(entry.uncompressed_size), '\0');
  ReadRange(entry, 0,
            std::span<std::byte>(reinterpret_cast<std::byte*>(out.data()),
                                 out.size()));
  return out;
}

void ZipReader::ReleaseCache() const noexcept {
  Impl& im = *impl_;
  if (!im.cache_live.load(std::memory_order_acquire)) return;
  for (size_t i = 0; i < im.entries.size(); ++i) {
    const ZipEntry& e = im.entries[i];
    bool cached = false;
    {
      std::lock_guard<std::mutex> lock(im.cache_mu);
      for (const Impl::Window& w : im.cache) {
        cached = cached ||
                 (e.local_header_offset >= w.at &&
                  FitsWithin(e.local_header_offset - w.at,
                             kLocalHeaderSize + e.name.size(), w.bytes.size()));
      }
    }
    if (!cached) continue;
    try {
      im.DataOffset(i);
    } catch (const Error&) {
      // Reported again when the entry is read (a corrupt header; or a read,
      // if another thread replaced the window meanwhile).
    }
  }
  im.cache_live.store(false, std::memory_order_release);
  std::lock_guard<std::mutex> lock(im.cache_mu);
  for (Impl::Window& w : im.cache) std::vector<unsigned char>().swap(w.bytes);
}

void ZipReader::ReadRange(const ZipEntry& entry, uint64_t offset,
                          std::span<std::byte> dst) const {
  const size_t index = impl_->IndexOf(entry);
  if (!FitsWithin(offset, dst.size(), entry.uncompressed_size)) {
    throw UsageError("read of ", dst.size(), " bytes at ", offset,
                     " is outside entry ", entry.name, " of ",
                     entry.uncompressed_size, " bytes");
  }
  if (dst.empty()) return;
  if (entry.method == kZipStored) {
    const uint64_t at = impl_->DataOffset(index) + offset;
    if (!impl_->FromCache(dst.data(), dst.size(), at - impl_->offset)) {
      impl_->file->ReadExact(dst.data(), dst.size(), at);
    }
    return;
  }
  if (entry.method != kZipDeflated) {
    impl_->Fail("entry ", entry.name, " uses unsupported compression method ",
                entry.method);
  }
  if (offset == 0 && dst.size() == entry.uncompressed_size) {
    impl_->Inflate(entry, dst.data());
    return;
  }
  std::vector<std::byte> whole(static_cast<size_t>(entry.uncompressed_size));
  impl_->Inflate(entry, whole.data());
  std::memcpy(dst.data(), whole.data() + offset, dst.size());
}

namespace {

// One pass over the uncompressed content of `entry`: its CRC-32, its
// XXH3-64 into `hasher` and every chunk to `observe` when given.
uint32_t ScanRecord(const ZipReader& zip, const ZipEntry& entry,
                    Xxh3Hasher* hasher,
                    const RecordChunkObserver& observe = {}) {
  uint32_t crc = 0;
  if (entry.method == kZipStored) {
    std::vector<std::byte> buf(
        std::min<uint64_t>(entry.uncompressed_size, uint64_t{8} << 20));
    for (uint64_t done = 0; done < entry.uncompressed_size;) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(buf.size(), entry.uncompressed_size - done));
      const std::span<std::byte> chunk(buf.data(), n);
      zip.ReadRange(entry, done, chunk);
      crc = Crc32(chunk, crc);
      if (hasher != nullptr) hasher->Update(buf.data(), n);
      if (observe) observe(done, chunk);
      done += n;
    }
  } else {
    std::string all = zip.ReadRecord(entry, entry.uncompressed_size);
    const auto bytes =
        std::as_bytes(std::span<const char>(all.data(), all.size()));
    crc = Crc32(bytes);
    if (hasher != nullptr) hasher->Update(all.data(), all.size());
    if (observe) observe(0, bytes);
  }
  return crc;
}

}  // namespace

bool ZipReader::CheckCrc(const ZipEntry& entry) const {
  return ScanRecord(*this, entry, nullptr) == entry.crc32;
}

bool ZipReader::CheckCrc(const ZipEntry& entry,
                         std::span<const CrcPiece> known) const {
  if (entry.method != kZipStored || known.empty()) return CheckCrc(entry);
  std::vector<CrcPiece> pieces(known.begin(), known.end());
  std::sort(
      pieces.begin(), pieces.end(), [](const CrcPiece& a, const CrcPiece& b) {
        return a.offset != b.offset ? a.offset < b.offset : a.size > b.size;
      });
  const uint64_t size = entry.uncompressed_size;
  std::vector<std::byte> buf;
  uint32_t crc = 0;
  uint64_t at = 0;
  auto read_to = [&](uint64_t end) {
    while (at < end) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(end - at, uint64_t{8} << 20));
      buf.resize(std::max(buf.size(), n));
      const std::span<std::byte> chunk(buf.data(), n);
      ReadRange(entry, at, chunk);
      crc = Crc32(chunk, crc);
      at += n;
    }
  };
  for (const CrcPiece& p : pieces) {
    if (p.size == 0 || p.offset < at || !FitsWithin(p.offset, p.size, size))
      continue;
    read_to(p.offset);
    crc = Crc32Combine(crc, p.crc, p.size);
    at = p.offset + p.size;
  }
  read_to(size);
  return crc == entry.crc32;
}

ZipReader::RecordDigest ZipReader::Digest(
    const ZipEntry& entry, bool xxh3,
    const RecordChunkObserver& observe) const {
  Xxh3Hasher hasher;
  const bool ok = ScanRecord(*this, entry, xxh3 ? &hasher : nullptr, observe) ==
                  entry.crc32;
  return {ok, xxh3 ? hasher.Digest() : 0};
}

// --- Layout ------------------------------------------------------------------

ZipLayout PlanZipLayout(std::span<const ZipRecordSpec> records,
                        const ZipLayoutOptions& options) {
  const uint64_t align = options.alignment;
  if (align == 0 || (align & (align - 1)) != 0 || align > 32768) {
    throw UsageError("zip alignment ", align,
                     " is not a power of two up to 32768");
  }
  ZipLayout layout;
  layout.records.reserve(records.size());
  std::unordered_set<std::string_view> names;
  uint64_t cursor = 0;
  uint64_t cd_size = 0;
  for (const ZipRecordSpec& r : records) {
    if (r.name.empty() || r.name.size() > 0xFFFF) {
      throw UsageError("zip record name '", r.name.substr(0, 64),
                       "' is empty or longer than 65535 bytes");
    }
    if (!names.insert(r.name).second) {
      throw UsageError("duplicate zip record ", r.name);
    }
    ZipPlannedRecord p;
    p.name = r.name;
    p.size = r.size;
    p.header_offset = cursor;
    p.zip64_size = options.force_zip64 || r.size >= k32Max;
    p.zip64_offset = options.force_zip64 || cursor >= k32Max;
    const uint64_t start =
        cursor + kLocalHeaderSize + r.name.size() + (p.zip64_size ? 20 : 0) + 4;
    const uint64_t pad = (align - start % align) % align;
    p.data_offset = start + pad;
    if (__builtin_add_overflow(p.data_offset, r.size, &cursor) ||
        cursor > (uint64_t{1} << 62)) {
      throw UsageError("zip archive size overflows");
    }
    const uint64_t extra =
        (p.zip64_size || p.zip64_offset)
            ? 4 + (p.zip64_size ? 16 : 0) + (p.zip64_offset ? 8 : 0)
            : 0;
    cd_size += kCentralHeaderSize + r.name.size() + extra;
    layout.records.push_back(std::move(p));
  }
  layout.central_directory_offset = cursor;
  layout.central_directory_size = cd_size;
  layout.zip64_eocd_offset = cursor + cd_size;
  layout.total_size =
      layout.zip64_eocd_offset + kZip64EocdSize + kZip64LocatorSize + kEocdSize;
  return layout;
}

namespace {

std::string EncodeLocalHeader(const ZipPlannedRecord& r, uint32_t crc,
                              uint32_t alignment) {
  std::string h;
  const size_t zip64_len = r.zip64_size ? 20 : 0;
  const uint64_t pad_field_start =
      r.header_offset + kLocalHeaderSize + r.name.size() + zip64_len;
  const uint64_t pad = r.data_offset - pad_field_start - 4;
  UCP_CHECK(pad < alignment);
  h.reserve(kLocalHeaderSize + r.name.size() + zip64_len + 4 + pad);
  Put32(h, kLocalSig);
  Put16(h, r.zip64_size ? 45 : 20);
  Put16(h, kUtf8Flag);
  Put16(h, kZipStored);
  Put16(h, 0);  // time
  Put16(h, 0);  // date
  Put32(h, crc);
  Put32(h, r.zip64_size ? k32Max : r.size);
  Put32(h, r.zip64_size ? k32Max : r.size);
  Put16(h, r.name.size());
  Put16(h, zip64_len + 4 + pad);
  h += r.name;
  if (r.zip64_size) {
    Put16(h, kZip64ExtraId);
    Put16(h, 16);
    Put64(h, r.size);
    Put64(h, r.size);
  }
  Put16(h, kPaddingExtraId);
  Put16(h, pad);
  h.append(pad, 'Z');
  UCP_CHECK(r.header_offset + h.size() == r.data_offset);
  return h;
}

std::string EncodeDirectory(const ZipLayout& layout,
                            std::span<const uint32_t> crcs) {
  std::string d;
  d.reserve(layout.central_directory_size + kZip64EocdSize + kZip64LocatorSize +
            kEocdSize);
  for (size_t i = 0; i < layout.records.size(); ++i) {
    const ZipPlannedRecord& r = layout.records[i];
    const bool z64 = r.zip64_size || r.zip64_offset;
    const size_t extra =
        z64 ? 4 + (r.zip64_size ? 16 : 0) + (r.zip64_offset ? 8 : 0) : 0;
    Put32(d, kCentralSig);
    Put16(d, 45);             // made by
    Put16(d, z64 ? 45 : 20);  // needed
    Put16(d, kUtf8Flag);
    Put16(d, kZipStored);
    Put16(d, 0);
    Put16(d, 0);
    Put32(d, crcs[i]);
    Put32(d, r.zip64_size ? k32Max : r.size);
    Put32(d, r.zip64_size ? k32Max : r.size);
    Put16(d, r.name.size());
    Put16(d, extra);
    Put16(d, 0);  // comment
    Put16(d, 0);  // disk
    Put16(d, 0);  // internal attributes
    Put32(d, 0);  // external attributes
    Put32(d, r.zip64_offset ? k32Max : r.header_offset);
    d += r.name;
    if (z64) {
      Put16(d, kZip64ExtraId);
      Put16(d, extra - 4);
      if (r.zip64_size) {
        Put64(d, r.size);
        Put64(d, r.size);
      }
      if (r.zip64_offset) Put64(d, r.header_offset);
    }
  }
  UCP_CHECK(d.size() == layout.central_directory_size);
  const uint64_t n = layout.records.size();
  Put32(d, kZip64EocdSig);
  Put64(d, kZip64EocdSize - 12);
  Put16(d, 45);
  Put16(d, 45);
  Put32(d, 0);
  Put32(d, 0);
  Put64(d, n);
  Put64(d, n);
  Put64(d, layout.central_directory_size);
  Put64(d, layout.central_directory_offset);
  Put32(d, kZip64LocatorSig);
  Put32(d, 0);
  Put64(d, layout.zip64_eocd_offset);
  Put32(d, 1);
  Put32(d, kEocdSig);
  Put16(d, 0);
  Put16(d, 0);
  Put16(d, std::min<uint64_t>(n, 0xFFFF));
  Put16(d, std::min<uint64_t>(n, 0xFFFF));
  Put32(d, std::min<uint64_t>(layout.central_directory_size, k32Max));
  Put32(d, std::min<uint64_t>(layout.central_directory_offset, k32Max));
  Put16(d, 0);
  return d;
}

struct Chunk {
  uint64_t len = 0;
  uint32_t crc = 0;
};

struct RecordState {
  std::mutex mu;
  std::map<uint64_t, Chunk> chunks;  // by start offset, disjoint, merged
  // A small record written whole in one Write: its bytes, written with its
  // local header (and its neighbours') by Commit in one pwrite.
  std::string staged;
  bool is_staged = false;
};

// Records up to this size written whole are kept for Commit (the pickles,
// byteorder and version records of torch.save archives, small tensors).
constexpr uint64_t kStagedRecordMax = 4096;
// Commit writes headers and staged records in pwrites of about this size.
constexpr size_t kCommitRunMax = size_t{1} << 20;

}  // namespace

// --- Writer ------------------------------------------------------------------

struct ZipWriter::Impl {
  std::filesystem::path path;
  ZipLayoutOptions options;
  bool in_memory = false;
  ZipLayout layout;
  std::optional<OutputFile> out;
  // An embedded archive: the shared file and where the archive starts.
  std::shared_ptr<OutputFile> shared;
  uint64_t base = 0;
  std::unique_ptr<RecordState[]> states;
  std::atomic<bool> failed{false};
  bool committed = false;

  bool open() const noexcept { return out.has_value() || shared != nullptr; }
  File& file() noexcept { return shared ? shared->file() : out->file(); }
  void Abandon() noexcept {
    failed.store(true);
    out.reset();  // removes the temporary file (a shared one: its owner)
    shared.reset();
  }
};

ZipWriter::ZipWriter(const std::filesystem::path& path,
                     std::span<const ZipRecordSpec> records,
                     const ZipLayoutOptions& options, bool in_memory)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->options = options;
  impl_->in_memory = in_memory;
  impl_->layout = PlanZipLayout(records, options);
  impl_->states = std::make_unique<RecordState[]>(records.size());
  if (in_memory) {
    impl_->out.emplace(OutputFile::InMemory(path));
  } else {
    impl_->out.emplace(path);
  }
  impl_->out->file().Allocate(impl_->layout.total_size);
}

ZipWriter::ZipWriter(std::shared_ptr<OutputFile> file, uint64_t base,
                     const std::filesystem::path& name,
                     std::span<const ZipRecordSpec> records,
                     const ZipLayoutOptions& options)
    : impl_(std::make_unique<Impl>()) {
  UCP_CHECK(file != nullptr, "embedded archive without a file");
  impl_->path = name;
  impl_->options = options;
  impl_->layout = PlanZipLayout(records, options);
  impl_->states = std::make_unique<RecordState[]>(records.size());
  impl_->shared = std::move(file);
  impl_->base = base;
}

ZipWriter::ZipWriter(ZipWriter&&) noexcept = default;
ZipWriter& ZipWriter::operator=(ZipWriter&&) noexcept = default;
ZipWriter::~ZipWriter() = default;

const ZipLayout& ZipWriter::layout() const noexcept { return impl_->layout; }
const std::filesystem::path& ZipWriter::path() const noexcept {
  return impl_->path;
}

void ZipWriter::Write(size_t index, uint64_t offset,
                      std::span<const std::byte> data) {
  Impl& im = *impl_;
  if (im.committed || im.failed.load() || !im.open()) {
    throw UsageError("zip writer for ", im.path.string(),
                     im.committed ? " is already committed" : " has failed");
  }
  try {
    if (index >= im.layout.records.size()) {
      throw UsageError("no zip record #", index);
    }
    const ZipPlannedRecord& r = im.layout.records[index];
    if (!FitsWithin(offset, data.size(), r.size)) {
      throw UsageError("write of ", data.size(), " bytes at ", offset,
                       " is outside record ", r.name, " of ", r.size, " bytes");
    }
    if (data.empty()) return;
    const uint32_t crc = Crc32(data);
    const bool stage =
        offset == 0 && data.size() == r.size && r.size <= kStagedRecordMax;
    if (!stage) {
      im.file().WriteExact(data.data(), data.size(),
                           im.base + r.data_offset + offset);
    }
    RecordState& st = im.states[index];
    std::lock_guard<std::mutex> lock(st.mu);
    auto next = st.chunks.upper_bound(offset);
    const uint64_t end = offset + data.size();
    if (next != st.chunks.end() && next->first < end) {
      throw UsageError("record ", r.name, ": bytes [", next->first, ", ",
                       std::min(end, next->first + next->second.len),
                       ") written twice");
    }
    auto prev = next == st.chunks.begin() ? st.chunks.end() : std::prev(next);
    if (prev != st.chunks.end() && prev->first + prev->second.len > offset) {
      throw UsageError("record ", r.name, ": bytes [", offset, ", ",
                       std::min(end, prev->first + prev->second.len),
                       ") written twice");
    }
    if (stage) {
      st.staged.assign(reinterpret_cast<const char*>(data.data()), data.size());
      st.is_staged = true;
    }
    std::map<uint64_t, Chunk>::iterator cur;
    if (prev != st.chunks.end() && prev->first + prev->second.len == offset) {
      prev->second.crc = Crc32Combine(prev->second.crc, crc, data.size());
      prev->second.len += data.size();
      cur = prev;
    } else {
      cur = st.chunks.emplace(offset, Chunk{data.size(), crc}).first;
    }
    if (next != st.chunks.end() && next->first == end) {
      cur->second.crc =
          Crc32Combine(cur->second.crc, next->second.crc, next->second.len);
      cur->second.len += next->second.len;
      st.chunks.erase(next);
    }
  } catch (...) {
    im.failed.store(true);
    throw;
  }
}

void ZipWriter::Commit() { CommitRuns(nullptr); }

void ZipWriter::Commit(PendingRun& carry) {
  UCP_CHECK(impl_->shared != nullptr, "zip writer for ", impl_->path.string(),
            ": a carried run is for an embedded archive");
  CommitRuns(&carry);
}

void ZipWriter::CommitRuns(PendingRun* carry) {
  Impl& im = *impl_;
  if (im.committed) {
    throw UsageError("zip writer for ", im.path.string(),
                     " is already committed");
  }
  if (im.failed.load() || !im.open()) {
    im.Abandon();
    throw UsageError("zip writer for ", im.path.string(),
                     " failed earlier; nothing was written");
  }
  try {
    std::vector<uint32_t> crcs(im.layout.records.size(), 0);
    for (size_t i = 0; i < im.layout.records.size(); ++i) {
      const ZipPlannedRecord& r = im.layout.records[i];
      RecordState& st = im.states[i];
      std::lock_guard<std::mutex> lock(st.mu);
      if (r.size == 0) continue;
      uint64_t covered = 0;
      if (!st.chunks.empty() && st.chunks.begin()->first == 0) {
        covered = st.chunks.begin()->second.len;
      }
      if (covered != r.size) {
        throw UsageError("record ", r.name, " of ", im.path.string(),
                         ": bytes from ", covered, " of ", r.size,
                         " were not written");
      }
      crcs[i] = st.chunks.begin()->second.crc;
    }
    // One pwrite per contiguous run of local headers, staged records and
    // the directory (the data of the other records lies between the runs).
    File& f = im.file();
    std::string run;
    uint64_t run_at = 0;  // archive offset of run[0]
    auto flush = [&] {
      if (run.empty()) return;
      uint64_t at = im.base + run_at;
      if (carry != nullptr && !carry->bytes.empty()) {
        if (carry->at + carry->bytes.size() == at) {  // the previous archive's
          run.insert(0, carry->bytes);                // end: one pwrite
          at = carry->at;
        } else {
          f.WriteExact(carry->bytes.data(), carry->bytes.size(), carry->at);
        }
        carry->bytes.clear();
      }
      f.WriteExact(run.data(), run.size(), at);
      run.clear();
    };
    for (size_t i = 0; i < im.layout.records.size(); ++i) {
      const ZipPlannedRecord& r = im.layout.records[i];
      if (run.size() >= kCommitRunMax) flush();
      if (run.empty()) run_at = r.header_offset;
      UCP_CHECK(run_at + run.size() == r.header_offset);
      run += EncodeLocalHeader(r, crcs[i], im.options.alignment);
      RecordState& st = im.states[i];
      if (r.size == 0) continue;
      if (st.is_staged) {
        run += st.staged;
        std::string().swap(st.staged);
      } else {
        flush();
      }
    }
    if (!run.empty() &&
        run_at + run.size() != im.layout.central_directory_offset) {
      flush();
    }
    if (run.empty()) run_at = im.layout.central_directory_offset;
    run += EncodeDirectory(im.layout, crcs);
    UCP_CHECK(run_at + run.size() == im.layout.total_size);
    if (carry != nullptr) {
      // The directory run is left to the next archive (or the caller); a
      // carry not joined by this archive's runs is written first.
      if (!carry->bytes.empty() &&
          carry->at + carry->bytes.size() == im.base + run_at &&
          carry->bytes.size() < kCommitRunMax) {  // archives of small records
        carry->bytes += run;
      } else {
        if (!carry->bytes.empty())
          f.WriteExact(carry->bytes.data(), carry->bytes.size(), carry->at);
        carry->at = im.base + run_at;
        carry->bytes = std::move(run);
      }
      run.clear();
    } else {
      flush();
    }
    if (im.out) im.out->Commit();
    im.committed = true;
  } catch (...) {
    im.Abandon();
    throw;
  }
}

std::string ZipWriter::Contents() const {
  const Impl& im = *impl_;
  if (!im.in_memory || !im.committed) {
    throw UsageError("zip writer for ", im.path.string(),
                     im.in_memory ? " is not committed" : " is not in memory");
  }
  const File& f = im.out->file();
  std::string bytes(static_cast<size_t>(f.Size()), '\0');
  f.ReadExact(bytes.data(), bytes.size(), 0);
  return bytes;
}

}  // namespace ucp::torchfile
