// The conformance suite every registered driver runs (conformance.h): its
// own checkpoints detected and opened; rewritten at their own layout they
// come back tensor for tensor with the same keys; through another layout and
// back the universal content is unchanged and the files come back again;
// foreign and damaged input is a clear error, never a crash; its save folders
// list their checkpoints; and the fit hook agrees with the layouts.

#include "tests/unit/engine/formats/conformance/conformance.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "engine/core/error.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/target_plan.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "tests/testutil/testutil.h"

namespace ucp::formats::conformance {

namespace {
std::vector<Sample>& Registry() {
  static std::vector<Sample> r;
  return r;
}
}  // namespace

bool RegisterSample(Sample sample) {
  Registry().push_back(std::move(sample));
  return true;
}
const std::vector<Sample>& Samples() { return Registry(); }

namespace {

namespace fs = std::filesystem;

const Sample* SampleFor(const std::string& driver) {
  for (const Sample& s : Samples())
    if (s.driver == driver) return &s;
  return nullptr;
}

std::string Bytes(const torchfile::TorchFile& f,
                  const torchfile::TensorInfo& t) {
  std::string b(t.nbytes, '\0');
  f.ReadTensor(t, std::as_writable_bytes(std::span<char>(b.data(), b.size())));
  return b;
}

// Every tensor (path -> dtype, shape, sha256 of its elements) and every
// dict's keys (in order) reachable from the root through containers.
void Walk(const torchfile::TorchFile& f, const pickle::Value* v,
          const std::string& path, std::map<std::string, std::string>& out,
          int depth = 0) {
  if (v == nullptr || depth > 64) return;
  if (const torchfile::TensorInfo* t = f.FindTensor(v)) {
    out[path] =
        StrCat("tensor ", DTypeName(t->dtype), " ", ShapeString(t->shape), " ",
               testutil::Sha256Hex(Bytes(f, *t)));
    return;
  }
  if (v->IsDictLike()) {
    std::string keys;
    for (const auto& [k, x] : v->entries) {
      const std::string key = k == nullptr                    ? "?"
                              : k->kind == pickle::Kind::kStr ? k->s
                              : k->kind == pickle::Kind::kInt
                                  ? std::to_string(k->i)
                                  : std::string("<key>");
      keys += key + ",";
      Walk(f, x, path + "/" + key, out, depth + 1);
    }
    out[path + "/"] = "keys " + keys;
    return;
  }
  if (v->kind == pickle::Kind::kList || v->kind == pickle::Kind::kTuple) {
    for (size_t i = 0; i < v->items.size(); ++i)
      Walk(f, v->items[i], StrCat(path, "/", i), out, depth + 1);
    out[path + "/#"] = StrCat("items ", v->items.size());
  }
}

// Every file under the checkpoint folder of `source`: a torch.save file by
// its tensors and keys; a file of several archives (Source::Archives) by
// theirs, as a set (their order in the file is the writer's); anything else
// by its bytes; names in `skip` (relative) left out.
std::map<std::string, std::string> TreeFingerprint(
    const Source& source, const std::vector<std::string>& skip) {
  const fs::path& folder = source.info().path;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = e.path().lexically_relative(folder).string();
    if (std::find(skip.begin(), skip.end(), rel) != skip.end()) continue;
    if (rel == "ucp.manifest.json") continue;
    const std::vector<ArchiveSpan> spans = source.Archives(e.path());
    if (!spans.empty()) {
      std::multiset<std::string> archives;
      for (const ArchiveSpan& span : spans) {
        const torchfile::TorchFile f =
            torchfile::TorchFile::Open(e.path(), span.offset, span.length);
        std::map<std::string, std::string> one;
        Walk(f, f.root(), "", one);
        std::string all;
        for (const auto& [k, v] : one) all += k + "=" + v + ";";
        archives.insert(all);
      }
      std::string all;
      for (const std::string& a : archives) all += a + "\n";
      out[rel] = all;
      continue;
    }
    try {
      const torchfile::TorchFile f = torchfile::TorchFile::Open(e.path());
      std::map<std::string, std::string> one;
      Walk(f, f.root(), "", one);
      for (auto& [k, v] : one) out[rel + ":" + k] = std::move(v);
    } catch (const FormatError&) {
      out[rel] = testutil::Sha256Hex(testutil::ReadFile(e.path()));
    }
  }
  return out;
}

// The universal content of a checkpoint: every atom and buffer (pad rows
// depend on the layout) by name, as the sha256 of its bytes.
std::map<std::string, std::string> Atoms(const Source& source) {
  const universal::SourcePlan plan = source.Plan();
  const std::unique_ptr<universal::UniversalInput> input =
      universal::PlanInput(plan, source.info().path, {});
  std::vector<reshape::Job> jobs;
  std::vector<std::unique_ptr<MemorySink>> sinks;
  std::vector<std::string> names;
  for (const atoms::DatasetInfo& d : input->datasets()) {
    if (d.kind != atoms::DatasetKind::kAtom &&
        d.kind != atoms::DatasetKind::kBuffer)
      continue;
    reshape::Job j;
    j.tensor.name = d.path;
    j.tensor.dtype = d.dtype;
    j.tensor.shape = d.shape;
    j.tensor.ops.push_back(
        {input->Tensor(d), Box::Whole(d.shape), Box::Whole(d.shape), 0, {}});
    sinks.push_back(std::make_unique<MemorySink>(d.nbytes));
    j.sink = sinks.back().get();
    jobs.push_back(std::move(j));
    names.push_back(d.fqn + "/" + d.state_kind);
  }
  input->Run(jobs, {});
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto& b = sinks[i]->bytes();
    out[names[i]] = testutil::Sha256Hex(
        std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  }
  return out;
}

void Write(const Driver& driver, const Source& source, const fs::path& out,
           const TargetOptions& options) {
  const universal::SourcePlan plan = source.Plan();
  const std::unique_ptr<universal::UniversalInput> input =
      universal::PlanInput(plan, source.info().path, {});
  universal::StagedDirectory staged(out);
  WriteTarget(driver, *input, staged.path(), options, {});
  staged.Commit();
}

class ConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    sample_ = SampleFor(GetParam());
    ASSERT_NE(sample_, nullptr)
        << "driver " << GetParam()
        << " has no conformance sample (tests/unit/engine/formats/"
           "conformance/<driver>_sample.cc)";
    driver_ = &GetDriver(GetParam());
    save_ = sample_->make(dir_.path() / "save");
  }
  std::unique_ptr<Source> Open(const fs::path& path) const {
    return driver_->Open(path, {});
  }

  testutil::TempDir dir_;
  const Sample* sample_ = nullptr;
  const Driver* driver_ = nullptr;
  fs::path save_;
};

TEST_P(ConformanceTest, DetectsAndOpensItsOwnCheckpoints) {
  EXPECT_EQ(DetectDriver(save_).Name(), driver_->Name());
  const std::unique_ptr<Source> s = Open(save_);
  EXPECT_EQ(s->info().format, driver_->Name());
  EXPECT_FALSE(s->info().files.empty());
  for (const fs::path& f : s->info().files) EXPECT_TRUE(fs::exists(f)) << f;
  const universal::SourcePlan plan = s->Plan();
  EXPECT_FALSE(plan.params.empty());
  EXPECT_FALSE(plan.atoms.empty());
  // Its folder is its own too (tag / iteration folder, or the save folder).
  EXPECT_EQ(DetectDriver(s->info().path).Name(), driver_->Name());
}

TEST_P(ConformanceTest, SameLayoutReproducesTheSource) {
  if (!driver_->CanWrite()) GTEST_SKIP() << "read-only format";
  const std::unique_ptr<Source> source = Open(save_);
  Write(*driver_, *source, dir_ / "same", sample_->same);
  const std::unique_ptr<Source> back = Open(dir_ / "same");
  const auto want = TreeFingerprint(*source, sample_->not_reproduced);
  const auto got = TreeFingerprint(*back, sample_->not_reproduced);
  ASSERT_FALSE(want.empty());
  for (const auto& [k, v] : want) {
    auto it = got.find(k);
    ASSERT_NE(it, got.end()) << "missing in the rewrite: " << k;
    EXPECT_EQ(it->second, v) << k;
  }
  for (const auto& [k, v] : got)
    EXPECT_TRUE(want.count(k)) << "not in the source: " << k;
}

TEST_P(ConformanceTest, AnotherLayoutAndBackIsTheIdentity) {
  if (!driver_->CanWrite()) GTEST_SKIP() << "read-only format";
  const std::unique_ptr<Source> a = Open(save_);
  Write(*driver_, *a, dir_ / "b", sample_->other);
  const std::unique_ptr<Source> b = Open(dir_ / "b");
  EXPECT_TRUE(b->Fits(sample_->other));
  const auto atoms_a = Atoms(*a);
  EXPECT_EQ(Atoms(*b), atoms_a);
  Write(*driver_, *b, dir_ / "a2", sample_->same);
  const std::unique_ptr<Source> a2 = Open(dir_ / "a2");
  EXPECT_EQ(Atoms(*a2), atoms_a);
  const auto want = TreeFingerprint(*a, sample_->not_reproduced);
  const auto got = TreeFingerprint(*a2, sample_->not_reproduced);
  for (const auto& [k, v] : want) {
    auto it = got.find(k);
    ASSERT_NE(it, got.end()) << "missing after the round trip: " << k;
    EXPECT_EQ(it->second, v) << k;
  }
}

TEST_P(ConformanceTest, ForeignAndDamagedInputIsAClearError) {
  // Probing never throws, and says no to what is not a checkpoint.
  fs::create_directory(dir_ / "empty");
  testutil::WriteFile(dir_ / "garbage.bin", std::string(4096, '\x5a'));
  EXPECT_EQ(driver_->Probe(dir_ / "empty"), Confidence::kNo);
  EXPECT_EQ(driver_->Probe(dir_ / "missing"), Confidence::kNo);
  EXPECT_EQ(driver_->Probe(dir_ / "garbage.bin"), Confidence::kNo);
  EXPECT_THROW(Open(dir_ / "empty"), Error);
  EXPECT_THROW(Open(dir_ / "missing"), Error);
  // Another format's checkpoint: an error, never a crash or a plan; except
  // a format refining this one (Driver::Refines: its checkpoints are this
  // format's too, read as such with --from).
  for (const Sample& other : Samples()) {
    if (other.driver == sample_->driver) continue;
    const fs::path foreign = other.make(dir_ / ("foreign-" + other.driver));
    const Driver& detected = DetectDriver(foreign);
    if (detected.Name() == driver_->Name()) continue;
    if (detected.RefinesFormat(driver_->Name())) continue;
    EXPECT_THROW(
        {
          std::unique_ptr<Source> s = Open(foreign);
          s->Plan();
        },
        Error)
        << other.driver;
  }
  // A rank file cut in half: an error naming it.
  const std::unique_ptr<Source> s = Open(save_);
  fs::path victim = s->info().files.front();
  for (const fs::path& f : s->info().files)
    if (fs::file_size(f) > fs::file_size(victim)) victim = f;
  fs::resize_file(victim, fs::file_size(victim) / 2);
  try {
    std::unique_ptr<Source> broken = Open(save_);
    broken->Plan();
    ADD_FAILURE() << "a truncated " << victim << " was read";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(victim.filename().string()));
  }
}

TEST_P(ConformanceTest, ListsItsCheckpointsAndKnowsWhatFits) {
  const std::vector<SavedCheckpoint> list = driver_->ListCheckpoints(save_);
  ASSERT_FALSE(list.empty());
  const std::unique_ptr<Source> s = Open(save_);
  bool found = false;
  for (const SavedCheckpoint& c : list) {
    SourceOptions o;
    o.values = c.selector;
    const std::unique_ptr<Source> x = driver_->Open(save_, o);
    x->Plan();
    if (c.iteration >= 0) {
      EXPECT_EQ(x->info().iteration, c.iteration) << c.name;
    }
    found = found || x->info().path == s->info().path;
  }
  EXPECT_TRUE(found) << "the tracked checkpoint is not listed";
  EXPECT_TRUE(s->Fits(sample_->same));
  EXPECT_EQ(s->Fits(sample_->other), sample_->loads_at_any_layout);
}

std::vector<std::string> DriverNames() {
  std::vector<std::string> out;
  for (const Driver* d : Drivers()) out.emplace_back(d->Name());
  return out;
}

INSTANTIATE_TEST_SUITE_P(Drivers, ConformanceTest,
                         ::testing::ValuesIn(DriverNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c)))
                               c = '_';
                           return n;
                         });

}  // namespace
}  // namespace ucp::formats::conformance
