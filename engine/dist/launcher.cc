#include "engine/dist/launcher.h"

#include <charconv>
#include <cstdlib>

#include "engine/core/error.h"

namespace ucp::dist {

namespace {

struct Convention {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
};

// In order of precedence. Slurm's step size (SLURM_STEP_NUM_TASKS) is tried
// before its allocation's (SLURM_NTASKS).
constexpr Convention kConventions[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
    {"mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
};

int64_t ParseInt(const Environment& env, const char* name, int64_t low,
                 int64_t high) {
  const std::string text = env(name).value_or("");
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || v < low || v > high) {
    throw UsageError("launcher environment: ", name, "='", text,
                     "' is not a number in ", low, "..", high);
  }
  return v;
}

}  // namespace

std::string Job::Describe() const {
  return StrCat("rank ", rank, " of ", world, " (", launcher, ")");
}

std::optional<Job> JobFromEnvironment(const Environment& env) {
  const std::optional<std::string> off = env("UCP_DIST");
  if (off && (*off == "0" || *off == "off")) return std::nullopt;
  const Convention* found = nullptr;
  for (const Convention& c : kConventions) {
    if (env(c.rank) && env(c.size)) {
      found = &c;
      break;
    }
  }
  if (found == nullptr) return std::nullopt;
  Job job;
  job.launcher = found->launcher;
  job.world = static_cast<int>(ParseInt(env, found->size, 1, 1 << 20));
  job.rank = static_cast<int>(ParseInt(env, found->rank, 0, 1 << 20));
  if (job.rank >= job.world) {
    throw UsageError("launcher environment: ", found->rank, "=", job.rank,
                     " is not below ", found->size, "=", job.world);
  }
  if (job.world == 1) return std::nullopt;
  if (env(found->local_rank))
    job.local_rank =
        static_cast<int>(ParseInt(env, found->local_rank, 0, 1 << 20));
  const std::optional<std::string> addr = env("MASTER_ADDR");
  if (!addr || addr->empty() || !env("MASTER_PORT")) {
    throw UsageError("launcher environment: ", found->rank, "=", job.rank,
                     " of ", job.world,
                     " without MASTER_ADDR and MASTER_PORT (the host and "
                     "port where rank 0 hosts ucp's store; or UCP_DIST=0 "
                     "for one process)");
  }
  job.store_host = *addr;
  if (env("UCP_STORE_PORT")) {
    job.store_port =
        static_cast<uint16_t>(ParseInt(env, "UCP_STORE_PORT", 1, 65535));
  } else {
    int64_t port = ParseInt(env, "MASTER_PORT", 1, 65535);
    // torchrun's agent store listens on MASTER_PORT (torch 2.x protocol).
    if (env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") ++port;
    if (port > 65535) {
      throw UsageError(
          "launcher environment: MASTER_PORT=65535 is torchrun's agent "
          "store; set UCP_STORE_PORT for ucp's");
    }
    job.store_port = static_cast<uint16_t>(port);
  }
  if (const auto id = env("TORCHELASTIC_RUN_ID")) {
    job.run_id = *id;
  } else if (const auto slurm = env("SLURM_JOB_ID")) {
    job.run_id = *slurm;
    if (const auto step = env("SLURM_STEP_ID")) job.run_id += "." + *step;
  } else if (const auto ompi = env("OMPI_MCA_ess_base_jobid")) {
    job.run_id = *ompi;
  }
  return job;
}

std::optional<Job> JobFromEnvironment() {
  return JobFromEnvironment(
      [](std::string_view name) -> std::optional<std::string> {
        const char* v = std::getenv(std::string(name).c_str());
        if (v == nullptr) return std::nullopt;
        return std::string(v);
      });
}

}  // namespace ucp::dist
