"""tf_sparse24: 2:4 structured sparsity for Keras 3 and TensorFlow.

Prune a trained model to 2:4 by magnitude, fine-tune it with masks held fixed, and export it with
compressed weights. The package reads top-down: masks -> wrapper -> prune -> callback -> ops -> export.
"""

__version__ = "0.1.0"
