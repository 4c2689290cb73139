#pragma once
// The job a launcher started this process in, read from its environment.
//
//   torchrun (and torch.distributed's env:// convention)
//     RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
//     TORCHELASTIC_USE_AGENT_STORE=True: MASTER_PORT is torchrun's agent
//     store, which LibTorch 1.13's TCPStore client cannot talk to (torch 2.x
//     changed the wire protocol), so ucp's store is on MASTER_PORT + 1.
//   Slurm (srun)        SLURM_PROCID, SLURM_NTASKS (SLURM_STEP_NUM_TASKS when
//                       set), SLURM_LOCALID; MASTER_ADDR, MASTER_PORT given
//   Open MPI (mpirun)   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//                       OMPI_COMM_WORLD_LOCAL_RANK; MASTER_ADDR, MASTER_PORT
//   MPICH / Intel MPI   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID; MASTER_ADDR,
//                       MASTER_PORT
//
// The first of these whose rank and size are both set wins. UCP_STORE_PORT
// overrides the store's port; UCP_DIST=0 ignores the environment (one
// process). No launcher, or a world of one process: no job (nothing changes).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace ucp::dist {

struct Job {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  std::string launcher;    // "torchrun", "slurm", "mpi" ("pmi")
  std::string store_host;  // MASTER_ADDR: where rank 0 hosts the store
  uint16_t store_port = 0;
  std::string run_id;  // TORCHELASTIC_RUN_ID, SLURM_JOB_ID.STEP, ... or ""
  /// "rank 1 of 4 (torchrun)".
  std::string Describe() const;
};

/// Looks up one environment variable; absent if unset.
using Environment =
    std::function<std::optional<std::string>(std::string_view name)>;

/// The job described by `env`; absent when no launcher started this process
/// or the world is one process. Throws UsageError naming the variables for
/// an inconsistent environment: a rank or size that is not a number, a rank
/// outside [0, size), a world of several processes without MASTER_ADDR /
/// MASTER_PORT, a port outside 1..65535.
std::optional<Job> JobFromEnvironment(const Environment& env);
/// The same on this process's environment (getenv).
std::optional<Job> JobFromEnvironment();

}  // namespace ucp::dist
