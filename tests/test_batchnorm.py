"""Tests for tf_sparse24.recalibrate_batch_norm: statistics against a numpy float64 reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import procs
from test_masks import reference_mask

import tf_sparse24

EPS = 1e-3  # BatchNormalization's default epsilon


def _model(synchronized: bool = False):
    """A pruned conv net with two BatchNormalization layers (the second frozen), stale statistics
    and seeded weights: the same model in every process."""
    inputs = keras.Input((6, 6, 4))
    y1 = keras.layers.Conv2D(8, 3, name="conv1")(inputs)
    bn1 = keras.layers.BatchNormalization(name="bn1", synchronized=synchronized)
    x = keras.layers.ReLU()(bn1(y1))
    y2 = keras.layers.Conv2D(8, 1, name="conv2")(x)
    bn2 = keras.layers.BatchNormalization(name="bn2", synchronized=synchronized)
    bn2.trainable = False  # frozen: still recalibrated
    x = keras.layers.GlobalAveragePooling2D()(bn2(y2))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    for name in ("bn1", "bn2"):  # stale statistics, as after pruning a trained model
        layer = model.get_layer(name)
        layer.moving_variance.assign(rng.uniform(0.5, 2.0, 8).astype("float32"))
    return tf_sparse24.prune(model)


def _reference_statistics(model, x, batch_size):
    """Size-weighted averages of each batch's moments of bn1's and bn2's inputs, in float64:
    conv2 and bn1's training-mode normalization in numpy (bn1's input from the pruned conv1)."""
    conv1_out = keras.Model(model.input, model.get_layer("bn1").input)
    gamma, beta = (w.astype("float64") for w in model.get_layer("bn1").get_weights()[:2])
    conv2 = model.get_layer("sparse24_conv2")
    raw = conv2.layer.kernel.numpy().astype("float64")
    kernel = (raw * reference_mask(raw, 2, 4, axis=2))[0, 0]  # pruned at its input channels
    bias = conv2.layer.bias.numpy().astype("float64")
    sums = {"bn1": [0, 0], "bn2": [0, 0]}
    for start in range(0, len(x), batch_size):
        y1 = np.asarray(conv1_out(x[start:start + batch_size])).astype("float64")
        rows = len(y1)
        m1, v1 = y1.mean(axis=(0, 1, 2)), y1.var(axis=(0, 1, 2))
        h = np.maximum((y1 - m1) / np.sqrt(v1 + EPS) * gamma + beta, 0)
        y2 = h @ kernel + bias
        for name, (m, v) in (("bn1", (m1, v1)), ("bn2", (y2.mean((0, 1, 2)), y2.var((0, 1, 2))))):
            sums[name][0] = sums[name][0] + rows * m
            sums[name][1] = sums[name][1] + rows * v
    return {name: (s[0] / len(x), s[1] / len(x)) for name, s in sums.items()}


def _statistics(model):
    return {n: [w.numpy() for w in (model.get_layer(n).moving_mean,
                                    model.get_layer(n).moving_variance)] for n in ("bn1", "bn2")}


@pytest.mark.parametrize("source", ["array", "dataset"])
def test_recalibration_sets_size_weighted_batch_moments(source):
    model = _model()
    assert isinstance(model.get_layer("sparse24_conv2"), tf_sparse24.Sparse24)
    x = np.random.default_rng(1).normal(size=(100, 6, 6, 4)).astype("float32")  # 32+32+32+4
    weights = [w.copy() for w in model.get_weights() if w.ndim > 1]
    data = x if source == "array" else tf.data.Dataset.from_tensor_slices(
        (x, np.zeros(100))).batch(32)

    names = tf_sparse24.recalibrate_batch_norm(model, data, batch_size=32)

    assert sorted(names) == ["bn1", "bn2"]
    expected = _reference_statistics(model, x, 32)
    for name, (mean, variance) in _statistics(model).items():
        np.testing.assert_allclose(mean, expected[name][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(variance, expected[name][1], rtol=1e-4, atol=1e-5)
    assert model.get_layer("bn1").momentum == 0.99 and not model.get_layer("bn2").trainable
    for before, after in zip(weights, [w for w in model.get_weights() if w.ndim > 1]):
        np.testing.assert_array_equal(before, after)  # no weight changed


def _siamese():
    """One Dense -> BatchNormalization tower shared by two inputs (its layers run twice per
    forward), seeded weights and stale statistics."""
    tower = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="dense"),
                              keras.layers.BatchNormalization(name="bn")], name="tower")
    a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b")
    model = keras.Model([a, b], keras.layers.Concatenate()([tower(a), tower(b)]))
    rng = np.random.default_rng(3)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    tower.get_layer("bn").moving_variance.assign(rng.uniform(0.5, 2.0, 4).astype("float32"))
    return model, tower


def test_a_layer_called_twice_per_forward_averages_the_statistics_of_every_call():
    model, tower = _siamese()
    rng = np.random.default_rng(4)  # branches far apart: the last call alone is far from the mean
    xa = rng.normal(size=(100, 8)).astype("float32")  # batches of 32+32+32+4
    xb = rng.normal(3.0, 2.0, size=(100, 8)).astype("float32")

    assert tf_sparse24.recalibrate_batch_norm(model, [xa, xb], batch_size=32) == ["bn"]

    kernel, bias = (w.astype("float64") for w in tower.get_layer("dense").get_weights())
    sums = [0, 0]
    for start in range(0, 100, 32):
        for x in (xa, xb):  # one batch statistic per call, weighted by its rows
            y = x[start:start + 32].astype("float64") @ kernel + bias
            sums = [sums[0] + len(y) * y.mean(axis=0), sums[1] + len(y) * y.var(axis=0)]
    bn = tower.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), sums[0] / 200, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), sums[1] / 200, rtol=1e-4, atol=1e-5)
    assert bn.momentum == 0.99 and "call" not in vars(bn)  # the layer is left as it was


def test_steps_limits_the_batches():
    model = _model()
    x = np.random.default_rng(2).normal(size=(96, 6, 6, 4)).astype("float32")
    tf_sparse24.recalibrate_batch_norm(model, x, batch_size=32, steps=1)
    expected = _reference_statistics(model, x[:32], 32)
    np.testing.assert_allclose(_statistics(model)["bn1"][0], expected["bn1"][0], rtol=1e-4,
                               atol=1e-5)


def test_a_failing_batch_restores_every_statistic_and_setting():
    model = _model()
    before = _statistics(model)
    good = np.zeros((8, 6, 6, 4), "float32") + 1.0

    def batches():
        yield good
        yield np.zeros((8, 5, 5, 4), "float32")  # wrong shape: the model raises

    with pytest.raises(ValueError):
        tf_sparse24.recalibrate_batch_norm(model, batches())
    for name, stats in _statistics(model).items():
        for a, b in zip(stats, before[name]):
            np.testing.assert_array_equal(a, b)
    assert model.get_layer("bn2").momentum == 0.99 and not model.get_layer("bn2").trainable
    assert "call" not in vars(model.get_layer("bn2"))  # the per-call hook is removed too


def test_bad_input_is_refused_before_anything_changes():
    model = _model()
    before = _statistics(model)
    with pytest.raises(ValueError, match="yielded no batch"):
        tf_sparse24.recalibrate_batch_norm(model, iter([]))
    with pytest.raises(ValueError, match="positive"):
        tf_sparse24.recalibrate_batch_norm(model, np.zeros((4, 6, 6, 4)), batch_size=0)
    forever = tf.data.Dataset.from_tensors(np.ones((8, 6, 6, 4), "float32")).repeat()
    with pytest.raises(ValueError, match="infinite dataset .* pass steps="):
        tf_sparse24.recalibrate_batch_norm(model, forever)
    examples = tf.data.Dataset.from_tensor_slices(np.ones((8, 6, 6, 4), "float32"))
    for unbatched in (examples, tf.data.Dataset.zip(examples, examples.map(lambda e: e[0, 0]))):
        with pytest.raises(ValueError, match=r"dataset of single examples \(element shapes "
                                             r"\[\(6, 6, 4\)\]; .* batch it, e.g. x.batch\(32\)"):
            tf_sparse24.recalibrate_batch_norm(model, unbatched)
    renorm = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(renorm=True,
                                                                                  name="rn")])
    with pytest.raises(ValueError, match=r"\['rn'\] use renorm=True"):
        tf_sparse24.recalibrate_batch_norm(renorm, np.zeros((4, 4)))
    x, y = np.ones((8, 6, 6, 4), "float32"), np.ones((8, 3), "float32")
    sequential = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.BatchNormalization()])
    sequential_stats = [v.numpy() for v in sequential.weights]
    # Data with targets, a list of batches, a tuple of batches: Keras reads each as the inputs.
    for data in ((x, y), [(x[:4], y[:4]), (x[4:], y[4:])], (x[:4], x[4:])):
        for net in (model, sequential):
            with pytest.raises(ValueError, match=r"x is a (tuple|list) of [24] arrays, read as "
                                                 r"the inputs of model .*, which takes 1"):
                tf_sparse24.recalibrate_batch_norm(net, data)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(sequential_stats, sequential.weights))
    with pytest.warns(UserWarning, match="no BatchNormalization"):
        assert tf_sparse24.recalibrate_batch_norm(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), np.zeros((4, 4))) == []
    for name, stats in _statistics(model).items():
        for a, b in zip(stats, before[name]):
            np.testing.assert_array_equal(a, b)


def test_a_batched_dataset_of_one_feature_columns_is_not_taken_for_single_examples():
    """Keras' structured-data recipe: `keras.Input((1,), name=column)` per feature, fed
    `Dataset.from_tensor_slices((dict(columns), labels)).batch(n)`, whose elements are `[batch]`,
    one axis short of `(None, 1)`: Keras' Functional model appends the axis of size 1, so these
    are batches, recalibrated as the same columns given as arrays are. An unbatched dataset of
    `(6, 1)` examples for a `(None, 6, 1)` input is still refused."""
    columns = {name: keras.Input((1,), name=name) for name in ("age", "income")}
    h = keras.layers.Dense(4)(keras.layers.Concatenate()([columns["age"], columns["income"]]))
    model = keras.Model(columns, keras.layers.BatchNormalization(name="bn")(h))
    rng = np.random.default_rng(7)
    data = {name: rng.standard_normal(32).astype("float32") for name in columns}
    labels = np.zeros(32, "float32")
    ds = tf.data.Dataset.from_tensor_slices((data, labels)).batch(8)
    assert ds.element_spec[0]["age"].shape.as_list() == [None]
    assert tf_sparse24.recalibrate_batch_norm(model, ds) == ["bn"]
    from_dataset = [v.numpy() for v in model.get_layer("bn").weights]
    tf_sparse24.recalibrate_batch_norm(model, {k: v[:, None] for k, v in data.items()},
                                       batch_size=8)
    for a, b in zip(from_dataset, model.get_layer("bn").weights):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-6, atol=1e-6)
    inp = keras.Input((6, 1))
    sequences = keras.Model(inp, keras.layers.BatchNormalization()(inp))
    examples = tf.data.Dataset.from_tensor_slices(np.ones((8, 6, 1), "float32"))
    with pytest.raises(ValueError, match=r"dataset of single examples \(element shapes "
                                         r"\[\(6, 1\)\]"):
        tf_sparse24.recalibrate_batch_norm(sequences, examples)
    assert tf_sparse24.recalibrate_batch_norm(sequences, examples.map(lambda e: e[:, 0]).batch(4))


def test_an_unbatched_dataset_of_one_feature_examples_is_refused():
    """`Dataset.from_tensor_slices(x)` of an `(n, 1)` array has `[1]` elements: single examples
    for `keras.Input((1,))`, not batches missing the feature axis (`[batch]`). Run as batches of
    one row they would set every moving variance to zero; refused with the hint to batch, and the
    batched dataset gives the numpy moments. Likewise `[steps, 1]` for `keras.Input((None, 1))`."""
    inp = keras.Input((1,))
    model = keras.Model(inp, keras.layers.BatchNormalization(name="bn")(inp))
    x = np.random.default_rng(3).normal(3.0, 2.0, size=(64, 1)).astype("float32")
    examples = tf.data.Dataset.from_tensor_slices(x)
    assert examples.element_spec.shape.as_list() == [1]
    before = [v.numpy() for v in model.get_layer("bn").weights]
    with pytest.raises(ValueError, match=r"dataset of single examples \(element shapes \[\(1,\)\]"):
        tf_sparse24.recalibrate_batch_norm(model, examples)
    for a, v in zip(before, model.get_layer("bn").weights):
        np.testing.assert_array_equal(a, v.numpy())
    assert tf_sparse24.recalibrate_batch_norm(model, examples.batch(16)) == ["bn"]
    bn = model.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(),
                               np.mean([x[i:i + 16].var(0) for i in range(0, 64, 16)], 0),
                               rtol=1e-5)
    seq_in = keras.Input((None, 1))
    sequences = keras.Model(seq_in, keras.layers.BatchNormalization()(seq_in))
    with pytest.raises(ValueError, match="dataset of single examples"):
        tf_sparse24.recalibrate_batch_norm(
            sequences, tf.data.Dataset.from_tensor_slices(np.ones((8, 5, 1), "float32")))


def test_a_batch_of_no_rows_counts_for_nothing():
    """A generator slicing past the end of its array yields empty batches: weighted by their
    rows (0), they change nothing, where Keras' batch statistics of no rows (NaN) made every
    statistic NaN, or the first call divided by zero."""
    model = _model()
    x = np.random.default_rng(4).normal(size=(64, 6, 6, 4)).astype("float32")
    expected = _reference_statistics(model, x, 32)
    for batches in ([x[:32], x[64:], x[32:]], [x[:0], x[:32], x[32:], x[64:96]]):
        assert sorted(tf_sparse24.recalibrate_batch_norm(model, iter(batches))) == ["bn1", "bn2"]
        for name, (mean, variance) in _statistics(model).items():
            np.testing.assert_allclose(mean, expected[name][0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(variance, expected[name][1], rtol=1e-4, atol=1e-5)


class _ListBatches(keras.utils.PyDataset):
    """A PyDataset whose `__getitem__` returns `[x, y]` lists, which Keras' fit reads as
    `(x, y)`."""

    def __init__(self, x, batch_size):
        super().__init__()
        self.x, self.batch_size = x, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        x = self.x[index * self.batch_size:(index + 1) * self.batch_size]
        return [x, np.zeros((len(x), 3), "float32")]


def test_a_py_dataset_of_lists_is_read_as_keras_reads_it():
    model = _model()
    x = np.random.default_rng(5).normal(size=(40, 6, 6, 4)).astype("float32")
    expected = _reference_statistics(model, x, 16)
    assert sorted(tf_sparse24.recalibrate_batch_norm(model, _ListBatches(x, 16))) == ["bn1", "bn2"]
    for name, (mean, variance) in _statistics(model).items():
        np.testing.assert_allclose(mean, expected[name][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(variance, expected[name][1], rtol=1e-4, atol=1e-5)


def test_nothing_but_the_statistics_changes():
    """A training-mode forward also rewrites SpectralNormalization's kernel and power-iteration
    vector, advances a stateful GRU's states and dropout's seed: all put back."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 8), batch_size=8)
    x = keras.layers.GRU(8, stateful=True, return_sequences=True)(inputs)
    x = keras.layers.SpectralNormalization(keras.layers.Dense(8))(keras.layers.Dropout(0.5)(x))
    model = tf_sparse24.prune(keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(x)))
    data = np.random.default_rng(3).normal(size=(16, 3, 8)).astype("float32")
    model(data[:8])  # states away from zero
    gru = next(layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.GRU))
    bn = model.get_layer("bn")
    statistics = {id(bn.moving_mean), id(bn.moving_variance)}
    before = [(v.path, v.numpy()) for v in model.variables + gru.states if id(v) not in statistics]
    assert tf_sparse24.recalibrate_batch_norm(model, data, batch_size=8) == ["bn"]
    after = [v.numpy() for v in model.variables + gru.states if id(v) not in statistics]
    for (path, a), b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)
    assert not np.array_equal(bn.moving_variance.numpy(), np.ones(8))


class _TracedForward(keras.Model):
    """A subclassed model whose forward is a tf.function; `spare` is a BatchNormalization it
    never calls."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)
        self.bn, self.spare = keras.layers.BatchNormalization(), keras.layers.BatchNormalization()
        self.traced = tf.function(self.forward)

    def forward(self, x, training):
        return self.bn(self.dense(x), training=training)

    def call(self, x, training=False):
        return self.traced(x, training)


def _traced_forward_model(x):
    model = _TracedForward()
    model.spare.build((None, 4))
    model.forward(x[:1], False)  # builds the layers eagerly
    model(x[:32], training=True)  # traces the forward, with BatchNormalization's momentum 0.99
    return model


def test_a_forward_traced_before_recalibration_raises_and_restores():
    x = np.random.default_rng(5).normal(1.0, size=(64, 8)).astype("float32")
    model = _traced_forward_model(x)
    before = [w.numpy() for w in (model.bn.moving_mean, model.bn.moving_variance)]

    # The traced graph updates the statistics with its own momentum, past the counting call.
    with pytest.raises(RuntimeError, match=rf"statistics of \['{model.bn.name}'\] changed"):
        tf_sparse24.recalibrate_batch_norm(model, x, batch_size=32)
    for a, b in zip([model.bn.moving_mean, model.bn.moving_variance], before):
        np.testing.assert_array_equal(a.numpy(), b)
    assert model.bn.momentum == 0.99


def test_a_layer_the_forward_does_not_call_is_named_and_left_alone():
    x = np.random.default_rng(6).normal(1.0, size=(64, 8)).astype("float32")
    model = _TracedForward()
    model.traced = model.forward  # eager this time
    model.spare.build((None, 4))
    model(x[:1])
    spare = [w.numpy() for w in (model.spare.moving_mean, model.spare.moving_variance)]

    with pytest.warns(UserWarning, match=rf"\['{model.spare.name}'\] were not called"):
        names = tf_sparse24.recalibrate_batch_norm(model, x, batch_size=32)

    assert names == [model.bn.name]
    kernel, bias = (w.astype("float64") for w in model.dense.get_weights())
    y = x.astype("float64") @ kernel + bias
    np.testing.assert_allclose(model.bn.moving_mean.numpy(), y.mean(0), rtol=1e-4, atol=1e-5)
    for a, b in zip([model.spare.moving_mean, model.spare.moving_variance], spare):
        np.testing.assert_array_equal(a.numpy(), b)


@pytest.mark.slow
def test_recalibration_under_mirrored_strategy_sets_every_replica(tmp_path):
    # tests/helpers/bn_mirrored_worker.py: _model() built under MirroredStrategy on 2 logical
    # CPUs, recalibrated (plain and synchronized BatchNormalization); each replica's statistics.
    out = tmp_path / "replicas.npz"
    procs.run("bn_mirrored_worker.py", out, tmp=tmp_path, timeout=300).check()
    got = np.load(out)
    x = got["x"]
    for synchronized in (False, True):
        expected = _reference_statistics(_model(synchronized), x, 32)
        for name in ("bn1", "bn2"):
            for i, what in enumerate(("mean", "variance")):
                for replica in range(2):
                    np.testing.assert_allclose(
                        got[f"{synchronized}/{name}/{what}/{replica}"], expected[name][i],
                        rtol=1e-4, atol=1e-5,
                        err_msg=f"synchronized={synchronized} {name} {what} replica {replica}")
