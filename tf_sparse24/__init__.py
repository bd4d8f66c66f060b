"""tf_sparse24: 2:4 structured sparsity for Keras 3 and TensorFlow.

Prune a trained model to 2:4 by magnitude, fine-tune it with masks held fixed, and export it with
compressed weights. The package reads top-down: masks -> wrapper -> prune -> callback -> ops -> export.
"""

__version__ = "0.1.0"

from tf_sparse24.masks import MASK_METHODS, compute_mask, is_nm_sparse, parse_pattern  # noqa: E402
from tf_sparse24.wrapper import PrunedWeight, Sparse24  # noqa: E402
from tf_sparse24.prune import eligible_weights, prune, pruned_layers, report, strip  # noqa: E402
from tf_sparse24.callbacks import Sparse24Callback  # noqa: E402
from tf_sparse24.export import export, load  # noqa: E402
from tf_sparse24.metadata import ExportError  # noqa: E402
from tf_sparse24.verify import describe as describe_export, verify as verify_export  # noqa: E402
from tf_sparse24.ops import CompressedWeight, compress, decompress, sparse_matmul  # noqa: E402
from tf_sparse24.permute import PermutationReport, permute, search_permutation  # noqa: E402
from tf_sparse24.srste import SRSTE  # noqa: E402
