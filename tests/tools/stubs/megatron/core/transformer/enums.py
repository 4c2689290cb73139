"""Stand-in for megatron.core.transformer.enums (see tests/tools/stubs/README.md).

Only the enum that Megatron-core v0.13 training args pickle (args.attention_backend, default
AttnBackend.auto); member names and values as pickled by core_v0.13.0."""
import enum


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
