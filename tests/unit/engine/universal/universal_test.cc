#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <set>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/universal/input.h"
#include "engine/universal/mapped_input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/sources.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::universal {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

class MemSource : public reshape::ByteSource {
 public:
  explicit MemSource(std::vector<float> v) : v_(std::move(v)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    ASSERT_LE(offset + dst.size(), v_.size() * 4);
    std::memcpy(dst.data(), reinterpret_cast<const char*>(v_.data()) + offset,
                dst.size());
  }
  std::string Describe() const override { return "mem"; }

 private:
  std::vector<float> v_;
};

// A 4x6 fp32 atom held as two dim-1 halves by two "TP ranks", each also
// holding a replica of a 6-element norm; plus padding rows.
struct Fixture {
  std::vector<float> full;
  SourcePlan plan;

  explicit Fixture(bool corrupt_replica = false, bool drop_rank = false) {
    for (int i = 0; i < 24; ++i) full.push_back(static_cast<float>(i) + 0.5f);
    for (int r = 0; r < 2; ++r) {
      std::vector<float>
          local;  // [4,3] columns 3r..3r+2, then norm [6], then pad [2,3]
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 3; ++j) local.push_back(full[i * 6 + 3 * r + j]);
      for (int k = 0; k < 6; ++k)
        local.push_back(100.0f + k + (corrupt_replica && r == 1 ? 1 : 0));
      for (int k = 0; k < 6; ++k) local.push_back(-1.0f - k - 6 * r);
      plan.sources.push_back(std::make_unique<MemSource>(local));
    }
    plan.model.iteration = 7;
    plan.model.source.framework = "test";
    plan.params.push_back({"w",
                           {4, 6},
                           DType::kFloat32,
                           "row",
                           atoms::ParamKind::kParam,
                           0,
                           0,
                           {}});
    plan.params.push_back({"norm",
                           {6},
                           DType::kFloat32,
                           "rep",
                           atoms::ParamKind::kParam,
                           1,
                           1,
                           {}});
    AtomPlan w{"w", "fp32", DType::kFloat32, {4, 6}, {2, 6}, {}};
    AtomPlan norm{"norm", "fp32", DType::kFloat32, {6}, {}, {}};
    for (uint32_t r = 0; r < 2; ++r) {
      if (drop_rank && r == 1) continue;
      reshape::SourceTensor t{r, 0, DType::kFloat32, {4, 3}};
      w.fragments.push_back({t, Box{{0, 0}, {4, 3}}, Box{{0, 3 * r}, {4, 3}},
                             false, "rank " + std::to_string(r)});
      reshape::SourceTensor pad{r, 4 * 18, DType::kFloat32, {2, 3}};
      w.fragments.push_back({pad, Box{{0, 0}, {2, 3}}, Box{{0, 3 * r}, {2, 3}},
                             true, "rank " + std::to_string(r) + " pad"});
      reshape::SourceTensor n{r, 4 * 12, DType::kFloat32, {6}};
      norm.fragments.push_back({n, Box{{0}, {6}}, Box{{0}, {6}}, false,
                                "rank " + std::to_string(r) + " norm"});
    }
    plan.atoms.push_back(std::move(w));
    plan.atoms.push_back(std::move(norm));
    plan.opaque.push_back({"args", "pickled-args"});
  }
};

std::vector<float> ReadAll(const atoms::AtomStoreReader& r,
                           const atoms::DatasetInfo* d) {
  std::vector<float> v(d->nbytes / 4);
  r.Read(d->id, 0, std::as_writable_bytes(std::span<float>(v)));
  return v;
}

TEST(WriteUniversalTest, AssemblesAtomsPadsAndBlobs) {
  testutil::TempDir dir;
  Fixture fx;
  WriteSummary s = WriteUniversal(fx.plan, dir / "u.h5", {});
  EXPECT_EQ(s.replicas_verified, 1);
  atoms::AtomStoreReader r = atoms::AtomStoreReader::Open(dir / "u.h5");
  EXPECT_EQ(r.root().iteration, 7);
  EXPECT_EQ(ReadAll(r, r.FindAtom("w", "fp32")), fx.full);
  std::vector<float> pad = ReadAll(r, r.FindPadAtom("w", "fp32"));
  std::vector<float> want_pad = {-1, -2, -3, -7,  -8,  -9,
                                 -4, -5, -6, -10, -11, -12};
  EXPECT_EQ(pad, want_pad);
  EXPECT_EQ(ReadAll(r, r.FindAtom("norm", "fp32")),
            (std::vector<float>{100, 101, 102, 103, 104, 105}));
  const atoms::DatasetInfo* blob = r.FindOpaque("args");
  ASSERT_NE(blob, nullptr);
  EXPECT_EQ(blob->xxh3, Xxh3("pickled-args", 12));
  EXPECT_TRUE(r.Verify().empty());
}

TEST(WriteUniversalTest, ReplicasThatDifferAreAnErrorAndNothingIsWritten) {
  testutil::TempDir dir;
  Fixture fx(/*corrupt_replica=*/true);
  EXPECT_THAT([&] { WriteUniversal(fx.plan, dir / "u.h5", {}); },
              ThrowsMessage<FormatError>(
                  AllOf(HasSubstr("param norm > fp32: replicas differ"),
                        HasSubstr("rank 0 norm"), HasSubstr("rank 1 norm"))));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(VerifySourceTest, ChecksCoverageAndReplicasWithoutWriting) {
  Fixture good;
  VerifySummary v = VerifySource(good.plan, {});
  EXPECT_EQ(v.atoms, 2);
  EXPECT_EQ(v.replicas_verified, 1);
  Fixture bad(/*corrupt_replica=*/true);
  EXPECT_THAT([&] { VerifySource(bad.plan, {}); },
              ThrowsMessage<FormatError>(HasSubstr("replicas differ")));
  Fixture missing(false, /*drop_rank=*/true);
  EXPECT_THAT([&] { VerifySource(missing.plan, {}); },
              ThrowsMessage<FormatError>(HasSubstr("12 of the 24 elements")));
}

TEST(WriteUniversalTest, MissingFragmentsAreNamed) {
  testutil::TempDir dir;
  Fixture fx(false, /*drop_rank=*/true);
  EXPECT_THAT(
      [&] { WriteUniversal(fx.plan, dir / "u.h5", {}); },
      ThrowsMessage<FormatError>(HasSubstr(
          "param w > fp32: the rank files hold 12 of the 24 elements")));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(WriteUniversalTest, PartialOverlapIsAnError) {
  testutil::TempDir dir;
  Fixture fx;
  fx.plan.atoms[0].fragments[2].atom_box =
      Box{{0, 2}, {4, 3}};  // rank 1 shifted
  EXPECT_THAT([&] { WriteUniversal(fx.plan, dir / "u.h5", {}); },
              ThrowsMessage<FormatError>(
                  HasSubstr("overlapping but different regions")));
}

class VecSink : public reshape::ByteSink {
 public:
  explicit VecSink(size_t n) : v(n, -7.0f) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    std::memcpy(reinterpret_cast<char*>(v.data()) + offset, data.data(),
                data.size());
  }
  std::vector<float> v;
};

// A target read through PlanInput (composed with the source fragments) equals
// the same target read from the written universal file.
TEST(PlanInputTest, ComposedJobsEqualJobsOnTheUniversalFile) {
  testutil::TempDir dir;
  Fixture fx;
  WriteUniversal(fx.plan, dir / "u.h5", {});
  atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(dir / "u.h5");
  std::unique_ptr<UniversalInput> from_store = StoreInput(store);
  std::unique_ptr<UniversalInput> from_plan = PlanInput(fx.plan, "src", {});
  ASSERT_EQ(from_plan->params().size(), 2u);
  EXPECT_EQ(from_plan->model().iteration, 7);
  ASSERT_NE(from_plan->FindOpaque("args"), nullptr);
  std::vector<std::vector<float>> results;
  for (const UniversalInput* in : {from_store.get(), from_plan.get()}) {
    const atoms::DatasetInfo* w = in->FindAtom("w", "fp32");
    const atoms::DatasetInfo* pad = in->FindPadAtom("w", "fp32");
    ASSERT_NE(w, nullptr);
    ASSERT_NE(pad, nullptr);
    // A flat target: columns 2..4 of rows 1..3 (crossing both TP halves),
    // then one padding row, with a gap of zeros in between.
    VecSink sink(14);
    std::vector<reshape::Job> jobs(1);
    jobs[0].tensor = reshape::TargetTensor{"t", DType::kFloat32, {14}, {}};
    jobs[0].tensor.ops.push_back(reshape::CopyOp{
        in->Tensor(*w), Box{{1, 2}, {3, 3}}, Box{{0, 0}, {3, 3}}, 0, {3, 3}});
    jobs[0].tensor.ops.push_back(reshape::CopyOp{in->Tensor(*pad),
                                                 Box{{1, 0}, {1, 4}},
                                                 Box{{0, 0}, {1, 4}},
                                                 10,
                                                 {1, 4}});
    jobs[0].sink = &sink;
    in->Run(jobs, {});
    results.push_back(sink.v);
  }
  std::vector<float> want = {8.5f,  9.5f,  10.5f, 14.5f, 15.5f, 16.5f, 20.5f,
                             21.5f, 22.5f, 0.0f,  -4.0f, -5.0f, -6.0f, -10.0f};
  EXPECT_EQ(results[0], want);
  EXPECT_EQ(results[1], want);
  Fixture bad(/*corrupt_replica=*/true);
  EXPECT_THAT([&] { PlanInput(bad.plan, "src", {}); },
              ThrowsMessage<FormatError>(HasSubstr("replicas differ")));
}

// The whole of `fqn`'s fp32 atom read through `in`.
std::vector<float> ReadParam(const UniversalInput& in, const std::string& fqn) {
  const atoms::DatasetInfo* d = in.FindAtom(fqn, "fp32");
  EXPECT_NE(d, nullptr) << fqn;
  if (d == nullptr) return {};
  VecSink sink(static_cast<size_t>(NumElements(d->shape)));
  std::vector<reshape::Job> jobs(1);
  jobs[0].tensor = reshape::TargetTensor{fqn, DType::kFloat32, d->shape, {}};
  jobs[0].tensor.ops.push_back(reshape::CopyOp{
      in.Tensor(*d), Box::Whole(d->shape), Box::Whole(d->shape), 0, {}});
  jobs[0].sink = &sink;
  in.Run(jobs, {});
  return sink.v;
}

MappedParam Mapped(std::string fqn, Shape shape,
                   std::vector<MappedPiece> pieces) {
  MappedParam m;
  m.info.fqn = std::move(fqn);
  m.info.shape = std::move(shape);
  m.pieces = std::move(pieces);
  return m;
}

// w's dim-1 halves swapped ("swapped"), w's rows 2..3 ("bottom"), norm
// renamed, over the universal file and over the source plan alike.
TEST(MappedInputTest, MappedParamsReadTheirSourceBoxes) {
  testutil::TempDir dir;
  Fixture fx;
  WriteUniversal(fx.plan, dir / "u.h5", {});
  atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(dir / "u.h5");
  std::unique_ptr<UniversalInput> from_store = StoreInput(store);
  std::unique_ptr<UniversalInput> from_plan = PlanInput(fx.plan, "src", {});
  for (const UniversalInput* in : {from_store.get(), from_plan.get()}) {
    Model model = in->model();
    model.training.emplace();
    model.training->param_order = std::vector<std::string>{"w", "norm"};
    model.training->frozen = std::vector<std::string>{"w"};
    std::vector<MappedParam> params;
    params.push_back(Mapped("swapped", {4, 6},
                            {{"w", Box{{0, 3}, {4, 3}}, Box{{0, 0}, {4, 3}}},
                             {"w", Box{{0, 0}, {4, 3}}, Box{{0, 3}, {4, 3}}}}));
    params.push_back(
        Mapped("bottom", {2, 6},
               {{"w", Box{{2, 0}, {2, 6}}, Box::Whole(Shape{2, 6})}}));
    params.push_back(Mapped(
        "scale", {6}, {{"norm", Box::Whole(Shape{6}), Box::Whole(Shape{6})}}));
    std::unique_ptr<UniversalInput> m =
        MappedInput(*in, std::move(params), model);
    ASSERT_EQ(m->params().size(), 3u);
    EXPECT_EQ(m->params()[0].info.fqn, "swapped");
    EXPECT_EQ(m->params()[2].info.group, 1);  // norm's
    EXPECT_EQ(m->FindParam("w"), nullptr);
    EXPECT_EQ(m->FindPadAtom("swapped", "fp32"), nullptr);
    // full[i][j] = 6 i + j + 0.5 (the fixture's).
    std::vector<float> swapped, bottom;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 6; ++j)
        swapped.push_back(6.0f * i + (j + 3) % 6 + 0.5f);
    for (int i = 2; i < 4; ++i)
      for (int j = 0; j < 6; ++j) bottom.push_back(6.0f * i + j + 0.5f);
    EXPECT_EQ(ReadParam(*m, "swapped"), swapped);
    EXPECT_EQ(ReadParam(*m, "bottom"), bottom);
    EXPECT_EQ(ReadParam(*m, "scale"),
              (std::vector<float>{100, 101, 102, 103, 104, 105}));
    const atoms::DatasetInfo* blob = m->FindOpaque("args");
    ASSERT_NE(blob, nullptr);
    EXPECT_EQ(m->ReadBlob(*blob), "pickled-args");
    ASSERT_TRUE(m->model().training.has_value());
    EXPECT_EQ(m->model().training->param_order,
              (std::vector<std::string>{"swapped", "bottom", "scale"}));
    EXPECT_EQ(m->model().training->frozen, std::vector<std::string>{});
  }
}

TEST(MappedInputTest, PiecesThatDoNotTileTheParamAreRefused) {
  Fixture fx;
  std::unique_ptr<UniversalInput> in = PlanInput(fx.plan, "src", {});
  auto map = [&](MappedParam p) {
    std::vector<MappedParam> v;
    v.push_back(std::move(p));
    return MappedInput(*in, std::move(v), in->model());
  };
  EXPECT_THAT(
      [&] {
        map(Mapped("x", {4, 6},
                   {{"w", Box{{0, 0}, {4, 4}}, Box{{0, 0}, {4, 4}}},
                    {"w", Box{{0, 3}, {4, 3}}, Box{{0, 3}, {4, 3}}}}));
      },
      ThrowsMessage<UsageError>(
          AllOf(HasSubstr("mapped param x"), HasSubstr("overlap"))));
  EXPECT_THAT(
      [&] {
        map(Mapped("x", {4, 6},
                   {{"w", Box{{0, 0}, {4, 3}}, Box{{0, 0}, {4, 3}}}}));
      },
      ThrowsMessage<UsageError>(HasSubstr("cover 12 of 24 elements")));
  EXPECT_THAT(
      [&] {
        map(Mapped("x", {6},
                   {{"nope", Box::Whole(Shape{6}), Box::Whole(Shape{6})}}));
      },
      ThrowsMessage<UsageError>(HasSubstr("has no param nope")));
  EXPECT_THAT(
      [&] {
        map(Mapped("x", {4, 6},
                   {{"w", Box{{1, 0}, {4, 6}}, Box::Whole(Shape{4, 6})}}));
      },
      ThrowsMessage<UsageError>(HasSubstr("does not fit")));
}

TEST(StagedDirectoryTest, AppearsOnlyOnCommitAndNeverOverwrites) {
  testutil::TempDir dir;
  auto out = dir / "out";
  {
    StagedDirectory s(out);
    testutil::WriteFile(s.path() / "f", "x");
    EXPECT_FALSE(std::filesystem::exists(out));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  {
    StagedDirectory s(out);
    testutil::WriteFile(s.path() / "f", "x");
    s.Commit();
  }
  EXPECT_EQ(testutil::ReadFile(out / "f"), "x");
  EXPECT_THAT([&] { StagedDirectory again(out); },
              ThrowsMessage<UsageError>(HasSubstr("already exists")));
  EXPECT_THAT([&] { StagedDirectory bad(dir / "missing" / "out"); },
              ThrowsMessage<IoError>(HasSubstr("does not exist")));
}

// Another run's staging folder (e.g. a process with the same pid in another
// container on a shared file system) is never touched; "dir/" names "dir".
TEST(StagedDirectoryTest, FreshStagingNameAndTrailingSlash) {
  testutil::TempDir dir;
  const auto other =
      dir / StrCat(".out.ucp-partial-", static_cast<long>(::getpid()));
  std::filesystem::create_directory(other);
  testutil::WriteFile(other / "theirs", "y");
  {
    StagedDirectory s(dir / "out");
    EXPECT_NE(s.path(), other);
    EXPECT_EQ(s.path().parent_path(), dir.path());
  }
  EXPECT_EQ(testutil::ReadFile(other / "theirs"), "y");
  {
    StagedDirectory s(std::filesystem::path((dir / "new").string() + "/"));
    EXPECT_EQ(s.final_path(), dir / "new");
    testutil::WriteFile(s.path() / "f", "z");
    s.Commit();
  }
  EXPECT_EQ(testutil::ReadFile(dir / "new" / "f"), "z");
}

// Two torch.save files, each a [64,96] fp32 tensor "t": rank 0 holds the
// primaries, rank 1 replicas of two atoms, "a" (rows 0-31, one contiguous
// run) and "b" (dim-1 elements 1-2 of every row: 64 runs).
constexpr int64_t kRows = 64, kCols = 96;
struct ZipFixture {
  testutil::TempDir dir;
  std::vector<std::shared_ptr<const torchfile::TorchFile>> files;
  SourcePlan plan;

  explicit ZipFixture(int changed_element = -1) {
    for (int r = 0; r < 2; ++r) {
      std::vector<float> v;
      for (int64_t i = 0; i < kRows * kCols; ++i) {
        v.push_back(static_cast<float>(i) * 0.25f);
      }
      if (r == 1 && changed_element >= 0) v[changed_element] += 1;
      const std::filesystem::path path =
          dir / ("rank" + std::to_string(r) + ".pt");
      torchfile::TorchWriter w(path);
      pickle::Value* t = w.NewTensor({DType::kFloat32, {kRows, kCols}});
      w.Begin(w.arena().Dict({{w.arena().Str("t"), t}}));
      w.WriteTensorData(t, 0, std::as_bytes(std::span<const float>(v)));
      w.Commit();
      files.push_back(std::make_shared<const torchfile::TorchFile>(
          torchfile::TorchFile::Open(path)));
      plan.sources.push_back(std::make_unique<TorchStorageSource>(
          files.back(), &files.back()->storages().at(0)));
    }
    plan.model.source.framework = "test";
    AtomPlan a{"a", "fp32", DType::kFloat32, {kRows / 2, kCols}, {}, {}};
    AtomPlan b{"b", "fp32", DType::kFloat32, {kRows, 2}, {}, {}};
    for (uint32_t r = 0; r < 2; ++r) {
      const reshape::SourceTensor t{r, 0, DType::kFloat32, {kRows, kCols}};
      const std::string where = "rank " + std::to_string(r);
      a.fragments.push_back({t, Box{{0, 0}, {kRows / 2, kCols}},
                             Box{{0, 0}, {kRows / 2, kCols}}, false, where});
      b.fragments.push_back(
          {t, Box{{0, 1}, {kRows, 2}}, Box{{0, 0}, {kRows, 2}}, false, where});
    }
    plan.atoms.push_back(std::move(a));
    plan.atoms.push_back(std::move(b));
  }

  // An integrity pass that reads every record whole in `chunk`-byte pieces
  // and shows them (when `show`); notes the bytes this process had read
  // when it started and the records it was given an observer for.
  IntegrityPass Pass(size_t chunk, bool show = true) {
    IntegrityPass pass;
    pass.whole_records = true;
    pass.run = [this, chunk, show](const torchfile::RecordCrcs&,
                                   const torchfile::RecordObservers& observe) {
      read_before_pass = testutil::BytesRead() - read_at_start;
      if (!observe) return;  // a partial pass: nothing to show
      for (const auto& f : files) {
        for (const torchfile::ZipEntry& e : f->zip()->entries()) {
          torchfile::RecordChunkObserver o =
              observe(f->path().lexically_normal().string(), e.name);
          if (!o) continue;
          watched.insert(e.name);
          std::string all = f->zip()->ReadRecord(e);
          for (size_t at = 0; show && at < all.size(); at += chunk) {
            const size_t n = std::min(chunk, all.size() - at);
            o(at, std::as_bytes(std::span<const char>(all.data() + at, n)));
          }
        }
      }
    };
    return pass;
  }

  VerifySummary Verify(const IntegrityPass& pass) {
    read_at_start = testutil::BytesRead();
    return VerifySource(plan, {}, pass);
  }

  uint64_t read_at_start = 0;
  uint64_t read_before_pass = 0;
  std::set<std::string> watched;
};

TEST(VerifySourceTest, WholeRecordPassHashesTheReplicasInsteadOfReadingThem) {
  for (size_t chunk : {size_t{1}, size_t{7}, size_t{64}, size_t{1} << 20}) {
    SCOPED_TRACE(chunk);
    ZipFixture fx;
    const VerifySummary v = fx.Verify(fx.Pass(chunk));
    EXPECT_EQ(v.replicas_verified, 2);
    // Nothing was read before the pass (but /proc/self/io): the replicas
    // came from its reads.
    EXPECT_LT(fx.read_before_pass, 1024u);
    EXPECT_EQ(fx.watched,
              (std::set<std::string>{"rank0/data/0", "rank1/data/0"}));
  }
  // Without whole records the replicated regions are read first.
  ZipFixture fx;
  IntegrityPass partial = fx.Pass(7);
  partial.whole_records = false;
  fx.Verify(partial);
  EXPECT_GE(fx.read_before_pass, 2u * (kRows / 2 * kCols + kRows * 2) * 4);
  EXPECT_TRUE(fx.watched.empty());
}

TEST(VerifySourceTest, WholeRecordPassFindsReplicasThatDiffer) {
  // Element 1 lies in both atoms' regions, 0 only in a's, the last row's
  // dim-1 element 2 only in b's.
  const int last_b = static_cast<int>((kRows - 1) * kCols + 2);
  const std::vector<std::pair<int, std::string>> cases = {
      {0, "param a > fp32"}, {1, "param a > fp32"}, {last_b, "param b > fp32"}};
  for (const auto& [element, atom] : cases) {
    SCOPED_TRACE(element);
    for (size_t chunk : {size_t{1}, size_t{13}, size_t{4096}}) {
      ZipFixture fx(element);
      EXPECT_THAT([&] { fx.Verify(fx.Pass(chunk)); },
                  ThrowsMessage<FormatError>(
                      AllOf(HasSubstr(atom + ": replicas differ"),
                            HasSubstr("rank 0"), HasSubstr("rank 1"))));
    }
  }
}

TEST(VerifySourceTest, ReplicasThePassDidNotShowAreReadAfterIt) {
  ZipFixture good;
  EXPECT_EQ(good.Verify(good.Pass(7, /*show=*/false)).replicas_verified, 2);
  ZipFixture bad(static_cast<int>((kRows - 1) * kCols + 2));
  EXPECT_THAT([&] { bad.Verify(bad.Pass(7, /*show=*/false)); },
              ThrowsMessage<FormatError>(HasSubstr("param b > fp32: replicas "
                                                   "differ")));
  EXPECT_LT(bad.read_before_pass, 1024u);
}

}  // namespace
}  // namespace ucp::universal
