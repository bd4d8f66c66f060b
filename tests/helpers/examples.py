"""The project's examples/ scripts as modules, for tests that reuse their models and layers."""

import importlib
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def example(name: str):
    """examples/<name>.py imported as a module (its folder on sys.path, as when run as a script)."""
    path = os.path.abspath(EXAMPLES)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)
