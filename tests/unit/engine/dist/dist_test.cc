#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/dist/assign.h"
#include "engine/dist/launcher.h"

namespace ucp::dist {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using Vars = std::map<std::string, std::string>;

std::optional<Job> Parse(const Vars& vars) {
  return JobFromEnvironment(
      [&](std::string_view name) -> std::optional<std::string> {
        auto it = vars.find(std::string(name));
        if (it == vars.end()) return std::nullopt;
        return it->second;
      });
}

TEST(LauncherTest, NoLauncherIsOneProcess) {
  EXPECT_FALSE(Parse({}).has_value());
  EXPECT_FALSE(Parse({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}));
  // A world of one process changes nothing either.
  EXPECT_FALSE(Parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).has_value());
  EXPECT_FALSE(Parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
}

TEST(LauncherTest, Torchrun) {
  // What torchrun 2.x sets (its agent store on MASTER_PORT).
  const std::optional<Job> j = Parse({{"RANK", "3"},
                                      {"WORLD_SIZE", "4"},
                                      {"LOCAL_RANK", "1"},
                                      {"MASTER_ADDR", "node0"},
                                      {"MASTER_PORT", "29500"},
                                      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                      {"TORCHELASTIC_RUN_ID", "job7"}});
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->rank, 3);
  EXPECT_EQ(j->world, 4);
  EXPECT_EQ(j->local_rank, 1);
  EXPECT_EQ(j->launcher, "torchrun");
  EXPECT_EQ(j->store_host, "node0");
  EXPECT_EQ(j->store_port, 29501);  // beside the agent's store
  EXPECT_EQ(j->run_id, "job7");
  // Without the agent store (torch.distributed's env:// convention), and
  // UCP_STORE_PORT over both.
  Vars plain = {{"RANK", "0"},
                {"WORLD_SIZE", "2"},
                {"MASTER_ADDR", "h"},
                {"MASTER_PORT", "1234"}};
  EXPECT_EQ(Parse(plain)->store_port, 1234);
  plain["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  plain["UCP_STORE_PORT"] = "4321";
  EXPECT_EQ(Parse(plain)->store_port, 4321);
  plain["UCP_DIST"] = "0";
  EXPECT_FALSE(Parse(plain).has_value());
}

TEST(LauncherTest, SlurmAndMpi) {
  const Vars master = {{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "5000"}};
  Vars slurm = master;
  slurm.insert({{"SLURM_PROCID", "5"},
                {"SLURM_NTASKS", "8"},
                {"SLURM_LOCALID", "1"},
                {"SLURM_JOB_ID", "991"},
                {"SLURM_STEP_ID", "2"}});
  std::optional<Job> j = Parse(slurm);
  ASSERT_TRUE(j);
  EXPECT_EQ(j->launcher, "slurm");
  EXPECT_EQ(j->rank, 5);
  EXPECT_EQ(j->world, 8);
  EXPECT_EQ(j->local_rank, 1);
  EXPECT_EQ(j->store_port, 5000);
  EXPECT_EQ(j->run_id, "991.2");
  // The step's size wins over the allocation's.
  slurm["SLURM_STEP_NUM_TASKS"] = "6";
  EXPECT_EQ(Parse(slurm)->world, 6);

  Vars ompi = master;
  ompi.insert({{"OMPI_COMM_WORLD_RANK", "2"},
               {"OMPI_COMM_WORLD_SIZE", "3"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  j = Parse(ompi);
  ASSERT_TRUE(j);
  EXPECT_EQ(j->launcher, "mpi");
  EXPECT_EQ(j->rank, 2);
  EXPECT_EQ(j->world, 3);

  Vars pmi = master;
  pmi.insert({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}});
  j = Parse(pmi);
  ASSERT_TRUE(j);
  EXPECT_EQ(j->launcher, "pmi");
  EXPECT_EQ(j->rank, 1);
  EXPECT_EQ(j->local_rank, 1);
  // torchrun's variables win over Slurm's (torchrun inside an allocation).
  Vars both = slurm;
  both.insert({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(Parse(both)->launcher, "torchrun");
}

TEST(LauncherTest, InconsistentEnvironmentsAreUsageErrors) {
  EXPECT_THAT(
      [] {
        Parse({{"RANK", "4"},
               {"WORLD_SIZE", "4"},
               {"MASTER_ADDR", "h"},
               {"MASTER_PORT", "1"}});
      },
      ThrowsMessage<UsageError>(HasSubstr("RANK=4 is not below WORLD_SIZE=4")));
  EXPECT_THAT(
      [] {
        Parse({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
      },
      ThrowsMessage<UsageError>(
          HasSubstr("SLURM_PROCID=1 of 2 without MASTER_ADDR")));
  EXPECT_THAT(
      [] {
        Parse({{"OMPI_COMM_WORLD_RANK", "0"},
               {"OMPI_COMM_WORLD_SIZE", "2"},
               {"MASTER_PORT", "9"}});
      },
      ThrowsMessage<UsageError>(HasSubstr("without MASTER_ADDR")));
  EXPECT_THAT(
      [] {
        Parse({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
      },
      ThrowsMessage<UsageError>(HasSubstr("RANK='x' is not a number")));
  EXPECT_THAT(
      [] {
        Parse({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
      },
      ThrowsMessage<UsageError>(HasSubstr("WORLD_SIZE='0'")));
  EXPECT_THAT(
      [] {
        Parse({{"RANK", "0"},
               {"WORLD_SIZE", "2"},
               {"MASTER_ADDR", "h"},
               {"MASTER_PORT", "70000"}});
      },
      ThrowsMessage<UsageError>(HasSubstr("MASTER_PORT='70000'")));
}

// Loads per rank of an assignment.
std::vector<uint64_t> Loads(const std::vector<FileLoad>& files,
                            const std::vector<int>& owner, int world) {
  std::vector<uint64_t> loads(static_cast<size_t>(world), 0);
  for (size_t i = 0; i < files.size(); ++i)
    if (files[i].slots)
      loads.at(static_cast<size_t>(owner[i])) += files[i].bytes;
  return loads;
}

TEST(AssignTest, WorkedExample) {
  // Largest first onto the least loaded, ties by rank (worked by hand):
  // 9 -> r0; 7 -> r1; 5 -> r2; 5 -> r2 (5 < 7); 3 -> r1 (7 < 9, 10); the
  // two files without slots -> r0.
  const std::vector<FileLoad> files = {{5, true}, {9, true}, {0, false},
                                       {7, true}, {5, true}, {3, true},
                                       {0, false}};
  EXPECT_EQ(AssignFiles(files, 3), (std::vector<int>{2, 0, 0, 1, 2, 1, 0}));
  // One process writes everything.
  EXPECT_EQ(AssignFiles(files, 1), std::vector<int>(files.size(), 0));
  // More processes than files: one file each, the rest idle.
  EXPECT_EQ(AssignFiles(files, 8), (std::vector<int>{2, 0, 0, 1, 3, 4, 0}));
  EXPECT_THAT([&] { AssignFiles(files, 0); },
              ThrowsMessage<UsageError>(HasSubstr("0 processes")));
}

TEST(AssignTest, BalancedWithinTheLargestFileAndDeterministic) {
  std::mt19937_64 rng(20261128);
  for (int round = 0; round < 300; ++round) {
    const int world = 1 + static_cast<int>(rng() % 9);
    std::vector<FileLoad> files(1 + rng() % 200);
    uint64_t largest = 0;
    for (FileLoad& f : files) {
      f.slots = rng() % 10 != 0;
      f.bytes = f.slots ? rng() % (1u << (rng() % 30)) : 0;
      if (f.slots) largest = std::max(largest, f.bytes);
    }
    const std::vector<int> owner = AssignFiles(files, world);
    ASSERT_EQ(owner.size(), files.size());
    for (size_t i = 0; i < files.size(); ++i) {
      ASSERT_GE(owner[i], 0);
      ASSERT_LT(owner[i], world);
      if (!files[i].slots) {
        ASSERT_EQ(owner[i], 0) << i;
      }
    }
    const std::vector<uint64_t> loads = Loads(files, owner, world);
    const auto [lo, hi] = std::minmax_element(loads.begin(), loads.end());
    ASSERT_LE(*hi - *lo, largest) << "round " << round;
    // The same input, the same answer (every process computes it alone).
    ASSERT_EQ(AssignFiles(files, world), owner);
  }
}

TEST(AssignTest, EqualFilesSpreadEvenly) {
  // 8 equal files over 4 processes: 2 each, in rank order.
  const std::vector<FileLoad> files(8, FileLoad{100, true});
  EXPECT_EQ(AssignFiles(files, 4), (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
}

}  // namespace
}  // namespace ucp::dist
