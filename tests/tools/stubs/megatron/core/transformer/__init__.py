"""Test stand-in (see tests/tools/stubs/README.md)."""
