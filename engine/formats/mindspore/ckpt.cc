#include "engine/formats/mindspore/ckpt.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kCrcMark = "crc_num";
constexpr size_t kCrcDigits = 10;
// Records are read through a window of the file; a Value's header (tag,
// dims, type) is small, its content is skipped.
// (Small: a window past a header reads tensor bytes that are skipped.)
constexpr size_t kWindow = 64 << 10;
// The CRC trailer's check reads the whole file in chunks of this size.
constexpr size_t kCrcChunk = 1 << 20;

// A protobuf reader over a byte range of the file, read in windows.
class Wire {
 public:
  Wire(const File& f, const fs::path& path, uint64_t begin, uint64_t end)
      : f_(f), path_(path), pos_(begin), end_(end) {}
  uint64_t pos() const { return pos_; }
  uint64_t end() const { return end_; }
  bool done() const { return pos_ >= end_; }

  uint8_t Byte() {
    if (pos_ >= end_) Fail("a record ends inside a field");
    if (pos_ < wbegin_ || pos_ >= wbegin_ + window_.size()) Fill();
    return static_cast<uint8_t>(window_[pos_++ - wbegin_]);
  }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const uint8_t b = Byte();
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    Fail("a varint longer than 10 bytes");
  }
  // A length-delimited field's bounds [pos, pos + len), checked.
  uint64_t Length() {
    const uint64_t n = Varint();
    if (n > end_ - pos_) Fail("a field of ", n, " bytes runs past its record");
    return n;
  }
  std::string String(uint64_t n) {
    if (n > 4096) Fail("a string of ", n, " bytes");
    std::string s;
    for (uint64_t i = 0; i < n; ++i) s.push_back(static_cast<char>(Byte()));
    return s;
  }
  void Skip(uint64_t n) { pos_ += n; }
  void SkipField(uint32_t wire_type) {
    switch (wire_type) {
      case 0:
        Varint();
        return;
      case 1:
        Skip(Checked(8));
        return;
      case 2:
        Skip(Length());
        return;
      case 5:
        Skip(Checked(4));
        return;
      default:
        Fail("wire type ", wire_type, " (not a Checkpoint stream)");
    }
  }
  template <typename... A>
  [[noreturn]] void Fail(const A&... a) const {
    throw FormatError(path_.string(), " @", pos_, ": ", a...,
                      " (not a MindSpore checkpoint, or damaged)");
  }

 private:
  uint64_t Checked(uint64_t n) {
    if (n > end_ - pos_) Fail("a field runs past its record");
    return n;
  }
  void Fill() {
    wbegin_ = pos_;
    window_.resize(
        static_cast<size_t>(std::min<uint64_t>(kWindow, end_ - pos_)));
    f_.ReadExact(window_.data(), window_.size(), pos_);
  }
  const File& f_;
  const fs::path& path_;
  uint64_t pos_;
  uint64_t end_;
  uint64_t wbegin_ = 0;
  std::string window_;
};

struct Record {
  std::string tag;
  std::string type;
  std::vector<int64_t> dims;
  bool map = false;
  CkptSlice content;
  bool has_content = false;
};

void ReadTensor(Wire& w, uint64_t end, Record& r) {
  while (w.pos() < end) {
    const uint64_t key = w.Varint();
    const uint32_t field = static_cast<uint32_t>(key >> 3);
    const uint32_t type = static_cast<uint32_t>(key & 7);
    if (field == 1 && type == 0) {
      r.dims.push_back(static_cast<int64_t>(w.Varint()));
    } else if (field == 1 && type == 2) {  // packed dims
      const uint64_t n = w.Length();       // (read before pos())
      const uint64_t e = w.pos() + n;
      while (w.pos() < e) r.dims.push_back(static_cast<int64_t>(w.Varint()));
    } else if (field == 2 && type == 2) {
      r.type = w.String(w.Length());
    } else if (field == 3 && type == 2) {
      r.content.length = w.Length();
      r.content.offset = w.pos();
      r.has_content = true;
      w.Skip(r.content.length);
    } else {
      w.SkipField(type);
    }
  }
  if (w.pos() != end) w.Fail("a tensor's fields run past it");
}

}  // namespace

std::optional<DType> DTypeOfTensorType(const std::string& t) {
  static const std::pair<const char*, DType> kTypes[] = {
      {"Float32", DType::kFloat32},   {"Float16", DType::kFloat16},
      {"BFloat16", DType::kBFloat16}, {"Float64", DType::kFloat64},
      {"Int8", DType::kInt8},         {"UInt8", DType::kUInt8},
      {"Uint8", DType::kUInt8},       {"Int16", DType::kInt16},
      {"Int32", DType::kInt32},       {"Int64", DType::kInt64},
      {"Bool", DType::kBool}};
  for (const auto& [name, dtype] : kTypes)
    if (t == name) return dtype;
  return std::nullopt;
}

std::string TensorTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "Float32";
    case DType::kFloat16:
      return "Float16";
    case DType::kBFloat16:
      return "BFloat16";
    case DType::kFloat64:
      return "Float64";
    case DType::kInt8:
      return "Int8";
    case DType::kUInt8:
      return "UInt8";
    case DType::kInt16:
      return "Int16";
    case DType::kInt32:
      return "Int32";
    case DType::kInt64:
      return "Int64";
    case DType::kBool:
      return "Bool";
    default:
      throw UsageError("MindSpore checkpoints hold no ", DTypeName(dtype),
                       " tensors");
  }
}

bool LooksLikeCkpt(const fs::path& path) noexcept {
  try {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return false;
    const File f = File::OpenRead(path);
    const uint64_t size = f.Size();
    if (size < 4) return false;
    Wire w(f, path, 0, size);
    if (w.Byte() != 0x0A) return false;
    const uint64_t n = w.Varint();
    if (n == 0 || n > size - w.pos()) return false;
    // The Value starts with its tag string.
    if (w.Byte() != 0x0A) return false;
    const uint64_t t = w.Varint();
    return t > 0 && t < 4096 && t < n;
  } catch (...) {
    return false;
  }
}

CkptIndex ReadCkptIndex(const fs::path& path) {
  const File f = File::OpenRead(path);
  uint64_t size = f.Size();
  CkptIndex index;
  index.path = path;
  if (size == 0) throw FormatError(path.string(), ": an empty file");
  // The CRC trailer: "crc_num" + 10 big-endian digits at the end.
  if (size >= kCrcMark.size() + kCrcDigits) {
    std::string tail(kCrcMark.size() + kCrcDigits, '\0');
    f.ReadExact(tail.data(), tail.size(), size - tail.size());
    if (tail.compare(0, kCrcMark.size(), kCrcMark) == 0) {
      uint64_t want = 0;
      for (size_t i = kCrcMark.size(); i < tail.size(); ++i)
        want = (want << 8) | static_cast<uint8_t>(tail[i]);
      const uint64_t data = size - tail.size();
      uLong crc = crc32(0L, Z_NULL, 0);
      std::string buf;
      for (uint64_t at = 0; at < data; at += buf.size()) {
        buf.resize(
            static_cast<size_t>(std::min<uint64_t>(kCrcChunk, data - at)));
        f.ReadExact(buf.data(), buf.size(), at);
        crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()),
                    static_cast<uInt>(buf.size()));
      }
      if (crc != want) {
        throw FormatError(path.string(), ": CRC-32 ", crc,
                          " of the records, the trailer says ", want,
                          " (damaged after it was written)");
      }
      index.crc = true;
      size = data;
    }
  }
  Wire w(f, path, 0, size);
  std::optional<Record> last;
  auto flush = [&](Record r) {
    if (!index.entries.empty() && index.entries.back().tag == r.tag && r.map &&
        index.entries.back().map_tensor) {
      // A map tensor is streamed in several Values: their raw bytes.
      index.entries.back().slices.push_back(r.content);
      index.entries.back().nbytes += r.content.length;
      return;
    }
    if (!index.entries.empty() && index.entries.back().tag == r.tag && !r.map &&
        !index.entries.back().map_tensor) {
      CkptEntry& e = index.entries.back();
      if (e.dims != r.dims || e.tensor_type != r.type)
        w.Fail("slices of ", r.tag, " disagree on dims or type");
      e.slices.push_back(r.content);
      e.nbytes += r.content.length;
      return;
    }
    for (const CkptEntry& e : index.entries)
      if (e.tag == r.tag) w.Fail("parameter ", r.tag, " stored twice");
    CkptEntry e;
    e.tag = std::move(r.tag);
    e.tensor_type = std::move(r.type);
    e.dims = std::move(r.dims);
    e.map_tensor = r.map;
    if (r.has_content || r.map) {
      e.slices.push_back(r.content);
      e.nbytes = r.content.length;
    }
    index.entries.push_back(std::move(e));
  };
  while (!w.done()) {
    const uint64_t record = w.pos();
    if (w.Byte() != 0x0A) w.Fail("a record does not start with a Value");
    const uint64_t n = w.Length();  // (read before pos())
    const uint64_t vend = w.pos() + n;
    Record r;
    bool have_value = false;
    while (w.pos() < vend) {
      const uint64_t key = w.Varint();
      const uint32_t field = static_cast<uint32_t>(key >> 3);
      const uint32_t type = static_cast<uint32_t>(key & 7);
      if (field == 1 && type == 2) {
        r.tag = w.String(w.Length());
      } else if (field == 2 && type == 2) {
        const uint64_t tlen = w.Length();
        const uint64_t tend = w.pos() + tlen;
        ReadTensor(w, tend, r);
        have_value = true;
      } else if (field == 3 && type == 2) {  // MapTensorProto: not read
        r.map = true;
        w.Skip(w.Length());
        have_value = true;
        r.content = {record, vend - record};  // the whole record, raw
      } else {
        w.SkipField(type);
      }
    }
    if (w.pos() != vend) w.Fail("a Value's fields run past it");
    if (r.tag.empty()) w.Fail("a Value without a tag");
    if (!have_value) w.Fail(r.tag, ": a Value without a tensor");
    if (!r.map && !r.has_content) w.Fail(r.tag, ": a tensor without content");
    flush(std::move(r));
  }
  if (index.entries.empty()) throw FormatError(path.string(), ": no records");
  return index;
}

}  // namespace ucp::mindspore
