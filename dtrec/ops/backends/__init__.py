"""The implementations behind the ops: torch (reference, CPU), Triton (CUDA) and fbgemm.

Each is a ``base.Backend`` (forward, row-sparse backward, fused optimizer steps);
``registry`` says which one runs (``dtrec.ops.set_backend``). The backend modules
import their kernels lazily, so a CPU install never imports triton or fbgemm.
"""
