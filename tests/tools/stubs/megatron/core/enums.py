"""Stand-in for megatron.core.enums (see tests/tools/stubs/README.md)."""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4
