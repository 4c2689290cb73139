"""Stand-in for deepspeed.runtime.zero.config (see tests/tools/stubs/README.md)."""
from enum import Enum


class ZeroStageEnum(int, Enum):
    """ZeRO stage: an int-valued enum, as DeepSpeed pickles it."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3
