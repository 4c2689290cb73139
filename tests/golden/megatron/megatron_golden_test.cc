// Golden tests of the Megatron driver (engine/formats/megatron):
//  - to-universal of every generated topology
//  (tests/tools/make_megatron_ckpts.py,
//    Megatron-core v0.13 semantics) gives the same universal content, and the
//    universal file equals the generator's truth.pt (check_universal.py);
//  - universal -> every topology equals the generator's files for that
//    topology (compare_megatron_ckpt.py, batched);
//  - A -> universal -> B -> universal is the identity; universal -> A
//    reproduces A's files;
//  - the real Megatron-LM 23.06 files: synth_tp2 (TP2) -> TP1 PP2 equals
//    Megatron's own from_tp2_to_tp1_pp2 tensor for tensor, and back;
//  - bad input: errors name file, param and problem; nothing is left under
//    the output name; the source is never modified.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/json/json.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"
#include "layouts/layout.h"
#include "tests/testutil/testutil.h"

namespace ucp::megatron {
namespace {

namespace fs = std::filesystem;
using testing::HasSubstr;

const char* const kVariants[] = {
    "gqa_swiglu_bias_untied", "gqa_swiglu_bias_tied", "mha_gelu_nobias_tied"};
// TP 4 x PP 4 holds every padding row of the grid and every (tp, pp) rank of
// any other topology, so rng states are exact everywhere.
constexpr const char* kReference = "tp4_pp4_vpp2_dp2_do";

fs::path MegatronData() { return testutil::TestDataDir() / "megatron"; }

std::vector<std::string> Topologies(const std::string& variant) {
  json::Value m = json::Value::Parse(
      testutil::ReadFile(MegatronData() / variant / "manifest.json"));
  std::vector<std::string> out;
  for (const json::Value& t : m.At("topologies").items())
    out.push_back(t.AsString());
  return out;
}

reshape::ExecutorOptions Exec() {
  reshape::ExecutorOptions o;
  o.threads = 2;
  o.memory_budget = 64ull << 20;
  return o;
}

universal::WriteSummary ToUniversal(const fs::path& ckpt, const fs::path& out,
                                    const SourceOptions& options = {}) {
  Checkpoint c = Discover(ckpt);
  universal::SourcePlan plan = PlanSource(c, options);
  return universal::WriteUniversal(plan, out, Exec());
}

TargetSummary WriteStaged(const fs::path& h5, const fs::path& out,
                          const TargetOptions& options) {
  atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(h5);
  universal::StagedDirectory staged(out);
  TargetSummary s = WriteTarget(store, staged.path(), options, Exec());
  staged.Commit();
  // The generator runs under numpy 1: every target notes that numpy's RNG
  // state keeps numpy 1's module path (--rng-state, judged by
  // tests/cli/test_megatron_rng_state.py). The other notes are checked here.
  std::erase_if(s.notes, [](const std::string& n) {
    return n.starts_with("rng states: numpy's state is pickled under numpy 1");
  });
  return s;
}

// name -> topology of the generator's folder names.
TargetOptions TargetFor(const std::string& name) {
  TargetOptions o;
  int tp, pp, vpp, dp;
  char kind[8] = {};
  EXPECT_EQ(std::sscanf(name.c_str(), "tp%d_pp%d_vpp%d_dp%d_%7s", &tp, &pp,
                        &vpp, &dp, kind),
            5)
      << name;
  o.topology.tp = tp;
  o.topology.pp = pp;
  o.topology.vpp = vpp;
  o.topology.dp = dp;
  o.distributed_optimizer = std::string(kind) == "do";
  return o;
}

// Everything of a universal file that does not depend on the source
// topology: params with attributes and the xxh3 of every main atom, the
// optimizer groups and the root attributes that describe the model.
std::string Digest(const fs::path& h5) {
  atoms::AtomStoreReader s = atoms::AtomStoreReader::Open(h5);
  std::string out = StrCat(
      "iteration=", s.root().iteration, " consumed=", s.root().consumed_samples,
      "\n", "model=", s.root().model, "\n", "optimizer=", s.root().optimizer,
      "\n", "scheduler=", s.root().scheduler, "\n");
  for (const atoms::StoredParam& p : s.params()) {
    out += StrCat(p.info.fqn, " rule=", p.info.rule,
                  " dtype=", DTypeName(p.info.dtype), " group=", p.info.group,
                  " order=", p.info.order, " shape=");
    for (int64_t d : p.info.shape) out += StrCat(d, ",");
    std::map<std::string, uint64_t> hashes;  // by state kind
    for (atoms::DatasetId id : p.atoms)
      hashes[s.dataset(id).state_kind] = s.dataset(id).xxh3;
    for (const auto& [kind, h] : hashes) {
      char hex[32];
      std::snprintf(hex, sizeof hex, "%016llx",
                    static_cast<unsigned long long>(h));
      out += StrCat(" ", kind, "=", hex);
    }
    out += "\n";
  }
  return out;
}

std::string Py() { return testutil::ShellQuote(testutil::Python()); }
std::string Tool(const char* name) {
  return testutil::ShellQuote(
      (testutil::SourceDir() / "tests" / "tools" / name).string());
}

// A copy of a generated topology folder.
fs::path CopyTopology(const std::string& v, const std::string& t,
                      const fs::path& to) {
  fs::copy(MegatronData() / v / t, to, fs::copy_options::recursive);
  return to;
}

// ---------------------------------------------------------------- to-universal

// check_universal.py (h5py + torch): the universal file of one topology per
// variant equals truth.pt, padding rows and tied copies included.
TEST(MegatronGolden, UniversalEqualsTruth) {
  testutil::TempDir tmp;
  const std::pair<const char*, const char*> cases[] = {
      {"gqa_swiglu_bias_untied", "tp1_pp1_vpp1_dp1_nodo"},
      {"gqa_swiglu_bias_tied", kReference},
      {"mha_gelu_nobias_tied", "tp2_pp2_vpp2_dp1_nodo"},
  };
  for (const auto& [v, t] : cases) {
    SCOPED_TRACE(StrCat(v, "/", t));
    const fs::path src = MegatronData() / v / t;
    const fs::path h5 = tmp / StrCat(v, ".h5");
    universal::WriteSummary s = ToUniversal(src, h5);
    EXPECT_GT(s.params, 0);
    std::string out;
    const int rc = testutil::RunCommand(
        StrCat(Py(), " ", Tool("check_universal.py"), " ",
               testutil::ShellQuote(h5.string()), " ",
               testutil::ShellQuote((MegatronData() / v / "truth.pt").string()),
               " --no-align-check --padding-from ",
               testutil::ShellQuote(src.string()), " -v"),
        &out);
    EXPECT_EQ(rc, 0) << out;
  }
}

// Runs compare_megatron_ckpt.py --batch over (expected, actual) pairs; one
// failure per differing pair.
void CompareBatch(const fs::path& dir,
                  const std::vector<std::pair<fs::path, fs::path>>& pairs) {
  std::string text;
  for (const auto& [e, a] : pairs)
    text += StrCat(e.string(), "\t", a.string(), "\n");
  const fs::path list = dir / "pairs.txt";
  testutil::WriteFile(list, text);
  std::string out;
  const int rc = testutil::RunCommand(
      StrCat(Py(), " ", Tool("compare_megatron_ckpt.py"), " --batch ",
             testutil::ShellQuote(list.string())),
      &out);
  size_t ok = 0;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("OK ", 0) == 0) ++ok;
    if (line.rfind("DIFF ", 0) == 0 || line.rfind("BAD ", 0) == 0)
      ADD_FAILURE() << line;
  }
  EXPECT_EQ(ok, pairs.size()) << out;
  EXPECT_EQ(rc, 0) << out;
}

// Every topology of every variant: to-universal gives the same content
// (digest) as the reference topology's universal file.
TEST(MegatronGolden, EveryTopologyToTheSameUniversal) {
  testutil::TempDir tmp;
  int checked = 0;
  int failures = 0;
  for (const char* v : kVariants) {
    const fs::path ref_h5 = tmp / StrCat(v, "_ref.h5");
    ToUniversal(MegatronData() / v / kReference, ref_h5);
    const std::string want = Digest(ref_h5);
    for (const std::string& t : Topologies(v)) {
      SCOPED_TRACE(StrCat(v, "/", t));
      const fs::path h5 = tmp / "t.h5";
      fs::remove(h5);
      ToUniversal(MegatronData() / v / t, h5);
      const std::string got = Digest(h5);
      if (got != want && ++failures <= 3) {
        // The first differing line.
        std::istringstream a(want), b(got);
        std::string la, lb;
        while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
        }
        ADD_FAILURE() << "universal differs from " << kReference
                      << "'s:\n  want " << la << "\n  got  " << lb;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 225);
  EXPECT_EQ(failures, 0);
}

// The reference universal file of each variant -> every topology equals the
// generator's files of that topology.
TEST(MegatronGolden, UniversalToEveryTopology) {
  testutil::TempDir tmp;
  std::vector<std::pair<fs::path, fs::path>> pairs;
  for (const char* v : kVariants) {
    const fs::path h5 = tmp / StrCat(v, ".h5");
    ToUniversal(MegatronData() / v / kReference, h5);
    for (const std::string& t : Topologies(v)) {
      SCOPED_TRACE(StrCat(v, "/", t));
      const fs::path out = tmp / v / t;
      fs::create_directories(out.parent_path());
      TargetSummary s = WriteStaged(h5, out, TargetFor(t));
      EXPECT_TRUE(s.notes.empty()) << s.notes.front();
      pairs.emplace_back(MegatronData() / v / t, out);
    }
  }
  EXPECT_EQ(pairs.size(), 225u);
  CompareBatch(tmp.path(), pairs);
}

// Runs a Python snippet (argv: the snippet's own args) with the tools'
// stand-in Megatron modules importable.
void RunPython(const std::string& code, const std::vector<std::string>& args) {
  std::string cmd =
      StrCat(Py(), " -c ",
             testutil::ShellQuote(StrCat(
                 "import sys; sys.path.insert(0, ", "'",
                 (testutil::SourceDir() / "tests" / "tools" / "stubs").string(),
                 "')\n", code)));
  for (const std::string& a : args) {
    cmd += ' ';
    cmd += testutil::ShellQuote(a);
  }
  std::string out;
  ASSERT_EQ(testutil::RunCommand(cmd, &out), 0) << out;
}

// ---------------------------------------------------------------- round trips

// A -> universal -> B -> universal is the identity for many pairs; universal
// (A) -> A reproduces A's files.
TEST(MegatronGolden, RoundTrips) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir tmp;
  std::vector<std::pair<fs::path, fs::path>> same;
  int pairs = 0;
  for (const char* v : kVariants) {
    const std::vector<std::string> topos = Topologies(v);
    const std::string want = [&] {
      const fs::path h5 = tmp / "ref.h5";
      ToUniversal(MegatronData() / v / kReference, h5);
      std::string d = Digest(h5);
      fs::remove(h5);
      return d;
    }();
    // Fixed pairs (extremes, VPP in and out, tied copies appearing and
    // disappearing, distributed optimizer on and off) plus seeded ones.
    std::vector<std::pair<std::string, std::string>> ab = {
        {"tp1_pp1_vpp1_dp1_nodo", "tp4_pp4_vpp2_dp4_do"},
        {"tp4_pp4_vpp2_dp4_do", "tp1_pp1_vpp1_dp1_nodo"},
        {"tp2_pp2_vpp2_dp1_nodo", "tp4_pp2_vpp1_dp4_do"},
        {"tp1_pp2_vpp1_dp4_do", "tp2_pp4_vpp2_dp1_nodo"},
    };
    for (int i = 0; i < 6; ++i) {
      ab.emplace_back(topos[rng() % topos.size()], topos[rng() % topos.size()]);
    }
    for (const auto& [a, b] : ab) {
      SCOPED_TRACE(StrCat(v, ": ", a, " -> ", b));
      const fs::path ua = tmp / "a.h5", ub = tmp / "b.h5";
      const fs::path outb = tmp / StrCat("b", pairs),
                     outa = tmp / StrCat("a", pairs);
      ToUniversal(MegatronData() / v / a, ua);
      EXPECT_EQ(Digest(ua), want);
      const TargetSummary sb = WriteStaged(ua, outb, TargetFor(b));
      // Ranks of B that A lacks get another rank's rng state, with a note.
      const TargetOptions ta = TargetFor(a), tb = TargetFor(b);
      const bool all_ranks =
          tb.topology.tp <= ta.topology.tp && tb.topology.pp <= ta.topology.pp;
      EXPECT_EQ(sb.notes.empty(), all_ranks);
      if (!all_ranks) {
        EXPECT_THAT(sb.notes, testing::Contains(HasSubstr("rng states")));
      }
      ToUniversal(outb, ub);
      EXPECT_EQ(Digest(ub), want);
      // universal(A) -> A is A again (padding rows included).
      WriteStaged(ua, outa, TargetFor(a));
      same.emplace_back(MegatronData() / v / a, outa);
      fs::remove(ua);
      fs::remove(ub);
      ++pairs;
    }
  }
  EXPECT_EQ(pairs, 30);
  CompareBatch(tmp.path(), same);

  // Uneven pipeline stages (--decoder-first-pipeline-num-layers 3 of 8 on
  // pp 2): the target's args carry the split and are read back from them.
  const fs::path ua = tmp / "uneven_src.h5", ub = tmp / "uneven.h5";
  ToUniversal(MegatronData() / kVariants[1] / kReference, ua);
  TargetOptions o = TargetFor("tp2_pp2_vpp1_dp2_do");
  o.topology.first_stage_layers = 3;
  WriteStaged(ua, tmp / "uneven", o);
  Checkpoint c = Discover(tmp / "uneven");
  EXPECT_EQ(c.topology.first_stage_layers, std::optional<int64_t>(3));
  ToUniversal(tmp / "uneven", ub);
  EXPECT_EQ(Digest(ub), Digest(ua));
}

// --no-optimizer: model weights only, as Megatron saves with --no-save-optim
// (no optimizer, no scheduler, no distrib_optim.pt); the model state dicts
// equal the generator's.
TEST(MegatronGolden, WeightsOnlyTarget) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_tied", t = "tp2_pp2_vpp2_dp2_do";
  ToUniversal(MegatronData() / v / kReference, tmp / "u.h5");
  TargetOptions o = TargetFor(t);
  o.no_optimizer = true;
  WriteStaged(tmp / "u.h5", tmp / "out", o);
  RunPython(
      "import os, torch\n"
      "sys.path.insert(0, sys.argv[3])\n"
      "import compare_megatron_ckpt as C\n"
      "exp, act = sys.argv[1], sys.argv[2]\n"
      "it = os.path.join(exp, 'iter_0000100')\n"
      "n = 0\n"
      "for rd in sorted(os.listdir(it)):\n"
      "    files = sorted(os.listdir(os.path.join(act, 'iter_0000100', rd)))\n"
      "    assert files == ['model_optim_rng.pt'], files\n"
      "    e = torch.load(os.path.join(it, rd, 'model_optim_rng.pt'))\n"
      "    a = torch.load(os.path.join(act, 'iter_0000100', rd, "
      "'model_optim_rng.pt'))\n"
      "    want = [k for k in e if k not in ('optimizer', "
      "'opt_param_scheduler')]\n"
      "    assert list(a) == want, (list(a), want)\n"
      "    for k in want:\n"
      "        if k.startswith('model'):\n"
      "            C.compare_model(e[k], a[k], k, False)\n"
      "            n += 1\n"
      "    assert a['args'].use_distributed_optimizer is True\n"
      "assert n == 8, n\n",
      {(MegatronData() / v / t).string(), (tmp / "out").string(),
       (testutil::SourceDir() / "tests" / "tools").string()});
  // Read back (a distributed-optimizer run saved with --no-save-optim has no
  // distrib_optim.pt) and written again: the same files.
  ToUniversal(tmp / "out", tmp / "w.h5");
  {
    atoms::AtomStoreReader s = atoms::AtomStoreReader::Open(tmp / "w.h5");
    EXPECT_EQ(s.FindOpaque("optimizer/param_groups"), nullptr);
  }
  WriteStaged(tmp / "w.h5", tmp / "again", o);
  CompareBatch(tmp.path(), {{tmp / "out", tmp / "again"}});
}

// torch.optim.Adam (Megatron without apex / Transformer Engine) keeps `step`
// per param as a 0-d float tensor in the state, not in the param groups; the
// distributed optimizer then stores its value as a float on every group
// (distrib_optimizer.py:state_dict). Files edited by torch from the
// generator's: step 97 (fp16 runs skip steps, so not the iteration 100).
// Both directions between the two.
TEST(MegatronGolden, TorchAdamStepPerParam) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_tied";
  const fs::path nodo = CopyTopology(v, "tp2_pp2_vpp1_dp1_nodo", tmp / "nodo");
  const fs::path dist = CopyTopology(v, "tp2_pp2_vpp2_dp2_do", tmp / "dist");
  RunPython(
      "import glob, os, torch\n"
      "def files(root):\n"
      "    return sorted(glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt')))\n"
      "for p in files(sys.argv[1]):\n"
      "    sd = torch.load(p)\n"
      "    inner = sd['optimizer']['optimizer']\n"
      "    for g in inner['param_groups']:\n"
      "        del g['step']\n"
      "        for i in g['params']:\n"
      "            inner['state'][i] = {'step': torch.tensor(97.0), "
      "**inner['state'][i]}\n"
      "    torch.save(sd, p)\n"
      "for p in files(sys.argv[2]):\n"
      "    sd = torch.load(p)\n"
      "    for g in sd['optimizer']['optimizer']['param_groups']:\n"
      "        g['step'] = 97.0\n"
      "    torch.save(sd, p)\n",
      {nodo.string(), dist.string()});
  const fs::path h5 = tmp / "u.h5";
  ToUniversal(nodo, h5);
  {
    atoms::AtomStoreReader s = atoms::AtomStoreReader::Open(h5);
    const atoms::DatasetInfo* step =
        s.FindAtom("decoder.layers.3.mlp.linear_fc2.weight", "step");
    ASSERT_NE(step, nullptr);
    EXPECT_TRUE(step->shape.empty());
  }
  ToUniversal(dist, tmp / "d.h5");
  std::vector<TargetSummary> notes;
  notes.push_back(
      WriteStaged(h5, tmp / "same", TargetFor("tp2_pp2_vpp1_dp1_nodo")));
  notes.push_back(
      WriteStaged(h5, tmp / "do", TargetFor("tp2_pp2_vpp2_dp2_do")));
  notes.push_back(WriteStaged(tmp / "d.h5", tmp / "back",
                              TargetFor("tp2_pp2_vpp1_dp1_nodo")));
  for (const TargetSummary& t : notes)
    EXPECT_TRUE(t.notes.empty()) << t.notes.front();
  CompareBatch(
      tmp.path(),
      {{nodo, tmp / "same"}, {dist, tmp / "do"}, {nodo, tmp / "back"}});
}

// FusedAdam keeps `step` per group and steps every group that has params, so
// a group that no source rank's DP rank 0 held (no `step` anywhere) takes
// another group's step, not the iteration.
TEST(MegatronGolden, GroupWithoutStepTakesAnotherGroupsStep) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_tied";
  const fs::path src = CopyTopology(v, "tp2_pp2_vpp1_dp2_do", tmp / "src");
  const fs::path want = CopyTopology(v, "tp2_pp2_vpp1_dp1_nodo", tmp / "want");
  RunPython(
      "import glob, os, torch\n"
      "for root, drop in ((sys.argv[1], True), (sys.argv[2], False)):\n"
      "    for p in glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt')):\n"
      "        sd = torch.load(p)\n"
      "        for g in sd['optimizer']['optimizer']['param_groups']:\n"
      "            if 'step' in g: g['step'] = 97\n"
      "            if drop and g['wd_mult'] == 0.0: g.pop('step', None)\n"
      "        torch.save(sd, p)\n",
      {src.string(), want.string()});
  ToUniversal(src, tmp / "u.h5");
  const TargetSummary s = WriteStaged(tmp / "u.h5", tmp / "out",
                                      TargetFor("tp2_pp2_vpp1_dp1_nodo"));
  EXPECT_TRUE(s.notes.empty()) << s.notes.front();
  CompareBatch(tmp.path(), {{want, tmp / "out"}});
}

// fp16 runs (Float16OptimizerWithFloat16Params with a dynamic grad scaler,
// fp16 grads: buffer key (float16, float16)) and fp32 runs (FP32Optimizer:
// the optimizer entry is the torch state dict itself; fp32 distributed
// optimizer: the model params are the main params), made by torch from the
// generator's bf16 files with the same values. Distributed and not, both
// ways, other TP and DP.
TEST(MegatronGolden, Fp16AndFp32Runs) {
  const char* const kEdit =
      "import glob, os, torch\n"
      "mode = sys.argv[1]\n"
      "dt = torch.float16 if mode == 'fp16' else torch.float32\n"
      "for root in sys.argv[2:]:\n"
      "  for p in glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt')):\n"
      "    sd = torch.load(p)\n"
      "    a = sd['args']\n"
      "    a.bf16, a.params_dtype = False, dt\n"
      "    a.fp16 = mode == 'fp16'\n"
      "    a.accumulate_allreduce_grads_in_fp32 = False\n"
      "    d = os.path.join(os.path.dirname(p), 'distrib_optim.pt')\n"
      "    dist = torch.load(d) if os.path.exists(d) else None\n"
      "    chunks = [k for k in sd if k.startswith('model')]\n"
      "    for v, k in enumerate(chunks):\n"
      "        buf = None\n"
      "        for n, t in sd[k].items():\n"
      "            if isinstance(t, torch.Tensor) and t.dtype == "
      "torch.bfloat16:\n"
      "                if buf is None:\n"
      "                    buf = torch.tensor([], "
      "dtype=torch.bfloat16).set_(t.storage()).float()\n"
      "                sd[k][n] = t.to(dt)\n"
      "        if dist is not None:\n"
      "            (key, w), = dist[v].items()\n"
      "            if mode == 'fp32':\n"
      "                w['param'] = buf[:w['numel_unpadded']].clone()\n"
      "            dist[v] = {(dt, dt): w}\n"
      "    o = sd['optimizer']\n"
      "    if mode == 'fp16':\n"
      "        scaler = {'scale': torch.tensor([4096.0]), 'growth_tracker': "
      "7, 'hysteresis_tracker': 2}\n"
      "        sd['optimizer'] = {'optimizer': o['optimizer'], "
      "'grad_scaler': scaler}\n"
      "        if 'fp32_from_fp16_params' in o:\n"
      "            sd['optimizer']['fp32_from_fp16_params'] = "
      "o['fp32_from_fp16_params']\n"
      "    elif dist is None:\n"
      "        sd['optimizer'] = o['optimizer']\n"
      "    if dist is not None: torch.save(dist, d)\n"
      "    torch.save(sd, p)\n";
  const std::string v = "gqa_swiglu_bias_tied";
  const std::string dist = "tp2_pp2_vpp1_dp2_do",
                    dist_tp1 = "tp1_pp2_vpp1_dp4_do",
                    nodo = "tp2_pp2_vpp1_dp1_nodo";
  for (const char* mode : {"fp16", "fp32"}) {
    SCOPED_TRACE(mode);
    testutil::TempDir tmp;
    std::vector<std::string> args = {mode};
    for (const std::string& t : {dist, dist_tp1, nodo})
      args.push_back(CopyTopology(v, t, tmp / t).string());
    RunPython(kEdit, args);
    ToUniversal(tmp / dist, tmp / "d.h5");
    ToUniversal(tmp / nodo, tmp / "n.h5");
    {
      atoms::AtomStoreReader s = atoms::AtomStoreReader::Open(tmp / "d.h5");
      const atoms::StoredParam* p =
          s.FindParam("decoder.layers.0.mlp.linear_fc1.weight");
      ASSERT_NE(p, nullptr);
      EXPECT_EQ(DTypeName(p->info.dtype),
                mode == std::string("fp16") ? "float16" : "float32");
      EXPECT_EQ(s.FindOpaque("grad_scaler") != nullptr,
                mode == std::string("fp16"));
    }
    WriteStaged(tmp / "d.h5", tmp / "o1", TargetFor(dist_tp1));
    WriteStaged(tmp / "d.h5", tmp / "o2", TargetFor(nodo));
    WriteStaged(tmp / "n.h5", tmp / "o3", TargetFor(dist));
    CompareBatch(tmp.path(), {{tmp / dist_tp1, tmp / "o1"},
                              {tmp / nodo, tmp / "o2"},
                              {tmp / dist, tmp / "o3"}});
  }
}

// ---------------------------------------------------------------- 23.06

// Copies a read-only fixture folder and makes the copy writable (so the
// temporary folder can be removed).
fs::path CopyFixture(const fs::path& from, const fs::path& to) {
  fs::copy(from, to, fs::copy_options::recursive);
  for (const auto& e : fs::recursive_directory_iterator(to)) {
    fs::permissions(e.path(), fs::perms::owner_all, fs::perm_options::add);
  }
  fs::permissions(to, fs::perms::owner_all, fs::perm_options::add);
  return to;
}

// Megatron-LM 23.06's own converter made from_tp2_to_tp1_pp2 out of
// synth_tp2: the same through the universal file, tensor for tensor (and
// back), with the right parallel sizes in args.
TEST(MegatronGolden, Megatron2306Fixtures) {
  testutil::TempDir tmp;
  const fs::path fx = testutil::FixturesDir() / "megatron-23.06";
  const fs::path tp2 = CopyFixture(fx / "synth_tp2", tmp / "synth_tp2");
  const fs::path pp2 =
      CopyFixture(fx / "from_tp2_to_tp1_pp2", tmp / "from_tp2_to_tp1_pp2");
  TargetOptions to_pp2;
  to_pp2.topology = {1, 2, 1, 4};
  TargetOptions to_tp2;
  to_tp2.topology = {2, 1, 1, 4};
  ToUniversal(tp2, tmp / "tp2.h5");
  ToUniversal(pp2, tmp / "pp2.h5");
  {
    atoms::AtomStoreReader s = atoms::AtomStoreReader::Open(tmp / "tp2.h5");
    // Weights only, fp32: one fp32 atom per param, the embedding at the
    // NullTokenizer's 511 + 1 = 512 rows (padded == true size).
    const atoms::StoredParam* emb =
        s.FindParam("language_model.embedding.word_embeddings.weight");
    ASSERT_NE(emb, nullptr);
    EXPECT_EQ(emb->info.shape, (Shape{512, 16}));
    EXPECT_EQ(emb->atoms.size(), 1u);
    EXPECT_EQ(s.params().size(), 28u);
    EXPECT_EQ(Digest(tmp / "tp2.h5"), Digest(tmp / "pp2.h5"));
  }
  WriteStaged(tmp / "tp2.h5", tmp / "out_pp2", to_pp2);
  WriteStaged(tmp / "pp2.h5", tmp / "out_tp2", to_tp2);
  std::string out;
  const std::string fields =
      " --args-fields tensor_model_parallel_size,pipeline_model_parallel_size,"
      "padded_vocab_size,num_layers,hidden_size ";
  for (const auto& [want, got] :
       {std::pair{pp2, tmp / "out_pp2"}, std::pair{tp2, tmp / "out_tp2"}}) {
    const int rc =
        testutil::RunCommand(StrCat(Py(), " ", Tool("compare_megatron_ckpt.py"),
                                    fields, testutil::ShellQuote(want.string()),
                                    " ", testutil::ShellQuote(got.string())),
                             &out);
    EXPECT_EQ(rc, 0) << out;
  }
}

// Megatron-LM 23.x / Megatron-core <= v0.5 with an optimizer: a legacy
// (language_model.*) bf16 model whose param groups follow the old fixed order
// (weight-decayed group first; v0.6+ orders groups by first appearance, so a
// later pipeline stage starting with a norm lists the no-decay group first).
// The 23.06 fixtures get a Float16OptimizerWithFloat16Params state made by
// torch: fp32 masters = the fixture's tensors, exp_avg = master / 2,
// exp_avg_sq = master^2, so every state id must land on its own param.
TEST(MegatronGolden, Megatron2306WithOptimizer) {
  testutil::TempDir tmp;
  const fs::path fx = testutil::FixturesDir() / "megatron-23.06";
  const fs::path tp2 = CopyFixture(fx / "synth_tp2", tmp / "synth_tp2");
  const fs::path pp2 =
      CopyFixture(fx / "from_tp2_to_tp1_pp2", tmp / "from_tp2_to_tp1_pp2");
  RunPython(
      "import glob, os, torch\n"
      "for root in sys.argv[1:]:\n"
      "  for p in sorted(glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt'))):\n"
      "    sd = torch.load(p)\n"
      "    sd['args'].bf16, sd['args'].params_dtype = True, torch.bfloat16\n"
      "    leaves = []\n"
      "    def walk(d):\n"
      "        for k, v in d.items():\n"
      "            if isinstance(v, dict): walk(v)\n"
      "            else:\n"
      "                leaves.append((k, v))\n"
      "                d[k] = v.to(torch.bfloat16)\n"
      "    walk(sd['model'])\n"
      "    nowd = lambda k, t: k.endswith('bias') or t.dim() == 1\n"
      "    state, groups, masters, pid = {}, [], [], 0\n"
      "    for mult in (1.0, 0.0):\n"
      "        members = [t for k, t in leaves if nowd(k, t) == (mult == "
      "0.0)]\n"
      "        ids = list(range(pid, pid + len(members)))\n"
      "        for i, t in zip(ids, members):\n"
      "            state[i] = {'exp_avg': t * 0.5, 'exp_avg_sq': t * t}\n"
      "        pid += len(members)\n"
      "        groups.append({'params': ids, 'wd_mult': mult, 'lr_mult': 1.0, "
      "'lr': 1e-4, 'bias_correction': True, 'betas': (0.9, 0.95), 'eps': "
      "1e-8, 'weight_decay': 0.1, 'step': 10})\n"
      "        masters.append(list(members))\n"
      "    sd['optimizer'] = {'optimizer': {'state': state, 'param_groups': "
      "groups}, 'fp32_from_fp16_params': masters}\n"
      "    sd['opt_param_scheduler'] = {'max_lr': 1e-4, 'num_steps': 80}\n"
      "    torch.save(sd, p)\n",
      {tp2.string(), pp2.string()});
  ToUniversal(tp2, tmp / "tp2.h5");
  ToUniversal(pp2, tmp / "pp2.h5");
  EXPECT_EQ(Digest(tmp / "tp2.h5"), Digest(tmp / "pp2.h5"));
  RunPython(
      "import h5py, numpy as np, torch\n"
      "n = 0\n"
      "with h5py.File(sys.argv[1], 'r') as f:\n"
      "    for name, g in f['params'].items():\n"
      "        m = g['fp32'][()]\n"
      "        assert np.array_equal(g['exp_avg'][()], m * np.float32(0.5)), "
      "name\n"
      "        assert np.array_equal(g['exp_avg_sq'][()], m * m), name\n"
      "        bf = torch.from_numpy(m).to(torch.bfloat16).view(torch.int16)\n"
      "        assert np.array_equal(g['param'][()].view(np.int16), "
      "bf.numpy()), name\n"
      "        n += 1\n"
      "assert n == 28, n\n",
      {(tmp / "pp2.h5").string()});
  // Written back (groups in first-appearance order) and read again.
  TargetOptions to_tp2;
  to_tp2.topology = {2, 1, 1, 4};
  WriteStaged(tmp / "pp2.h5", tmp / "out_tp2", to_tp2);
  ToUniversal(tmp / "out_tp2", tmp / "out_tp2.h5");
  EXPECT_EQ(Digest(tmp / "out_tp2.h5"), Digest(tmp / "pp2.h5"));
}

// checkpoint_version < 2.0 (0 when absent): Megatron reorders the legacy
// query_key_value rows when loading such files, so they are refused; an
// mcore model (linear_qkv, nothing to reorder) without the key is read.
TEST(MegatronGolden, OldCheckpointVersion) {
  testutil::TempDir tmp;
  const fs::path legacy = CopyFixture(
      testutil::FixturesDir() / "megatron-23.06" / "synth_tp2", tmp / "l");
  const fs::path mcore = CopyTopology("gqa_swiglu_bias_untied",
                                      "tp1_pp1_vpp1_dp1_nodo", tmp / "m");
  RunPython(
      "import glob, os, torch\n"
      "for root, v in ((sys.argv[1], 1.0), (sys.argv[2], None)):\n"
      "  for p in glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt')):\n"
      "    sd = torch.load(p)\n"
      "    if v is None: del sd['checkpoint_version']\n"
      "    else: sd['checkpoint_version'] = v\n"
      "    torch.save(sd, p)\n",
      {legacy.string(), mcore.string()});
  EXPECT_THAT([&] { PlanSource(Discover(legacy), {}); },
              testing::ThrowsMessage<FormatError>(testing::AllOf(
                  HasSubstr("mp_rank_00"), HasSubstr("query_key_value.weight"),
                  HasSubstr("checkpoint_version 1"))));
  ToUniversal(mcore, tmp / "m.h5");
}

// ---------------------------------------------------------------- v0.8 files

// Files written the way Megatron-core v0.8 writes them (TE 1.x BytesIO extra
// state, no rerun_state_machine, v0.8 args) read into the same universal
// content and come back unchanged; a v0.8 distrib_optim.pt hit by the
// shared-embedding bucket quirk is refused with a clear message.
TEST(MegatronGolden, Megatron08Files) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_tied";
  const std::vector<std::string> topos = {
      "tp2_pp2_vpp2_dp2_do", "tp1_pp2_vpp1_dp4_do", "tp4_pp1_vpp1_dp1_nodo",
      "tp2_pp4_vpp1_dp2_nodo"};
  std::string list;
  for (const std::string& t : topos) {
    if (!list.empty()) list += ',';
    list += t;
  }
  std::string out;
  ASSERT_EQ(testutil::RunCommand(
                StrCat(Py(), " ", Tool("make_megatron_ckpts.py"),
                       " --megatron-version 0.8 --no-truth --variant ", v,
                       " --topologies ", list, " --out ",
                       testutil::ShellQuote((tmp / "v08").string())),
                &out),
            0)
      << out;
  const fs::path ref = tmp / "ref.h5";
  ToUniversal(MegatronData() / v / kReference, ref);
  const std::string want = Digest(ref);
  std::vector<std::pair<fs::path, fs::path>> pairs;
  for (const std::string& t : topos) {
    SCOPED_TRACE(t);
    const fs::path src = tmp / "v08" / v / t;
    const fs::path h5 = tmp / StrCat(t, ".h5");
    ToUniversal(src, h5);
    EXPECT_EQ(Digest(h5), want);
    fs::create_directories(tmp / "out");
    WriteStaged(h5, tmp / "out" / t, TargetFor(t));
    pairs.emplace_back(src, tmp / "out" / t);
  }
  CompareBatch(tmp.path(), pairs);

  // The quirk: on the first stage of mha_gelu_nobias_tied tp4_pp4_vpp2 dp1
  // the tied embedding opens its own bucket at 576 (64-aligned) while the
  // bucket starts at 640; v0.8 kept 576 and lost the embedding's first 64
  // elements from distrib_optim.pt (numel_unpadded 1088 - 64).
  const fs::path quirk = tmp / "quirk";
  fs::copy(MegatronData() / "mha_gelu_nobias_tied" / "tp4_pp4_vpp2_dp1_do",
           quirk, fs::copy_options::recursive);
  const fs::path dfile =
      quirk / "iter_0000100" / "mp_rank_00_000" / "distrib_optim.pt";
  RunPython(
      "import torch\n"
      "p = sys.argv[1]\n"
      "d = torch.load(p)\n"
      "w = d[0][(torch.bfloat16, torch.float32)]\n"
      "assert w['numel_unpadded'] == 1088, w['numel_unpadded']\n"
      "for k in ('param', 'exp_avg', 'exp_avg_sq'):\n"
      "    w[k] = torch.cat([w[k][:576], w[k][640:]])\n"
      "w['numel_unpadded'] = 1024\n"
      "torch.save(d, p)\n",
      {dfile.string()});
  EXPECT_THAT([&] { PlanSource(Discover(quirk), {}); },
              testing::ThrowsMessage<FormatError>(testing::AllOf(
                  HasSubstr(dfile.string()), HasSubstr("v0.8-v0.12"),
                  HasSubstr("embedding.word_embeddings.weight"),
                  HasSubstr("numel_unpadded 1024"))));
}

// --overlap-grad-reduce --ddp-bucket-size 600: the first stage's first
// chunk has several distributed-optimizer buckets, each padded for its DP
// size (distrib_optim.pt drops every bucket's end padding). The generator's
// files read into the same universal content, and one of them reshaped (DP
// changes included) reproduces every other one.
TEST(MegatronGolden, BucketedDistributedOptimizer) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_tied";
  const std::vector<std::string> topos = {
      "tp4_pp2_vpp1_dp4_do", "tp4_pp2_vpp1_dp1_do", "tp2_pp2_vpp1_dp2_do",
      "tp1_pp2_vpp2_dp4_do", "tp2_pp1_vpp1_dp4_do", "tp2_pp2_vpp1_dp1_nodo"};
  std::string list;
  for (const std::string& t : topos) list += (list.empty() ? "" : ",") + t;
  std::string out;
  ASSERT_EQ(testutil::RunCommand(
                StrCat(Py(), " ", Tool("make_megatron_ckpts.py"),
                       " --ddp-bucket-size 600 --no-truth --variant ", v,
                       " --topologies ", list, " --out ",
                       testutil::ShellQuote((tmp / "gen").string())),
                &out),
            0)
      << out;
  ToUniversal(MegatronData() / v / kReference, tmp / "ref.h5");
  const std::string want = Digest(tmp / "ref.h5");
  for (const std::string& t : topos) {
    SCOPED_TRACE(t);
    ToUniversal(tmp / "gen" / v / t, tmp / "t.h5");
    EXPECT_EQ(Digest(tmp / "t.h5"), want);
    fs::remove(tmp / "t.h5");
  }
  ToUniversal(tmp / "gen" / v / topos[0], tmp / "src.h5");
  std::vector<std::pair<fs::path, fs::path>> pairs;
  for (const std::string& t : topos) {
    const TargetSummary s = WriteStaged(tmp / "src.h5", tmp / t, TargetFor(t));
    EXPECT_TRUE(s.notes.empty()) << t << ": " << s.notes.front();
    pairs.emplace_back(tmp / "gen" / v / t, tmp / t);
  }
  CompareBatch(tmp.path(), pairs);
}

// ---------------------------------------------------------------- bad input

// Names and contents of every file under `dir`.
std::string TreeHash(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string all;
  for (const fs::path& f : files)
    all += StrCat(fs::relative(f, dir).string(), ":",
                  testutil::Sha256Hex(testutil::ReadFile(f)), "\n");
  return testutil::Sha256Hex(all);
}

// The entries of a folder (no staging leftovers after a failure).
std::vector<std::string> Entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(MegatronGolden, MissingFiles) {
  testutil::TempDir tmp;
  const fs::path src = CopyTopology("gqa_swiglu_bias_untied",
                                    "tp2_pp2_vpp1_dp2_do", tmp / "src");
  const fs::path it = src / "iter_0000100";
  const fs::path m = it / "mp_rank_01_001" / "model_optim_rng.pt";
  fs::rename(m, tmp / "saved.pt");
  EXPECT_THAT([&] { Discover(src); },
              testing::ThrowsMessage<FormatError>(testing::AllOf(
                  HasSubstr("missing rank file"), HasSubstr(m.string()))));
  fs::rename(tmp / "saved.pt", m);
  const fs::path d = it / "mp_rank_00_001" / "distrib_optim.pt";
  fs::remove(d);
  EXPECT_THAT([&] { Discover(src); },
              testing::ThrowsMessage<FormatError>(HasSubstr(d.string())));
  EXPECT_THAT([&] { Discover(tmp.path()); },
              testing::ThrowsMessage<FormatError>(
                  HasSubstr("latest_checkpointed_iteration.txt")));
  // The iteration folder itself is accepted.
  const fs::path other = CopyTopology("gqa_swiglu_bias_untied",
                                      "tp2_pp1_vpp1_dp1_nodo", tmp / "o");
  Checkpoint c = Discover(other / "iter_0000100");
  EXPECT_EQ(c.iteration, 100);
  EXPECT_EQ(c.dir, other);
  EXPECT_EQ(c.rank_files.size(), 1u);
  EXPECT_EQ(c.rank_files[0].size(), 2u);
  // An explicit iteration; a missing one is the caller's mistake, named
  // with the iterations there are.
  EXPECT_EQ(Discover(other, 100).iter_dir, other / "iter_0000100");
  EXPECT_THAT([&] { Discover(other, 99); },
              testing::ThrowsMessage<UsageError>(testing::AllOf(
                  HasSubstr("iter_0000099"), HasSubstr("iter_0000100"))));
  // A release checkpoint: the tracker says "release" and so does the output.
  const fs::path rel = CopyTopology("gqa_swiglu_bias_untied",
                                    "tp1_pp1_vpp1_dp1_nodo", tmp / "rel");
  fs::rename(rel / "iter_0000100", rel / "release");
  testutil::WriteFile(rel / "latest_checkpointed_iteration.txt", "release\n");
  Checkpoint r = Discover(rel);
  EXPECT_TRUE(r.release);
  EXPECT_EQ(r.iter_dir, rel / "release");
  ToUniversal(rel, tmp / "rel.h5");
  WriteStaged(tmp / "rel.h5", tmp / "rel_out",
              TargetFor("tp2_pp1_vpp1_dp1_nodo"));
  EXPECT_EQ(
      testutil::ReadFile(tmp / "rel_out" / "latest_checkpointed_iteration.txt"),
      "release");
  EXPECT_TRUE(fs::exists(tmp / "rel_out" / "release" / "mp_rank_01" /
                         "model_optim_rng.pt"));
  // An unexplained rank folder (e.g. expert parallelism).
  fs::create_directories(other / "iter_0000100" / "mp_rank_02");
  EXPECT_THAT([&] { Discover(other); },
              testing::ThrowsMessage<FormatError>(HasSubstr("mp_rank_02")));
}

TEST(MegatronGolden, TruncatedAndCorruptFiles) {
  testutil::TempDir tmp;
  const fs::path src = CopyTopology("gqa_swiglu_bias_untied",
                                    "tp2_pp2_vpp1_dp2_do", tmp / "src");
  const fs::path it = src / "iter_0000100";
  const fs::path out = tmp / "u.h5";
  auto expect_bad = [&](const fs::path& file) {
    const std::string before = TreeHash(src);
    EXPECT_THAT([&] { ToUniversal(src, out); },
                testing::ThrowsMessage<FormatError>(HasSubstr(file.string())));
    EXPECT_FALSE(fs::exists(out));
    EXPECT_EQ(Entries(tmp.path()), (std::vector<std::string>{"src"}));
    EXPECT_EQ(TreeHash(src), before);
  };
  for (const char* name : {"model_optim_rng.pt", "distrib_optim.pt"}) {
    SCOPED_TRACE(name);
    const fs::path f = it / "mp_rank_01_000" / name;
    const std::string good = testutil::ReadFile(f);
    // Truncated.
    testutil::WriteFile(f, good.substr(0, good.size() / 2));
    expect_bad(f);
    // Corrupt: garbage over the first pickle bytes of data.pkl.
    std::string bad = good;
    const size_t pkl = bad.find("data.pkl") + 8 + 64;
    for (size_t i = pkl; i < pkl + 40 && i < bad.size(); ++i) bad[i] = '\x97';
    testutil::WriteFile(f, bad);
    expect_bad(f);
    testutil::WriteFile(f, good);
  }
  // Corrupt rank (0, 0): already Discover fails.
  const fs::path f0 = it / "mp_rank_00_000" / "model_optim_rng.pt";
  testutil::WriteFile(f0, "not a torch file");
  EXPECT_THAT([&] { Discover(src); },
              testing::ThrowsMessage<FormatError>(HasSubstr(f0.string())));
}

// Rank files that contradict each other or Megatron's rules, each a copy
// with one change made by torch: a replicated norm differing in one bit on
// TP rank 1, a tensor of the wrong shape, an fp32 master of the wrong shape,
// optimizer groups in another order, an optimizer state in another dtype.
TEST(MegatronGolden, RanksThatDisagree) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_untied", t = "tp2_pp1_vpp1_dp1_nodo";
  const std::string norm =
      "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight";
  const std::string fc2 = "decoder.layers.0.mlp.linear_fc2.weight";
  const char* kinds[] = {"flip", "shape", "master", "groups", "state_dtype"};
  std::vector<std::string> files;
  for (const char* k : kinds) {
    CopyTopology(v, t, tmp / k);
    files.push_back(
        (tmp / k / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt")
            .string());
  }
  RunPython(
      "import torch\n"
      "def edit(p, fn):\n"
      "    sd = torch.load(p)\n"
      "    fn(sd)\n"
      "    torch.save(sd, p)\n"
      "norm, fc2 = sys.argv[6], sys.argv[7]\n"
      "def flip(sd): sd['model'][norm].view(torch.int16)[3] ^= 1\n"
      "def shape(sd): sd['model'][fc2] = torch.zeros(8, 9, "
      "dtype=torch.bfloat16)\n"
      "def master(sd): sd['optimizer']['fp32_from_fp16_params'][0][2] = "
      "torch.zeros(3)\n"
      "def groups(sd):\n"
      "    g = sd['optimizer']['optimizer']['param_groups']\n"
      "    g[0], g[1] = g[1], g[0]\n"
      "def state_dtype(sd):\n"
      "    st = sd['optimizer']['optimizer']['state'][0]\n"
      "    st['exp_avg'] = st['exp_avg'].to(torch.bfloat16)\n"
      "for p, fn in zip(sys.argv[1:6], (flip, shape, master, groups, "
      "state_dtype)): edit(p, fn)\n",
      {files[0], files[1], files[2], files[3], files[4], norm, fc2});
  const fs::path r0 =
      tmp / "flip" / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt";
  const std::vector<std::vector<std::string>> want = {
      {"replicas differ", norm, r0.string(), files[0]},
      {files[1], fc2, "local shape [8, 9], expected [8, 8]"},
      {files[2], "fp32_from_fp16_params[0][2] has shape [3]",
       "decoder.layers.0.self_attention.linear_qkv.weight"},
      {files[3], "param group 0 has key (wd_mult=0",
       "Megatron's rule gives (wd_mult=1"},
      {files[4], "embedding.word_embeddings.weight",
       "'exp_avg' is bfloat16 here but float32 in another rank file"},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(kinds[i]);
    const fs::path src = tmp / kinds[i];
    const std::string before = TreeHash(src);
    const fs::path out = tmp / StrCat(kinds[i], ".h5");
    try {
      ToUniversal(src, out);
      ADD_FAILURE() << "no error";
    } catch (const FormatError& e) {
      for (const std::string& m : want[i]) EXPECT_THAT(e.what(), HasSubstr(m));
    }
    EXPECT_FALSE(fs::exists(out));
    EXPECT_EQ(TreeHash(src), before);
  }
}

// distrib_optim.pt buffers that do not fit the model chunks: a buffer keyed
// by another param dtype, a buffer more than there are chunks (Megatron
// makes one per chunk and dtype).
TEST(MegatronGolden, DistribOptimBuffersThatDoNotFit) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_untied", t = "tp2_pp2_vpp1_dp2_do";
  const char* kinds[] = {"dtype", "extra"};
  std::vector<std::string> files;
  for (const char* k : kinds) {
    CopyTopology(v, t, tmp / k);
    files.push_back(
        (tmp / k / "iter_0000100" / "mp_rank_01_001" / "distrib_optim.pt")
            .string());
  }
  RunPython(
      "import torch\n"
      "d = torch.load(sys.argv[1])\n"
      "d[0] = {(torch.float16, torch.float32): d[0][(torch.bfloat16, "
      "torch.float32)]}\n"
      "torch.save(d, sys.argv[1])\n"
      "d = torch.load(sys.argv[2])\n"
      "d[1] = d[0]\n"
      "torch.save(d, sys.argv[2])\n",
      {files[0], files[1]});
  const std::vector<std::vector<std::string>> want = {
      {files[0], "buffer 0 holds torch.float16 params",
       "of model chunk 0 is bfloat16"},
      {files[1], "holds 2 gradient buffers for 1 model chunks"},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(kinds[i]);
    try {
      PlanSource(Discover(tmp / kinds[i]), {});
      ADD_FAILURE() << "no error";
    } catch (const FormatError& e) {
      for (const std::string& m : want[i]) EXPECT_THAT(e.what(), HasSubstr(m));
    }
  }
}

TEST(MegatronGolden, LayoutLeavingAParamUnmatched) {
  testutil::TempDir tmp;
  std::string yaml = layouts::Layout::Builtin("mcore-gpt").yaml();
  const size_t a = yaml.find("  - name: fc2_bias");
  const size_t b = yaml.find("  - name:", a + 4);
  ASSERT_NE(a, std::string::npos);
  yaml.erase(a, b - a);
  testutil::WriteFile(tmp / "no_fc2_bias.yaml", yaml);
  SourceOptions o;
  o.layout = (tmp / "no_fc2_bias.yaml").string();
  const fs::path src =
      MegatronData() / "gqa_swiglu_bias_untied" / "tp1_pp2_vpp1_dp1_nodo";
  EXPECT_THAT(
      [&] { PlanSource(Discover(src), o); },
      testing::ThrowsMessage<LayoutError>(testing::AllOf(
          HasSubstr("decoder.layers.0.mlp.linear_fc2.bias"),
          HasSubstr((src / "iter_0000100" / "mp_rank_00_000").string()))));
}

TEST(MegatronGolden, TargetsThatDoNotFit) {
  testutil::TempDir tmp;
  const fs::path h5 = tmp / "u.h5";
  ToUniversal(MegatronData() / "gqa_swiglu_bias_untied" / kReference, h5);
  struct Case {
    layouts::Topology topology;
    std::optional<int64_t> vocab;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {{3, 1, 1, 1}, {}, {"tp=3", "does not divide"}},
      {{8, 1, 1, 1}, {}, {"tp=8", "query groups"}},
      {{1, 3, 1, 1}, {}, {"pp=3", "layers"}},
      {{1, 4, 4, 1}, {}, {"vpp=4", "layers"}},
      {{1, 1, 2, 1}, {}, {"vpp", "pp > 1"}},
      {{1, 1, 1, 1},
       64,
       {"embedding.word_embeddings.weight", "true vocab size"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.topology.ToString());
    TargetOptions o;
    o.topology = c.topology;
    o.true_vocab_size = c.vocab;
    const fs::path out = tmp / "out";
    try {
      WriteStaged(h5, out, o);
      ADD_FAILURE() << "no error";
    } catch (const LayoutError& e) {
      for (const std::string& m : c.message)
        EXPECT_THAT(e.what(), HasSubstr(m));
    }
    EXPECT_FALSE(fs::exists(out));
    EXPECT_EQ(Entries(tmp.path()), (std::vector<std::string>{"u.h5"}));
  }
}

// A tokenizer other than the NullTokenizer: the args do not tell the true
// vocabulary size, so the padded rows count as real. Going to a tp whose
// padding Megatron could compute differently (tp 4 -> 1: 256 rows, but a
// true size of 129..256 pads to 160..256) says so; tp 4 -> 4 does not. With
// the size given to reshape, the rows beyond it are padding again: tp 1 gets
// Megatron's 160 rows, the generator's files.
TEST(MegatronGolden, UnknownVocabularySize) {
  testutil::TempDir tmp;
  const std::string v = "gqa_swiglu_bias_untied";
  const fs::path src = CopyTopology(v, "tp4_pp1_vpp1_dp1_nodo", tmp / "s");
  const fs::path want = CopyTopology(v, "tp1_pp1_vpp1_dp1_nodo", tmp / "w");
  RunPython(
      "import glob, os, torch\n"
      "for root in sys.argv[1:]:\n"
      "  for p in glob.glob(os.path.join(root, 'iter_*', '*', "
      "'model_optim_rng.pt')):\n"
      "    sd = torch.load(p)\n"
      "    sd['args'].tokenizer_type = 'GPT2BPETokenizer'\n"
      "    torch.save(sd, p)\n",
      {src.string(), want.string()});
  ToUniversal(src, tmp / "u.h5");
  const TargetSummary same = WriteStaged(tmp / "u.h5", tmp / "tp4",
                                         TargetFor("tp4_pp1_vpp1_dp1_nodo"));
  EXPECT_TRUE(same.notes.empty()) << same.notes.front();
  const TargetSummary tp1 = WriteStaged(tmp / "u.h5", tmp / "tp1",
                                        TargetFor("tp1_pp1_vpp1_dp1_nodo"));
  EXPECT_THAT(tp1.notes,
              testing::Contains(testing::AllOf(
                  HasSubstr("true vocabulary size is unknown"),
                  HasSubstr("256 padded rows"), HasSubstr("160..256"),
                  HasSubstr("--vocab-size"))));
  TargetOptions o = TargetFor("tp1_pp1_vpp1_dp1_nodo");
  o.true_vocab_size = 130;
  const TargetSummary sized = WriteStaged(tmp / "u.h5", tmp / "tp1v", o);
  EXPECT_TRUE(sized.notes.empty()) << sized.notes.front();
  CompareBatch(tmp.path(), {{want, tmp / "tp1v"}});
}

// A universal file whose driver metadata was damaged (an entry without its
// kind): one FormatError naming the file and the attribute.
TEST(MegatronGolden, DamagedUniversalMetadata) {
  testutil::TempDir tmp;
  const fs::path h5 = tmp / "u.h5";
  ToUniversal(
      MegatronData() / "gqa_swiglu_bias_untied" / "tp1_pp1_vpp1_dp1_nodo", h5);
  RunPython(
      "import h5py, json\n"
      "with h5py.File(sys.argv[1], 'r+') as f:\n"
      "    m = json.loads(f.attrs['megatron'])\n"
      "    m['entries'][3] = ['decoder.layers.0.x']\n"
      "    f.attrs['megatron'] = json.dumps(m)\n",
      {h5.string()});
  EXPECT_THAT(
      [&] { WriteStaged(h5, tmp / "out", TargetFor("tp1_pp1_vpp1_dp1_nodo")); },
      testing::ThrowsMessage<FormatError>(testing::AllOf(
          HasSubstr(h5.string()), HasSubstr("attribute megatron"),
          HasSubstr("entry [\"decoder.layers.0.x\"]"))));
  EXPECT_FALSE(fs::exists(tmp / "out"));
}

// Conversions read their sources and never write there.
TEST(MegatronGolden, SourceIsNeverModified) {
  testutil::TempDir tmp;
  const fs::path src =
      CopyTopology("gqa_swiglu_bias_tied", "tp2_pp2_vpp2_dp2_do", tmp / "src");
  const std::string before = TreeHash(src);
  const Checkpoint c = Discover(src);
  NameListing names = ListNames(c, {});
  EXPECT_EQ(names.layout_name, "mcore-gpt");
  EXPECT_EQ(names.variables.Get("num_layers"), 8);
  // 8 layers x 17 entries, embeddings 2, final norm 3, output layer 2.
  EXPECT_EQ(names.names.size(), 8u * 17 + 2 + 3 + 2);
  ToUniversal(src, tmp / "u.h5");
  WriteStaged(tmp / "u.h5", tmp / "out", TargetFor("tp1_pp1_vpp1_dp1_nodo"));
  EXPECT_EQ(TreeHash(src), before);
}

}  // namespace
}  // namespace ucp::megatron
