"""Stand-in for megatron.core.rerun_state_machine (see tests/tools/stubs/README.md).

The enums that the 'rerun_state_machine' entry of a Megatron-core v0.13 checkpoint pickles (mode,
sharded.state, sharded.error_injector_checkpoint.error_injection_type); member names and values as
pickled by core_v0.13.0 (str-valued enums reduce to their value, RerunState to its int)."""
import enum


class RerunDiagnostic(str, enum.Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(enum.Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5
