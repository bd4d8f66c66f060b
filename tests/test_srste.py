"""SR-STE (tf_sparse24.srste): per-step masks, straight-through gradient, sparse-refined decay.

Every expectation comes from an independent numpy float64 reference (masks by argsort, SGD by
hand) or from a plain Keras layer holding the numpy-masked weights.
"""

import functools
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_sparse24
from tf_sparse24 import SRSTE, Sparse24, Sparse24Callback


def np_mask(w, pattern, axis):
    """Numpy N:M magnitude mask: keep the N largest |w| of every M along `axis` (lower index wins ties)."""
    n, m = map(int, pattern.split(":"))
    a = np.moveaxis(np.asarray(w, np.float64), axis, -1)
    groups = a.reshape(*a.shape[:-1], a.shape[-1] // m, m)
    order = np.argsort(-np.abs(groups), axis=-1, kind="stable")
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    return np.moveaxis(keep.reshape(a.shape), -1, axis)


def assert_exact_nm(w, pattern, axis):
    n, m = map(int, pattern.split(":"))
    a = np.moveaxis(np.asarray(w), axis, -1)
    nonzeros = np.count_nonzero(a.reshape(*a.shape[:-1], a.shape[-1] // m, m), axis=-1)
    assert nonzeros.max() <= n, f"{pattern} violated along axis {axis}"


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
def test_fit_steps_match_numpy_sgd_with_masks_of_the_current_weights(pattern):
    """Each train step: forward with mask(W_t), W_{t+1} = W_t - lr * (dL/dW~ + decay * (1 - m) * W_t)."""
    keras.utils.set_random_seed(1)
    k, units, batch, lr, decay = 16, 6, 8, 0.3, 0.05
    rng = np.random.default_rng(2)
    layer = SRSTE(keras.layers.Dense(units), pattern, decay=decay)
    model = keras.Sequential([keras.Input((k,)), layer])
    model.compile(keras.optimizers.SGD(lr), "mse")
    w = rng.normal(size=(k, units)) * np.linspace(0.5, 1.5, k)[:, None]  # near-ties: masks move
    layer.layer.kernel.assign(w.astype("float32"))
    masks = []
    for _ in range(8):
        x, t = rng.normal(size=(batch, k)), rng.normal(size=(batch, units))
        w, b = (np.float64(v.numpy()) for v in (layer.layer.kernel, layer.layer.bias))
        mask = np_mask(w, pattern, 0)
        y = x @ (w * mask) + b
        pruned = (~mask) * w
        expected_loss = np.mean((y - t) ** 2) + 0.5 * decay * np.sum(pruned**2)
        dy = 2 * (y - t) / y.size
        expected_w = w - lr * (x.T @ dy + decay * pruned)
        expected_b = b - lr * dy.sum(0)

        loss = model.train_on_batch(x.astype("float32"), t.astype("float32"))

        np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
        np.testing.assert_array_equal(layer.pruned_weights[0].mask.numpy(), mask)  # mask used
        np.testing.assert_allclose(layer.layer.kernel.numpy(), expected_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.layer.bias.numpy(), expected_b, rtol=1e-5, atol=1e-6)
        masks.append(mask)
    flips = sum(int(np.sum(a != b)) for a, b in itertools.pairwise(masks))
    assert flips > 0, "the test must exercise masks that change between steps"


CASES = {
    "dense": (lambda: keras.layers.Dense(6), (5, 16), 0),
    "conv2d": (lambda: keras.layers.Conv2D(3, 3), (2, 5, 5, 8), 2),
    "conv1d": (lambda: keras.layers.Conv1D(4, 2, activation="tanh"), (3, 6, 16), 1),
}


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_is_straight_through_plus_sparse_refined_decay(case, pattern):
    make, x_shape, axis = CASES[case]
    decay = 0.01
    rng = np.random.default_rng(3)
    x = rng.normal(size=x_shape).astype("float32")
    wrapper = SRSTE(make(), pattern, decay=decay)
    y0 = wrapper(x)
    r = rng.normal(size=y0.shape).astype("float32")
    pw = wrapper.pruned_weights[0]
    assert pw.axis == axis
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(wrapper(x, training=True) * r) + tf.add_n(wrapper.losses)
    grads = dict(
        zip(
            ("kernel", "bias"),
            tape.gradient(loss, [wrapper.layer.kernel, wrapper.layer.bias]),
        )
    )

    w = pw.variable.numpy()
    mask = np_mask(w, pattern, axis)
    plain = make()
    plain.build(x_shape)
    plain.set_weights([w * mask, wrapper.layer.bias.numpy()])
    with tf.GradientTape() as tape:
        y_plain = plain(x)
        plain_loss = tf.reduce_sum(y_plain * r)
    g_kernel, g_bias = tape.gradient(plain_loss, [plain.kernel, plain.bias])

    np.testing.assert_array_equal(y0, y_plain)  # forward = exactly the numpy-masked weights
    np.testing.assert_allclose(
        grads["kernel"], g_kernel.numpy() + decay * (~mask) * w, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(grads["bias"], g_bias, rtol=1e-5, atol=1e-6)
    assert np.any((~mask) & (grads["kernel"].numpy() != 0)), "pruned positions get gradient"


def test_no_decay_loss_outside_training_or_with_zero_decay():
    x = np.ones((2, 8), "float32")
    wrapper = SRSTE(keras.layers.Dense(3))
    wrapper(x)
    assert wrapper.losses == []
    wrapper(x, training=True)
    assert len(wrapper.losses) == 1
    plain = SRSTE(keras.layers.Dense(3), decay=0)
    plain(x, training=True)
    assert plain.losses == []


FIT_MODES = {
    "eager": {"run_eagerly": True},
    "graph": {"jit_compile": False},
    "xla": {"jit_compile": True},
}


@pytest.mark.parametrize("mode", sorted(FIT_MODES))
def test_shared_layer_called_twice_per_forward_decays_once(mode):
    """One wrapped Dense on two inputs (a Siamese model): the decay belongs to the weights, so
    each step is W - lr * (dL/dW~ + decay * (1 - m) * W) with the decay once, not once per call
    (that decayed the pruned weights 0.90x a step here instead of 0.95x)."""
    keras.utils.set_random_seed(6)
    k, units, batch, lr, decay = 16, 3, 4, 0.1, 0.5
    rng = np.random.default_rng(6)
    shared = SRSTE(keras.layers.Dense(units), decay=decay)
    a, b = keras.Input((k,)), keras.Input((k,))
    model = keras.Model([a, b], keras.layers.Concatenate()([shared(a), shared(b)]))
    model.compile(keras.optimizers.SGD(lr), "mse", **FIT_MODES[mode])
    for _ in range(3):
        xa, xb = rng.normal(size=(batch, k)), rng.normal(size=(batch, k))
        t = rng.normal(size=(batch, 2 * units))
        w, bias = (np.float64(v.numpy()) for v in (shared.layer.kernel, shared.layer.bias))
        mask = np_mask(w, "2:4", 0)
        y = np.concatenate([xa @ (w * mask) + bias, xb @ (w * mask) + bias], axis=1)
        pruned = (~mask) * w
        dya, dyb = np.split(2 * (y - t) / y.size, 2, axis=1)
        expected_w = w - lr * (xa.T @ dya + xb.T @ dyb + decay * pruned)
        expected_b = bias - lr * (dya.sum(0) + dyb.sum(0))
        expected_loss = np.mean((y - t) ** 2) + 0.5 * decay * np.sum(pruned**2)

        x32 = [xa.astype("float32"), xb.astype("float32")]
        history = model.fit(x32, t.astype("float32"), batch_size=batch, verbose=0)

        kernel = shared.layer.kernel.numpy()
        np.testing.assert_allclose(kernel[~mask], expected_w[~mask], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kernel, expected_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(shared.layer.bias.numpy(), expected_b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(history.history["loss"], [expected_loss], rtol=1e-5)


def test_model_losses_hold_one_decay_per_wrapped_layer_and_the_inner_losses_per_call():
    """A shared SR-STE layer (called twice) and a head: two decay terms, while the shared inner
    layer's activity regulariser, a loss of the call, still counts once per call."""
    rng = np.random.default_rng(7)
    shared = SRSTE(keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1)), decay=1)
    head = SRSTE(keras.layers.Dense(4), decay=1)
    a, b = keras.Input((8,)), keras.Input((8,))
    model = keras.Model([a, b], head(keras.layers.Concatenate()([shared(a), shared(b)])))
    xa, xb = rng.normal(size=(2, 2, 8)).astype("float32")

    def expected_decay(layer):
        w = np.float64(layer.layer.kernel.numpy())
        return 0.5 * np.sum(((~np_mask(w, "2:4", 0)) * w) ** 2)

    w, bias = np.float64(shared.layer.kernel.numpy()), shared.layer.bias.numpy()
    activity = [
        0.1 * np.sum((x @ (w * np_mask(w, "2:4", 0)) + bias) ** 2) / len(x) for x in (xa, xb)
    ]
    expected = sorted([expected_decay(shared), expected_decay(head), *activity])
    for _ in range(2):  # each forward starts afresh: nothing piles up
        model([xa, xb], training=True)
        np.testing.assert_allclose(sorted(map(float, model.losses)), expected, rtol=1e-5)
    assert [len(shared.losses), len(head.losses)] == [3, 1]


@settings(max_examples=12, deadline=None)
@given(
    pattern=st.sampled_from(["2:4", "1:4", "3:4", "4:8", "1:2"]),
    groups=st.integers(1, 3),
    units=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_effective_weight_is_numpy_mask_of_current_weights(pattern, groups, units, seed):
    m = int(pattern.split(":")[1])
    rng = np.random.default_rng(seed)
    wrapper = SRSTE(keras.layers.Dense(units), pattern)
    wrapper.build((None, groups * m))
    pw = wrapper.pruned_weights[0]
    for _ in range(2):  # the effective weight follows every assignment of the variable
        w = rng.normal(size=pw.variable.shape).astype("float32")
        pw.variable.assign(w)
        np.testing.assert_array_equal(wrapper.effective_weight(pw), w * np_mask(w, pattern, 0))


def digits_mlp():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return model, x, y


@pytest.fixture(scope="module")
def trained():
    """SR-STE from scratch on scikit-learn digits: random init -> prune(wrapper=SRSTE) -> fit."""
    model, x, y = digits_mlp()
    sparse = tf_sparse24.prune(model, wrapper=SRSTE)
    initial = {
        w.name: np_mask(w.layer.kernel.numpy(), "2:4", 0) for w in tf_sparse24.pruned_layers(sparse)
    }
    sparse.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = sparse.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[Sparse24Callback()])
    return sparse, x, y, initial, history


def test_fit_from_scratch_moves_masks_and_ends_exactly_nm(trained):
    sparse, x, _, initial, history = trained
    layers = tf_sparse24.pruned_layers(sparse)
    assert [type(layer) for layer in layers] == [SRSTE, SRSTE]
    assert history.history["accuracy"][-1] > 0.85  # it learns
    assert history.history["sparse24_valid"] == [1.0] * 4
    for layer in layers:
        w = layer.layer.kernel.numpy()
        final = np_mask(w, "2:4", 0)
        assert np.mean(final != initial[layer.name]) > 0.01, (
            f"{layer.name}: kept positions must change"
        )
        effective = layer.effective_weight(layer.pruned_weights[0]).numpy()
        np.testing.assert_array_equal(effective, w * final)
        assert_exact_nm(effective, "2:4", 0)
    expected = x
    for layer in layers:  # numpy forward with the masks of the final weights
        kernel = layer.layer.kernel.numpy().astype(np.float64)
        expected = expected @ (kernel * np_mask(kernel, "2:4", 0)) + layer.layer.bias.numpy()
        expected = np.maximum(expected, 0) if layer is layers[0] else expected
    np.testing.assert_allclose(sparse(x), expected, rtol=1e-4, atol=1e-4)


def test_keras_round_trip(trained, tmp_path):
    sparse, x, _, _, _ = trained
    path = tmp_path / "srste.keras"
    sparse.save(path)
    loaded = keras.models.load_model(path)
    layers = tf_sparse24.pruned_layers(loaded)
    assert [type(layer) for layer in layers] == [SRSTE, SRSTE]
    assert [(layer.pattern, layer.decay) for layer in layers] == [("2:4", 2e-4)] * 2
    for a, b in zip(sparse.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(loaded(x), sparse(x))


def test_strip_gives_plain_model_with_exact_nm_weights(trained):
    sparse, x, y, _, _ = trained
    plain = tf_sparse24.strip(sparse)
    assert not any(isinstance(layer, Sparse24) for layer in plain.layers)
    for layer, wrapper in zip(plain.layers, tf_sparse24.pruned_layers(sparse)):
        w = wrapper.layer.kernel.numpy()
        np.testing.assert_array_equal(layer.kernel.numpy(), w * np_mask(w, "2:4", 0))
        assert_exact_nm(layer.kernel.numpy(), "2:4", 0)
    np.testing.assert_allclose(plain(x), sparse(x), rtol=1e-6, atol=1e-6)
    # evaluate() adds no decay term: the SR-STE model's loss is the plain model's loss
    plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    np.testing.assert_allclose(
        sparse.evaluate(x, y, verbose=0, return_dict=True)["loss"],
        plain.evaluate(x, y, verbose=0, return_dict=True)["loss"],
        rtol=1e-6,
    )


def test_prune_wrapper_partial_and_bad_arguments():
    model, _, _ = digits_mlp()
    sparse = tf_sparse24.prune(model, "4:8", wrapper=functools.partial(SRSTE, decay=1e-3))
    layers = tf_sparse24.pruned_layers(sparse)
    assert [(type(l), l.pattern, l.decay) for l in layers] == [(SRSTE, "4:8", 1e-3)] * 2
    assert tf_sparse24.prune(model).layers[0].__class__ is Sparse24  # default unchanged
    with pytest.raises(TypeError, match="wrapper"):
        tf_sparse24.prune(model, wrapper=keras.layers.Dense)
    for bad in (-1.0, float("nan"), "2e-4", True, np.bool_(True), np.float32("inf")):
        with pytest.raises(ValueError, match=r"SRSTE\('dense\w*'\): decay must be"):
            SRSTE(keras.layers.Dense(2), decay=bad)
    # numpy scalars (a sweep over np.linspace(..., dtype="float32"), np.int64(0)) are numbers too
    for good, value in ((np.float32(1e-3), float(np.float32(1e-3))), (np.int64(0), 0.0)):
        layer = SRSTE(keras.layers.Dense(2), decay=good)
        assert layer.decay == value and type(layer.get_config()["decay"]) is float


def test_nested_variables_and_mixed_precision():
    """MHA projections (nested variables) under mixed_float16: exact N:M after each step."""
    keras.utils.set_random_seed(4)
    rng = np.random.default_rng(4)
    x, y = (
        rng.normal(size=(16, 6, 8)).astype("float32"),
        rng.normal(size=(16, 4)).astype("float32"),
    )
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((6, 8))
        h = keras.layers.MultiHeadAttention(2, 4)(inputs, inputs)
        model = keras.Model(
            inputs, keras.layers.Dense(4, dtype="float32")(keras.layers.Flatten()(h))
        )
        sparse = tf_sparse24.prune(model, wrapper=SRSTE)
        sparse.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
        for _ in range(2):
            loss = sparse.train_on_batch(x, y)
            assert np.isfinite(loss)
            for layer in tf_sparse24.pruned_layers(sparse):
                for pw in layer.pruned_weights:
                    w = pw.variable.numpy()
                    effective = layer.effective_weight(pw).numpy()
                    np.testing.assert_array_equal(effective, w * np_mask(w, "2:4", pw.axis))
    finally:
        keras.config.set_dtype_policy("float32")
    names = {pw.name for layer in tf_sparse24.pruned_layers(sparse) for pw in layer.pruned_weights}
    assert {
        "query/kernel",
        "key/kernel",
        "value/kernel",
        "attention_output/kernel",
        "kernel",
    } == names


@keras.saving.register_keras_serializable(package="test_srste")
class SubclassedNet(keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = SRSTE(keras.layers.Dense(units, activation="relu"), decay=1e-3)
        self.head = SRSTE(keras.layers.Dense(4), "1:4")

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_subclassed_model_with_srste_layers_copies_through_prune():
    net = SubclassedNet()
    x = np.random.default_rng(5).normal(size=(3, 16)).astype("float32")
    net(x)
    copy = tf_sparse24.prune(net)
    layers = tf_sparse24.pruned_layers(copy)
    assert [(type(l), l.pattern, l.decay) for l in layers] == [
        (SRSTE, "2:4", 1e-3),
        (SRSTE, "1:4", 2e-4),
    ]
    w1, b1 = net.hidden.layer.kernel.numpy(), net.hidden.layer.bias.numpy()
    w2, b2 = net.head.layer.kernel.numpy(), net.head.layer.bias.numpy()
    hidden = np.maximum(x @ (w1 * np_mask(w1, "2:4", 0)) + b1, 0)
    np.testing.assert_allclose(
        copy(x), hidden @ (w2 * np_mask(w2, "1:4", 0)) + b2, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("floatx", ["float64", "float16"])
def test_decay_loss_is_in_floatx_so_fit_runs_under_another_floatx(floatx):
    """Keras sums added losses with the compiled loss in floatx: a float32 decay loss beside a
    float64 (or float16) loss stopped the first step."""
    default = keras.config.floatx()
    keras.config.set_floatx(floatx)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
        pruned = tf_sparse24.prune(model, wrapper=SRSTE)
        x = np.random.default_rng(1).normal(size=(32, 16)).astype(floatx)
        wrapper = pruned.layers[0]
        wrapper(x, training=True)
        (loss,) = wrapper.losses
        kernel = np.float64(wrapper.layer.kernel.numpy())
        pruned_part = np.where(np_mask(kernel, "2:4", 0), 0.0, kernel)
        assert loss.dtype == floatx
        np.testing.assert_allclose(float(loss), 0.5 * 2e-4 * np.sum(pruned_part**2), rtol=1e-3)
        pruned.compile(keras.optimizers.SGD(1e-3), "mse")
        history = pruned.fit(x, x[:, :8], epochs=2, batch_size=16, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        assert_exact_nm(np.float64(tf_sparse24.strip(pruned).layers[0].kernel.numpy()), "2:4", 0)
    finally:
        keras.config.set_floatx(default)
