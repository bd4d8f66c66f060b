"""Tests for channel permutation search and its application to Keras models (tf_sparse24.permute)."""

import itertools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.examples import example

from tf_sparse24 import eligible_weights, prune
from tf_sparse24.permute import permute
from tf_sparse24.permute_search import (
    _native_top2_group_sums,
    _partitions,
    _top2_sum,
    _top2_sum_numpy,
    channel_matrix,
    kept_magnitude,
    permutation_efficacy,
    search_permutation,
)
from tf_sparse24.wrapper import walk_layers

TokenAndPositionEmbedding = example("text_transformer").TokenAndPositionEmbedding
TransformerBlock = example("text_transformer").TransformerBlock  # keras.io's, no build()


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


@pytest.mark.parametrize("scale, dtype", [(1e38, "float32"), (1e300, "float64"), (1e-9, "float32")])
def test_search_finds_the_same_order_at_any_scale(scale, dtype):
    """Finite but huge weights overflowed float32 group sums (inf - inf gains: it never
    returned); tiny ones fell under the gain threshold (a weaker search)."""
    w = np.random.default_rng(0).standard_normal((16, 8))
    perm = search_permutation(w, 0, kicks=0)
    assert _kept_reference(w.T, perm) > _kept_reference(w.T, np.arange(16))
    np.testing.assert_array_equal(
        search_permutation((w * scale).astype(dtype), 0, kicks=0), perm)


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(10, 3\).*10 channels"):
        search_permutation(np.ones((10, 3)), axis=0)
    w = np.ones((8, 4))
    w[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        search_permutation(w)
    with pytest.raises(ValueError, match="out of range"):
        search_permutation(np.ones((8, 4)), axis=2)


@pytest.mark.parametrize("rows", [1, 7, 8, 2049, 4100])  # around the 8 lanes and 2048-row blocks
def test_native_group_scores_match_float64_reference(rows):
    assert _native_top2_group_sums() is not None  # the op library is built in this suite
    rng = np.random.default_rng(rows)
    at = np.abs(rng.standard_cauchy(size=(40, rows))).astype(np.float32)  # wide range of values
    groups = rng.integers(0, 40, size=(3, 37, 4))  # any leading shape; repeats allowed
    expected = np.array([
        np.sort(at[g].astype(np.float64), axis=0)[2:].sum() for g in groups.reshape(-1, 4)
    ]).reshape(3, 37)
    np.testing.assert_allclose(_top2_sum(at, groups), expected, rtol=2e-6)
    np.testing.assert_allclose(_top2_sum_numpy(at, groups.reshape(-1, 4)).reshape(3, 37), expected,
                               rtol=1e-9)


def test_search_in_blocks_keeps_groups_inside_blocks_and_never_loses():
    rng = np.random.default_rng(7)
    w = rng.normal(size=(96, 20)) * rng.lognormal(0, 1, size=(96, 1))  # Dense [in, out]
    plain = _kept_reference(w.T, np.arange(96))
    blocked = search_permutation(w, kicks=2, block_channels=32, seed=3)
    np.testing.assert_array_equal(blocked, search_permutation(w, kicks=2, block_channels=32, seed=3))
    assert sorted(blocked.tolist()) == list(range(96))
    assert _kept_reference(w.T, blocked) > plain
    # Every group of the blocked order holds channels of one block: 3 blocks of 8 original groups
    # each, so the new groups' original group positions fall into 3 disjoint sets of 8.
    members = [set((blocked[g : g + 4] // 4).tolist()) for g in range(0, 96, 4)]
    blocks = []
    for m in members:
        hit = [b for b in blocks if b & m]
        merged = set(m).union(*hit)
        blocks = [b for b in blocks if not b & m] + [merged]
    assert all(len(b) <= 8 for b in blocks)
    with pytest.raises(ValueError, match="block_channels must be at least 8"):
        search_permutation(w, block_channels=4)


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


def test_permute_conv_bn_chain_with_siblings_and_a_concatenation():
    inputs = keras.Input((8, 8, 4))
    c = keras.layers.Conv2D(12, 1, name="c3")(keras.layers.Conv2D(8, 3, name="c1")(inputs))
    c = keras.layers.BatchNormalization(name="bn3")(c)
    c = keras.layers.MaxPooling2D()(c)
    left = keras.layers.Conv2D(8, 3, name="c4")(c)  # two consumers of c3's channels
    right = keras.layers.Conv2D(8, 1, name="c5")(c)
    right = keras.layers.Cropping2D(1)(right)
    merged = keras.layers.Concatenate(name="cat")([left, right])
    merged = keras.layers.BatchNormalization(name="bn_cat")(merged)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(merged))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=2)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 8, 8, 4, seed=3))
    by_producer = {r.producer: r for r in reports}
    group = by_producer["c3"]
    assert group.permuted and set(group.consumers) == {"c4", "c5"} and group.channels == 12
    after = sum(_kept_in_layer(permuted.get_layer(n)) for n in ("c4", "c5"))
    before = sum(_kept_in_layer(model.get_layer(n)) for n in ("c4", "c5"))
    assert group.kept_after == pytest.approx(after) and after >= before
    # The head reads c4's channels at input channels 0-7 and c5's at 8-15: two spaces, each
    # reordered inside its own slice of the head's kernel and of the BatchNorm after the concat.
    head = model.get_layer("head").kernel.numpy()
    for producer, rows in (("c4", slice(0, 8)), ("c5", slice(8, 16))):
        r = by_producer[producer]
        assert r.permuted and r.consumers == ("head",) and r.channels == 8
        assert r.kept_before == pytest.approx(kept_magnitude(head[rows].T))
        assert r.kept_after == pytest.approx(
            kept_magnitude(permuted.get_layer("head").kernel.numpy()[rows].T))


def test_permute_dense_blocks_reorder_each_layers_slice_of_the_concatenations():
    # DenseNet: every layer's output is concatenated onto the block's running tensor and read by
    # every later layer of the block and by the transition, at the same input channels.
    inputs = keras.Input((6, 6, 4))
    x = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    for i in range(3):
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        y = keras.layers.Conv2D(8, 1, name=f"b{i}_1x1")(y)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.Conv2D(8, 3, padding="same", name=f"b{i}_3x3")(y)
        x = keras.layers.Concatenate(name=f"cat{i}")([x, y])
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn_t")(x))
    x = keras.layers.Conv2D(12, 1, name="transition")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(
        keras.layers.GlobalAveragePooling2D()(x)))
    _randomize(model, seed=4)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 6, 6, 4, seed=5))
    by_producer = {r.producer: r for r in reports if r.permuted}
    assert set(by_producer["stem"].consumers) == {"b0_1x1", "b1_1x1", "b2_1x1", "transition"}
    assert set(by_producer["b0_3x3"].consumers) == {"b1_1x1", "b2_1x1", "transition"}
    assert by_producer["b2_3x3"].consumers == ("transition",)
    for producer, start in (("stem", 0), ("b0_3x3", 8), ("b1_3x3", 16), ("b2_3x3", 24)):
        r = by_producer[producer]  # the consumers' input channels start..start+7, searched as one
        rows = np.concatenate([_channel_slice(model, n, start) for n in r.consumers])
        assert r.kept_before == pytest.approx(kept_magnitude(rows))
        after = np.concatenate([_channel_slice(permuted, n, start) for n in r.consumers])
        assert r.kept_after == pytest.approx(kept_magnitude(after)) and r.kept_after > r.kept_before
    assert [r.consumers for r in reports if not r.permuted] == [("stem",)]


def _channel_slice(model, name, start):
    """`name`'s kernel as ASP rows over the 8 input channels from `start`."""
    kernel = model.get_layer(name).kernel.numpy()
    return channel_matrix(kernel, kernel.ndim - 2)[:, start:start + 8]


def test_permute_skips_concatenated_channels_that_would_share_a_group():
    inputs = keras.Input((12,))
    a = keras.layers.Dense(6, name="a")(inputs)  # 6 channels, then b's at input channels 6-13
    b = keras.layers.Dense(8, name="b")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(
        keras.layers.Concatenate()([a, b])))
    _randomize(model, seed=6)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 12))
    by_producer = {r.producer: r for r in reports}
    assert by_producer["a"].reason == "6 channels, not a multiple of 4"
    assert by_producer["b"].reason == (
        "channels reach 'head' (Dense) at input channel 6, not a multiple of 4")
    assert not any(r.permuted for r in reports)


def _residual_stage(inputs, blocks, width, prefix):
    """ResNet's bottleneck blocks sharing one residual stream: a projection shortcut first."""
    shortcut = keras.layers.BatchNormalization(name=f"{prefix}_sbn")(
        keras.layers.Conv2D(width, 1, name=f"{prefix}_short")(inputs))
    x = inputs
    for b in range(blocks):
        y = keras.layers.Conv2D(width // 2, 1, name=f"{prefix}{b}_a")(x)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.Conv2D(width, 3, padding="same", name=f"{prefix}{b}_b")(y)
        y = keras.layers.BatchNormalization(name=f"{prefix}{b}_bn")(y)
        x = keras.layers.ReLU()(keras.layers.Add(name=f"{prefix}{b}_add")([shortcut, y]))
        shortcut = x
    return x


def test_permute_joins_residual_adds_into_one_channel_space():
    inputs = keras.Input((6, 6, 4))
    x = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    x = _residual_stage(x, 3, 16, "s1")
    x = _residual_stage(x, 2, 24, "s2")
    pooled = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.Dropout(0.2)(pooled))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=2)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 6, 6, 4, seed=3))
    report_of = {c: r for r in reports for c in r.consumers}  # report of each consumer
    s1 = report_of["s11_a"]  # stage 1's residual stream, read by its blocks and by stage 2
    assert s1.permuted and s1.channels == 16
    assert set(s1.producers) == {"s1_short", "s10_b", "s11_b", "s12_b"}
    assert set(s1.consumers) == {"s11_a", "s12_a", "s2_short", "s20_a"}
    s2 = report_of["s21_a"]
    assert s2.permuted and set(s2.producers) == {"s2_short", "s20_b", "s21_b"}
    assert set(s2.consumers) == {"s21_a", "head"}
    for r in (s1, s2):  # one order for all the space's consumers: what the search saw
        rows = np.concatenate([channel_matrix(k, k.ndim - 2) for k in
                               (model.get_layer(n).kernel.numpy() for n in r.consumers)])
        assert r.kept_before == pytest.approx(kept_magnitude(rows))
        after = sum(_kept_in_layer(permuted.get_layer(n)) for n in r.consumers)
        assert r.kept_after == pytest.approx(after) and after > r.kept_before
    inner = report_of["s10_b"]
    assert inner.permuted and inner.producers == ("s10_a",) and inner.consumers == ("s10_b",)
    stem = report_of["s1_short"]
    assert stem.permuted and stem.producers == ("stem",)
    assert set(stem.consumers) == {"s1_short", "s10_a"}
    skipped = [r for r in reports if not r.permuted]
    assert [r.consumers for r in skipped] == [("stem",)]
    assert skipped[0].reason == "its input channels come from the model input"


def test_permute_through_squeeze_excite_products():
    # EfficientNet's block: expand -> depthwise -> x * sigmoid(conv(conv(pool(x)))) -> project.
    inputs = keras.Input((6, 6, 8))
    x = keras.layers.Conv2D(16, 1, name="expand")(inputs)
    x = keras.layers.Activation("swish")(keras.layers.BatchNormalization()(x))
    x = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(x)
    x = keras.layers.Activation("swish")(keras.layers.BatchNormalization()(x))
    se = keras.layers.GlobalAveragePooling2D()(x)
    se = keras.layers.Reshape((1, 1, 16), name="se_reshape")(se)
    se = keras.layers.Conv2D(4, 1, activation="swish", name="se_reduce")(se)
    se = keras.layers.Conv2D(16, 1, activation="sigmoid", name="se_expand")(se)
    x = keras.layers.Multiply(name="excite")([x, se])
    x = keras.layers.Conv2D(8, 1, name="project")(x)
    gate = keras.layers.Conv2D(1, 1, name="gate")(x)  # [.., 1]: broadcast over the 8 channels
    x = keras.layers.Multiply(name="gated")([x, gate])
    outputs = keras.layers.Conv2D(4, 1, name="out")(x)
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=5)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 6, 6, 8, seed=6))
    report_of = {c: r for r in reports for c in r.consumers}  # report of each consumer
    excite = report_of["se_reduce"]
    assert excite.permuted and excite.producers == ("expand", "se_expand")
    assert excite.consumers == ("se_reduce", "project") and excite.channels == 16
    assert not np.array_equal(permuted.get_layer("dw").get_weights()[0],
                              model.get_layer("dw").get_weights()[0])
    assert report_of["se_expand"].permuted and report_of["se_expand"].producers == ("se_reduce",)
    gated = report_of["gate"]  # the 1-channel gate is left alone; x's channels pass through
    assert gated.permuted and gated.producers == ("project",)
    assert gated.consumers == ("gate", "out") and gated.channels == 8
    np.testing.assert_array_equal(permuted.get_layer("gate").bias.numpy(),
                                  model.get_layer("gate").bias.numpy())


def test_permute_a_layer_that_reads_and_writes_the_same_channels():
    inputs = keras.Input((8,))
    h = keras.layers.ReLU()(keras.layers.Dense(16, name="d0")(inputs))
    x = keras.layers.Add()([h, keras.layers.Dense(16, name="d1")(h)])  # x + d1(x): both axes
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(x))
    _randomize(model, seed=13)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 8))
    space = next(r for r in reports if r.permuted)
    assert set(space.producers) == {"d0", "d1"} and set(space.consumers) == {"d1", "d2"}
    before, after = (m.get_layer("d1").kernel.numpy() for m in (model, permuted))
    assert not np.array_equal(np.sort(before, axis=0), np.sort(after, axis=0))  # columns moved
    np.testing.assert_array_equal(np.sort(before, axis=None), np.sort(after, axis=None))


def test_permute_skips_a_residual_add_of_the_model_input():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="d0")(inputs)
    x = keras.layers.Add(name="add")([inputs, keras.layers.Dense(16, name="d1")(x)])
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(x))
    _randomize(model, seed=8)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    report_of = {c: r for r in reports for c in r.consumers}  # report of each consumer
    assert report_of["d1"].permuted and report_of["d1"].producers == ("d0",)
    add = report_of["d2"]  # the sum's channels are the input's too
    assert not add.permuted and add.consumers == ("d2",) and add.producers == ("d1",)
    assert add.reason == "its input channels come from the model input"


def test_permute_through_depthwise_convs_and_from_separable_convs():
    # MobileNet's inverted residual (expand -> depthwise -> project) and a SeparableConv producer.
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(16, 1, name="expand")(inputs)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU(6.0)(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(x)
    x = keras.layers.BatchNormalization(name="bn2")(x)
    x = keras.layers.ReLU(6.0)(x)
    x = keras.layers.Conv2D(12, 1, name="project")(x)
    x = keras.layers.SeparableConv2D(16, 3, depth_multiplier=2, name="sep")(x)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="dw2")(x)  # interleaves: skipped
    x = keras.layers.Conv2D(8, 1, name="after_dw2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    y = keras.layers.Reshape((4, 4, 4))(keras.layers.Dense(64, name="d")(inputs[:, 0, 0, :]))
    y = keras.layers.SeparableConv1D(8, 2, name="sep1d")(keras.layers.Reshape((16, 4))(y))
    y = keras.layers.DepthwiseConv1D(3, name="dw1d")(keras.layers.ReLU()(y))
    y = keras.layers.GlobalAveragePooling1D()(y)
    outputs = keras.layers.Concatenate()([
        keras.layers.Dense(4, name="head")(x), keras.layers.Dense(4, name="head1d")(y)])
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=21)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 8, 8, 4))
    by_consumer = {r.consumers: r for r in reports}
    project = by_consumer[("project",)]
    assert project.permuted and project.producer == "expand" and project.channels == 16
    assert project.kept_after > project.kept_before
    assert not np.array_equal(permuted.get_layer("dw").get_weights()[0],
                              model.get_layer("dw").get_weights()[0])
    assert "'dw2' (DepthwiseConv2D), which cannot be permuted" in by_consumer[("after_dw2",)].reason
    head1d = by_consumer[("head1d",)]
    assert head1d.permuted and head1d.producer == "sep1d"


def test_permute_separable_convs_as_consumers():
    # Xception's entry flow: separable convs read the channels (depthwise filters, then the
    # pointwise kernel that 2:4 prunes); a depth multiplier of 2 interleaves them and stops.
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(
        keras.layers.Conv2D(8, 1, name="c0")(inputs)))
    y = keras.layers.SeparableConv2D(16, 3, padding="same", name="sep1")(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.SeparableConv2D(16, 3, padding="same", name="sep2")(y)
    y = keras.layers.BatchNormalization()(y)
    x = keras.layers.Add()([keras.layers.Conv2D(16, 1, name="short")(x), y])
    x = keras.layers.SeparableConv2D(8, 3, depth_multiplier=2, name="sep_dm2")(x)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=9)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 8, 8, 4))
    report_of = {c: r for r in reports for c in r.consumers}
    entry = report_of["sep1"]
    assert entry.permuted and entry.producers == ("c0",)
    assert set(entry.consumers) == {"sep1", "short"}
    kept = [kept_magnitude(channel_matrix(k, 2)) for k in (
        model.get_layer("sep1").pointwise_kernel.numpy(),
        model.get_layer("short").kernel.numpy())]
    assert entry.kept_before == pytest.approx(sum(kept))
    for name in ("depthwise_kernel", "pointwise_kernel"):
        assert not np.array_equal(getattr(permuted.get_layer("sep1"), name).numpy(),
                                  getattr(model.get_layer("sep1"), name).numpy())
    assert report_of["sep2"].permuted and report_of["sep2"].producers == ("sep1",)
    # The residual stream reaches only sep_dm2, not a consumer permute() can reorder: untouched.
    assert not {"short", "sep2"} & {p for r in reports for p in r.producers}
    short = [m.get_layer("short").kernel.numpy() for m in (model, permuted)]
    np.testing.assert_array_equal(*(np.sort(k, axis=2) for k in short))  # input axis only
    assert report_of["head"].permuted and report_of["head"].producers == ("sep_dm2",)


@pytest.mark.parametrize("middle, cause", [
    (keras.layers.Conv2D(16, 3, padding="same", groups=2, name="mid"),
     "grouped convolution, groups=2"),
    (keras.layers.Conv2DTranspose(16, 3, padding="same", name="mid"), "transposed convolution"),
    (keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="mid"),
     "depth_multiplier=2 interleaves its output channels"),
    (keras.layers.SeparableConv2D(16, 3, padding="same", depth_multiplier=2, name="mid"),
     "depth_multiplier=2: only its output channels are reordered"),
], ids=["grouped", "transposed", "depthwise_multiplier", "separable_multiplier"])
def test_permute_reports_each_convolution_it_leaves_alone_and_why(middle, cause):
    # The channels between c0 and `mid` have no consumer permute() reorders: `mid` gets a report
    # of its own, and the space after it names the same cause.
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(16, 3, padding="same", name="c0")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", name="c2")(middle(x))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    _randomize(model, seed=2)
    printed = []

    permuted, reports = permute(model, kicks=1, progress=False, print_fn=printed.append)

    _assert_same_function(model, permuted, _x(2, 8, 8, 4))
    kind = type(middle).__name__
    by_consumer = {r.consumers: r for r in reports}
    own = by_consumer[("mid",)]
    assert not own.permuted and own.producers == () and own.channels == 0
    assert own.reason == f"'mid' ({kind}) is not permuted: {cause}"
    assert f"- -> mid: skipped: 'mid' ({kind}) is not permuted: {cause}" in printed
    after = by_consumer[("c2",)]
    if kind == "SeparableConv2D":  # its pointwise kernel writes its output channels
        assert after.permuted and after.producers == ("mid",)
    else:
        assert after.reason == (f"its input channels come from 'mid' ({kind}), which cannot be "
                                f"permuted ({cause})")
    assert by_consumer[("head",)].permuted


@pytest.mark.parametrize("bidirectional", [
    lambda: keras.layers.Bidirectional(keras.layers.RNN(keras.layers.GRUCell(4)), name="bi"),
    lambda: keras.layers.Bidirectional(
        keras.layers.GRU(4), name="bi",
        backward_layer=keras.layers.RNN(keras.layers.GRUCell(4), go_backwards=True)),
], ids=["rnn_cell", "gru_with_rnn_cell_backward"])
def test_permute_reports_a_bidirectional_layer_and_a_channels_first_convolution(bidirectional):
    # A Bidirectional reads reordered channels only when both its layers are GRU, LSTM or SimpleRNN.
    inputs = keras.Input((6, 8))
    x = keras.layers.Dense(8, name="d0")(inputs)
    x = bidirectional()(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    _randomize(model, seed=3)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(2, 6, 8))
    reasons = {r.consumers: r.reason for r in reports if not r.permuted}
    assert reasons[("bi",)] == ("'bi' (Bidirectional) is not permuted: recurrent layer (of these, "
                                "only GRU, LSTM and SimpleRNN, alone or as both layers of a "
                                "Bidirectional, read reordered channels)")
    assert "which cannot be permuted (recurrent layer (of these" in reasons[("head",)]
    assert not any(r.permuted for r in reports)

    # channels_first: TensorFlow's CPU convolutions do not run it, so only the report is checked.
    inputs = keras.Input((6, 8))
    x = keras.layers.Dense(8, name="d0")(inputs)
    x = keras.layers.Conv1D(8, 1, data_format="channels_first", name="first")(x)  # channels: 6
    model = keras.Model(inputs, x)
    reasons = {r.consumers: r.reason for r in permute(model, kicks=1, progress=False)[1]}
    assert reasons[("first",)] == "'first' (Conv1D) is not permuted: data_format='channels_first'"


def _stacked(layers: list, input_shape: tuple, sequential: bool) -> keras.Model:
    """`layers` applied one after the other, as a Sequential or a Functional model."""
    if sequential:
        return keras.Sequential([keras.Input(input_shape), *layers])
    inputs = keras.Input(input_shape)
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x)


@pytest.mark.parametrize("recurrent", [
    lambda: keras.layers.GRU(12, name="rnn"),
    lambda: keras.layers.GRU(12, reset_after=False, return_sequences=True, name="rnn"),
    lambda: keras.layers.LSTM(12, name="rnn"),
    lambda: keras.layers.SimpleRNN(12, go_backwards=True, name="rnn"),
], ids=["gru", "gru_v1_sequences", "lstm", "simple_rnn_backwards"])
@pytest.mark.parametrize("sequential", [False, True], ids=["functional", "sequential"])
def test_permute_reorders_the_input_channels_of_recurrent_layers(recurrent, sequential):
    # A recurrent kernel [in, gates * units] reads its input's channels along axis 0, as a Dense
    # kernel does: its rows are reordered with the producer's output channels; its output (the
    # recurrent state) is not.
    layers = [keras.layers.Dense(16, activation="relu", name="d0"), recurrent(),
              keras.layers.Dense(4, name="head")]
    model = _stacked(layers, (5, 8), sequential)
    _randomize(model, seed=7)

    permuted, reports = permute(model, kicks=2, progress=False)

    _assert_same_function(model, permuted, _x(3, 5, 8, seed=11))
    by_consumer = {r.consumers: r for r in reports}
    space = by_consumer[("rnn",)]
    assert space.permuted and space.producers == ("d0",) and space.channels == 16
    kernel = model.get_layer("rnn").cell.kernel.numpy()
    assert space.kept_before == pytest.approx(kept_magnitude(kernel.T))
    assert space.kept_after == pytest.approx(
        kept_magnitude(permuted.get_layer("rnn").cell.kernel.numpy().T))
    assert space.kept_after > space.kept_before
    kind = type(model.get_layer("rnn")).__name__
    assert by_consumer[("head",)].reason == (
        f"its input channels come from 'rnn' ({kind}), which cannot be permuted (recurrent layer: "
        "only its input channels are reordered)")
    np.testing.assert_array_equal(permuted.get_layer("rnn").cell.recurrent_kernel.numpy(),
                                  model.get_layer("rnn").cell.recurrent_kernel.numpy())


@pytest.mark.parametrize("bidirectional", [
    lambda: keras.layers.Bidirectional(keras.layers.GRU(12), name="bi"),
    lambda: keras.layers.Bidirectional(keras.layers.GRU(12, reset_after=False), merge_mode="ave",
                                       name="bi"),
    lambda: keras.layers.Bidirectional(keras.layers.LSTM(12, return_sequences=True), name="bi"),
    lambda: keras.layers.Bidirectional(keras.layers.LSTM(12), merge_mode="sum", name="bi"),
    lambda: keras.layers.Bidirectional(keras.layers.LSTM(12, return_sequences=True),
                                       merge_mode="mul", name="bi"),
    lambda: keras.layers.Bidirectional(keras.layers.SimpleRNN(12, return_sequences=True),
                                       name="bi"),
    lambda: keras.layers.Bidirectional(  # a backward layer of its own, of another kind
        keras.layers.LSTM(12), backward_layer=keras.layers.GRU(12, go_backwards=True), name="bi"),
], ids=["gru", "gru_v1_ave", "lstm_sequences", "lstm_sum", "lstm_sequences_mul", "simple_rnn",
        "lstm_with_gru_backward"])
@pytest.mark.parametrize("producer", [
    lambda: keras.layers.Dense(16, activation="relu", name="p"),
    lambda: keras.layers.Conv1D(16, 3, padding="same", name="p"),
], ids=["dense", "conv1d"])
@pytest.mark.parametrize("sequential", [False, True], ids=["functional", "sequential"])
def test_permute_reorders_the_input_channels_of_bidirectional_layers(
        bidirectional, producer, sequential):
    # Both the forward and the backward layer's cell kernels [in, gates * units] read the input's
    # channels along axis 0: their rows are searched together and reordered with the producer's
    # output channels; the output (the merged recurrent states) is not reordered.
    layers = [producer(), bidirectional(), keras.layers.Dense(4, name="head")]
    model = _stacked(layers, (5, 8), sequential)
    _randomize(model, seed=7)
    printed = []

    permuted, reports = permute(model, kicks=2, progress=False, print_fn=printed.append)

    _assert_same_function(model, permuted, _x(3, 5, 8, seed=11))
    by_consumer = {r.consumers: r for r in reports}
    space = by_consumer[("bi",)]
    assert space.permuted and space.producers == ("p",) and space.channels == 16
    assert any(line.startswith("p -> bi [16 ch]: kept |w| ") for line in printed)

    def directions(m):
        bi = m.get_layer("bi")
        return bi.forward_layer.cell, bi.backward_layer.cell

    rows = np.concatenate([cell.kernel.numpy().T for cell in directions(model)])
    assert space.kept_before == pytest.approx(kept_magnitude(rows))
    assert space.kept_after == pytest.approx(kept_magnitude(
        np.concatenate([cell.kernel.numpy().T for cell in directions(permuted)])))
    assert space.kept_after > space.kept_before
    assert by_consumer[("head",)].reason == (
        "its input channels come from 'bi' (Bidirectional), which cannot be permuted (recurrent "
        "layer: only its input channels are reordered)")
    for before, after in zip(directions(model), directions(permuted)):
        np.testing.assert_array_equal(after.recurrent_kernel.numpy(),
                                      before.recurrent_kernel.numpy())
        assert not np.array_equal(after.kernel.numpy(), before.kernel.numpy())


def test_permute_reorders_the_input_channels_of_a_bidirectional_layer_without_merge():
    # merge_mode=None: the Bidirectional has two outputs (forward and backward states), each read
    # by a head of its own; its input channels are reordered all the same.
    inputs = keras.Input((5, 8))
    x = keras.layers.Dense(16, name="p")(inputs)
    forward, backward = keras.layers.Bidirectional(
        keras.layers.LSTM(12, return_sequences=True), merge_mode=None, name="bi")(x)
    model = keras.Model(inputs, [keras.layers.Dense(4, name="head_f")(forward),
                                 keras.layers.Dense(4, name="head_b")(backward)])
    _randomize(model, seed=9)

    permuted, reports = permute(model, kicks=2, progress=False)

    _assert_same_function(model, permuted, _x(3, 5, 8, seed=12))
    space = next(r for r in reports if r.consumers == ("bi",))
    assert space.permuted and space.producers == ("p",) and space.kept_after > space.kept_before


@pytest.mark.parametrize("encoder", [
    lambda: keras.layers.LSTM(12, return_state=True, name="enc"),
    lambda: keras.layers.Bidirectional(keras.layers.LSTM(6, return_state=True), name="enc"),
], ids=["lstm", "bidirectional_lstm"])
def test_permute_reorders_an_encoder_decoder_whose_states_pass_between_recurrent_layers(encoder):
    # A seq2seq model: the encoder returns its states (return_state=True) and they start the
    # decoder (initial_state=). Only the sequences' channels are reordered: each recurrent layer's
    # input rows with its producer; the states and what reads them keep their order.
    source, target = keras.Input((5, 8), name="source"), keras.Input((4, 8), name="target")
    encoded = encoder()(keras.layers.Dense(16, name="p_enc")(source))
    states = encoded[1:]
    if len(states) == 4:  # a Bidirectional's forward (h, c) and backward (h, c), concatenated
        states = [keras.layers.Concatenate(name=f"state_{i}")([states[i], states[i + 2]])
                  for i in range(2)]
    decoded = keras.layers.LSTM(12, return_sequences=True, name="dec")(
        keras.layers.Dense(16, name="p_dec")(target), initial_state=states)
    heads = [keras.layers.Dense(4, name="head")(decoded),
             keras.layers.Dense(3, name="state_head")(states[0])]
    model = keras.Model([source, target], heads)
    _randomize(model, seed=13)

    permuted, reports = permute(model, kicks=2, progress=False)

    _assert_same_function(model, permuted, [_x(3, 5, 8, seed=14), _x(3, 4, 8, seed=15)])
    by_consumer = {r.consumers: r for r in reports}
    for consumer, producer in (("enc", "p_enc"), ("dec", "p_dec")):
        space = by_consumer[(consumer,)]
        assert space.permuted and space.producers == (producer,)
        assert space.kept_after > space.kept_before
    assert not by_consumer[("state_head",)].permuted
    decoder_before, decoder_after = model.get_layer("dec").cell, permuted.get_layer("dec").cell
    np.testing.assert_array_equal(decoder_after.recurrent_kernel.numpy(),
                                  decoder_before.recurrent_kernel.numpy())


@pytest.mark.parametrize("recurrent", [
    lambda: keras.layers.GRU(8, name="gru"),
    lambda: keras.layers.Bidirectional(keras.layers.GRU(8), name="gru"),
], ids=["gru", "bidirectional_gru"])
def test_permute_reorders_an_embedding_table_for_a_masked_gru(recurrent):
    # A text classifier: the Embedding table's columns and the GRU kernel's rows (both
    # directions' in a Bidirectional) move together; the mask (from the token ids) does not change.
    inputs = keras.Input((7,), dtype="int32")
    x = keras.layers.Embedding(50, 16, mask_zero=True, name="embed")(inputs)
    x = recurrent()(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    _randomize(model, seed=5)

    permuted, reports = permute(model, kicks=2, progress=False)

    tokens = np.random.default_rng(3).integers(0, 50, size=(6, 7)).astype("int32")
    tokens[:, 4:] = 0  # padding, masked
    _assert_same_function(model, permuted, tokens)
    space = next(r for r in reports if r.consumers == ("gru",))
    assert space.permuted and space.producers == ("embed",) and space.kept_after > space.kept_before


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


def _assert_same_function(model, permuted, x):
    """`permuted` computes what `model` does (every output; float32 rounding relative to scale)."""
    before = keras.tree.flatten(model(x, training=False))
    after = keras.tree.flatten(permuted(x, training=False))
    assert len(before) == len(after)
    for a, b in zip(after, before):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(b).max()))


def _x(*shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def test_permute_sequential_with_a_reused_activation_skips_its_consumers():
    # One ReLU object used twice: its consumers' channels come from two different producers.
    relu = keras.layers.ReLU(name="relu")
    layers = keras.layers
    model = keras.Sequential([keras.Input((16,)), layers.Dense(16, name="d0"), relu,
                              layers.Dense(16, name="d1"), relu, layers.Dense(16, name="d2"),
                              layers.ReLU(), layers.Dense(4, name="d3")])
    _randomize(model, seed=6)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    by_consumer = {r.consumers: r for r in reports}
    for name in ("d1", "d2"):
        r = by_consumer[(name,)]
        assert not r.permuted and "'relu' (ReLU), which is shared (called 2 times)" in r.reason
    assert by_consumer[("d3",)].permuted and by_consumer[("d3",)].producer == "d2"


def test_permute_sequential_with_a_layer_used_twice_skips_it():
    a = keras.layers.Dense(16, name="a")
    model = keras.Sequential([keras.Input((16,)), a, keras.layers.Dense(16, name="b"), a,
                              keras.layers.Dense(4, name="c")])  # x -> a -> b -> a -> c
    _randomize(model, seed=7)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    assert not any(r.permuted for r in reports)
    reasons = {r.consumers: r.reason for r in reports}
    assert reasons[("a",)] == "'a' (Dense) is shared (called 2 times)"
    for consumer in ("b", "c"):
        assert reasons[(consumer,)] == (
            "its input channels come from 'a' (Dense), which is shared (called 2 times)")


def _chain(widths=(16, 32, 16, 4), names=("d0", "d1", "d2", "d3")):
    inputs = keras.Input((16,))
    x = inputs
    for width, name in zip(widths, names):
        x = keras.layers.Dense(width, name=name)(keras.layers.ReLU()(x) if name != "d0" else x)
    return keras.Model(inputs, x)


@pytest.mark.parametrize(
    "mode",
    ["lora", "int8", "int4", "float8"],
)
def test_permute_skips_quantized_and_lora_layers(mode):
    model = _chain()
    _randomize(model, seed=8)
    d1 = model.get_layer("d1")
    if mode == "lora":
        d1.enable_lora(4)
        d1.lora_kernel_b.assign(_x(4, 32, seed=9))  # adapters that change the kernel
    else:
        d1.quantize(mode)
    x = _x(8, 16)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, x)
    by_producer = {r.producer: r for r in reports}
    expected = f"'d1' (Dense) is quantized ({mode})"
    if mode == "lora":
        expected = "LoRA is enabled on 'd1' (Dense)"
    for producer in ("d0", "d1"):  # d1 consumes d0's channels and produces d2's
        assert not by_producer[producer].permuted and expected in by_producer[producer].reason
    assert by_producer["d2"].permuted


def test_permute_skips_groups_wider_than_max_channels():
    model = _chain()  # d0 -> 16 channels -> d1 -> 32 channels -> d2 -> 16 channels -> d3
    _randomize(model, seed=11)
    permuted, reports = permute(model, kicks=1, max_channels=16, progress=False)
    _assert_same_function(model, permuted, _x(8, 16))
    by_producer = {r.producer: r for r in reports}
    assert not by_producer["d1"].permuted
    assert "32 channels > max_channels=16" in by_producer["d1"].reason
    assert by_producer["d0"].permuted and by_producer["d2"].permuted


def test_permute_searches_wide_groups_in_blocks():
    model = _chain()  # d1 produces 32 channels for d2
    _randomize(model, seed=12)
    permuted, reports = permute(model, kicks=1, block_channels=8, progress=False)
    _assert_same_function(model, permuted, _x(8, 16))
    d1 = next(r for r in reports if r.producer == "d1")
    assert d1.permuted and d1.kept_after > d1.kept_before
    rows = model.get_layer("d2").kernel.numpy().T
    perm = search_permutation(rows, axis=1, kicks=1, block_channels=8)
    assert d1.kept_after == pytest.approx(kept_magnitude(rows, perm))  # the blocked search's
    assert d1.kept_after != pytest.approx(
        kept_magnitude(rows, search_permutation(rows, axis=1, kicks=1, block_channels=None)))


def test_permute_follows_elementwise_keras_ops():
    # Keras 3 Functional code written with operators and keras.ops instead of layers.
    ops = keras.ops
    inputs = keras.Input((6, 6, 8))
    x = keras.layers.Conv2D(16, 1, name="c0")(inputs)
    x = x * ops.relu6(x + 3.0) / 6.0  # hard-swish: one space through scalar ops and a product
    y = keras.layers.Conv2D(16, 1, name="c1")(ops.sigmoid(x) - 0.5)
    x = ops.softmax(x + ops.gelu(y), axis=-1)  # a residual add of two spaces, softmax on channels
    gate = keras.layers.Conv2D(1, 1, name="gate")(x)  # [..., 1]: broadcast over the channels
    x = ops.leaky_relu(x * ops.sigmoid(gate) + np.ones((6, 1), "float32"), negative_slope=0.2)
    z = keras.layers.Conv2D(8, 1, name="c2")(x)
    cat = ops.concatenate([ops.cast(x, "float32"), ops.square(z)], axis=-1)  # [16 | 8]
    outputs = keras.layers.Conv2D(4, 1, name="head")(cat)
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=21)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 6, 6, 8, seed=22))
    report_of = {c: r for r in reports for c in r.consumers}  # report of each consumer
    joined = report_of["c1"]
    assert joined.permuted and joined.producers == ("c0", "c1") and joined.channels == 16
    assert joined.consumers == ("c1", "gate", "c2", "head")
    assert [r.producers for r in reports if r.permuted and "head" in r.consumers] == [
        ("c0", "c1"), ("c2",)]  # c2's 8 channels sit at offset 16 of head's input
    assert [r.consumers for r in reports if not r.permuted] == [("c0",)]
    assert report_of["c0"].reason == "its input channels come from the model input"
    for name in ("c1", "gate", "c2", "head"):
        assert _kept_in_layer(permuted.get_layer(name)) >= _kept_in_layer(model.get_layer(name))


def test_permute_stops_at_keras_ops_that_do_not_commute_with_a_channel_order():
    ops = keras.ops
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="d0")(inputs)
    a = keras.layers.Dense(16, name="d1")(x + np.arange(16, dtype="float32"))  # per channel
    b = keras.layers.Dense(16, name="d2")(ops.flip(a, axis=-1))  # moves channels
    c = keras.layers.Dense(16, name="d3")(ops.cumsum(b, axis=-1))  # mixes channels
    d = keras.layers.Dense(16, name="d4")(ops.relu(c))  # elementwise: permuted
    outputs = keras.layers.Dense(4, name="d5")(d[:, :8])
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=10)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    reasons = {r.consumers: r.reason for r in reports if not r.permuted}
    # Keras numbers automatic op names per process ('add_16' after other tests' ops).
    assert re.search(r"'add(_\d+)?' \(keras op Add\), which cannot be permuted", reasons[("d1",)])
    assert "(keras op Flip), which cannot be permuted" in reasons[("d2",)]
    assert "(keras op Cumsum), which cannot be permuted" in reasons[("d3",)]
    assert "(keras op GetItem), which cannot be permuted" in reasons[("d5",)]
    assert [r.consumers for r in reports if r.permuted] == [("d4",)]


class _Scale(keras.layers.Layer):
    """ConvNeXt's LayerScale: x * gamma, gamma [C] (a layer permute() has no rule for)."""

    def build(self, shape):
        self.gamma = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.gamma


class _ScaledSum(keras.layers.Layer):
    """InceptionResNetV2's CustomScaleLayer: inputs[0] + inputs[1] * scale."""

    def __init__(self, scale=0.5, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}

    def call(self, inputs):
        return inputs[0] + inputs[1] * self.scale


class _ChannelMix(keras.layers.Layer):
    """Rolls the channels by one and scales them by a [C] vector: not channel by channel."""

    def build(self, shape):
        self.gamma = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return keras.ops.roll(x, 1, axis=-1) * self.gamma


def test_permute_tries_layers_it_has_no_rule_for():
    # ConvNeXt's block (grouped depthwise conv, LayerNorm, MLP, LayerScale, residual add) and a
    # CustomScaleLayer residual; a layer that mixes channels and GroupNormalization stop a space.
    inputs = keras.Input((6, 6, 8))
    stem = keras.layers.Conv2D(16, 1, name="stem")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", groups=16, name="dw")(stem)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    x = keras.layers.Dense(32, activation="gelu", name="pw1")(x)
    x = _Scale(name="scale")(keras.layers.Dense(16, name="pw2")(x))
    x = keras.layers.Add()([stem, x])
    branch = keras.layers.Conv2D(16, 1, name="branch")(x)
    x = _ScaledSum(name="scaled_sum")([x, branch])
    y = keras.layers.Conv2D(8, 1, name="mix_in")(x)
    z = keras.layers.Conv2D(8, 1, name="gn_in")(x)
    y = keras.layers.Conv2D(4, 1, name="after_mix")(_ChannelMix(name="mix")(y))
    z = keras.layers.Conv2D(4, 1, name="after_gn")(keras.layers.GroupNormalization(2)(z))
    model = keras.Model(inputs, keras.layers.Concatenate()([y, z]))
    _randomize(model, seed=31)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(4, 6, 6, 8, seed=32))
    report_of = {c: r for r in reports for c in r.consumers}  # report of each consumer
    stream = report_of["pw1"]  # stem -> dw -> ... -> scale -> add -> scaled_sum -> mix_in, gn_in
    assert stream.permuted and stream.producers == ("stem", "pw2", "branch")
    assert stream.consumers == ("pw1", "branch", "mix_in", "gn_in")
    assert not np.array_equal(permuted.get_layer("scale").gamma.numpy(),
                              model.get_layer("scale").gamma.numpy())
    assert "'mix' (_ChannelMix), which cannot be permuted" in report_of["after_mix"].reason
    assert "(GroupNormalization), which cannot be permuted" in report_of["after_gn"].reason


def test_permute_runs_through_nested_sequential_models():
    # ConvNeXt's stem Sequential([Conv2D, LayerNorm]) and downsampling Sequential([LayerNorm,
    # Conv2D]): spaces enter and leave them; a nested Sequential called twice stops a space.
    layers = keras.layers
    stem = keras.Sequential([layers.Conv2D(16, 2, strides=2, name="stem_conv"),
                             layers.LayerNormalization(name="stem_ln")], name="stem")
    down = keras.Sequential([layers.LayerNormalization(name="down_ln"),
                             layers.Conv2D(8, 2, strides=2, name="down_conv")], name="down")
    twice = keras.Sequential([layers.Dense(8, name="twice_dense")], name="twice")
    inputs = keras.Input((8, 8, 4))
    x = stem(inputs)
    x = layers.Add()([x, layers.Conv2D(16, 1, name="block")(x)])
    x = down(x)
    y = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(4, name="head")(twice(twice(y)))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=34)
    before = [w.copy() for w in model.get_weights()]

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 8, 8, 4, seed=35))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # the caller's model, nested ones included
    report_of = {c: r for r in reports for c in r.consumers}
    stream = report_of["block"]
    assert stream.permuted and stream.producers == ("stem/stem_conv", "block")
    assert stream.consumers == ("block", "down/down_conv")
    for name in ("stem", "down"):
        assert not all(np.array_equal(a, b) for a, b in zip(
            permuted.get_layer(name).get_weights(), model.get_layer(name).get_weights()))
    assert report_of["head"].reason == (
        "its input channels come from 'twice' (Sequential), which is shared (called 2 times)")
    with pytest.raises(ValueError, match=r"\['twice_dense'\] sit inside a nested model"):
        permute(model, layers="twice_dense", kicks=1, progress=False)
    assert permute(model, layers="down_conv", kicks=1, progress=False)[1][0].permuted


def test_permute_runs_through_a_nested_functional_base_model():
    # Transfer learning: a Functional base model (conv, BatchNorm, residual add) inside the model
    # being pruned; spaces inside it, across its boundary, and through a nested model with two
    # inputs.
    layers = keras.layers
    base_in = keras.Input((6, 6, 4))
    c0 = layers.Conv2D(16, 1, name="c0")(base_in)
    h = layers.ReLU()(layers.BatchNormalization(name="bn")(layers.Conv2D(8, 1, name="c1")(c0)))
    base_out = layers.Add()([c0, layers.Conv2D(16, 1, name="c2")(h)])
    base = keras.Model(base_in, base_out, name="base")
    a, b = keras.Input((16,)), keras.Input((16,))
    pair = keras.Model([a, b], layers.Add()([a, b]), name="pair")
    inputs = keras.Input((6, 6, 4))
    x = layers.GlobalAveragePooling2D()(base(inputs))
    y = layers.Dense(16, name="head0")(x)
    outputs = layers.Dense(4, name="head1")(pair([y, layers.Dense(16, name="side")(x)]))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=36)
    before = [w.copy() for w in model.get_weights()]

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 6, 6, 4, seed=37))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    report_of = {c: r for r in reports for c in r.consumers}
    stream = report_of["base/c1"]  # the residual stream crosses the base model's output
    assert stream.permuted and stream.producers == ("base/c0", "base/c2")
    assert stream.consumers == ("base/c1", "head0", "side")
    inner = report_of["base/c2"]
    assert inner.permuted and inner.producers == ("base/c1",)
    pair = report_of["head1"]  # through 'pair', whose add joins head0's and side's channels
    assert pair.permuted and pair.producers == ("head0", "side")
    assert not np.array_equal(permuted.get_layer("base").get_layer("bn").gamma.numpy(),
                              model.get_layer("base").get_layer("bn").gamma.numpy())
    only = permute(model, layers="base/c2", kicks=1, progress=False)[1]  # a name from a report
    assert [(r.consumers, r.permuted) for r in only] == [(("base/c2",), True)]


@keras.saving.register_keras_serializable(package="test_permute")
def _group_sort(x):
    """GroupSort (1-Lipschitz nets): sorts each pair of channels, so it mixes channels."""
    pairs = keras.ops.reshape(x, (-1, x.shape[-1] // 2, 2))
    return keras.ops.reshape(keras.ops.sort(pairs, axis=-1), keras.ops.shape(x))


class _SumAll(keras.layers.Layer):
    def call(self, xs):
        return sum(xs[1:], xs[0])


def test_permute_stops_where_channels_are_not_followed_one_to_one():
    # Each of these changed the function before: a custom activation (on a producer and in an
    # Activation layer), a constant among a concatenation's inputs, a constant in a layer's
    # list argument, and a layer inside two nested models (under two graph names).
    layers, ops = keras.layers, keras.ops
    shared = layers.Dense(8, name="shared")
    s1 = keras.Sequential([keras.Input((8,)), layers.Dense(8, name="s1_d"), shared], name="s1")
    s2 = keras.Sequential([keras.Input((8,)), layers.Dense(8, name="s2_d"), shared], name="s2")
    inputs = keras.Input((4, 4, 3))
    x = layers.Conv2D(8, 1, activation=_group_sort, name="sorted")(
        layers.Conv2D(8, 1, name="c0")(inputs))
    x = layers.Activation(_group_sort, name="act")(layers.Conv2D(8, 1, name="ca")(x))
    coords = np.random.default_rng(0).normal(size=(1, 4, 4, 4)).astype("float32")
    x = ops.concatenate([np.repeat(coords, 3, 0), layers.Conv2D(8, 1, name="cb")(x)], axis=-1)
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 1, name="cc")(x))
    x = layers.Dense(8, name="d0")(_SumAll(name="sum_all")([x, np.arange(8, dtype="float32")]))
    x = s2(layers.Dense(8, name="d1")(s1(layers.Dense(8, name="d2")(x))))
    model = keras.Model(inputs, layers.Dense(4, name="head")(x))
    _randomize(model, seed=38)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 4, 4, 3, seed=39))
    reasons = {c: r.reason for r in reports if not r.permuted for c in r.consumers}
    custom = "is not known to act channel by channel (a custom function)"
    assert reasons["ca"] == f"the activation of 'sorted' (Conv2D) {custom}"
    assert reasons["cb"] == f"the activation of 'act' (Activation) {custom}"
    assert re.fullmatch(r"its input channels come from 'concatenate(_\d+)?' \(keras op "
                        r"Concatenate\), which cannot be permuted", reasons["cc"])
    assert reasons["d0"] == "its input channels come from 'sum_all' (_SumAll), which cannot be permuted"
    assert reasons["d1"] == (
        "its input channels come from 's1/shared' (Dense), which is shared (also used inside a "
        "nested model)")
    assert reasons["head"].startswith("its input channels come from 's2/shared' (Dense)")
    assert {c for r in reports if r.permuted for c in r.consumers} == {
        "sorted", "d2", "s1/s1_d", "s2/s2_d"}


def test_permute_refuses_a_layer_whose_config_hands_over_its_own_variables():
    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.g = self.add_weight(shape=(shape[-1],), name="g")

        def call(self, x):
            return x * keras.ops.flip(self.g, 0)

    class Holder(keras.layers.Layer):  # get_config returns the layer object, not its config
        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner

        def get_config(self):
            return {**super().get_config(), "inner": self.inner}

        def call(self, x):
            return self.inner(x)

    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="d1")(keras.layers.Dense(8, name="d0")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(Holder(Scale(), name="holder")(x)))
    _randomize(model, seed=40)
    before = [w.copy() for w in model.get_weights()]
    for call in (lambda: permute(model, kicks=1, progress=False), lambda: prune(model)):
        with pytest.raises(TypeError, match=r"'holder' \(Holder\): the copy made from its "
                                            r"get_config\(\) holds the layer's own variables"):
            call()
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_permute_model_without_a_config_is_a_type_error_naming_it():
    inputs = keras.Input((8,))
    x = keras.ops.clip(keras.layers.Dense(8)(inputs), np.zeros(8), np.ones(8))  # arrays: no config
    model = keras.Model(inputs, keras.layers.Dense(4)(x), name="clipped")
    with pytest.raises(TypeError, match=r"graph of model 'clipped' from its config, and "
                                        r"get_config\(\) failed"):
        permute(model, kicks=1, progress=False)


def test_permute_stops_at_a_layer_with_several_outputs():
    inputs = keras.Input((5, 8))
    seq, state, _ = keras.layers.LSTM(16, return_sequences=True, return_state=True)(inputs)
    x = keras.layers.Dense(8, name="d1")(state)
    model = keras.Model(inputs, [keras.layers.Dense(4, name="d2")(x), seq])
    _randomize(model, seed=33)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 5, 8))
    report_of = {c: r for r in reports for c in r.consumers}
    assert re.fullmatch(r"its input channels come from 'lstm(_\d+)?' \(LSTM\), which has several "
                        r"outputs", report_of["d1"].reason)
    assert report_of["d2"].permuted


@pytest.mark.parametrize("structure", ["dict", "nested list"])
def test_permute_models_with_dict_and_nested_outputs(structure):
    inputs = keras.Input((16,))
    h = keras.layers.ReLU()(keras.layers.Dense(32, name="h")(inputs))
    a, b = keras.layers.Dense(8, name="a")(h), keras.layers.Dense(4, name="b")(h)
    model = keras.Model(inputs, {"a": a, "b": b} if structure == "dict" else [[a], b])
    _randomize(model, seed=11)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    assert [(r.producer, r.consumers) for r in reports if r.permuted] == [("h", ("a", "b"))]


def test_permute_copies_lambda_layers():
    inputs = keras.Input((16,))
    x = keras.layers.Lambda(lambda t: t / 4.0)(inputs)
    x = keras.layers.Dense(32, name="d0")(x)
    outputs = keras.layers.Dense(8, name="d1")(keras.layers.ReLU()(x))
    model = keras.Model(inputs, outputs)
    _randomize(model, seed=12)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    assert [r.consumers for r in reports if r.permuted] == [("d1",)]


def test_permute_copies_an_adapted_lookup():
    lookup = keras.layers.IntegerLookup()
    lookup.adapt(np.array([3, 7, 11, 42, 99]))
    inputs = keras.Input((5,), dtype="int64")
    x = keras.layers.Embedding(10, 16, name="embedding")(lookup(inputs))
    x = keras.layers.Dense(16, name="d0")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="d1")(x))
    _randomize(model, seed=13)
    x = np.array([[3, 7, 11, 42, 99], [99, 5, 3, 3, 0]], "int64")

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, x)
    assert [(r.producers, r.consumers) for r in reports if r.permuted] == [
        (("embedding",), ("d0",)), (("d0",), ("d1",))]  # the embedding table's columns too


def _normalized_chain(normalization, shape=(12,), seed=41):
    """Dense 'd0' -> `normalization` (adapted here unless given constants) -> Dense 'd1'."""
    rng = np.random.default_rng(seed)
    inputs = keras.Input(shape)
    h = keras.layers.Dense(16, name="d0", bias_initializer="random_normal")(inputs)
    if normalization.input_mean is None:  # per-channel statistics far from 0 and 1, all distinct
        data = rng.normal(size=(64, *shape[:-1], 16)) * rng.uniform(0.2, 5.0, 16) + np.arange(16)
        normalization.adapt(data.astype("float32"))
    model = keras.Model(inputs, keras.layers.Dense(8, name="d1")(normalization(h)))
    return model, _x(8, *shape, seed=seed + 1)


def test_permute_reorders_an_adapted_normalizations_statistics():
    # Keras computes from tensors that finalize_state() makes from the mean/variance weights.
    model, x = _normalized_chain(keras.layers.Normalization(name="norm"))
    expected = _outputs(model, x)
    kernels = {n: model.get_layer(n).kernel.numpy() for n in ("d0", "d1")}
    bias, (mean, variance, _) = model.get_layer("d0").bias.numpy(), model.get_layer(
        "norm").get_weights()

    permuted, reports = permute(model, kicks=1, progress=False)

    np.testing.assert_allclose(_outputs(permuted, x), expected, rtol=1e-5, atol=1e-5)
    (report,) = [r for r in reports if r.consumers == ("d1",)]
    assert report.permuted and report.producers == ("d0",)
    assert report.kept_after > report.kept_before
    # The order applied, read off d1's kernel rows: d0's columns and the statistics moved alike.
    d1 = permuted.get_layer("d1").kernel.numpy()
    perm = np.array([np.flatnonzero((kernels["d1"] == row).all(axis=1))[0] for row in d1])
    assert sorted(perm) == list(range(16)) and (perm != np.arange(16)).any()
    np.testing.assert_array_equal(d1, kernels["d1"][perm])
    np.testing.assert_array_equal(permuted.get_layer("d0").kernel.numpy(), kernels["d0"][:, perm])
    np.testing.assert_array_equal(permuted.get_layer("d0").bias.numpy(), bias[perm])
    norm = permuted.get_layer("norm")
    new_mean, new_variance, _ = norm.get_weights()
    np.testing.assert_array_equal(new_mean, mean[perm])
    np.testing.assert_array_equal(new_variance, variance[perm])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(norm.mean).ravel(), mean[perm])
    np.testing.assert_array_equal(model.get_layer("norm").get_weights()[0], mean)  # untouched


def test_permute_normalizations_it_cannot_reorder_stop_the_space():
    # Per-channel constants are no weights to reorder; statistics over another axis (as long as
    # the channels here) do not follow the channels.
    for normalization, shape, why in [
        (keras.layers.Normalization(mean=np.arange(16.0), variance=np.arange(1.0, 17.0),
                                    name="norm"), (12,), "constants given to its constructor"),
        (keras.layers.Normalization(axis=1, name="norm"), (16, 12), "cannot be permuted"),
    ]:
        model, x = _normalized_chain(normalization, shape)
        weights = model.get_layer("norm").get_weights()

        permuted, reports = permute(model, kicks=1, progress=False)

        _assert_same_function(model, permuted, x)
        (report,) = [r for r in reports if r.consumers == ("d1",)]
        assert not report.permuted and "'norm' (Normalization)" in report.reason
        assert why in report.reason
        for before, after in zip(weights, permuted.get_layer("norm").get_weights()):
            np.testing.assert_array_equal(before, after)
    # Scalar constants treat every channel alike: the space goes through.
    model, x = _normalized_chain(keras.layers.Normalization(mean=3.0, variance=2.0))
    permuted, reports = permute(model, kicks=1, progress=False)
    _assert_same_function(model, permuted, x)
    assert [r.consumers for r in reports if r.permuted] == [("d1",)]


def test_permute_skips_a_layer_shared_with_a_nested_model():
    shared = keras.layers.Dense(16, name="s")
    inner_inputs = keras.Input((16,))
    inner = keras.Model(inner_inputs, shared(inner_inputs), name="inner")
    inputs = keras.Input((8,))
    x = shared(keras.layers.Dense(16, name="d0")(inputs))
    x = inner(keras.layers.Dense(16, name="d1")(x))
    x = keras.layers.Dense(16, name="d2")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="d3")(x))
    _randomize(model, seed=14)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 8))
    reasons = {r.consumers: r.reason for r in reports if not r.permuted}
    assert reasons[("s",)] == "'s' (Dense) is shared (also used inside a nested model)"
    assert reasons[("d1",)] == (
        "its input channels come from 's' (Dense), which is shared (also used inside a nested "
        "model)")
    assert "'inner' (Functional), which cannot be permuted" in reasons[("d2",)]
    assert [(r.producer, r.consumers) for r in reports if r.permuted] == [("d2", ("d3",))]


@pytest.mark.parametrize("which", ["name", "object", "class"])
def test_permute_layers_accepts_one_name_layer_objects_and_classes(which):
    model = _chain()
    _randomize(model, seed=15)
    selector = {"name": "d2", "object": [model.get_layer("d2")],
                "class": keras.layers.Dense}[which]

    permuted, reports = permute(model, layers=selector, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(8, 16))
    searched = [r.consumers for r in reports]
    assert searched == ([("d0",), ("d1",), ("d2",), ("d3",)] if which == "class" else [("d2",)])
    with pytest.raises(ValueError, match=r"no layer named \['nope'\]"):
        permute(model, layers="nope")
    with pytest.raises(ValueError, match=r"layers: \[\] selects no layer"):
        permute(model, layers=[])


def test_permute_nan_kernel_error_names_the_layer():
    model = _chain()
    kernel = model.get_layer("d2").kernel
    kernel.assign(np.where(np.arange(kernel.shape[0])[:, None] == 3, np.nan, kernel.numpy()))
    with pytest.raises(ValueError, match="layer 'd2'.*NaN/Inf"):
        permute(model, kicks=1, progress=False)


def test_permute_layers_inside_a_nested_model_are_an_error_not_a_silent_no_op():
    inner_in = keras.Input((16,))
    inner = keras.Model(inner_in, keras.layers.Dense(16, name="inner_b")(inner_in), name="inner")
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(inner(inner(inp))))  # shared
    with pytest.raises(ValueError, match=r"\['inner_b'\] sit inside a nested model"):
        permute(model, layers="inner_b", kicks=1, progress=False)


class _PositionTable(keras.layers.Layer):
    """x + a learned [length, C] table (keras_hub's PositionEmbedding, added in)."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + self.table


class _SineTable(keras.layers.Layer):
    """x + a fixed sinusoid [length, C] (SinePositionEncoding, added in): no weights, but the
    channels are not treated alike."""

    def call(self, x):
        length, channels = x.shape[1], x.shape[2]
        angles = np.arange(length)[:, None] / 10.0 ** (np.arange(channels)[None] / channels)
        return x + np.sin(angles).astype("float32")


def _transformer_block(x, context, name):
    """Self-attention (value also the key), cross-attention on `context`, an EinsumDense FFN with
    unusual kernel layouts; residual adds as keras ops and as an Add layer; LayerNorms."""
    attended = keras.layers.MultiHeadAttention(2, 8, name=f"{name}_self")(x, x)
    x = keras.layers.LayerNormalization(name=f"{name}_ln1")(x + attended)
    crossed = keras.layers.MultiHeadAttention(2, 4, value_dim=8, name=f"{name}_cross")(
        query=x, value=context, key=context)
    x = keras.layers.LayerNormalization(name=f"{name}_ln2")(keras.layers.Add()([x, crossed]))
    h = keras.layers.EinsumDense("abc,dc->abd", (None, 32), bias_axes="d", activation="gelu",
                                 name=f"{name}_ffn1")(x)  # kernel [32, 16]: reads axis 1
    h = keras.layers.EinsumDense("abd,dc->abc", (None, 16), bias_axes="c", name=f"{name}_ffn2")(h)
    return keras.layers.LayerNormalization(name=f"{name}_ln3")(x + h)


def test_permute_follows_a_transformers_residual_stream():
    # Embedding + learned positions -> blocks of self/cross attention and FFN -> pooled logits:
    # one residual stream whose producers are the embedding table, both attentions' output
    # projections and the FFN's second layer, read by the attention projections, the FFN and
    # the classifier; the context stream (read as cross-attention value and key) is another.
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    context = keras.Input((5, 12), name="context")
    x = _PositionTable(name="pos")(keras.layers.Embedding(50, 16, name="embed")(tokens))
    memory = keras.layers.Dense(16, name="memory")(context)
    x = _transformer_block(x, memory, "b0")
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model([tokens, context], keras.layers.Dense(4, name="logits")(x))
    _randomize(model, seed=41)
    data = [np.random.default_rng(42).integers(0, 50, (8, 6)), _x(8, 5, 12, seed=43)]

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, data)
    spaces = {r.producers: r for r in reports}
    stream = spaces[("embed", "b0_self", "b0_cross", "b0_ffn2")]
    assert stream.permuted and stream.channels == 16 and stream.gain_percent > 0
    assert stream.consumers == ("b0_self", "b0_cross", "b0_ffn1", "logits")
    assert spaces[("memory",)].permuted and spaces[("memory",)].consumers == ("b0_cross",)
    assert spaces[("b0_ffn1",)].permuted and spaces[("b0_ffn1",)].consumers == ("b0_ffn2",)
    # Every weight on the stream moved: the table, the projections reading and writing it.
    old, new = model.get_layer("b0_self"), permuted.get_layer("b0_self")
    for dense in ("query_dense", "key_dense", "value_dense", "output_dense"):
        assert not np.array_equal(getattr(new, dense).kernel.numpy(),
                                  getattr(old, dense).kernel.numpy()), dense
    assert not np.array_equal(permuted.get_layer("pos").table.numpy(),
                              model.get_layer("pos").table.numpy())
    cross_old, cross_new = model.get_layer("b0_cross"), permuted.get_layer("b0_cross")
    for dense in ("key_dense", "value_dense"):  # read the memory space, not the stream
        assert not np.array_equal(getattr(cross_new, dense).kernel.numpy(),
                                  getattr(cross_old, dense).kernel.numpy()), dense


def test_permute_stops_a_transformer_stream_where_channels_are_not_followed():
    # A fixed sinusoid added to the embedding treats channels differently (the trial run fails);
    # a gate read as an attention mask reaches no kernel; a LoRA-enabled embedding table is not a
    # plain array. Each stops its space; the model still computes the same function.
    tokens = keras.Input((8,), dtype="int32")
    x = _SineTable(name="sine")(keras.layers.Embedding(50, 16, name="embed")(tokens))
    y = keras.layers.Embedding(50, 16, name="lora_embed")(tokens)
    gate = keras.layers.Dense(8, name="gate")(y)
    attended = keras.layers.MultiHeadAttention(2, 8, name="mha")(
        x, x, attention_mask=keras.ops.greater(gate, 0.0))
    x = keras.layers.Dense(16, name="after_sine")(x)
    z = keras.layers.Dense(16, name="after_lora")(y)
    g = keras.layers.Dense(4, name="after_gate")(gate)
    pooled = [keras.layers.GlobalAveragePooling1D()(t) for t in (x, attended, z, g)]
    model = keras.Model(tokens, keras.layers.Concatenate()(pooled))
    _randomize(model, seed=44)
    model.get_layer("lora_embed").enable_lora(2)
    model.get_layer("lora_embed").lora_embeddings_b.assign(_x(2, 16, seed=45))
    data = np.random.default_rng(46).integers(0, 50, (4, 8))

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, data)
    report_of = {c: r for r in reports for c in r.consumers}
    assert "'sine' (_SineTable), which cannot be permuted" in report_of["after_sine"].reason
    assert report_of["after_gate"].reason == (
        "channels reach 'mha' (MultiHeadAttention) as an input that no kernel of it reads")
    assert "LoRA is enabled on 'lora_embed' (Embedding)" in report_of["after_lora"].reason


def test_permute_reorders_value_channels_within_each_attention_head():
    # A MultiHeadAttention called twice on model inputs (no channel space between layers to
    # permute): its value heads are still reordered, each within its own head; value_dim 6 is
    # reported and left alone.
    query, value = keras.Input((5, 12)), keras.Input((7, 12))
    mha = keras.layers.MultiHeadAttention(3, 4, value_dim=8, name="mha")
    odd = keras.layers.MultiHeadAttention(2, 4, value_dim=6, name="odd")
    outputs = [mha(query, value), mha(value, query), odd(query, value)]
    model = keras.Model([query, value], outputs)
    _randomize(model, seed=47)

    permuted, reports = permute(model, kicks=2, progress=False)

    _assert_same_function(model, permuted, [_x(4, 5, 12, seed=48), _x(4, 7, 12, seed=49)])
    by_layer = {r.producer: r for r in reports if r.heads}
    assert by_layer["mha"].permuted and by_layer["mha"].heads == 3
    assert by_layer["mha"].channels == 8 and by_layer["mha"].gain_percent > 0
    assert by_layer["odd"].reason == "value_dim 6, not a multiple of 4"
    old, new = model.get_layer("mha"), permuted.get_layer("mha")
    kernel_old, kernel_new = old.value_dense.kernel.numpy(), new.value_dense.kernel.numpy()
    assert not np.array_equal(kernel_old, kernel_new)
    for h in range(3):  # the same columns, reordered within the head
        columns = sorted(map(tuple, kernel_old[:, h, :].T.round(6)))
        assert sorted(map(tuple, kernel_new[:, h, :].T.round(6))) == columns
    kept = sum(kept_magnitude(channel_matrix(head, 0)) for head in new.output_dense.kernel.numpy())
    assert kept == pytest.approx(by_layer["mha"].kept_after, rel=1e-6)


@keras.saving.register_keras_serializable(package="test_permute")
class _EncoderBlock(keras.layers.Layer):
    """A transformer block as a custom layer with its own build(): permute() follows its call
    and reaches the attention layer inside."""

    def __init__(self, heads=2, key_dim=8, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.key_dim = heads, key_dim
        self.attention = keras.layers.MultiHeadAttention(heads, key_dim)  # automatic name
        self.norm = keras.layers.LayerNormalization()

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "key_dim": self.key_dim}

    def build(self, shape):
        self.attention.build(shape, shape)
        self.norm.build(shape)

    def call(self, x):
        return self.norm(x + self.attention(x, x))


def test_permute_reorders_value_heads_of_attention_inside_custom_layers():
    inputs = keras.Input((5, 16))
    block = _EncoderBlock(name="block")
    x = _EncoderBlock(name="other")(block(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    _randomize(model, seed=50)
    inner = block.attention.name

    permuted, reports = permute(model, kicks=2, progress=False, layers=[inner, "head"])

    _assert_same_function(model, permuted, _x(3, 5, 16, seed=51))
    assert [(r.producer, r.heads, r.permuted) for r in reports if r.heads] == [
        (f"block/{inner}", 2, True)]  # `layers=` names the attention inside 'block' only
    copy = next(layer for layer in permuted.layers if layer.name == "block").attention
    assert not np.array_equal(copy.value_dense.kernel.numpy(),
                              block.attention.value_dense.kernel.numpy())

    _, reports = permute(model, kicks=2, progress=False)
    assert sorted(r.producer for r in reports if r.heads and r.permuted) == sorted(
        [f"block/{inner}", f"other/{model.get_layer('other').attention.name}"])


class _NamelessTable(keras.layers.Layer):
    """A learned position table added in, whose get_config() leaves out the layer's name (so its
    copy is named anew): permute() must still find the copy to reorder its table."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")

    def get_config(self):
        return {}

    def call(self, x):
        return x + self.table


class _NamelessBlock(_EncoderBlock):
    def get_config(self):
        return {"heads": self.heads, "key_dim": self.key_dim}


def test_permute_finds_the_copies_of_layers_whose_config_has_no_name():
    tokens = keras.Input((6,), dtype="int32")
    x = _NamelessTable(name="pos")(keras.layers.Embedding(20, 16, name="embed")(tokens))
    x = _NamelessBlock(name="block")(keras.layers.Dense(16, name="d0")(x))
    model = keras.Model(tokens, keras.layers.Dense(4, name="d1")(keras.layers.Dense(16)(x)))
    _randomize(model, seed=52)
    data = np.random.default_rng(53).integers(0, 20, (4, 6))

    for _ in range(2):  # the second copy's automatic names differ from the first's
        permuted, reports = permute(model, kicks=1, progress=False)

        _assert_same_function(model, permuted, data)
        assert {r.producers: r for r in reports}[("embed",)].permuted  # through 'pos' to d0
        assert [r.permuted for r in reports if r.heads] == [True]  # inside 'block'
        assert not np.array_equal(permuted.layers[2].table.numpy(),
                                  model.get_layer("pos").table.numpy())


class Embedding(keras.layers.Embedding):  # a user's class named like Keras' own
    """Adds a fixed per-channel pattern to the lookup: not a plain table."""

    def call(self, ids):
        return super().call(ids) + np.arange(self.output_dim, dtype="float32") / 4.0


class MultiHeadAttention(keras.layers.Layer):
    """A tutorial-style attention layer with the Keras class's name and none of its attributes."""

    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.wq, self.wv = keras.layers.Dense(width), keras.layers.Dense(width)

    def get_config(self):
        return {**super().get_config(), "width": self.width}

    def build(self, query_shape, value_shape):
        self.wq.build(query_shape)
        self.wv.build(value_shape)

    def call(self, query, value):
        scores = keras.ops.softmax(keras.ops.einsum("btc,bsc->bts", self.wq(query), value))
        return keras.ops.einsum("bts,bsc->btc", scores, self.wv(value))


def test_permute_applies_keras_rules_to_keras_classes_only():
    # User classes named Embedding and MultiHeadAttention are neither producers nor consumers:
    # the Embedding subclass adds a per-channel pattern, the attention has other weights.
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Dense(16, name="d0")(Embedding(20, 16, name="embed")(tokens))
    x = MultiHeadAttention(name="mha")(x, x)
    model = keras.Model(tokens, keras.layers.Dense(4)(keras.layers.Dense(16, name="d1")(x)))
    _randomize(model, seed=54)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, np.random.default_rng(55).integers(0, 20, (4, 6)))
    report_of = {c: r for r in reports for c in r.consumers}
    assert "'embed' (Embedding), which cannot be permuted" in report_of["d0"].reason
    # Its call is followed (a custom layer): the channels stop at its first einsum.
    assert re.search(r"'mha/einsum\w*' \(keras op Einsum\), which combines several inputs",
                     report_of["d1"].reason)
    assert not any(r.heads for r in reports)


def test_permute_layers_selects_attention_heads_inside_a_selected_layer():
    inputs = keras.Input((5, 16))
    x = _EncoderBlock(name="other")(_EncoderBlock(name="block")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    _randomize(model, seed=56)
    inner = model.get_layer("block").attention.name

    both = sorted([f"block/{inner}", f"other/{model.get_layer('other').attention.name}"])
    for selector in ("block", f"block/{inner}", _EncoderBlock):
        _, reports = permute(model, kicks=1, progress=False, layers=selector)
        heads = sorted(r.producer for r in reports if r.heads)
        assert heads == (both if selector is _EncoderBlock else [f"block/{inner}"]), selector


@pytest.mark.parametrize("use_gate", [False, True])
def test_permute_follows_group_query_attention(use_gate):
    # 4 query heads share 2 value heads: value head j's channels are read at query heads 2j and
    # 2j + 1 of the output projection (and of the gate, which multiplies them).
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(30, 16, name="embed")(tokens)
    attended = keras.layers.GroupQueryAttention(8, 4, 2, use_gate=use_gate, name="gqa")(x, x)
    x = keras.layers.RMSNormalization(name="norm")(x + attended)  # Llama-style
    x = x + keras.layers.Dense(16, name="ffn2")(keras.layers.Dense(32, name="ffn1")(x))
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="logits")(x))
    _randomize(model, seed=57)

    permuted, reports = permute(model, kicks=2, progress=False)

    _assert_same_function(model, permuted, np.random.default_rng(58).integers(0, 30, (4, 6)))
    stream = {r.producers: r for r in reports}[("embed", "gqa", "ffn2")]
    assert stream.permuted and stream.consumers == ("gqa", "ffn1", "logits")
    (heads,) = [r for r in reports if r.heads]
    assert heads.permuted and heads.heads == 2 and heads.channels == 8 and heads.gain_percent > 0
    assert not np.array_equal(permuted.get_layer("norm").scale.numpy(),
                              model.get_layer("norm").scale.numpy())
    old = model.get_layer("gqa")._value_dense.kernel.numpy()
    assert not np.array_equal(permuted.get_layer("gqa")._value_dense.kernel.numpy(), old)


@keras.saving.register_keras_serializable(package="test_permute")
class _Encoder(keras.layers.Layer):
    """Blocks in a list, each holding an attention layer of the same name."""

    def __init__(self, depth=3, **kwargs):
        super().__init__(**kwargs)
        self.depth = depth
        self.blocks = [_NamedBlock(name=f"block_{i}") for i in range(depth)]

    def get_config(self):
        return {**super().get_config(), "depth": self.depth}

    def build(self, shape):
        for block in self.blocks:
            block.build(shape)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@keras.saving.register_keras_serializable(package="test_permute")
class _NamedBlock(_EncoderBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 8, name="self_attention")


def test_permute_names_attention_layers_by_their_whole_path_and_selects_by_it():
    inputs = keras.Input((5, 16))
    x = _Encoder(name="encoder")(inputs)
    inner_inputs = keras.Input((5, 16))
    inner = keras.Model(inner_inputs, keras.layers.Dense(16, name="inner_d")(
        keras.layers.MultiHeadAttention(2, 8, name="inner_mha")(inner_inputs, inner_inputs)),
        name="inner")
    x = keras.layers.Dense(16, name="d0")(inner(keras.layers.Dense(16, name="d_in")(x)))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d1")(x))
    _randomize(model, seed=59)
    data = _x(3, 5, 16, seed=60)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, data)
    assert sorted(r.producer for r in reports if r.heads and r.permuted) == [
        "encoder/block_0/self_attention", "encoder/block_1/self_attention",
        "encoder/block_2/self_attention", "inner/inner_mha"]
    for selector in ("encoder/block_1/self_attention", "block_1"):
        permuted, reports = permute(model, kicks=1, progress=False, layers=selector)
        assert [r.producer for r in reports if r.heads] == ["encoder/block_1/self_attention"]
        blocks = [(old, new) for old, new in zip(model.get_layer("encoder").blocks,
                                                 permuted.get_layer("encoder").blocks)]
        changed = [not np.array_equal(old.attention.value_dense.kernel.numpy(),
                                      new.attention.value_dense.kernel.numpy())
                   for old, new in blocks]
        assert changed == [False, True, False], selector
    # A nested model the graph runs through, by name or object: its consumers and heads.
    for selector in ("inner", inner):
        _, reports = permute(model, kicks=1, progress=False, layers=selector)
        assert sorted(c for r in reports if r.permuted for c in r.consumers) == [
            "inner/inner_d", "inner/inner_mha", "inner/inner_mha"]


def test_permute_follows_the_residual_stream_through_a_custom_transformer_block():
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(20, 16, name="embed")(tokens)
    x = TransformerBlock(16, 2, 32, name="block")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(
        keras.layers.Dense(16, activation="relu", name="fc")(x)))
    _randomize(model, seed=60)
    block = model.get_layer("block")
    nodes = [(len(layer._inbound_nodes), len(layer._outbound_nodes))
             for layer in walk_layers(model)]
    weights = [w.copy() for w in model.get_weights()]

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, np.random.default_rng(61).integers(0, 20, (4, 6)))
    by_producers = {r.producers: r for r in reports if r.permuted and not r.heads}
    ffn = [f"block/{block.ffn.name}/{layer.name}" for layer in block.ffn.layers]
    stream = by_producers[("embed", f"block/{block.att.name}", ffn[1])]
    assert stream.consumers == (f"block/{block.att.name}", ffn[0], "fc")
    assert by_producers[(ffn[0],)].consumers == (ffn[1],)  # the feed-forward hidden channels
    assert [r.permuted for r in reports if r.heads] == [True]
    copy = permuted.get_layer("block")
    assert not np.array_equal(copy.ffn.layers[0].kernel.numpy(), block.ffn.layers[0].kernel)
    # The caller's model is as it was: weights, and the Keras nodes the trace recorded.
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    assert nodes == [(len(layer._inbound_nodes), len(layer._outbound_nodes))
                     for layer in walk_layers(model)]


class _TrainingOnlyBranch(keras.layers.Layer):
    """Runs a Dense on the stream only when training: following its inference call alone would
    leave that Dense's kernel in the old channel order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16)
        self.extra = keras.layers.Dense(16)

    def call(self, x, training=None):
        y = self.proj(x)
        return y + self.extra(x) if training else y


class _OwnScale(keras.layers.Layer):
    """Holds a Dense and a weight of its own, which its call uses on the channels."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16)

    def build(self, shape):
        self.proj.build(shape)
        self.scale = self.add_weight(shape=(16,), initializer="ones")

    def call(self, x):
        return self.proj(x) * self.scale


class _Masked(keras.layers.Layer):
    """Takes a Keras mask: Keras passes one that the symbolic call would not."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16)

    def call(self, x, mask=None):
        return self.proj(x)


class _NotSymbolic(keras.layers.Layer):
    """Calls a TensorFlow function on its input, which a Keras symbolic tensor cannot enter."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16)

    def call(self, x):
        return self.proj(tf.math.cumsum(x, axis=1))


class _TiedDecoder(keras.layers.Layer):
    """Decodes with its encoder's kernel, read directly (tied weights): the trace holds it as a
    constant, so the channels it reorders would go unseen."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.enc = keras.layers.Dense(8)

    def call(self, x):
        z = keras.ops.relu(self.enc(x))
        return keras.ops.matmul(z, keras.ops.transpose(self.enc.kernel))


class _TrainingFlip(_TrainingOnlyBranch):
    """Runs the same layers in both modes, but reverses the channels only when training."""

    def call(self, x, training=None):
        y = self.proj(x)
        return self.extra(keras.ops.flip(y, axis=-1) if training else y)


@pytest.mark.parametrize("make, why", [
    (_TrainingOnlyBranch, "it computes otherwise when training"),
    (_TrainingFlip, "it computes otherwise when training"),
    (_TiedDecoder, "its call reads the weights"),
    (_OwnScale, "it has weights of its own"),
    (_Masked, "its call takes a Keras mask"),
    (_NotSymbolic, "its call could not be followed"),
])
def test_permute_names_why_a_custom_layers_call_is_not_followed(make, why):
    inputs = keras.Input((5, 16))
    h = keras.layers.Dense(16, name="d0")(inputs)
    x = keras.layers.Add()([h, make(name="block")(h)])  # its input and output: one space
    model = keras.Model(inputs, keras.layers.Dense(4, name="d1")(x))
    x = _x(3, 5, 16, seed=63)
    model(x, training=True)  # builds a layer run only when training
    _randomize(model, seed=62)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, x)
    np.testing.assert_allclose(permuted(x, training=True), model(x, training=True),
                               rtol=1e-5, atol=1e-5)
    (report,) = [r for r in reports if r.consumers == ("d1",)]
    assert not report.permuted
    assert f"'block' ({make.__name__}), which cannot be permuted ({why}" in report.reason


class _CrossBlock(keras.layers.Layer):
    """Two streams in: `x` attends to `context` (Keras' examples' decoder blocks)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cross = keras.layers.MultiHeadAttention(2, 8, name="cross")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x, context):
        return self.norm(x + self.cross(x, context))


def test_permute_follows_each_tensor_input_of_a_custom_layer_to_its_own_space():
    x_in, c_in = keras.Input((5, 16)), keras.Input((7, 12))
    x = keras.layers.Dense(16, name="dx")(x_in)
    context = keras.layers.Dense(12, name="dc")(c_in)
    h = _CrossBlock(name="block")(x, context)
    model = keras.Model([x_in, c_in], keras.layers.Dense(4, name="out")(
        keras.layers.Dense(16, name="fc")(h)))
    _randomize(model, seed=64)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, [_x(3, 5, 16, seed=65), _x(3, 7, 12, seed=66)])
    spaces = {r.producers: (r.consumers, r.channels) for r in reports if r.permuted}
    assert spaces[("dx", "block/cross")] == (("block/cross", "fc"), 16)  # query and residual
    assert spaces[("dc",)] == (("block/cross",), 12)  # key and value


class _MixedEmbedding(TokenAndPositionEmbedding):
    """Mixes the channels after the lookup (weights [C, C]): its output channels do not follow
    its weights' order."""

    def build(self, shape):
        self.token_emb.build(shape)
        self.pos_emb.build(shape)
        self.mix = self.add_weight(shape=(self.token_emb.output_dim,) * 2)

    def call(self, x):
        return keras.ops.matmul(super().call(x), self.mix)


def test_permute_finds_by_a_trial_run_a_custom_layer_that_produces_channels_from_its_tables():
    def model_of(embedding):
        tokens = keras.Input((6,), dtype="int32")
        x = TransformerBlock(16, 2, 32, name="block")(embedding(tokens))
        return keras.Model(tokens, keras.layers.Dense(4, name="out")(
            keras.layers.GlobalAveragePooling1D()(x)))

    data = np.random.default_rng(71).integers(0, 20, (4, 6))
    for embedding, producer in ((TokenAndPositionEmbedding(6, 20, 16, name="embed"), True),
                                (_MixedEmbedding(6, 20, 16, name="embed"), False)):
        model = model_of(embedding)
        _randomize(model, seed=70)

        permuted, reports = permute(model, kicks=1, progress=False)

        _assert_same_function(model, permuted, data)
        (stream,) = [r for r in reports if "out" in r.consumers]
        assert stream.permuted == producer, stream.reason
        if producer:  # both tables' columns reordered, alike
            assert stream.producers[0] == "embed"
            copy, original = permuted.get_layer("embed"), model.get_layer("embed")
            order = [np.flatnonzero((original.token_emb.embeddings.numpy()[:, [c]] ==
                                     copy.token_emb.embeddings.numpy()).all(0))[0]
                     for c in range(16)]
            assert sorted(order) == list(range(16)) and order != list(range(16))
            np.testing.assert_array_equal(copy.pos_emb.embeddings.numpy()[:, order],
                                          original.pos_emb.embeddings.numpy())
        else:
            assert "'embed' (_MixedEmbedding), which cannot be permuted" in stream.reason


@keras.saving.register_keras_serializable(package="test_permute")
def _quick_gelu(x):
    """A custom elementwise activation (CLIP's): not a Keras built-in, passes the trial run."""
    return x * keras.ops.sigmoid(1.702 * x)


def test_permute_follows_a_custom_activation_that_acts_channel_by_channel():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, activation=_quick_gelu, name="d0")(inputs)
    x = keras.layers.Activation(_quick_gelu, name="act")(keras.layers.Dense(16, name="d1")(x))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(x))
    _randomize(model, seed=72)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(5, 16, seed=73))
    assert [r.producers for r in reports if r.permuted] == [("d0",), ("d1",)]


@pytest.mark.parametrize("tie_weights", [True, False])
def test_permute_takes_a_reversible_embedding_as_a_producer_when_it_is_one(tie_weights):
    # Keras' ReversibleEmbedding has no rule here: the trial run finds that reordering its table's
    # columns reorders its output. Untied, its reverse kernel [C, vocab] fails the run's shape rule.
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.ReversibleEmbedding(20, 16, tie_weights=tie_weights, name="embed")(tokens)
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(keras.layers.Dense(16)(x)))
    _randomize(model, seed=74)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, np.random.default_rng(75).integers(0, 20, (4, 6)))
    (stream,) = [r for r in reports if r.producers == ("embed",) or "'embed'" in r.reason]
    assert stream.permuted == tie_weights


class _CausalBlock(keras.layers.Layer):
    """Builds a [length, length] mask from its input's shape, which a symbolic input of unknown
    length cannot give: followed with the lengths set (as keras_hub's decoders need)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16, name="proj")

    def call(self, x):
        length = keras.ops.shape(x)[1]
        causal = keras.ops.tril(keras.ops.ones((length, length)))
        return self.proj(keras.ops.einsum("st,btc->bsc", causal, x))


def test_permute_follows_a_custom_layer_that_needs_known_lengths():
    inputs = keras.Input((None, 16))
    x = keras.layers.Dense(16, name="d0")(inputs)
    x = keras.layers.Dense(16, name="d1")(_CausalBlock(name="block")(x))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(x))
    _randomize(model, seed=76)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(2, 7, 16, seed=77))
    spaces = {r.producers: r.consumers for r in reports if r.permuted}
    assert spaces == {("block/proj",): ("d1",), ("d1",): ("d2",)}
    (stopped,) = [r.reason for r in reports if r.consumers == ("block/proj",)]
    assert re.search(r"'block/einsum(_\d+)?' \(keras op Einsum\)", stopped)  # mixes over time


class _LengthBranch(keras.layers.Layer):
    """Reverses the channels for inputs longer than 8: a trace at an unknown length sees one
    branch, a call another."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1, self.d2 = keras.layers.Dense(16), keras.layers.Dense(16)

    def call(self, x):
        h = self.d1(x)
        if x.shape[1] is not None and x.shape[1] > 8:
            h = keras.ops.flip(h, axis=-1)
        return self.d2(h)


class _EagerOnly(_LengthBranch):
    """Reverses the channels except when called on a Keras symbolic tensor, which only permute's
    trace does: no check on the trace can see it, the final comparison does."""

    def call(self, x):
        h = self.d1(x)
        return self.d2(h if isinstance(x, keras.KerasTensor) else keras.ops.flip(h, axis=-1))


def test_permute_does_not_follow_a_call_that_branches_on_its_input_length():
    inputs = keras.Input((None, 16))
    x = _LengthBranch(name="block")(keras.layers.Dense(16, name="pre")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="post")(x))
    _randomize(model, seed=78)

    permuted, reports = permute(model, kicks=1, progress=False)

    for length in (5, 12):
        _assert_same_function(model, permuted, _x(2, length, 16, seed=79))
    assert "(it computes otherwise at other input lengths" in " ".join(r.reason for r in reports)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_permute_checks_its_copy_and_stops_following_custom_layers_if_it_differs(kind):
    # Keras 3's Sequential has no `input` (never called itself): the final comparison takes its
    # inputs from `inputs`; a Sequential's copy went unchecked.
    layers = [keras.layers.Dense(16, name="pre"), _EagerOnly(name="block"),
              keras.layers.Dense(4, name="post")]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((5, 16)), *layers])
    else:
        inputs = keras.Input((5, 16))
        model = keras.Model(inputs, layers[2](layers[1](layers[0](inputs))))
    _randomize(model, seed=80)

    with pytest.warns(UserWarning, match="permuted again without following them"):
        permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 5, 16, seed=81))
    assert "'block' (_EagerOnly), which cannot be permuted" in " ".join(r.reason for r in reports)


@keras.saving.register_keras_serializable(package="test_permute")
def _cumsum_mix(x):
    """Mixes along axis 1: the channel axis of a Dense's 2-D output (not of a 3-D one)."""
    return x - 0.1 * keras.ops.cumsum(x, axis=1)


@keras.saving.register_keras_serializable(package="test_permute")
def _group_centre(x):
    """Centres each group of 8 channels: equivariant for 8 channels, not for 16."""
    means = keras.ops.mean(keras.ops.reshape(x, (-1, x.shape[-1] // 8, 8)), axis=-1)
    return x - keras.ops.repeat(means, 8, axis=-1)


@pytest.mark.parametrize("activation", [_cumsum_mix, _group_centre])
def test_permute_tries_a_custom_activation_on_the_layers_own_shape(activation):
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, activation=activation, name="d0")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="d1")(keras.layers.Dense(16)(x)))
    _randomize(model, seed=82)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(5, 16, seed=83))
    (report,) = [r for r in reports if r.producers == ("d0",)]
    assert not report.permuted and "activation of 'd0'" in report.reason


class _StatelessSublayersAndState(keras.layers.Layer):
    """Makes an Add layer in every call and keeps Python state from its last call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16, name="proj")
        self.calls = 0

    def call(self, x):
        self.calls += 1
        self.last = self.proj(x)
        return keras.layers.Add()([x, self.last])


def test_permute_follows_a_call_that_makes_weightless_layers_and_leaves_its_state_alone():
    inputs = keras.Input((16,))
    x = _StatelessSublayersAndState(name="block")(keras.layers.Dense(16, name="pre")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="post")(x))
    _randomize(model, seed=84)
    block = model.get_layer("block")
    state = (block.calls, block.last)

    permuted, reports = permute(model, kicks=1, progress=False)

    assert (block.calls, block.last) == state
    _assert_same_function(model, permuted, _x(5, 16, seed=85))
    assert [r.producers for r in reports if r.permuted] == [("pre", "block/proj")]


class _TrainingMix(keras.layers.Layer):
    """Scales its channels; when training, also mixes each with its neighbour."""

    def build(self, shape):
        self.gamma = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x, training=None):
        y = x * self.gamma
        return y + 0.5 * keras.ops.roll(y, 1, axis=-1) if training else y


class _ScalarGate(keras.layers.Layer):
    """ReZero's `x * alpha`, a scalar weight."""

    def build(self, shape):
        self.alpha = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return x * self.alpha


class _CountsCalls(keras.layers.Layer):
    """Counts its calls in a variable and records their losses: state a call changes."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.count.assign_add(1.0)
        self.add_loss(keras.ops.mean(x**2))
        return x


def test_permute_tries_layers_in_training_mode_takes_scalar_weights_and_changes_no_state():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="d0")(inputs)
    x = keras.layers.Dense(16, name="d1")(_TrainingMix(name="mix")(x))
    x = keras.layers.Dense(16, name="d2")(_CountsCalls(name="counts")(_ScalarGate(name="gate")(x)))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d3")(x))
    _randomize(model, seed=86)
    data = _x(3, 16, seed=87)
    model(data)
    counts, losses = model.get_layer("counts").count.numpy(), [float(v) for v in model.losses]

    permuted, reports = permute(model, kicks=1, progress=False)

    for training in (False, True):
        np.testing.assert_allclose(permuted(data, training=training), model(data, training=training),
                                   rtol=1e-5, atol=1e-5)
    reasons = {r.consumers: r.reason for r in reports if not r.permuted}
    assert "'mix' (_TrainingMix), which cannot be permuted" in reasons[("d1",)]
    assert [r.producers for r in reports if r.permuted] == [("d1",), ("d2",)]  # d1 -> gate -> d2
    assert model.get_layer("counts").count.numpy() == counts + 2  # the two calls above only
    model(data)  # a call to clear the losses of the two above
    assert [float(v) for v in model.losses] == losses


def test_permute_compares_a_mixed_precision_model_at_its_compute_precision():
    # float16 rounding, which the permuted copy rounds otherwise, reaches the float32 head (as
    # Keras' mixed precision guide has it): compared at float32 precision, a false alarm.
    keras.utils.set_random_seed(8)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((64,))
        x = inputs
        for i in range(8):
            x = keras.layers.Dense(256, activation="relu", name=f"d{i}")(x)
        model = keras.Model(inputs, keras.layers.Dense(10, dtype="float32", name="head")(x))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "permute")  # no "computes otherwise" warning
        _, reports = permute(model, kicks=0, progress=False)  # and no RuntimeError
    assert sum(r.permuted for r in reports) == 8


def test_permute_maps_each_input_of_a_nested_model_to_its_own_source():
    a, b = keras.Input((16,), name="a"), keras.Input((12,), name="b")
    inner = keras.Model([a, b], keras.layers.Concatenate()(
        [keras.layers.Dense(16, name="pa")(a), keras.layers.Dense(8, name="pb")(b)]),
        name="inner")
    inputs = keras.Input((8,))
    y, z = keras.layers.Dense(16, name="y")(inputs), keras.layers.Dense(12, name="z")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(inner([y, z])))
    _randomize(model, seed=88)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(3, 8, seed=89))
    spaces = {r.producers: r.consumers for r in reports if r.permuted}
    assert spaces[("y",)] == ("inner/pa",) and spaces[("z",)] == ("inner/pb",)


def test_permute_refuses_a_pruned_model():
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(16)(inputs)))
    with pytest.raises(ValueError, match=r"already has Sparse24 layers .*permute the dense model"):
        permute(prune(model), progress=False)


class _Triples(keras.layers.Layer):
    """Averages positions in threes: runs only on batch x length a multiple of 3."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16, name="proj")

    def call(self, x):
        triples = keras.ops.reshape(x, (-1, 3, x.shape[-1]))
        mixed = triples + keras.ops.mean(triples, axis=1, keepdims=True)
        return self.proj(keras.ops.reshape(mixed, keras.ops.shape(x)))


def test_permute_says_when_it_cannot_check_a_copy_whose_custom_layers_it_followed():
    inputs = keras.Input((None, 16))
    x = _Triples(name="block")(keras.layers.Dense(16, name="pre")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="post")(
        keras.layers.Dense(16, name="mid")(x)))
    _randomize(model, seed=90)

    with pytest.warns(UserWarning, match=r"followed the calls of the custom layers \['block'\].*"
                                         "could not check the copy"):
        permuted, _ = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(2, 9, 16, seed=91))


@keras.saving.register_keras_serializable(package="test_permute")
class _ScaledTable(keras.layers.Layer):
    """A token table times a learned scalar: a producer found by a trial run, with a scalar
    weight that stays as it is."""

    def build(self, shape):
        self.table = self.add_weight(shape=(20, 16), initializer="normal", name="table")
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, ids):
        return keras.ops.take(self.table, ids, axis=0) * self.scale


def test_permute_leaves_the_scalar_weights_of_a_producer_found_by_a_trial_run_as_they_are():
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Dense(16, name="fc")(_ScaledTable(name="embed")(tokens))
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(x))
    _randomize(model, seed=86)
    data = np.random.default_rng(87).integers(0, 20, (4, 6))

    permuted, reports = permute(model, kicks=1, progress=False)  # was an IndexError

    _assert_same_function(model, permuted, data)
    (report,) = [r for r in reports if r.producers == ("embed",)]
    assert report.permuted and report.consumers == ("fc",)
    copy, original = permuted.get_layer("embed"), model.get_layer("embed")
    assert copy.scale.numpy() == original.scale.numpy()


def test_permute_counts_and_searches_only_kernels_that_2_4_prunes():
    # 'odd' reads 16 + 3 concatenated channels: prune() leaves it alone, so its kernel neither
    # enters the search nor the report's kept magnitudes, though its channels are reordered.
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", name="c0")(inputs)
    odd = keras.layers.Conv2D(8, 3, name="odd")(keras.layers.Concatenate()([x, inputs]))
    both = keras.Model(inputs, [odd, keras.layers.Conv2D(8, 3, name="c1")(x)])
    alone = keras.Model(inputs, odd)
    _randomize(both, seed=88)
    data = _x(2, 6, 6, 3, seed=89)

    permuted, reports = permute(both, kicks=1, progress=False)

    _assert_same_function(both, permuted, data)
    (report,) = [r for r in reports if r.producers == ("c0",)]
    assert report.permuted and report.consumers == ("odd", "c1")
    for kept, model in ((report.kept_before, both), (report.kept_after, permuted)):
        assert kept == pytest.approx(_kept_in_layer(model.get_layer("c1")))
    assert _kept_in_layer(permuted.get_layer("c1")) > _kept_in_layer(both.get_layer("c1"))
    assert not eligible_weights(both.get_layer("odd"))

    permuted, reports = permute(alone, kicks=1, progress=False)

    _assert_same_function(alone, permuted, data)
    (report,) = [r for r in reports if r.producers == ("c0",)]
    assert not report.permuted and "2:4 prunes none of the kernels" in report.reason
    for old, new in zip(alone.get_weights(), permuted.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_permute_reports_the_layers_inside_a_layer_it_does_not_follow():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = keras.layers.Dense(32, name="up")
            self.down = keras.layers.Dense(16, name="down")

        def call(self, x):
            return x + self.down(self.up(x))

    inputs = keras.Input((5, 12))
    block = Block(name="block")
    x = block(block(keras.layers.Dense(16, name="d0")(inputs)))
    model = keras.Model(inputs, keras.layers.TimeDistributed(keras.layers.Dense(8, name="fc"),
                                                             name="td")(x))
    _randomize(model, seed=90)

    permuted, reports = permute(model, kicks=1, progress=False)

    _assert_same_function(model, permuted, _x(2, 5, 12, seed=91))
    reasons = {r.consumers: r.reason for r in reports if not r.permuted}
    assert reasons[("block",)] == (
        "'block' (Block) is not followed (it is called more than once): the input channels of "
        "the layers ['up', 'down'] inside it keep their order")
    assert reasons[("td",)] == (
        "'td' (TimeDistributed) is not followed (permute() does not look inside it): the input "
        "channels of the layers ['fc'] inside it keep their order")
