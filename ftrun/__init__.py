"""ftrun: fault-tolerant training runtime for PyTorch (FT-HSDP) and its CPU emulation harness."""

__version__ = "0.1.0"
