// The write side as data (formats/target_plan.h, emit.h): the containers
// against torch and the format spec, the emit stage's order and manifest,
// and the drivers' planning checked against real framework files without
// writing a byte.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/driver.h"
#include "engine/formats/emit.h"
#include "engine/formats/target_plan.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/zip.h"
#include "engine/universal/input.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/stub_input.h"

namespace ucp::formats {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

class MemSource : public reshape::ByteSource {
 public:
  explicit MemSource(std::string bytes) : bytes_(std::move(bytes)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    ASSERT_LE(offset + dst.size(), bytes_.size());
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
  }
  std::string Describe() const override { return "memory"; }

 private:
  std::string bytes_;
};

std::string Floats(int n, float start) {
  std::string s(static_cast<size_t>(n) * 4, '\0');
  for (int i = 0; i < n; ++i) {
    const float v = start + static_cast<float>(i);
    std::memcpy(s.data() + i * 4, &v, 4);
  }
  return s;
}

// A slot copying elements [at, at + n) of a float32 source.
reshape::TargetTensor Slot(const std::string& name, int64_t at, int64_t n) {
  reshape::TargetTensor t;
  t.name = name;
  t.dtype = DType::kFloat32;
  t.shape = {n};
  t.ops.push_back({reshape::SourceTensor{
                       0, static_cast<uint64_t>(at) * 4, DType::kFloat32, {n}},
                   Box::Whole(Shape{n}),
                   Box::Whole(Shape{n}),
                   0,
                   {}});
  return t;
}

void Fill(PlannedFile& f, const MemSource& src) {
  std::vector<const reshape::ByteSource*> sources = {&src};
  reshape::Execute(f.jobs(), sources, {.threads = 2});
}

// The framing of archives back to back is written in runs carried from one
// archive's directory into the next one's headers (ZipWriter::Commit(carry)):
// with a raw archive between two (no join) and a record over 4 KiB (written
// by the executor, between two runs), every archive still reads back whole in
// torch, and the integrity check finds every record's CRC right.
TEST(TargetPlanTest, CarriedFramingRunsKeepEveryArchiveWhole) {
  testutil::TempDir dir;
  const MemSource src(Floats(3000, 0.25f));
  TorchSaveRunFile f("__0_0.distcp");
  const std::vector<int64_t> sizes = {7, 0, 2000, 9, 11};  // 0: the raw one
  pickle::Arena blob_arena;
  const std::string blob = SaveBlob(
      nullptr, blob_arena.Dict({{blob_arena.Str("lr"), blob_arena.Int(7)}}));
  for (size_t a = 0; a < sizes.size(); ++a) {
    if (sizes[a] == 0) {
      EXPECT_EQ(f.AddRawArchive(blob), a);
      continue;
    }
    TorchArchive& ar = f.AddArchive();
    pickle::Value* root = ar.arena().Dict();
    root->entries.emplace_back(
        ar.arena().Str("x"),
        f.AddTensor(
            a, Slot(StrCat("x", a), static_cast<int64_t>(a) * 100, sizes[a])));
    ar.SetRoot(root);
  }
  const uint64_t size = f.Layout();
  f.Open(dir.path());
  Fill(f, src);
  f.Commit();
  const fs::path path = dir / "__0_0.distcp";
  ASSERT_EQ(fs::file_size(path), size);
  const std::vector<ArchiveSpan> spans = f.archives();
  ASSERT_EQ(spans.size(), sizes.size());
  EXPECT_EQ(testutil::ReadFile(path).substr(spans[1].offset, spans[1].length),
            blob);
  std::string script =
      "import io, sys, torch\nd = open(sys.argv[1], 'rb').read()\n";
  int compared = 0;
  for (size_t a = 0; a < sizes.size(); ++a) {
    if (sizes[a] == 0) continue;
    const torchfile::TorchFile t =
        torchfile::TorchFile::Open(path, spans[a].offset, spans[a].length);
    ASSERT_EQ(t.tensors().size(), 1u);
    std::string got(t.tensors()[0].nbytes, '\0');
    t.ReadTensor(t.tensors()[0], std::as_writable_bytes(std::span<char>(got)));
    EXPECT_EQ(got, Floats(static_cast<int>(sizes[a]),
                          0.25f + 100.0f * static_cast<float>(a)));
    script += StrCat("o = torch.load(io.BytesIO(d[", spans[a].offset, ":",
                     spans[a].offset + spans[a].length, "]))\n",
                     "assert o['x'].tolist() == [", 0.25 + 100.0 * a,
                     " + i for i in range(", sizes[a], ")], o\n");
    ++compared;
  }
  EXPECT_EQ(compared, 4);
  script += StrCat("assert torch.load(io.BytesIO(d[", spans[1].offset, ":",
                   spans[1].offset + spans[1].length, "]))['lr'] == 7\n");
  const ArchivesOf archives_of = [&](const fs::path&) { return spans; };
  WriteManifest(dir.path(), {path}, archives_of);
  EXPECT_EQ(
      CheckIntegrity(dir.path(), {path}, nullptr, {}, archives_of).records,
      4 * 4 + 3);  // data.pkl, byteorder, the tensor, version; the blob's
  testutil::WriteFile(dir / "check.py", script + "print('ok')\n");
  std::string out;
  EXPECT_EQ(testutil::RunCommand(
                StrCat(testutil::ShellQuote(testutil::Python()), " ",
                       testutil::ShellQuote((dir / "check.py").string()), " ",
                       testutil::ShellQuote(path.string())),
                &out),
            0)
      << out;
}

// Several torch.save archives back to back (as a DCP .distcp file): each
// span is a whole archive that ucp and torch read on their own, with the
// slot's bytes and the constants; the spans tile the file.
TEST(TargetPlanTest, ARunOfArchivesIsTorchSaveFilesBackToBack) {
  testutil::TempDir dir;
  const MemSource src(Floats(100, 0.5f));
  TorchSaveRunFile f("sub/__0_0.distcp");
  for (int a = 0; a < 3; ++a) {
    TorchArchive& ar = f.AddArchive();
    pickle::Arena& arena = ar.arena();
    pickle::Value* root = arena.Dict();
    root->entries.emplace_back(
        arena.Str("x"), f.AddTensor(static_cast<size_t>(a),
                                    Slot(StrCat("x", a), a * 10, 7 + a)));
    std::vector<std::byte> bytes(8);
    bytes[0] = std::byte{static_cast<unsigned char>(a + 1)};
    root->entries.emplace_back(arena.Str("c"),
                               ar.AddConstant(DType::kInt64, {}, bytes));
    ar.SetRoot(root);
  }
  // A torch.save archive kept verbatim (a DCP BYTE_IO item).
  pickle::Arena blob_arena;
  const std::string blob = SaveBlob(
      nullptr, blob_arena.Dict({{blob_arena.Str("lr"), blob_arena.Int(42)}}));
  EXPECT_EQ(f.AddRawArchive(blob), 3u);
  EXPECT_THROW(f.archive(3), UsageError);
  const uint64_t size = f.Layout();
  f.Open(dir.path());
  Fill(f, src);
  f.Commit();
  const fs::path path = dir / "sub/__0_0.distcp";
  ASSERT_EQ(fs::file_size(path), size);
  const std::vector<ArchiveSpan> spans = f.archives();
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[3].length, blob.size());
  EXPECT_EQ(testutil::ReadFile(path).substr(spans[3].offset), blob);
  uint64_t at = 0;
  std::string script =
      "import io, sys, torch\nd = open(sys.argv[1], 'rb').read()\n";
  for (size_t a = 0; a < 3; ++a) {
    EXPECT_EQ(spans[a].offset, at);
    at += spans[a].length;
    const torchfile::TorchFile t =
        torchfile::TorchFile::Open(path, spans[a].offset, spans[a].length);
    const torchfile::TensorInfo* x = nullptr;
    for (const auto& info : t.tensors())
      if (info.shape == Shape{static_cast<int64_t>(7 + a)}) x = &info;
    ASSERT_NE(x, nullptr);
    std::string got(x->nbytes, '\0');
    t.ReadTensor(*x, std::as_writable_bytes(std::span<char>(got)));
    EXPECT_EQ(got, Floats(static_cast<int>(7 + a), 0.5f + 10.0f * a));
    script += StrCat("o = torch.load(io.BytesIO(d[", spans[a].offset, ":",
                     spans[a].offset + spans[a].length, "]))\n",
                     "assert o['x'].tolist() == [", 0.5 + 10.0 * a,
                     " + i for i in range(", 7 + a, ")], o\n",
                     "assert int(o['c']) == ", a + 1, "\n");
  }
  EXPECT_EQ(at + spans[3].length, size);
  script += StrCat("assert torch.load(io.BytesIO(d[", spans[3].offset,
                   ":]))['lr'] == 42\n");
  // Integrity sees each archive: a manifest names the records of archive k
  // at offset o > 0 "@o/<record>", and a flipped byte in one is caught.
  const ArchivesOf archives_of = [&](const fs::path&) { return spans; };
  const IntegrityReport m = WriteManifest(dir / "sub", {path}, archives_of);
  EXPECT_EQ(m.zips, 1);
  EXPECT_EQ(m.records, 3 * 5 + 3);  // data.pkl, byteorder, tensors, version
  EXPECT_THAT(testutil::ReadFile(dir / "sub" / kManifestName),
              HasSubstr(StrCat("\"@", spans[2].offset, "/archive/data.pkl")));
  EXPECT_EQ(
      CheckIntegrity(dir / "sub", {path}, nullptr, {}, archives_of).records,
      18);
  // A byte inside archive 1's first tensor record.
  const uint64_t victim = [&] {
    const torchfile::ZipReader z =
        torchfile::ZipReader::Open(path, spans[1].offset, spans[1].length);
    return z.DataOffset(*z.Find("archive/data/0")) + 5;
  }();
  auto flip = [&] {
    std::string bytes = testutil::ReadFile(path);
    bytes[victim] ^= 0x10;
    testutil::WriteFile(path, bytes);
  };
  flip();
  EXPECT_THAT(
      [&] { CheckIntegrity(dir / "sub", {path}, nullptr, {}, archives_of); },
      ThrowsMessage<FormatError>(HasSubstr(StrCat("@", spans[1].offset, "/"))));
  fs::remove(dir / "sub" / kManifestName);
  EXPECT_THAT(
      [&] { CheckIntegrity(dir / "sub", {path}, nullptr, {}, archives_of); },
      ThrowsMessage<FormatError>(HasSubstr("CRC-32 mismatch")));
  flip();
  testutil::WriteFile(dir / "check.py", script + "print('ok')\n");
  std::string out;
  EXPECT_EQ(testutil::RunCommand(
                StrCat(testutil::ShellQuote(testutil::Python()), " ",
                       testutil::ShellQuote((dir / "check.py").string()), " ",
                       testutil::ShellQuote(path.string())),
                &out),
            0)
      << out;
}

// Known bytes and slots back to back, at the offsets AddBytes / AddTensor
// returned; nothing under the final name before Commit.
TEST(TargetPlanTest, ARawFileIsItsSegmentsInOrder) {
  testutil::TempDir dir;
  const MemSource src(Floats(20, 1.0f));
  RawFile f("a/b.bin");
  EXPECT_EQ(f.AddBytes("head"), 0u);
  EXPECT_EQ(f.AddTensor(Slot("t", 2, 5)), 4u);
  EXPECT_EQ(f.AddBytes("tail"), 24u);
  EXPECT_EQ(f.size(), 28u);
  f.Open(dir.path());
  EXPECT_FALSE(fs::exists(dir / "a/b.bin"));
  Fill(f, src);
  f.Commit();
  EXPECT_EQ(testutil::ReadFile(dir / "a/b.bin"),
            "head" + Floats(5, 3.0f) + "tail");
  const auto text = TextFile("t.txt", "12\n");
  text->Open(dir.path());
  text->Commit();
  EXPECT_EQ(testutil::ReadFile(dir / "t.txt"), "12\n");
}

// A slot the executor never filled: Commit refuses, naming it, and nothing
// appears under the final name.
TEST(TargetPlanTest, AnIncompleteFileIsNeverCommitted) {
  testutil::TempDir dir;
  TorchSaveFile f("x.pt");
  pickle::Arena& a = f.arena();
  pickle::Value* root = a.Dict();
  root->entries.emplace_back(a.Str("w"), f.AddTensor(Slot("w", 0, 4)));
  f.SetRoot(root);
  f.Open(dir.path());
  EXPECT_THROW(f.Commit(), UsageError);
  EXPECT_FALSE(fs::exists(dir / "x.pt"));
}

// The emit stage: files committed in the plan's order (a tracker planned
// last is written last), batches of any size, the manifest of the
// checkpoint folder only.
// A torch.save file that notes when it is committed.
class NotedFile : public TorchSaveFile {
 public:
  NotedFile(std::string name, std::vector<std::string>* committed)
      : TorchSaveFile(name), committed_(committed) {}
  void Commit() override {
    TorchSaveFile::Commit();
    committed_->push_back(path().string());
  }

 private:
  std::vector<std::string>* committed_;
};

class ListPlan : public TargetPlan {
 public:
  ListPlan(std::vector<std::string>* planned,
           std::vector<std::string>* committed)
      : planned_(planned), committed_(committed) {}
  size_t units() const override { return 4; }
  std::vector<std::unique_ptr<PlannedFile>> Plan(size_t i) const override {
    std::vector<std::unique_ptr<PlannedFile>> out;
    if (i == 3) {
      out.push_back(TextFile("tracker", "3"));
      planned_->push_back("tracker");
      return out;
    }
    for (int k = 0; k < 2; ++k) {
      const std::string name = StrCat("ckpt/r", i, "_", k, ".pt");
      auto f = std::make_unique<NotedFile>(name, committed_);
      pickle::Arena& a = f->arena();
      pickle::Value* root = a.Dict();
      root->entries.emplace_back(
          a.Str("w"), f->AddTensor(Slot(name, static_cast<int64_t>(i), 3)));
      f->SetRoot(root);
      planned_->push_back(name);
      out.push_back(std::move(f));
    }
    return out;
  }
  fs::path checkpoint_dir() const override { return "ckpt"; }
  TargetSummary Summary() const override {
    TargetSummary s;
    s.notes = {"a note"};
    return s;
  }

 private:
  std::vector<std::string>* planned_;
  std::vector<std::string>* committed_;
};

// A universal input of one float32 "dataset" (for the emit stage's Run).
class MemInput : public testutil::StubInput {
 public:
  MemInput() : StubInput({}, {}, "memory"), src_(Floats(16, 0.0f)) {}
  reshape::ExecutorStats Run(
      std::span<reshape::Job> jobs,
      const reshape::ExecutorOptions& options) const override {
    std::vector<const reshape::ByteSource*> s = {&src_};
    runs_.push_back(jobs.size());
    return reshape::Execute(jobs, s, options);
  }
  mutable std::vector<size_t> runs_;

 private:
  MemSource src_;
};

TEST(EmitTest, CommitsInPlanOrderInBatchesWithTheManifest) {
  for (const size_t batch : {size_t{1}, size_t{3}, size_t{32}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch);
    testutil::TempDir dir;
    std::vector<std::string> planned, committed;
    const ListPlan plan(&planned, &committed);
    const MemInput input;
    EmitOptions o;
    o.batch_files = batch;
    o.manifest = true;
    const TargetSummary s = Emit(plan, input, dir.path(), o);
    EXPECT_EQ(s.files, 7);
    EXPECT_EQ(s.notes, std::vector<std::string>{"a note"});
    ASSERT_EQ(planned.size(), 7u);
    // Commit order = plan order (the tracker, planned last, is last).
    planned.pop_back();
    EXPECT_EQ(committed, planned);
    for (const std::string& name : planned)
      EXPECT_TRUE(fs::exists(dir / name)) << name;
    EXPECT_EQ(testutil::ReadFile(dir / "tracker"), "3");
    EXPECT_EQ(input.runs_.size(), (7 + batch - 1) / batch) << "executor runs";
    // The manifest lists the checkpoint folder's six files, not the tracker.
    const std::string manifest =
        testutil::ReadFile(dir / "ckpt" / kManifestName);
    EXPECT_THAT(manifest, HasSubstr("r2_1.pt"));
    EXPECT_THAT(manifest, ::testing::Not(HasSubstr("tracker")));
    EXPECT_EQ(CheckIntegrity(dir / "ckpt",
                             {dir / "ckpt/r0_0.pt", dir / "ckpt/r0_1.pt",
                              dir / "ckpt/r1_0.pt", dir / "ckpt/r1_1.pt",
                              dir / "ckpt/r2_0.pt", dir / "ckpt/r2_1.pt"})
                  .files,
              6);
    const torchfile::TorchFile f =
        torchfile::TorchFile::Open(dir / "ckpt/r2_1.pt");
    std::string got(12, '\0');
    f.ReadTensor(f.tensors().at(0),
                 std::as_writable_bytes(std::span<char>(got)));
    EXPECT_EQ(got, Floats(3, 2.0f));
  }
}

// --- The drivers' planning, without writing ---------------------------------

// Tensors (dtype, shape) and dict keys reachable through containers.
template <typename IsTensor>
void Walk(const pickle::Value* v, const std::string& path,
          const IsTensor& is_tensor, std::map<std::string, std::string>& out,
          int depth = 0) {
  if (v == nullptr || depth > 64) return;
  if (std::string t = is_tensor(v); !t.empty()) {
    out[path] = t;
    return;
  }
  if (v->IsDictLike()) {
    std::string keys;
    for (const auto& [k, x] : v->entries) {
      const std::string key = k != nullptr && k->kind == pickle::Kind::kStr
                                  ? k->s
                              : k != nullptr && k->kind == pickle::Kind::kInt
                                  ? std::to_string(k->i)
                                  : std::string("<key>");
      keys += key + ",";
      Walk(x, path + "/" + key, is_tensor, out, depth + 1);
    }
    out[path + "/"] = keys;
  } else if (v->kind == pickle::Kind::kList ||
             v->kind == pickle::Kind::kTuple) {
    for (size_t i = 0; i < v->items.size(); ++i)
      Walk(v->items[i], StrCat(path, "/", i), is_tensor, out, depth + 1);
  }
}

std::map<std::string, std::string> Structure(const torchfile::TorchFile& f) {
  std::map<std::string, std::string> out;
  Walk(
      f.root(), "",
      [&](const pickle::Value* v) {
        const torchfile::TensorInfo* t = f.FindTensor(v);
        return t == nullptr
                   ? std::string()
                   : StrCat(DTypeName(t->dtype), ShapeString(t->shape));
      },
      out);
  return out;
}

std::map<std::string, std::string> Structure(const TorchSaveFile& f) {
  std::map<std::string, std::string> out;
  Walk(
      f.root(), "",
      [&](const pickle::Value* v) {
        const torchfile::TensorSpec* t =
            const_cast<TorchSaveFile&>(f).archive().SpecOf(v);
        return t == nullptr
                   ? std::string()
                   : StrCat(DTypeName(t->dtype), ShapeString(t->shape));
      },
      out);
  return out;
}

// Planned for the real checkpoint's own layout, every DeepSpeed file has the
// real file's keys, tensor dtypes and shapes (ZeRO 0-3, fp32 / bf16, worlds
// 1 and 2), and nothing is written: the output folder is never named.
TEST(DriverPlanningTest, DeepSpeedPlansDeepSpeedsOwnFiles) {
  const fs::path fx = testutil::FixturesDir() / "deepspeed-0.14.5";
  int checked = 0;
  for (const auto& e : fs::directory_iterator(fx)) {
    if (!fs::exists(e.path() / "latest")) continue;
    SCOPED_TRACE(e.path().filename().string());
    const Driver& d = GetDriver("deepspeed");
    const std::unique_ptr<Source> s = d.Open(e.path(), {});
    const universal::SourcePlan plan = s->Plan();
    const auto input = universal::PlanInput(plan, s->info().path, {});
    TargetOptions o;
    o.topology.dp = s->info().topology.dp;
    o.values.Set("zero-stage",
                 std::to_string(s->info().settings.At("zero_stage").AsInt()));
    const std::unique_ptr<TargetPlan> target = d.PlanTarget(*input, o);
    for (size_t u = 0; u < target->units(); ++u) {
      for (const auto& file : target->Plan(u)) {
        const auto* t = dynamic_cast<const TorchSaveFile*>(file.get());
        if (t == nullptr) {
          EXPECT_EQ(file->path(), "latest");
          continue;
        }
        const torchfile::TorchFile real =
            torchfile::TorchFile::Open(e.path() / file->path());
        EXPECT_EQ(Structure(*t), Structure(real)) << file->path();
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 35);
}

// The same for Megatron-LM: the generator's files (Megatron-core v0.13's
// layout) at several topologies, with and without the distributed
// optimizer.
TEST(DriverPlanningTest, MegatronPlansMegatronsOwnFiles) {
  const fs::path root =
      testutil::TestDataDir() / "megatron" / "gqa_swiglu_bias_untied";
  int checked = 0;
  for (const char* name : {"tp2_pp2_vpp1_dp2_do", "tp1_pp2_vpp2_dp1_do",
                           "tp2_pp1_vpp1_dp2_nodo"}) {
    if (!fs::exists(root / name)) continue;
    SCOPED_TRACE(name);
    const Driver& d = GetDriver("megatron");
    const std::unique_ptr<Source> s = d.Open(root / name, {});
    const universal::SourcePlan plan = s->Plan();
    const auto input = universal::PlanInput(plan, s->info().path, {});
    TargetOptions o;
    o.topology = s->info().topology;
    if (s->info().settings.At("distributed_optimizer").AsBool())
      o.values.Set("distributed-optimizer", "true");
    const std::unique_ptr<TargetPlan> target = d.PlanTarget(*input, o);
    for (size_t u = 0; u < target->units(); ++u) {
      for (const auto& file : target->Plan(u)) {
        const auto* t = dynamic_cast<const TorchSaveFile*>(file.get());
        if (t == nullptr) continue;  // the tracker
        const torchfile::TorchFile real =
            torchfile::TorchFile::Open(root / name / file->path());
        EXPECT_EQ(Structure(*t), Structure(real)) << file->path();
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 10);
}

// A layout the model cannot take fails while planning, before any file.
TEST(DriverPlanningTest, ImpossibleLayoutsFailWhilePlanning) {
  const fs::path src = testutil::TestDataDir() / "megatron" /
                       "gqa_swiglu_bias_untied" / "tp2_pp2_vpp1_dp2_do";
  const Driver& d = GetDriver("megatron");
  const std::unique_ptr<Source> s = d.Open(src, {});
  const universal::SourcePlan plan = s->Plan();
  const auto input = universal::PlanInput(plan, s->info().path, {});
  TargetOptions o;
  o.topology.tp = 3;
  o.topology.dp = 1;
  EXPECT_THROW(d.PlanTarget(*input, o), LayoutError);
}

}  // namespace
}  // namespace ucp::formats
