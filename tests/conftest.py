"""Test-wide settings. The Triton kernels are tested on the CPU through Triton's interpreter,
which must be chosen before anything imports triton."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
