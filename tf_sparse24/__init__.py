"""tf_sparse24: 2:4 structured sparsity for Keras 3 and TensorFlow.

Prune a trained model to 2:4 by magnitude, fine-tune it with masks held fixed, and export it with
compressed weights. The package reads top-down: masks -> wrapper -> prune -> callback -> ops -> export.
"""

import keras

if keras.backend.backend() != "tensorflow":
    # The wrapper's masked forward, the ops and the exporter are TensorFlow code: refuse here rather
    # than fail later inside a layer's call with another backend's tensors.
    raise ImportError(
        "tf_sparse24 needs Keras' TensorFlow backend; Keras is running on the "
        f"{keras.backend.backend()!r} backend. Set KERAS_BACKEND=tensorflow (or \"backend\": "
        "\"tensorflow\" in ~/.keras/keras.json) before keras is first imported.")

from tf_sparse24.masks import MASK_METHODS, compute_mask, is_nm_sparse, parse_pattern
from tf_sparse24.wrapper import PrunedWeight, Sparse24
from tf_sparse24.registry import eligible_weights
from tf_sparse24.prune import prune, pruned_layers, strip
from tf_sparse24.report import report
from tf_sparse24.batchnorm import recalibrate_batch_norm
from tf_sparse24.callbacks import Sparse24Callback
from tf_sparse24.ops import CompressedWeight, compress, decompress, sparse_matmul
from tf_sparse24.export import export, load
from tf_sparse24.metadata import ExportError
from tf_sparse24.verify import describe as describe_export, verify as verify_export
from tf_sparse24.permute import PermutationReport, permute
from tf_sparse24.permute_search import search_permutation
from tf_sparse24.srste import SRSTE

__version__ = "0.1.0"

__all__ = [
    "MASK_METHODS", "compute_mask", "is_nm_sparse", "parse_pattern",
    "PrunedWeight", "Sparse24", "SRSTE",
    "eligible_weights", "prune", "pruned_layers", "report", "strip", "recalibrate_batch_norm",
    "Sparse24Callback",
    "CompressedWeight", "compress", "decompress", "sparse_matmul",
    "PermutationReport", "permute", "search_permutation",
    "ExportError", "describe_export", "export", "load", "verify_export",
]
