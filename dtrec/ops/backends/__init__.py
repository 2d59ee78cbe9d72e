"""The implementations behind the ops: torch (reference, CPU), Triton (CUDA) and fbgemm.

``registry`` says which one runs (``dtrec.ops.set_backend``); the backend modules
import their kernels lazily, so a CPU install never imports triton or fbgemm.
"""
