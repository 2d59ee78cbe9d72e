"""Kernels: plain tensors in, plain tensors out (no DTensor, mesh or process group).

Each kernel module holds the ``@triton.jit`` kernels and their launchers;
``reference`` holds the pure-torch math they are tested against. Importing this
package does not import triton: the backends import the kernel modules lazily.
``cpu`` holds dtrec's C kernels for the CPU's row-sparse backward and updates.
"""
