"""Run Triton kernels in Triton's CPU interpreter when there is no GPU (must precede triton)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
