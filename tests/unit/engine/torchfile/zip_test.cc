// The zip layer against the spec (layout arithmetic) and Python's zipfile
// (reading archives it writes; checking the archives we write).

#include "engine/torchfile/zip.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/torchfile/crc32_fast.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/torchfile/torchfile_testutil.h"

namespace ucp::torchfile {
namespace {

using test::Bytes;

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

TEST(Crc32Test, MatchesTheStandardCheckValue) {
  // CRC-32/ISO-HDLC check value from the catalogue of CRC algorithms.
  EXPECT_EQ(Crc32(Bytes("123456789")), 0xCBF43926u);
  EXPECT_EQ(Crc32(Bytes("")), 0u);
}

// Oracle: the bit-at-a-time definition of CRC-32 (reflected 0xEDB88320,
// init and xorout 0xFFFFFFFF), independent of zlib and of the folded path.
uint32_t BitwiseCrc32(const unsigned char* p, size_t n, uint32_t crc) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k)
      crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

TEST(Crc32Property, FoldedPathMatchesBitwiseDefinition) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> buf(300000);
  for (auto& c : buf) c = static_cast<unsigned char>(rng());
  for (int iter = 0; iter < 400; ++iter) {
    size_t off = rng() % 64;
    size_t len = iter < 300 ? rng() % 3000 : rng() % (buf.size() - 64);
    uint32_t init = iter % 2 ? static_cast<uint32_t>(rng()) : 0u;
    auto span =
        std::as_bytes(std::span<const unsigned char>(buf.data() + off, len));
    ASSERT_EQ(Crc32(span, init), BitwiseCrc32(buf.data() + off, len, init))
        << "offset " << off << " length " << len;
  }
}

TEST(Crc32Property, WideAndFoldedPathsAgree) {
  if (!internal::HaveWideCrc32()) GTEST_SKIP() << "no AVX-512 VPCLMULQDQ";
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> buf(1 << 20);
  for (auto& c : buf) c = static_cast<unsigned char>(rng());
  for (int iter = 0; iter < 300; ++iter) {
    const size_t off = rng() % 64;
    const size_t len = (256 + rng() % (buf.size() - 320)) & ~size_t{15};
    const uint32_t init = static_cast<uint32_t>(rng());
    ASSERT_EQ(internal::Crc32Wide(init, buf.data() + off, len),
              internal::Crc32Folded(init, buf.data() + off, len))
        << "offset " << off << " length " << len;
  }
}

TEST(Crc32Test, CombineEqualsCrcOfConcatenation) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 50; ++i) {
    std::string a = RandomBytes(rng, rng() % 3000);
    std::string b = RandomBytes(rng, rng() % 3000);
    EXPECT_EQ(Crc32Combine(Crc32(Bytes(a)), Crc32(Bytes(b)), b.size()),
              Crc32(Bytes(a + b)));
    // Empty pieces on either side.
    EXPECT_EQ(Crc32Combine(Crc32(Bytes(a)), Crc32(Bytes("")), 0),
              Crc32(Bytes(a)));
    EXPECT_EQ(Crc32Combine(Crc32(Bytes("")), Crc32(Bytes(b)), b.size()),
              Crc32(Bytes(b)));
  }
}

// Size of a local header + name + extras before the padding field, per the
// spec in zip.h.
uint64_t HeaderBeforePad(const ZipPlannedRecord& r) {
  return 30 + r.name.size() + (r.zip64_size ? 20 : 0);
}

TEST(PlanZipLayoutTest, AlignsEveryRecordAndPacksThemTightly) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 20; ++round) {
    std::vector<ZipRecordSpec> specs;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      specs.push_back(
          {"arch" + std::string(rng() % 7, 'x') + "/data/" + std::to_string(i),
           rng() % 1000});
    }
    const uint32_t alignment = round % 2 == 0 ? 64 : 4096;
    ZipLayout l = PlanZipLayout(specs, {alignment, false});
    ASSERT_EQ(l.records.size(), specs.size());
    uint64_t cursor = 0;
    uint64_t cd = 0;
    for (const ZipPlannedRecord& r : l.records) {
      EXPECT_EQ(r.header_offset, cursor);
      EXPECT_EQ(r.data_offset % alignment, 0u) << r.name;
      const uint64_t pad_start = r.header_offset + HeaderBeforePad(r) + 4;
      EXPECT_GE(r.data_offset, pad_start);
      EXPECT_LT(r.data_offset, pad_start + alignment);
      EXPECT_FALSE(r.zip64_size);
      EXPECT_FALSE(r.zip64_offset);
      cursor = r.data_offset + r.size;
      cd += 46 + r.name.size();
    }
    EXPECT_EQ(l.central_directory_offset, cursor);
    EXPECT_EQ(l.central_directory_size, cd);
    EXPECT_EQ(l.zip64_eocd_offset, cursor + cd);
    EXPECT_EQ(l.total_size, cursor + cd + 56 + 20 + 22);
  }
}

TEST(PlanZipLayoutTest, UsesZip64PastFourGiB) {
  const uint64_t kGiB = uint64_t{1} << 30;
  std::vector<ZipRecordSpec> specs = {{"a/data/0", 5 * kGiB},
                                      {"a/data/1", 10},
                                      {"a/data/2", 0xFFFFFFFFu},
                                      {"a/data/3", 0xFFFFFFFEu},
                                      {"a/version", 2}};
  ZipLayout l = PlanZipLayout(specs);
  ASSERT_EQ(l.records.size(), 5u);
  // Sizes >= 0xFFFFFFFF need zip64 sizes; offsets >= 0xFFFFFFFF zip64 offsets.
  EXPECT_TRUE(l.records[0].zip64_size);
  EXPECT_FALSE(l.records[0].zip64_offset);
  EXPECT_FALSE(l.records[1].zip64_size);
  EXPECT_TRUE(l.records[1].zip64_offset);
  EXPECT_TRUE(l.records[2].zip64_size);
  EXPECT_FALSE(l.records[3].zip64_size);
  EXPECT_TRUE(l.records[4].zip64_offset);
  // First record: 30 + 8 name + 20 zip64 extra + 4 pad header = 62 -> 64.
  EXPECT_EQ(l.records[0].data_offset, 64u);
  EXPECT_EQ(l.records[1].header_offset, 64 + 5 * kGiB);
  for (const ZipPlannedRecord& r : l.records) {
    EXPECT_EQ(r.data_offset % 64, 0u);
    EXPECT_GT(r.data_offset, uint64_t{0xFFFFFFFF} * (&r != &l.records[0]));
  }
  uint64_t cd = 0;
  for (const ZipPlannedRecord& r : l.records) {
    uint64_t extra = 0;
    if (r.zip64_size || r.zip64_offset) {
      extra = 4 + (r.zip64_size ? 16 : 0) + (r.zip64_offset ? 8 : 0);
    }
    cd += 46 + r.name.size() + extra;
  }
  EXPECT_EQ(l.central_directory_size, cd);
  EXPECT_GT(l.central_directory_offset, 4 * kGiB);
}

TEST(PlanZipLayoutTest, ForcedZip64MarksEverything) {
  std::vector<ZipRecordSpec> specs = {{"a/x", 1}, {"a/y", 0}};
  ZipLayout l = PlanZipLayout(specs, {64, true});
  for (const ZipPlannedRecord& r : l.records) {
    EXPECT_TRUE(r.zip64_size);
    EXPECT_TRUE(r.zip64_offset);
    EXPECT_EQ(r.data_offset % 64, 0u);
  }
}

TEST(PlanZipLayoutTest, RejectsBadInput) {
  std::vector<ZipRecordSpec> dup = {{"a/x", 1}, {"a/x", 2}};
  EXPECT_THROW(PlanZipLayout(dup), UsageError);
  std::vector<ZipRecordSpec> empty = {{"", 1}};
  EXPECT_THROW(PlanZipLayout(empty), UsageError);
  std::vector<ZipRecordSpec> ok = {{"a/x", 1}};
  EXPECT_THROW(PlanZipLayout(ok, {48, false}), UsageError);
  std::vector<ZipRecordSpec> huge = {{"a/x", uint64_t{1} << 63},
                                     {"a/y", uint64_t{1} << 63}};
  EXPECT_THROW(PlanZipLayout(huge), UsageError);
}

// Python oracle for archives we write: prints one JSON object with testzip's
// verdict and, per entry, name, header offset, data offset, size, crc, sha256.
constexpr std::string_view kInspectZip = R"PY(
import hashlib, json, struct, sys, zipfile
path = sys.argv[1]
out = {"entries": []}
with zipfile.ZipFile(path) as zf:
    out["testzip"] = zf.testzip()
    raw = open(path, "rb").read()
    for info in zf.infolist():
        h = info.header_offset
        sig, = struct.unpack("<I", raw[h:h + 4])
        n, e = struct.unpack("<HH", raw[h + 26:h + 30])
        out["entries"].append({
            "name": info.filename, "header_offset": h, "data_offset": h + 30 + n + e,
            "local_sig_ok": sig == 0x04034b50, "size": info.file_size,
            "compress_type": info.compress_type, "crc": info.CRC,
            "sha256": hashlib.sha256(zf.read(info)).hexdigest()})
print(json.dumps(out))
)PY";

nlohmann::json InspectWithPython(const std::filesystem::path& path) {
  std::string out;
  int rc = test::RunPythonScript(kInspectZip,
                                 testutil::ShellQuote(path.string()), &out);
  EXPECT_EQ(rc, 0) << out;
  if (rc != 0) return nlohmann::json::object();
  return nlohmann::json::parse(out.substr(out.find('{')));
}

// Writes `contents` as records of a new archive, in random chunks from
// several threads, then checks it with Python and with ZipReader.
void WriteAndCheck(
    const std::vector<std::pair<std::string, std::string>>& contents,
    const ZipLayoutOptions& options, uint64_t seed) {
  testutil::TempDir dir;
  const std::filesystem::path path = dir / "out.pt";
  std::vector<ZipRecordSpec> specs;
  for (const auto& [name, data] : contents)
    specs.push_back({name, data.size()});
  struct Piece {
    size_t record;
    uint64_t offset;
    uint64_t len;
  };
  std::vector<Piece> pieces;
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < contents.size(); ++i) {
    uint64_t off = 0;
    const uint64_t size = contents[i].second.size();
    while (off < size) {
      uint64_t len = std::min<uint64_t>(size - off, 1 + rng() % 700);
      pieces.push_back({i, off, len});
      off += len;
    }
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  {
    ZipWriter writer(path, specs, options);
    EXPECT_FALSE(std::filesystem::exists(path));
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (size_t k = t; k < pieces.size(); k += 4) {
          const Piece& p = pieces[k];
          writer.Write(p.record, p.offset,
                       Bytes(std::string_view(contents[p.record].second)
                                 .substr(p.offset, p.len)));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    writer.Commit();
    ASSERT_EQ(std::filesystem::file_size(path), writer.layout().total_size);
  }
  nlohmann::json py = InspectWithPython(path);
  EXPECT_TRUE(py["testzip"].is_null()) << py.dump();
  ASSERT_EQ(py["entries"].size(), contents.size());
  for (size_t i = 0; i < contents.size(); ++i) {
    const nlohmann::json& e = py["entries"][i];
    EXPECT_EQ(e["name"], contents[i].first);
    EXPECT_TRUE(e["local_sig_ok"].get<bool>());
    EXPECT_EQ(e["size"], contents[i].second.size());
    EXPECT_EQ(e["compress_type"], 0);
    EXPECT_EQ(e["data_offset"].get<uint64_t>() % options.alignment, 0u);
    EXPECT_EQ(e["crc"].get<uint32_t>(), Crc32(Bytes(contents[i].second)));
    EXPECT_EQ(e["sha256"], testutil::Sha256Hex(contents[i].second));
  }
  // And our own reader.
  ZipReader reader = ZipReader::Open(path);
  ASSERT_EQ(reader.entries().size(), contents.size());
  for (size_t i = 0; i < contents.size(); ++i) {
    const ZipEntry& e = reader.entries()[i];
    EXPECT_EQ(e.name, contents[i].first);
    EXPECT_EQ(reader.DataOffset(e), py["entries"][i]["data_offset"]);
    EXPECT_EQ(reader.ReadRecord(e), contents[i].second);
    EXPECT_TRUE(reader.CheckCrc(e));
  }
}

TEST(ZipWriterTest, ParallelOutOfOrderWritesGiveAValidArchive) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::string, std::string>> contents;
  contents.emplace_back("out/data.pkl", RandomBytes(rng, 100));
  contents.emplace_back("out/byteorder", "little");
  for (int i = 0; i < 12; ++i) {
    contents.emplace_back("out/data/" + std::to_string(i),
                          RandomBytes(rng, rng() % 5000));
  }
  contents.emplace_back("out/data/empty", "");
  contents.emplace_back("out/version", "3\n");
  WriteAndCheck(contents, {}, seed);
  WriteAndCheck(contents, {4096, false}, seed + 1);
  WriteAndCheck(contents, {64, true}, seed + 2);  // zip64 extras everywhere
}

TEST(ZipWriterTest, IncompleteOrOverlappingWritesLeaveNoFile) {
  testutil::TempDir dir;
  const std::filesystem::path path = dir / "x.pt";
  std::vector<ZipRecordSpec> specs = {{"x/a", 10}, {"x/b", 4}};
  auto files_in_dir = [&] {
    return std::distance(std::filesystem::directory_iterator(dir.path()),
                         std::filesystem::directory_iterator());
  };
  {
    ZipWriter w(path, specs);
    w.Write(0, 0, Bytes("0123456789"));
    w.Write(1, 0, Bytes("ab"));
    EXPECT_THAT([&] { w.Commit(); },
                ThrowsMessage<UsageError>(HasSubstr("x/b")));
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_EQ(files_in_dir(), 0);
    EXPECT_THROW(w.Commit(), UsageError);
  }
  {
    ZipWriter w(path, specs);
    w.Write(0, 2, Bytes("2345"));
    EXPECT_THAT([&] { w.Write(0, 5, Bytes("567")); },
                ThrowsMessage<UsageError>(HasSubstr("written twice")));
    EXPECT_THROW(w.Commit(), UsageError);
    EXPECT_FALSE(std::filesystem::exists(path));
  }
  {
    ZipWriter w(path, specs);
    w.Write(0, 4, Bytes("456"));
    EXPECT_THROW(w.Write(0, 1, Bytes("1234")), UsageError);  // overlaps left
  }
  {
    ZipWriter w(path, specs);
    EXPECT_THROW(w.Write(1, 2, Bytes("abc")), UsageError);  // past the end
    EXPECT_THROW(w.Write(2, 0, Bytes("a")), UsageError);    // no record 2
  }
  {
    ZipWriter w(path, specs);
    w.Write(0, 0, Bytes("0123456789"));
    w.Write(1, 0, Bytes("abcd"));
    // Destroyed without Commit.
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(files_in_dir(), 0);
}

// Python writes archives our reader must understand: stored and deflated
// entries, arbitrary prefixes, comments, forced zip64, an archive embedded
// inside a larger file. It prints a manifest of what it wrote.
constexpr std::string_view kMakeZips = R"PY(
import hashlib, io, json, os, random, sys, zipfile
out_dir = sys.argv[1]
rng = random.Random(int(sys.argv[2]))
manifest = []
def payload(n):
    # Compressible but not trivial.
    return bytes(rng.choice(b"abcdefgh\x00\xff") for _ in range(n))
def make(name, entries, comment=b"", zip64=False, method=zipfile.ZIP_STORED,
         prefix_junk=0, suffix_junk=0):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        for ename, data, emethod in entries:
            info = zipfile.ZipInfo(ename)
            info.compress_type = emethod if emethod is not None else method
            with zf.open(info, "w", force_zip64=zip64) as f:
                f.write(data)
        zf.comment = comment
    blob = buf.getvalue()
    path = os.path.join(out_dir, name)
    with open(path, "wb") as f:
        f.write(os.urandom(prefix_junk) + blob + os.urandom(suffix_junk))
    manifest.append({"file": path, "offset": prefix_junk, "length": len(blob),
                     "entries": [{"name": n, "method": m if m is not None else method,
                                  "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                                 for n, d, m in entries]})
basic = [("my.odd prefix/data.pkl", payload(300), None),
         ("my.odd prefix/data/0", payload(5000), None),
         ("my.odd prefix/data/1", b"", None),
         ("my.odd prefix/version", b"3\n", None)]
make("stored.zip", basic)
make("deflated.zip", basic, method=zipfile.ZIP_DEFLATED)
make("mixed.zip", [(n, d, zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED)
                   for i, (n, d, _) in enumerate(basic)])
make("comment.zip", basic, comment=b"a comment with PK\x05\x06 inside")
make("zip64.zip", basic, zip64=True)
make("zip64_deflated.zip", basic, zip64=True, method=zipfile.ZIP_DEFLATED)
make("embedded.bin", basic, prefix_junk=777, suffix_junk=1234)
make("embedded_deflated.bin", basic, method=zipfile.ZIP_DEFLATED, prefix_junk=4096,
     suffix_junk=3)
make("many.zip", [("archive/data/%d" % i, payload(rng.randrange(0, 200)), None)
                  for i in range(300)])
# Larger than 64 KiB: the end records are looked for in the last 4 KiB first.
big = [("archive/data.pkl", payload(700), None),
       ("archive/byteorder", b"little", None),
       ("archive/data/0", payload(100000), None),
       ("archive/version", b"3\n", None)]
make("big.zip", big)
make("big_comment.zip", big, comment=payload(10000))
# A record-like "PK\x05\x06" in the last 4 KiB of the comment that fits but
# does not end the archive: the real end record (further back) must win.
make("big_fake_eocd.zip", big,
     comment=payload(6000) + b"PK\x05\x06" + bytes(18) + payload(100))
make("big_embedded.bin", big, prefix_junk=5000, suffix_junk=70000)
print(json.dumps(manifest))
)PY";

TEST(ZipReaderTest, ReadsWhatPythonZipfileWrites) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  testutil::TempDir dir;
  std::string out;
  ASSERT_EQ(test::RunPythonScript(kMakeZips,
                                  testutil::ShellQuote(dir.path().string()) +
                                      " " + std::to_string(seed % 1000000),
                                  &out),
            0)
      << out;
  nlohmann::json manifest = nlohmann::json::parse(out.substr(out.find('[')));
  ASSERT_GE(manifest.size(), 13u);
  std::mt19937_64 rng(seed);
  for (const nlohmann::json& m : manifest) {
    const std::string file = m["file"];
    SCOPED_TRACE(file);
    const bool embedded = m["offset"].get<uint64_t>() != 0;
    ZipReader reader = embedded
                           ? ZipReader::Open(file, m["offset"].get<uint64_t>(),
                                             m["length"].get<uint64_t>())
                           : ZipReader::Open(file);
    ASSERT_EQ(reader.entries().size(), m["entries"].size());
    for (size_t i = 0; i < reader.entries().size(); ++i) {
      const ZipEntry& e = reader.entries()[i];
      const nlohmann::json& want = m["entries"][i];
      EXPECT_EQ(e.name, want["name"]);
      EXPECT_EQ(e.method, want["method"]);
      EXPECT_EQ(e.uncompressed_size, want["size"]);
      EXPECT_EQ(reader.Find(e.name), &e);
      const std::string all = reader.ReadRecord(e);
      EXPECT_EQ(testutil::Sha256Hex(all), want["sha256"]);
      EXPECT_TRUE(reader.CheckCrc(e));
      // Digest shows every chunk it reads, in order, covering the record.
      std::string seen;
      const ZipReader::RecordDigest d = reader.Digest(
          e, /*xxh3=*/true, [&](uint64_t offset, std::span<const std::byte> b) {
            EXPECT_EQ(offset, seen.size());
            seen.append(reinterpret_cast<const char*>(b.data()), b.size());
          });
      EXPECT_TRUE(d.crc_ok);
      EXPECT_EQ(d.xxh3, Xxh3(all.data(), all.size()));
      EXPECT_EQ(seen, all);
      EXPECT_TRUE(reader.Digest(e, /*xxh3=*/false).crc_ok);
      // Reads are the same from the cache of small reads and without it.
      if (i == 1) reader.ReleaseCache();
      if (!all.empty()) {
        const uint64_t off = rng() % all.size();
        const uint64_t len = rng() % (all.size() - off + 1);
        std::string part(len, '\0');
        reader.ReadRange(
            e, off, std::as_writable_bytes(std::span<char>(part.data(), len)));
        EXPECT_EQ(part, all.substr(off, len));
      }
      std::string one(1, '\0');
      EXPECT_THROW(
          reader.ReadRange(e, all.size(),
                           std::as_writable_bytes(std::span<char>(one))),
          UsageError);
    }
    EXPECT_EQ(reader.Find("no/such/entry"), nullptr);
  }
}

// CheckCrc with the CRC-32s of ranges already read: random pieces (some
// overlapping, empty or outside the record) give the record's CRC while only
// the bytes between the usable ones are read; a piece whose CRC is wrong (the
// reader saw damaged bytes) or damage between the pieces fails the check.
TEST(ZipReaderProperty, CheckCrcCombinesKnownPiecesAndReadsOnlyTheGaps) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const std::filesystem::path path = dir / "a.pt";
  const std::string data = RandomBytes(rng, 300000 + rng() % 100000);
  {
    const std::vector<ZipRecordSpec> specs = {{"a/data/0", data.size()}};
    ZipWriter writer(path, specs);
    writer.Write(0, 0, Bytes(data));
    writer.Commit();
  }
  for (int round = 0; round < 50; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    std::vector<CrcPiece> pieces;
    const int n = static_cast<int>(rng() % 8);
    for (int i = 0; i < n; ++i) {
      CrcPiece p;
      p.offset = rng() % (data.size() + 100);
      p.size = rng() % 4 == 0 ? 0 : 1 + rng() % 80000;
      if (p.offset + p.size <= data.size()) {
        p.crc = Crc32(Bytes(std::string_view(data).substr(p.offset, p.size)));
      }
      pieces.push_back(p);
    }
    // What the reader should read: the record minus the pieces it can use
    // (sorted by offset, longest first; each must start after the last).
    std::vector<CrcPiece> usable = pieces;
    std::sort(usable.begin(), usable.end(), [](auto& a, auto& b) {
      return a.offset != b.offset ? a.offset < b.offset : a.size > b.size;
    });
    uint64_t at = 0, skipped = 0;
    for (const CrcPiece& p : usable) {
      if (p.size == 0 || p.offset < at || p.offset + p.size > data.size())
        continue;
      skipped += p.size;
      at = p.offset + p.size;
    }
    const ZipReader reader = ZipReader::Open(path);
    const ZipEntry& e = reader.entries()[0];
    reader.DataOffset(e);  // the local header, read once
    // Without the bytes kept from the headers' reads (which hold the first
    // and last KiB of the record): only the gaps are read.
    reader.ReleaseCache();
    const uint64_t before = testutil::BytesRead();
    EXPECT_TRUE(reader.CheckCrc(e, pieces));
    // (reading /proc/self/io itself counts some 100 bytes)
    EXPECT_NEAR(static_cast<double>(testutil::BytesRead() - before),
                static_cast<double>(data.size() - skipped), 256);
    // A usable piece with a wrong CRC.
    for (CrcPiece& p : pieces) {
      if (p.size == 0 || p.offset + p.size > data.size()) continue;
      std::vector<CrcPiece> bad = {p};
      bad[0].crc ^= 1u << (rng() % 32);
      EXPECT_FALSE(reader.CheckCrc(e, bad));
      break;
    }
  }
  // Damage between the pieces is read and caught.
  {
    const ZipReader reader = ZipReader::Open(path);
    const uint64_t at = reader.DataOffset(reader.entries()[0]) + 150000;
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(data[150000] ^ 0x10));
  }
  const ZipReader reader = ZipReader::Open(path);
  const std::vector<CrcPiece> around = {
      {0, 100000, Crc32(Bytes(std::string_view(data).substr(0, 100000)))},
      {200000, 1000,
       Crc32(Bytes(std::string_view(data).substr(200000, 1000)))}};
  EXPECT_FALSE(reader.CheckCrc(reader.entries()[0], around));
  EXPECT_FALSE(reader.CheckCrc(reader.entries()[0]));
}

TEST(ZipReaderTest, RejectsNonZipAndSlicesOutsideTheFile) {
  testutil::TempDir dir;
  testutil::WriteFile(dir / "junk.bin", std::string(1000, 'j'));
  EXPECT_THAT([&] { ZipReader::Open(dir / "junk.bin"); },
              ThrowsMessage<FormatError>(HasSubstr("junk.bin")));
  EXPECT_THROW(ZipReader::Open(dir / "junk.bin", 990, 20), FormatError);
  EXPECT_THROW(ZipReader::Open(dir / "missing.bin"), IoError);
}

// Opt-in: a real archive larger than 4 GiB, checked by Python's zipfile.
TEST(ZipLargeTest, RecordsPastFourGiB) {
  const char* flag = std::getenv("UCP_LARGE_TESTS");
  if (flag == nullptr || std::string(flag) != "1") {
    GTEST_SKIP() << "set UCP_LARGE_TESTS=1 to write a 4.5 GiB archive";
  }
  testutil::TempDir dir;
  const std::filesystem::path path = dir / "big.pt";
  const uint64_t big = (uint64_t{9} << 29);  // 4.5 GiB
  std::vector<ZipRecordSpec> specs = {{"big/data/0", big}, {"big/data/1", 100}};
  {
    ZipWriter w(path, specs);
    AlignedBuffer buf(64 << 20);
    for (uint64_t off = 0; off < big; off += buf.size()) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(buf.size(), big - off));
      for (size_t i = 0; i < n; i += 4096) {
        std::memcpy(buf.data() + i, &off, sizeof(off));
      }
      w.Write(0, off, std::span<const std::byte>(buf.data(), n));
    }
    w.Write(1, 0, Bytes(std::string(100, 't')));
    w.Commit();
    EXPECT_GT(w.layout().records[1].data_offset, uint64_t{1} << 32);
  }
  nlohmann::json py = InspectWithPython(path);
  EXPECT_TRUE(py["testzip"].is_null()) << py.dump();
  EXPECT_EQ(py["entries"][1]["sha256"],
            testutil::Sha256Hex(std::string(100, 't')));
  EXPECT_EQ(py["entries"][1]["data_offset"].get<uint64_t>() % 64, 0u);
  ZipReader reader = ZipReader::Open(path);
  EXPECT_EQ(reader.entries()[0].uncompressed_size, big);
  EXPECT_EQ(reader.ReadRecord(reader.entries()[1]), std::string(100, 't'));
}

// Opt-in throughput figures (not a pass/fail criterion).
TEST(ZipPerfTest, Crc32Throughput) {
  const char* flag = std::getenv("UCP_PERF_TESTS");
  if (flag == nullptr || std::string(flag) != "1") {
    GTEST_SKIP() << "set UCP_PERF_TESTS=1 to measure";
  }
  AlignedBuffer buf(size_t{1} << 30);
  std::memset(buf.data(), 0x5A, buf.size());
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    volatile uint32_t crc = Crc32(buf.span());
    (void)crc;
    double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    best = std::max(best, buf.size() / s / 1e9);
  }
  std::printf("crc32_z on 1 GiB: %.2f GB/s\n", best);
}

}  // namespace
}  // namespace ucp::torchfile
