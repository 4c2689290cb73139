// A small GPT trainer in C++ (LibTorch) on synthetic data, data-parallel over
// N local processes (c10d Gloo), checkpointed with ucp::resume::Checkpointer:
// it resumes from the newest intact checkpoint, at any process count.
//
//   RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p
//     elastic_train --dir CKPT --steps 24 --save-every 4 --log loss.txt
//
// The global batch (12 sequences) is split evenly over the ranks, gradients
// are averaged, so the mathematics does not depend on the process count; at
// the same count a resumed run repeats an uninterrupted one bit for bit.
// Rank 0 appends "step loss" lines to --log (the loss as a hex float).

#include <signal.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "engine/core/error.h"
#include "engine/resume/checkpointer.h"

namespace {

constexpr int64_t kVocab = 48, kContext = 16, kDim = 32, kHeads = 2,
                  kLayers = 2, kGlobalBatch = 12;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module(
            "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        qkv(register_module("qkv", torch::nn::Linear(kDim, 3 * kDim))),
        proj(register_module("proj", torch::nn::Linear(kDim, kDim))),
        ln2(register_module(
            "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", torch::nn::Linear(kDim, 4 * kDim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kDim, kDim))) {}

  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const int64_t b = x.size(0), t = x.size(1), hd = kDim / kHeads;
    auto q_k_v =
        qkv(ln1(x)).view({b, t, 3, kHeads, hd}).permute({2, 0, 3, 1, 4});
    auto att = torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) /
               std::sqrt(static_cast<double>(hd));
    att =
        att.masked_fill(mask.narrow(0, 0, t).narrow(1, 0, t), -1e9).softmax(-1);
    auto y = torch::matmul(att, q_k_v[2]).transpose(1, 2).reshape({b, t, kDim});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }

  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kDim))),
        pos(register_module("pos", torch::nn::Embedding(kContext, kDim))),
        ln(register_module(
            "ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int64_t i = 0; i < kLayers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Block()));
    }
    // A buffer: checkpointed beside the parameters.
    mask = register_buffer(
        "causal_mask", torch::ones({kContext, kContext}, torch::kBool).triu(1));
  }

  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx) + pos(torch::arange(idx.size(1)));
    for (auto& b : blocks) x = b->forward(x, mask);
    return head(ln(x));
  }

  torch::nn::Embedding tok, pos;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
  torch::Tensor mask;
};
TORCH_MODULE(Gpt);

// Sequence i of step t: an arithmetic progression mod kVocab, the same
// whatever the process count.
torch::Tensor Batch(int64_t step, int64_t first, int64_t count) {
  auto out = torch::empty({count, kContext + 1}, torch::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (int64_t i = 0; i < count; ++i) {
    uint64_t h = static_cast<uint64_t>(step) * 1000003u +
                 static_cast<uint64_t>(first + i) * 7919u;
    h ^= h >> 13;
    h *= 0x9E3779B97F4A7C15ull;
    const int64_t start = static_cast<int64_t>(h % kVocab);
    const int64_t stride = 1 + static_cast<int64_t>((h >> 20) % 5);
    for (int64_t j = 0; j <= kContext; ++j)
      a[i][j] = (start + stride * j) % kVocab;
  }
  return out;
}

struct Args {
  std::string dir, save_dir, log;
  int64_t steps = 24, save_every = 4, kill_in_save = -1, seed = 1234;
  int keep = 2;
  int64_t timeout_ms = 30000;
  bool save_on_resume = false;
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw ucp::UsageError(k, " needs a value");
      return argv[++i];
    };
    auto number = [&]() -> int64_t {
      const std::string v = next();
      int64_t out = 0;
      const auto [end, ec] =
          std::from_chars(v.data(), v.data() + v.size(), out);
      if (ec != std::errc() || end != v.data() + v.size()) {
        throw ucp::UsageError(k, " '", v, "' is not an integer");
      }
      return out;
    };
    if (k == "--dir")
      a.dir = next();
    else if (k == "--save-dir")
      a.save_dir = next();
    else if (k == "--log")
      a.log = next();
    else if (k == "--steps")
      a.steps = number();
    else if (k == "--save-every")
      a.save_every = number();
    else if (k == "--keep")
      a.keep = static_cast<int>(number());
    else if (k == "--kill-in-save")
      a.kill_in_save = number();
    else if (k == "--timeout-ms")
      a.timeout_ms = number();
    else if (k == "--seed")
      a.seed = number();
    else if (k == "--save-on-resume")
      a.save_on_resume = true;
    else if (k == "--help" || k == "-h") {
      std::printf(
          "usage: elastic_train --dir CKPT [--steps N] [--save-every K] "
          "[--keep K] [--log FILE]\n"
          "                     [--kill-in-save STEP] [--save-on-resume] "
          "[--save-dir DIR] [--timeout-ms MS]\n"
          "Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as "
          "torchrun sets them).\n");
      std::exit(0);
    } else {
      throw ucp::UsageError("unknown argument ", k, " (see --help)");
    }
  }
  if (a.dir.empty()) throw ucp::UsageError("--dir is required");
  return a;
}

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(args.seed);
  const auto timeout = std::chrono::milliseconds(args.timeout_ms);
  ucp::resume::ProcessGroup group = ucp::resume::ProcessGroup::FromEnv(timeout);
  const int rank = group.rank(), world = group.size();
  if (kGlobalBatch % world != 0) {
    throw ucp::UsageError("the global batch of ", kGlobalBatch,
                          " sequences does not split over ", world, " ranks");
  }
  Gpt model;
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(3e-3));
  ucp::resume::ScalerState scaler;
  c10::impl::GenericDict extra(c10::StringType::get(), c10::AnyType::get());
  const ucp::resume::TrainingState state{model.ptr().get(), &optimizer, &scaler,
                                         &extra};

  ucp::resume::CheckpointerOptions copts;
  copts.dir = args.dir;
  copts.save_every = args.save_every;
  copts.keep_last = args.keep;
  copts.group = group;
  copts.on_phase = [&](std::string_view phase, int64_t step) {
    if (step == args.kill_in_save && phase == "shard-written" &&
        rank == world - 1) {
      std::fprintf(stderr,
                   "rank %d: SIGKILL in the middle of the save of step %lld\n",
                   rank, static_cast<long long>(step));
      ::raise(SIGKILL);
    }
  };
  ucp::resume::Checkpointer ckpt(copts);

  int64_t step = 0;
  if (auto r = ckpt.Resume(state)) {
    step = r->step;
    if (rank == 0) {
      for (const std::string& s : r->skipped) {
        std::fprintf(stderr, "skipped %s\n", s.c_str());
      }
      std::fprintf(
          stderr,
          "resumed from %s (step %lld, saved by %d ranks, now %d%s), "
          "read %llu bytes of tensor data on rank 0, tokens_seen %lld\n",
          r->checkpoint.string().c_str(), static_cast<long long>(step),
          r->saved_world_size, world, r->resharded ? ", resharded" : "",
          static_cast<unsigned long long>(r->bytes_read),
          static_cast<long long>(extra.at("tokens_seen").toInt()));
    }
    if (args.save_on_resume) {
      ucp::resume::CheckpointerOptions o2 = copts;
      o2.dir = args.save_dir.empty() ? args.dir : args.save_dir;
      ucp::resume::Checkpointer(o2).Save(step, state);
    }
  } else if (rank == 0) {
    std::fprintf(stderr, "no checkpoint in %s: starting at step 0\n",
                 args.dir.c_str());
  }
  if (!extra.contains("tokens_seen")) extra.insert("tokens_seen", int64_t{0});

  std::FILE* log = nullptr;
  if (rank == 0 && !args.log.empty()) log = std::fopen(args.log.c_str(), "a");
  const int64_t local = kGlobalBatch / world;
  while (step < args.steps) {
    ++step;
    const torch::Tensor batch = Batch(step, rank * local, local);
    const torch::Tensor x = batch.narrow(1, 0, kContext);
    const torch::Tensor y = batch.narrow(1, 1, kContext);
    optimizer.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(
        model->forward(x).reshape({-1, kVocab}), y.reshape({-1}));
    loss.backward();
    // Average the gradients (one flat buffer) and the loss over the ranks.
    std::vector<torch::Tensor> grads;
    for (auto& p : model->parameters()) grads.push_back(p.grad().reshape({-1}));
    torch::Tensor flat = torch::cat(grads);
    group.AllReduceMean(flat, "gradients");
    int64_t off = 0;
    for (auto& p : model->parameters()) {
      p.mutable_grad().copy_(flat.narrow(0, off, p.numel()).view_as(p));
      off += p.numel();
    }
    torch::Tensor l = loss.detach().reshape({1}).clone();
    group.AllReduceMean(l, "loss");
    optimizer.step();
    extra.insert_or_assign("tokens_seen", extra.at("tokens_seen").toInt() +
                                              kGlobalBatch * kContext);
    if (log != nullptr) {
      std::fprintf(log, "%lld %a\n", static_cast<long long>(step),
                   static_cast<double>(l.item<float>()));
      std::fflush(log);
    }
    if (ckpt.Due(step)) ckpt.Save(step, state);
  }
  if (log != nullptr) std::fclose(log);
  if (rank == 0) {
    std::fprintf(stderr, "done: step %lld on %d ranks\n",
                 static_cast<long long>(step), world);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const ucp::Error& e) {
    std::fprintf(stderr, "elastic_train: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_train: %s\n", e.what());
    return 1;
  }
}
