"""Replacing a layer instance's `call` for a while, leaving the layer exactly as it was after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import keras

_ABSENT = object()


@contextlib.contextmanager
def calls_replaced(
    replacements: Iterable[tuple[keras.layers.Layer, Callable]],
) -> Iterator[None]:
    """Sets each layer's `call` to its replacement inside the block, then restores it, also on
    error.

    `Layer.__call__` (through `Operation.__call__`) runs `self.call`, so an instance attribute
    takes effect wherever the layer is called: in a Functional graph, a subclassed model's `call`,
    inside MultiHeadAttention or a `Sparse24` wrapper. `object.__setattr__` keeps Keras' attribute
    tracking out of it; a `call` the instance already had is put back, none is left behind.
    """
    previous = []
    try:
        for layer, call in replacements:
            previous.append((layer, vars(layer).get("call", _ABSENT)))
            object.__setattr__(layer, "call", call)
        yield
    finally:
        for layer, old in reversed(previous):
            if old is _ABSENT:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
