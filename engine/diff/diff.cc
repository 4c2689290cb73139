#include "engine/diff/diff.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <utility>

#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/box.h"
#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/formats/name_map.h"
#include "engine/universal/mapped_input.h"

namespace ucp::diff {
namespace {

namespace fs = std::filesystem;

// A batch of windows (A's bytes) and the executor's chunk, by default.
constexpr uint64_t kBatchBytes = 8u << 20;
constexpr uint64_t kChunkBytes = 1u << 20;

// A state whose values both sides hold in one shape.
struct ValueTask {
  StateDiff* state = nullptr;
  std::string name;  // "param P > kind" for messages
  const atoms::DatasetInfo* a = nullptr;
  const atoms::DatasetInfo* b = nullptr;
  std::mutex* mutex = nullptr;  // guards state->values
};

// Elements [begin, end) of a task, A's at `offset` of the batch buffer.
struct Window {
  ValueTask* task = nullptr;
  int64_t begin = 0, end = 0;
  uint64_t offset = 0;
};

// Bytes a sink reads itself from a source's file (Copy) at a time: cache
// sized, a multiple of every element size.
constexpr uint64_t kPieceBytes = 256u << 10;

// Keeps A's elements of a window.
class BufferSink : public reshape::ByteSink {
 public:
  explicit BufferSink(std::byte* at) : at_(at) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    std::memcpy(at_ + offset, data.data(), data.size());
  }
  // Bytes stored as they are in a file: read straight into the buffer.
  bool Copy(uint64_t offset, uint64_t n, const FileLocation& from) override {
    from.file->ReadExact(at_ + offset, n, from.offset);
    return true;
  }

 private:
  std::byte* at_;
};

// Compares B's elements of a window, chunk by chunk, with A's in the buffer.
class CompareSink : public reshape::ByteSink {
 public:
  CompareSink(const Window& w, const std::byte* a, const Tolerance& t)
      : w_(w), a_(a), tolerance_(t) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    const DType da = w_.task->a->dtype, db = w_.task->b->dtype;
    const uint64_t eb = ElementSize(db);
    const auto at = static_cast<int64_t>(offset / eb);
    const auto n = static_cast<int64_t>(data.size() / eb);
    UCP_CHECK(offset % eb == 0 && data.size() % eb == 0, w_.task->name,
              ": a chunk that is not whole elements");
    ElementStats local;
    CompareElements(da, a_ + at * static_cast<int64_t>(ElementSize(da)), db,
                    data.data(), n, w_.begin + at, tolerance_, local);
    std::lock_guard lock(*w_.task->mutex);
    w_.task->state->values.Merge(local);
  }
  // Bytes stored as they are in a file: read a cache-sized piece at a time
  // and compare it while it is in the cache.
  bool Copy(uint64_t offset, uint64_t n, const FileLocation& from) override {
    thread_local std::vector<std::byte> piece;
    piece.resize(std::min(n, kPieceBytes));
    for (uint64_t done = 0; done < n;) {
      const uint64_t k = std::min(n - done, kPieceBytes);
      from.file->ReadExact(piece.data(), k, from.offset + done);
      Write(offset + done, std::span<const std::byte>(piece.data(), k));
      done += k;
    }
    return true;
  }

 private:
  const Window& w_;
  const std::byte* a_;
  const Tolerance& tolerance_;
};

// Window `w` of dataset `d` as a flat tensor of the window's elements (the
// boxes FlatRangeBoxes gives, each written into its own view).
reshape::TargetTensor WindowTensor(const universal::UniversalInput& input,
                                   const atoms::DatasetInfo& d, const Window& w,
                                   const char* side) {
  reshape::TargetTensor t;
  t.name = StrCat(w.task->name, " (", side, ")");
  t.dtype = d.dtype;
  const reshape::SourceTensor src = input.Tensor(d);
  if (d.shape.empty()) {  // 0-d: the one element
    t.shape = {};
    t.ops.push_back({src, Box::Whole(d.shape), Box::Whole(d.shape), 0, {}});
    return t;
  }
  t.shape = {w.end - w.begin};
  int64_t at = 0;
  for (Box& box : FlatRangeBoxes(d.shape, w.begin, w.end)) {
    reshape::CopyOp op;
    op.src = src;
    op.dst_box = Box::Whole(box.size);
    op.dst_offset = at;
    op.dst_shape = box.size;
    at += box.NumElements();
    op.src_box = std::move(box);
    t.ops.push_back(std::move(op));
  }
  return t;
}

// Reads and compares the windows of one batch: A's into `buffer`, then B's
// compared as they arrive.
uint64_t RunBatch(const universal::UniversalInput& a,
                  const universal::UniversalInput& b,
                  std::span<const Window> windows, std::byte* buffer,
                  const Tolerance& tolerance,
                  const reshape::ExecutorOptions& executor) {
  std::vector<BufferSink> keep;
  std::vector<CompareSink> compare;
  keep.reserve(windows.size());
  compare.reserve(windows.size());
  std::vector<reshape::Job> jobs;
  for (const Window& w : windows) {
    keep.emplace_back(buffer + w.offset);
    reshape::Job job;
    job.tensor = WindowTensor(a, *w.task->a, w, "A");
    job.sink = &keep.back();
    jobs.push_back(std::move(job));
  }
  uint64_t bytes = a.Run(jobs, executor).bytes_read;
  jobs.clear();
  for (const Window& w : windows) {
    compare.emplace_back(w, buffer + w.offset, tolerance);
    reshape::Job job;
    job.tensor = WindowTensor(b, *w.task->b, w, "B");
    job.sink = &compare.back();
    jobs.push_back(std::move(job));
  }
  bytes += b.Run(jobs, executor).bytes_read;
  return bytes;
}

Shape Unravel(int64_t flat, const Shape& shape) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] == 0 ? 0 : flat % shape[d];
    flat = shape[d] == 0 ? 0 : flat / shape[d];
  }
  return index;
}

// The state kinds of a param, in its atoms' order.
std::vector<const atoms::DatasetInfo*> States(
    const universal::UniversalInput& input, const atoms::StoredParam& p) {
  std::vector<const atoms::DatasetInfo*> out;
  const auto datasets = input.datasets();
  for (atoms::DatasetId id : p.atoms) {
    UCP_CHECK(id < datasets.size() && datasets[id].id == id, "param ",
              p.info.fqn, ": atom ", id, " is not a dataset of the input");
    out.push_back(&datasets[id]);
  }
  return out;
}

// The optimizer step a side without per-param steps implies.
std::optional<int64_t> OptimizerStep(const universal::Model& m) {
  if (m.optimizer.step) return m.optimizer.step;
  if (m.training && m.training->step) return m.training->step;
  if (m.training && m.training->iteration) return m.training->iteration;
  if (m.iteration > 0) return m.iteration;
  return std::nullopt;
}

// A per-param step one side holds, to compare with the other's optimizer
// step.
struct StepCheck {
  StateDiff* state = nullptr;
  const atoms::DatasetInfo* dataset = nullptr;
  int64_t expected = 0;
  const char* other = "";  // "A" or "B"
};

// Reads each check's (small) dataset of `input` and settles the check.
uint64_t SettleSteps(const universal::UniversalInput& input,
                     std::span<StepCheck> checks,
                     const reshape::ExecutorOptions& executor) {
  if (checks.empty()) return 0;
  std::vector<std::vector<std::byte>> bytes(checks.size());
  std::vector<BufferSink> sinks;
  sinks.reserve(checks.size());
  std::vector<reshape::Job> jobs;
  for (size_t i = 0; i < checks.size(); ++i) {
    const atoms::DatasetInfo& d = *checks[i].dataset;
    bytes[i].resize(NumElements(d.shape) * ElementSize(d.dtype));
    sinks.emplace_back(bytes[i].data());
    reshape::Job job;
    job.tensor.name = StrCat("param ", d.fqn, " > ", d.state_kind);
    job.tensor.dtype = d.dtype;
    job.tensor.shape = d.shape;
    job.tensor.ops.push_back(
        {input.Tensor(d), Box::Whole(d.shape), Box::Whole(d.shape), 0, {}});
    job.sink = &sinks.back();
    jobs.push_back(std::move(job));
  }
  const uint64_t read = input.Run(jobs, executor).bytes_read;
  for (size_t i = 0; i < checks.size(); ++i) {
    StepCheck& c = checks[i];
    const int64_t n = NumElements(c.dataset->shape);
    bool same = true;
    double seen = 0;
    for (int64_t e = 0; e < n && same; ++e) {
      seen = ElementToDouble(c.dataset->dtype, bytes[i].data(), e);
      same = seen == static_cast<double>(c.expected);
    }
    c.state->derived = same;
    c.state->note =
        same ? StrCat("equal to ", c.other, "'s optimizer step ", c.expected)
             : StrCat("step ", seen, ", ", c.other, "'s optimizer step ",
                      c.expected);
  }
  return read;
}

void CheckTolerance(const char* what, double v) {
  if (!(v >= 0) || std::isinf(v)) {
    throw UsageError(what, " ", v, ": must be a finite number >= 0");
  }
}

}  // namespace

bool ParamDiff::equal() const {
  if (!in_a || !in_b) return false;
  return std::all_of(states.begin(), states.end(),
                     [](const StateDiff& s) { return s.equal(); });
}

bool Report::equal() const {
  return std::all_of(params.begin(), params.end(),
                     [](const ParamDiff& p) { return p.equal(); });
}

namespace {

// What Compare reads: the states whose values it compares, and the steps it
// checks against the other side's optimizer step.
struct Work {
  std::vector<ValueTask> tasks;
  std::vector<StepCheck> steps_in_a, steps_in_b;
  std::optional<int64_t> a_step, b_step;
};

// Marks state `s` that one side lacks (the `lacking` param of
// `lacking_input`) derived when the other side (`having`) implies it, or
// queues the check of its step (Compare's contract).
void Derive(const atoms::StoredParam& lacking, StateDiff& s,
            const atoms::DatasetInfo& d,
            const universal::UniversalInput& lacking_input,
            const universal::UniversalInput& having, Work& work) {
  const bool a_has = s.in_a;
  const std::optional<int64_t>& step = a_has ? work.b_step : work.a_step;
  if (s.state == "param" &&
      lacking_input.FindAtom(lacking.info.fqn, "fp32") != nullptr &&
      having.FindAtom(lacking.info.fqn, "fp32") != nullptr) {
    s.derived = true;
    s.note = "the training-dtype copy of the fp32 master (compared)";
  } else if (s.state == "step" && step) {
    (a_has ? work.steps_in_a : work.steps_in_b)
        .push_back({&s, &d, *step, a_has ? "B" : "A"});
  }
}

// The states of param `p` (in both), into p.states (reserved: `work` keeps
// pointers to them).
void PairStates(const universal::UniversalInput& a,
                const universal::UniversalInput& b,
                const atoms::StoredParam& pa, const atoms::StoredParam& pb,
                ParamDiff& p, Work& work) {
  const auto sa = States(a, pa), sb = States(b, pb);
  p.states.reserve(sa.size() + sb.size());
  for (const atoms::DatasetInfo* da : sa) {
    StateDiff s;
    s.state = da->state_kind;
    s.in_a = true;
    s.a_dtype = da->dtype;
    s.a_shape = da->shape;
    const atoms::DatasetInfo* db = b.FindAtom(p.name, da->state_kind);
    if (db != nullptr) {
      s.in_b = true;
      s.b_dtype = db->dtype;
      s.b_shape = db->shape;
    }
    p.states.push_back(std::move(s));
    StateDiff& stored = p.states.back();
    if (db == nullptr) {
      Derive(pb, stored, *da, b, a, work);
    } else if (!stored.shape_differs() &&
               ValuesComparable(da->dtype, db->dtype)) {
      stored.values_compared = true;
      work.tasks.push_back({&stored,
                            StrCat("param ", p.name, " > ", stored.state), da,
                            db, nullptr});
    }
  }
  for (const atoms::DatasetInfo* db : sb) {
    if (a.FindAtom(p.name, db->state_kind) != nullptr) continue;
    StateDiff s;
    s.state = db->state_kind;
    s.in_b = true;
    s.b_dtype = db->dtype;
    s.b_shape = db->shape;
    p.states.push_back(std::move(s));
    Derive(pa, p.states.back(), *db, a, b, work);
  }
}

// Reads and compares every task's values in batches of windows; returns the
// bytes read.
uint64_t CompareValues(const universal::UniversalInput& a,
                       const universal::UniversalInput& b,
                       std::vector<ValueTask>& tasks, const Options& options,
                       reshape::ExecutorOptions& executor) {
  // The budget: at most half for A's windows (a batch of kBatchBytes stays
  // in the last-level cache until B's chunks are compared with it), a
  // quarter for the executor's chunks (of kChunkBytes: several per batch for
  // the threads to share).
  const uint64_t budget = options.executor.memory_budget;
  const uint64_t buffer_bytes =
      options.batch_bytes != 0
          ? options.batch_bytes
          : std::clamp<uint64_t>(budget / 2, 1u << 20, kBatchBytes);
  executor.memory_budget = std::max<uint64_t>(budget / 4, 1u << 20);
  if (executor.chunk_bytes == 0) executor.chunk_bytes = kChunkBytes;
  std::mutex mutex;
  for (ValueTask& t : tasks) t.mutex = &mutex;
  std::unique_ptr<std::byte[]> buffer;
  uint64_t buffer_size = 0, used = 0, read = 0;
  std::vector<Window> batch;
  auto flush = [&] {
    if (batch.empty()) return;
    if (buffer_size < used) {
      buffer.reset(new std::byte[used]);  // not zeroed: every byte is read
      buffer_size = used;
    }
    read += RunBatch(a, b, batch, buffer.get(), options.tolerance, executor);
    batch.clear();
    used = 0;
  };
  for (ValueTask& t : tasks) {
    const int64_t n = NumElements(t.a->shape);
    const auto ea = static_cast<uint64_t>(ElementSize(t.a->dtype));
    const auto per_window =
        static_cast<int64_t>(std::max<uint64_t>(buffer_bytes / ea, 1));
    for (int64_t begin = 0; begin < n; begin += per_window) {
      const int64_t end = std::min(n, begin + per_window);
      const uint64_t bytes = static_cast<uint64_t>(end - begin) * ea;
      if (used + bytes > buffer_bytes) flush();
      batch.push_back({&t, begin, end, used});
      used += bytes;
    }
  }
  flush();
  return read;
}

}  // namespace

Report Compare(const universal::UniversalInput& a,
               const universal::UniversalInput& b, const Options& options) {
  CheckTolerance("atol", options.tolerance.atol);
  CheckTolerance("rtol", options.tolerance.rtol);
  Report report;
  report.a = a.path().string();
  report.b = b.path().string();
  report.tolerance = options.tolerance;
  // Params: A's in order, then B's others.
  std::vector<std::pair<const atoms::StoredParam*, const atoms::StoredParam*>>
      pairs;
  for (const atoms::StoredParam& p : a.params())
    pairs.emplace_back(&p, b.FindParam(p.info.fqn));
  for (const atoms::StoredParam& p : b.params())
    if (a.FindParam(p.info.fqn) == nullptr) pairs.emplace_back(nullptr, &p);
  report.params.resize(pairs.size());  // not resized again: Work points in
  Work work;
  work.a_step = OptimizerStep(a.model());
  work.b_step = OptimizerStep(b.model());
  size_t states = 0;
  for (const auto& [pa, pb] : pairs)
    if (pa && pb) states += pa->atoms.size();
  work.tasks.reserve(states);  // windows point at tasks
  for (size_t i = 0; i < pairs.size(); ++i) {
    const auto [pa, pb] = pairs[i];
    ParamDiff& p = report.params[i];
    p.name = (pa ? pa : pb)->info.fqn;
    p.in_a = pa != nullptr;
    p.in_b = pb != nullptr;
    if (!pa || !pb) continue;
    ++report.params_compared;
    PairStates(a, b, *pa, *pb, p, work);
  }
  reshape::ExecutorOptions executor = options.executor;
  std::unique_ptr<Progress> progress;
  if (options.progress) {
    uint64_t total = 0;
    for (const ValueTask& t : work.tasks) {
      const auto n = static_cast<uint64_t>(NumElements(t.a->shape));
      total += n * (ElementSize(t.a->dtype) + ElementSize(t.b->dtype));
    }
    progress = std::make_unique<Progress>("diff", total);
    executor.progress = progress.get();
  }
  report.bytes_read = CompareValues(a, b, work.tasks, options, executor);
  report.bytes_read += SettleSteps(a, work.steps_in_a, executor);
  report.bytes_read += SettleSteps(b, work.steps_in_b, executor);
  if (progress) progress->Finish();
  for (ParamDiff& p : report.params) {
    for (StateDiff& s : p.states) {
      report.derived_states += s.derived;
      if (!s.values_compared) continue;
      ++report.states_compared;
      report.elements_compared += s.values.compared;
      report.differing_elements += s.values.differing;
      if (s.values.first >= 0)
        s.first_index = Unravel(s.values.first, s.a_shape);
    }
  }
  return report;
}

struct Opened::Impl {
  std::string format;
  std::optional<atoms::AtomStoreReader> store;
  std::unique_ptr<formats::Source> source;
  std::unique_ptr<universal::SourcePlan> plan;
  std::unique_ptr<universal::UniversalInput> input;
  std::unique_ptr<universal::UniversalInput> mapped;
};

Opened::Opened() : impl_(std::make_unique<Impl>()) {}
Opened::Opened(Opened&&) noexcept = default;
Opened& Opened::operator=(Opened&&) noexcept = default;
Opened::~Opened() = default;

const universal::UniversalInput& Opened::input() const {
  return impl_->mapped ? *impl_->mapped : *impl_->input;
}

const std::string& Opened::format() const { return impl_->format; }

bool Opened::mapped() const { return impl_->mapped != nullptr; }

Opened Opened::Open(const fs::path& path, const Options& options) {
  Opened o;
  Impl& m = *o.impl_;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw IoError("cannot open ", path.string(), ": no such file or directory");
  }
  if (!fs::is_directory(path, ec) && atoms::IsHdf5File(path)) {
    m.format = "universal";
    m.store.emplace(atoms::AtomStoreReader::Open(path));
    m.input = universal::StoreInput(*m.store);
  } else {
    const formats::Driver& driver = formats::DetectDriver(path);
    m.format = std::string(driver.Name());
    m.source = driver.Open(path, options.source);
    m.plan = std::make_unique<universal::SourcePlan>(m.source->Plan());
    m.input =
        universal::PlanInput(*m.plan, m.source->info().path, options.executor);
  }
  if (!options.names.empty()) {
    m.mapped =
        formats::MapNamesIfKnown(*m.input, options.names, options.model_vars);
  }
  return o;
}

Report DiffPaths(const fs::path& a, const fs::path& b, const Options& options) {
  if (!options.names.empty()) formats::CheckNameMapName(options.names);
  CheckTolerance("atol", options.tolerance.atol);
  CheckTolerance("rtol", options.tolerance.rtol);
  Opened oa = Opened::Open(a, options);
  Opened ob = Opened::Open(b, options);
  if (!options.names.empty() && !oa.mapped() && !ob.mapped()) {
    // Neither side is a model the map knows: its own error.
    (void)formats::MapNames(oa.input(), options.names, options.model_vars);
  }
  Report r = Compare(oa.input(), ob.input(), options);
  r.a = a.string();
  r.b = b.string();
  r.a_format = oa.format();
  r.b_format = ob.format();
  return r;
}

}  // namespace ucp::diff
