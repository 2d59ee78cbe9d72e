"""TorchRec-compatible sparse inputs and pooled outputs: KeyedJaggedTensor, JaggedTensor,
KeyedTensor (same method names, so model code written for TorchRec runs unchanged)."""

from dtrec.sparse.jagged import JaggedTensor
from dtrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor, as_kjt
from dtrec.sparse.keyed_tensor import KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "as_kjt"]
