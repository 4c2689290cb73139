"""Stand-in for deepspeed.utils.tensor_fragment (see tests/tools/stubs/README.md)."""
from dataclasses import dataclass


@dataclass
class fragment_address:  # noqa: N801 - the real class name
    numel: int
    start: int
