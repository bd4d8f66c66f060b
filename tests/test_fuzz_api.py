"""Hypothesis fuzz of the public Python API with bad input: clear exceptions, never a wrong answer,
and the model untouched afterwards.

Answers are checked against numpy references (tests/helpers/scenario.py); "untouched" means every
weight and mask is bit-identical to a snapshot taken before the failing call.
"""

import functools
import math
import re

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras
import tf_sparse24
from helpers import scenario

FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
SLOW_FUZZ = settings(FUZZ, max_examples=8)
DTYPES = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16]
PATTERNS = ["2:4", "1:4", "3:4", "1:2", "2:8", " 2 : 4 "]
BAD_PATTERNS = ["4:2", "0:4", "4:4", "2/4", "", "2:4:8", "-2:4", "two:four", "2:", ":4", "2.0:4"]


def snapshot(model) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in model.weights]


def assert_unchanged(model, before: list[np.ndarray]) -> None:
    after = snapshot(model)
    assert len(after) == len(before), "weights were added or removed"
    for a, b, v in zip(after, before, model.weights):
        assert a.tobytes() == b.tobytes(), f"{v.path} changed after a failed call"


@functools.lru_cache(maxsize=None)
def trained_model():
    """A built dense model (shared: tests restore anything they poke into it)."""
    return scenario.dense_model(seed=3)


@functools.lru_cache(maxsize=None)
def pruned_model():
    return tf_sparse24.prune(trained_model())


@FUZZ
@given(
    st.one_of(
        st.text(max_size=12),
        st.builds(
            "{}{}:{}{}".format,
            st.sampled_from(["", " "]),
            st.integers(-9, 99),
            st.integers(-9, 99),
            st.sampled_from(["", " ", "x"]),
        ),
        st.integers(),
        st.none(),
        st.tuples(st.integers(), st.integers()),
    )
)
def test_parse_pattern_accepts_exactly_n_colon_m(pattern):
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern) if isinstance(pattern, str) else None
    valid = match is not None and 0 < int(match[1]) < int(match[2])
    if valid:
        assert tf_sparse24.parse_pattern(pattern) == (int(match[1]), int(match[2]))
    else:
        with pytest.raises(ValueError, match="Received"):
            tf_sparse24.parse_pattern(pattern)


@st.composite
def weights(draw):
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 8]), min_size=rank, max_size=rank)))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Few distinct magnitudes and both signs: plenty of ties for the lower-index rule.
    w = (rng.integers(-3, 4, size=shape) * draw(st.sampled_from([1.0, 0.5, 1e-3]))).astype(dtype)
    if w.size and draw(st.booleans()):
        w.flat[rng.integers(w.size)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return w


@FUZZ
@given(weights(), st.integers(-5, 4), st.sampled_from(PATTERNS + BAD_PATTERNS[:4]))
def test_compute_mask_matches_numpy_or_raises_clearly(w, axis, pattern):
    try:
        n, m = tf_sparse24.parse_pattern(pattern)
    except ValueError:
        with pytest.raises(ValueError, match="pattern"):
            tf_sparse24.compute_mask(w, pattern, axis)
        return
    bad_axis = not -w.ndim <= axis < w.ndim
    if bad_axis or w.shape[axis] % m or not np.isfinite(w.astype(np.float64)).all():
        with pytest.raises(ValueError, match=r"[Aa]xis|multiple|NaN"):
            tf_sparse24.compute_mask(w, pattern, axis)
        return
    mask = np.asarray(tf_sparse24.compute_mask(w, pattern, axis))
    assert mask.shape == w.shape and mask.dtype == w.dtype
    np.testing.assert_array_equal(mask, scenario.magnitude_mask(w, axis, n, m))
    assert tf_sparse24.is_nm_sparse(w * mask, pattern, axis)
    assert tf_sparse24.is_nm_sparse(w, pattern, axis) == scenario.is_nm(w, axis, n, m)


@SLOW_FUZZ
@given(
    st.sampled_from(["hidden", "out"]),
    st.integers(0, 10**6),
    st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_prune_rejects_nonfinite_weights_naming_the_layer_and_changes_nothing(
    layer_name, spot, bad
):
    model = trained_model()
    kernel = model.get_layer(layer_name).kernel
    original = kernel.numpy()
    poisoned = original.copy()
    poisoned.flat[spot % poisoned.size] = bad
    kernel.assign(poisoned)
    try:
        before = snapshot(model)
        with pytest.raises(ValueError, match=f"{layer_name}.*NaN/Inf"):
            tf_sparse24.prune(model)
        assert_unchanged(model, before)
    finally:
        kernel.assign(original)


@SLOW_FUZZ
@given(st.one_of(st.sampled_from(BAD_PATTERNS), st.text(max_size=6)))
def test_prune_rejects_bad_patterns_and_changes_nothing(pattern):
    try:
        tf_sparse24.parse_pattern(pattern)
        return  # a valid pattern drawn by st.text(): not this test's business
    except ValueError:
        pass
    model = trained_model()
    before = snapshot(model)
    with pytest.raises(ValueError, match="pattern"):
        tf_sparse24.prune(model, pattern)
    assert_unchanged(model, before)


@pytest.mark.parametrize("thing", [None, 3, "model", keras.layers.Dense(4), np.ones((4, 4))])
def test_model_functions_reject_non_models(thing):
    for fn in (tf_sparse24.prune, tf_sparse24.strip, tf_sparse24.report):
        with pytest.raises(TypeError, match="keras.Model"):
            fn(thing)


def test_prune_rejects_unbuilt_models_and_unknown_layer_names():
    unbuilt = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="built"):
        tf_sparse24.prune(unbuilt)
    model = trained_model()
    before = snapshot(model)
    with pytest.raises(ValueError, match="no_such_layer"):
        tf_sparse24.prune(model, layers=["no_such_layer"])
    with pytest.raises(ValueError, match="no_such_layer"):
        tf_sparse24.prune(model, skip=["no_such_layer"])
    assert_unchanged(model, before)


@SLOW_FUZZ
@given(st.integers(0, 1), st.integers(0, 10**6), st.sampled_from([np.nan, np.inf]))
def test_update_masks_with_nonfinite_weights_keeps_every_mask(which, spot, bad):
    model = pruned_model()
    wrapper = tf_sparse24.pruned_layers(model)[which]
    (pw,) = wrapper.pruned_weights
    original = pw.variable.numpy()
    poisoned = original.copy()
    poisoned.flat[spot % poisoned.size] = bad
    pw.variable.assign(poisoned)
    try:
        before = snapshot(model)
        with pytest.raises(ValueError, match="NaN/Inf"):
            wrapper.update_masks()
        assert_unchanged(model, before)
    finally:
        pw.variable.assign(original)


@SLOW_FUZZ
@given(st.integers(1, 40).filter(lambda f: f != scenario.FEATURES), st.integers(0, 3))
def test_pruned_model_rejects_wrong_input_shapes_and_changes_nothing(features, batch):
    model = pruned_model()
    before = snapshot(model)
    with pytest.raises(
        (ValueError, tf.errors.InvalidArgumentError), match=r"(?i)shape|incompatible"
    ):
        model(np.ones((batch, features), "float32"))
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "kwargs", [{"start_step": -1}, {"start_step": 1.5}, {"update_every": 0}, {"update_every": "10"}]
)
def test_callback_rejects_bad_schedules(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        tf_sparse24.Sparse24Callback(**kwargs)


@pytest.mark.parametrize("pattern", BAD_PATTERNS[:5])
def test_wrapper_rejects_bad_patterns(pattern):
    with pytest.raises(ValueError, match="pattern"):
        tf_sparse24.Sparse24(keras.layers.Dense(4), pattern=pattern)


def test_callback_fails_loudly_when_the_invariant_breaks():
    model = tf_sparse24.prune(scenario.dense_model(seed=4))
    model.compile("sgd", "mse")
    wrapper = tf_sparse24.pruned_layers(model)[0]
    (pw,) = wrapper.pruned_weights
    pw.mask.assign(np.ones(pw.mask.shape, "float32"))  # corrupt: a dense "mask"
    x, y = scenario.data(16)
    with pytest.raises(RuntimeError, match=f"{wrapper.name}/kernel.*not 2:4"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[tf_sparse24.Sparse24Callback()])


def test_nothing_half_done_when_one_of_many_layers_is_bad():
    """prune() validates every layer before building anything: a NaN in the last layer aborts it."""
    model = scenario.dense_model(seed=5)
    out = model.get_layer("out").kernel
    poisoned = out.numpy()
    poisoned[-1, -1] = np.nan
    out.assign(poisoned)
    before = snapshot(model)
    names = {layer.name for layer in model.layers}
    with pytest.raises(ValueError, match="out"):
        tf_sparse24.prune(model)
    assert_unchanged(model, before)
    assert {layer.name for layer in model.layers} == names
    assert not tf_sparse24.pruned_layers(model)
    assert math.isnan(model.get_layer("out").kernel.numpy()[-1, -1])
