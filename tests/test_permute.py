"""Tests for channel permutation search and its application to Keras models (tf_sparse24.permute)."""

import itertools

import keras
import numpy as np
import pytest

from tf_sparse24.permute import (
    _partitions,
    kept_magnitude,
    permutation_efficacy,
    permute,
    search_permutation,
)


def _kept_reference(matrix, perm):
    """2:4 kept magnitude with plain Python loops (float64), ASP orientation."""
    total = 0.0
    for row in np.abs(np.asarray(matrix, dtype=np.float64))[:, perm]:
        for g in range(0, len(row), 4):
            total += sum(sorted(row[g : g + 4])[2:])
    return total


def _best_by_brute_force(matrix):
    """Max kept magnitude over every split of the channels into groups of 4 (tiny matrices)."""
    channels = list(range(matrix.shape[1]))

    def splits(rest):
        if not rest:
            yield []
            return
        for others in itertools.combinations(rest[1:], 3):
            group = [rest[0], *others]
            for tail in splits([c for c in rest if c not in group]):
                yield group + tail

    return max(_kept_reference(matrix, perm) for perm in splits(channels))


def test_kept_magnitude_and_efficacy_match_asp_published_numbers():
    # apex permutation_tests README, seed 1, 128 filters x 64 channels: unpruned 4083.169,
    # default 2:4 2852.377, 50% rows 3042.332.
    np.random.seed(1)
    matrix = np.random.rand(128, 64)
    assert np.abs(matrix).sum() == pytest.approx(4083.169, abs=1e-3)
    assert kept_magnitude(matrix) == pytest.approx(2852.377, abs=1e-3)
    assert permutation_efficacy(matrix, np.arange(64)) == 0.0
    rng = np.random.default_rng(0)
    perm = rng.permutation(64)
    assert kept_magnitude(matrix, perm) == pytest.approx(_kept_reference(matrix, perm))
    lost_rows = matrix.sum() - 3042.332
    expected = 100 * (kept_magnitude(matrix, perm) - 2852.377) / (matrix.sum() - 2852.377 - lost_rows)
    assert permutation_efficacy(matrix, perm) == pytest.approx(expected, abs=1e-3)


def test_partition_tables_are_complete_and_distinct():
    for stripes, count in ((2, 35), (3, 5775)):  # 8!/(4!^2 2!), 12!/(4!^3 3!)
        subsets, partitions = _partitions(stripes)
        assert len(partitions) == count
        covers = {tuple(sorted(np.concatenate(subsets[p]).tolist())) for p in partitions}
        assert covers == {tuple(range(4 * stripes))}
        assert len({tuple(sorted(p)) for p in partitions.tolist()}) == count
        index = {tuple(sub): i for i, sub in enumerate(subsets.tolist())}
        assert partitions[0].tolist() == [index[tuple(range(4 * i, 4 * i + 4))] for i in range(stripes)]


@pytest.mark.parametrize("channels", [8, 12])
def test_search_finds_the_brute_force_optimum_on_small_layers(channels):
    rng = np.random.default_rng(channels)
    for _ in range(3 if channels == 8 else 1):
        matrix = rng.normal(size=(5, channels))
        perm = search_permutation(matrix, axis=1, kicks=0)
        assert sorted(perm.tolist()) == list(range(channels))
        assert _kept_reference(matrix, perm) == pytest.approx(_best_by_brute_force(matrix), rel=1e-9)


def test_search_recovers_a_hidden_perfect_order():
    # A matrix that is exactly 2:4 in some unknown channel order: the search must find an order
    # that keeps everything (efficacy 100%).
    rng = np.random.default_rng(3)
    rows, channels = 32, 32
    dense = rng.uniform(0.5, 1.0, size=(rows, channels))
    mask = np.zeros_like(dense)
    for r in range(rows):
        for g in range(0, channels, 4):
            mask[r, g + rng.choice(4, 2, replace=False)] = 1
    hidden = rng.permutation(channels)
    matrix = (dense * mask)[:, hidden]
    perm = search_permutation(matrix, axis=1, kicks=20, seed=1)
    assert _kept_reference(matrix, perm) == pytest.approx(np.abs(matrix).sum(), rel=1e-9)


def test_search_on_keras_layouts_never_loses_and_is_deterministic():
    rng = np.random.default_rng(0)
    conv = rng.normal(size=(3, 3, 24, 16))  # [h, w, in, out], channels on axis 2
    perm = search_permutation(conv, axis=2, kicks=3, seed=5)
    rows = np.moveaxis(conv, 2, -1).reshape(-1, 24)
    assert _kept_reference(rows, perm) >= _kept_reference(rows, np.arange(24)) - 1e-9
    np.testing.assert_array_equal(perm, search_permutation(conv, axis=2, kicks=3, seed=5))
    dense = rng.normal(size=(40, 12))  # [in, out], channels on axis 0
    perm = search_permutation(dense, axis=0, kicks=2)
    assert _kept_reference(dense.T, perm) > _kept_reference(dense.T, np.arange(40))


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(10, 3\).*10 channels"):
        search_permutation(np.ones((10, 3)), axis=0)
    w = np.ones((8, 4))
    w[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        search_permutation(w)
    with pytest.raises(ValueError, match="out of range"):
        search_permutation(np.ones((8, 4)), axis=2)


def _randomize(model, seed=0):
    """Random weights everywhere, BatchNorm statistics included, so a mis-permutation shows."""
    rng = np.random.default_rng(seed)
    weights = []
    for w in model.get_weights():
        weights.append(rng.uniform(0.5, 1.5, w.shape) if w.ndim == 1 else rng.normal(size=w.shape))
    model.set_weights([w.astype("float32") for w in weights])


def _outputs(model, x):
    return keras.ops.convert_to_numpy(model(x, training=False))


def _kept_in_layer(layer):
    kernel = layer.kernel.numpy()
    return kept_magnitude(np.moveaxis(kernel, kernel.ndim - 2, -1).reshape(-1, kernel.shape[-2]))


def test_permute_dense_chain_keeps_function_and_gains():
    inputs = keras.Input((10,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dropout(0.5)(x)
    x = keras.layers.Dense(24, activation="tanh", name="d2")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    outputs = keras.layers.Dense(5, name="d3")(x)
    model = keras.Model(inputs, outputs)
    _randomize(model)
    original = [w.copy() for w in model.get_weights()]
    x = np.random.default_rng(1).normal(size=(16, 10)).astype("float32")

    permuted, reports = permute(model, kicks=2, progress=False)

    np.testing.assert_allclose(_outputs(permuted, x), _outputs(model, x), rtol=1e-5, atol=1e-5)
    for before, after in zip(original, model.get_weights()):  # the caller's model is untouched
        np.testing.assert_array_equal(before, after)
    by_consumer = {r.consumers: r for r in reports}
    assert not by_consumer[("d1",)].permuted and "model input" in by_consumer[("d1",)].reason
    for name, producer in (("d2", "d1"), ("d3", "d2")):
        r = by_consumer[(name,)]
        assert r.permuted and r.producer == producer
        assert r.kept_before == pytest.approx(_kept_in_layer(model.get_layer(name)))
        assert r.kept_after == pytest.approx(_kept_in_layer(permuted.get_layer(name)))
        assert r.kept_after > r.kept_before and r.efficacy > 0


def test_permute_conv_bn_chain_with_residual_add_and_siblings():
    inputs = keras.Input((8, 8, 4))
    a = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    a = keras.layers.BatchNormalization(name="bn1")(a)
    a = keras.layers.ReLU()(a)
    b = keras.layers.Conv2D(8, 3, padding="same", name="c2")(a)
    s = keras.layers.Add(name="add")([a, b])  # c1's channels reach a residual add
    c = keras.layers.Conv2D(12, 1, name="c3")(s)
    c = keras.layers.BatchNormalization(name="bn3")(c)
    c = keras.layers.MaxPooling2D()(c)
    left = keras.layers.Conv2D(8, 3, name="c4")(c)  # two consumers of c3's channels
    right = keras.layers.Conv2D(8, 1, name="c5")(c)
    right = keras.layers.Cropping2D(1)(right)
    merged = keras.layers.Concatenate()([left, right])
    outputs = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(merged))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=2)
    x = np.random.default_rng(3).normal(size=(4, 8, 8, 4)).astype("float32")

    permuted, reports = permute(model, kicks=1, progress=False)

    np.testing.assert_allclose(_outputs(permuted, x), _outputs(model, x), rtol=1e-4, atol=1e-4)
    by_producer = {r.producer: r for r in reports}
    assert not by_producer["c1"].permuted and "'add' (Add)" in by_producer["c1"].reason
    group = by_producer["c3"]
    assert group.permuted and set(group.consumers) == {"c4", "c5"} and group.channels == 12
    after = sum(_kept_in_layer(permuted.get_layer(n)) for n in ("c4", "c5"))
    before = sum(_kept_in_layer(model.get_layer(n)) for n in ("c4", "c5"))
    assert group.kept_after == pytest.approx(after) and after >= before
    head = {r.consumers: r for r in reports}[("head",)]
    assert not head.permuted and "(Concatenate)" in head.reason


def test_permute_sequential_and_errors():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    _randomize(model, seed=4)
    x = np.random.default_rng(5).normal(size=(8, 6)).astype("float32")
    permuted, reports = permute(model, kicks=1, progress=False)
    np.testing.assert_allclose(_outputs(permuted, x), _outputs(model, x), rtol=1e-5, atol=1e-5)
    assert [r.permuted for r in reports] == [False, True, True]
    assert "model input" in reports[0].reason

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.zeros((1, 4), "float32"))
    with pytest.raises(TypeError, match="Functional or Sequential"):
        permute(sub)
    with pytest.raises(TypeError, match="keras.Model"):
        permute(keras.layers.Dense(4))
    with pytest.raises(ValueError, match="no layer named"):
        permute(model, layers=["nope"])
