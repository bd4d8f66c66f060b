"""The Sparse24 wrapper: masked forward, zero gradients, every supported layer, round trips."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_masks import reference_mask

import tf_sparse24
from tf_sparse24 import Sparse24, is_nm_sparse

RNG = np.random.default_rng(0)
SEQ = RNG.normal(size=(2, 6, 8)).astype("float32")
IMG = RNG.normal(size=(2, 5, 5, 8)).astype("float32")
VOL = RNG.normal(size=(2, 4, 4, 4, 8)).astype("float32")
FRAMES = RNG.normal(size=(2, 3, 5, 5, 8)).astype("float32")
VOL_FRAMES = np.random.default_rng(1).normal(size=(2, 2, 3, 3, 3, 8)).astype("float32")

# (layer factory, inputs, expected {relative path: axis})
CASES = {
    "dense": (lambda: keras.layers.Dense(6), (SEQ,), {"kernel": 0}),
    "einsum": (
        lambda: keras.layers.EinsumDense(
            "abc,cd->abd", output_shape=(None, 4), bias_axes="d"
        ),
        (SEQ,),
        {"kernel": 0},
    ),
    "conv1d": (lambda: keras.layers.Conv1D(4, 3), (SEQ,), {"kernel": 1}),
    "conv2d": (lambda: keras.layers.Conv2D(4, 3), (IMG,), {"kernel": 2}),
    "conv3d": (lambda: keras.layers.Conv3D(4, 2), (VOL,), {"kernel": 3}),
    "separable": (
        lambda: keras.layers.SeparableConv2D(4, 3),
        (IMG,),
        {"pointwise_kernel": 2},
    ),
    "mha": (
        lambda: keras.layers.MultiHeadAttention(2, 4),
        (SEQ, SEQ),
        {
            "query/kernel": 0,
            "key/kernel": 0,
            "value/kernel": 0,
            "attention_output/kernel": 1,
        },
    ),
    "lstm": (
        lambda: keras.layers.LSTM(8),
        (SEQ,),
        {"lstm_cell/kernel": 0, "lstm_cell/recurrent_kernel": 0},
    ),
    "gru": (
        lambda: keras.layers.GRU(4),
        (SEQ,),
        {"gru_cell/kernel": 0, "gru_cell/recurrent_kernel": 0},
    ),
    "simple_rnn": (
        lambda: keras.layers.SimpleRNN(4),
        (SEQ,),
        {"simple_rnn_cell/kernel": 0, "simple_rnn_cell/recurrent_kernel": 0},
    ),
    "rnn_cell": (
        lambda: keras.layers.RNN(keras.layers.LSTMCell(8, name="cell")),
        (SEQ,),
        {"cell/kernel": 0, "cell/recurrent_kernel": 0},
    ),
    "stacked_cells": (
        lambda: keras.layers.RNN(
            keras.layers.StackedRNNCells(
                [keras.layers.GRUCell(8, name="a"), keras.layers.SimpleRNNCell(4, name="b")],
                name="stack",
            )
        ),
        (SEQ,),
        {f"stack/{c}/{k}": 0 for c in "ab" for k in ["kernel", "recurrent_kernel"]},
    ),
    "conv_lstm2d": (
        lambda: keras.layers.ConvLSTM2D(4, 3),
        (FRAMES,),
        {"conv_lstm_cell/kernel": 2, "conv_lstm_cell/recurrent_kernel": 2},
    ),
    # Each registry entry's input axis, also for the kinds above in other ranks.
    "separable1d": (
        lambda: keras.layers.SeparableConv1D(4, 3),
        (SEQ,),
        {"pointwise_kernel": 1},
    ),
    "conv_lstm1d": (
        lambda: keras.layers.ConvLSTM1D(4, 3),
        (FRAMES[:, :, 0],),
        {"conv_lstm_cell/kernel": 1, "conv_lstm_cell/recurrent_kernel": 1},
    ),
    "conv_lstm3d": (
        lambda: keras.layers.ConvLSTM3D(4, 2),
        (VOL_FRAMES,),
        {"conv_lstm_cell/kernel": 3, "conv_lstm_cell/recurrent_kernel": 3},
    ),
}


def masked_reference(wrapper, *inputs):
    """Output of the inner layer with its variables overwritten by variable * mask."""
    saved = [(pw.variable, pw.variable.numpy()) for pw in wrapper.pruned_weights]
    try:
        for pw in wrapper.pruned_weights:
            pw.variable.assign(pw.variable.numpy() * pw.mask.numpy())
        return np.asarray(wrapper.layer(*inputs))
    finally:
        for var, value in saved:
            var.assign(value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_forward_and_gradients_are_masked(case):
    make, inputs, expected = CASES[case]
    layer = make()
    dense_out = np.asarray(layer(*inputs))
    wrapper = Sparse24(layer)
    np.testing.assert_allclose(
        wrapper(*inputs), dense_out, rtol=1e-6, atol=1e-6
    )  # ones masks
    assert {pw.name: pw.axis for pw in wrapper.pruned_weights} == expected
    wrapper.update_masks()
    for pw in wrapper.pruned_weights:
        assert float(tf.reduce_mean(pw.mask)) == 0.5
        assert is_nm_sparse(wrapper.effective_weight(pw), "2:4", pw.axis)
    out = np.asarray(wrapper(*inputs))
    np.testing.assert_allclose(
        out, masked_reference(wrapper, *inputs), rtol=1e-5, atol=1e-6
    )
    assert np.abs(out - dense_out).max() > 1e-3  # the masks really changed the output

    variables = [pw.variable for pw in wrapper.pruned_weights]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(wrapper(*inputs)))
    for pw, grad in zip(wrapper.pruned_weights, tape.gradient(loss, variables)):
        grad = tf.convert_to_tensor(grad).numpy()
        mask = pw.mask.numpy()
        assert np.all(grad[mask == 0] == 0), pw.name
        assert np.count_nonzero(grad[mask == 1]) > 0, pw.name


def test_mha_fit_under_jit_updates_real_variables_and_keeps_24():
    inp = keras.Input((6, 8))
    h = Sparse24(keras.layers.MultiHeadAttention(2, 4, dropout=0.2))
    out = keras.layers.GlobalAveragePooling1D()(h(inp, inp))
    model = keras.Model(inp, out)
    h.update_masks()
    before = [pw.variable.numpy().copy() for pw in h.pruned_weights]
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse", jit_compile=True)
    (seed,) = [v for v in h.layer.non_trainable_variables if "seed_generator" in v.path]
    seed_before = seed.numpy().copy()
    model.fit(np.tile(SEQ, (4, 1, 1)), np.ones((8, 8), "float32"), epochs=2, verbose=0)
    assert not np.array_equal(seed.numpy(), seed_before)  # dropout RNG advances
    for pw, old in zip(h.pruned_weights, before):
        new, mask = pw.variable.numpy(), pw.mask.numpy()
        assert np.array_equal(
            new[mask == 0], old[mask == 0]
        )  # zero gradient, no momentum
        assert not np.array_equal(new[mask == 1], old[mask == 1])  # kept weights train
        assert is_nm_sparse(new * mask, "2:4", pw.axis)


class Projection(keras.layers.Layer):
    """A user layer naming its prunable kernel through the get_prunable_weights() protocol."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 4), name="w")
        self.skip_me = self.add_weight(shape=(input_shape[-1], 4), name="skip_me")

    def call(self, x):
        return x @ self.w + x @ self.skip_me

    def get_prunable_weights(self):
        return [self.w]


def test_user_layer_protocol_and_weights_mapping():
    x = SEQ[:, 0]
    layer = Projection()
    layer(x)
    protocol = Sparse24(layer)
    protocol(x)
    # A bare variable is grouped along ndim - 2, the input axis of x @ w.
    assert [(pw.name, pw.axis) for pw in protocol.pruned_weights] == [("w", 0)]
    protocol.update_masks()
    w, skip = (v.numpy().astype(np.float64) for v in (layer.w, layer.skip_me))
    expected = x @ (w * reference_mask(w, 2, 4, 0)) + x @ skip
    np.testing.assert_allclose(protocol(x), expected, rtol=1e-5, atol=1e-5)
    mapped = Sparse24(layer, weights={"w": 0, "skip_me": 0}, name="mapped")
    mapped(x)
    assert [pw.name for pw in mapped.pruned_weights] == ["w", "skip_me"]
    mapped.update_masks()
    np.testing.assert_allclose(mapped(x), masked_reference(mapped, x), atol=1e-6)


class _ProjectionWithBias(Projection):
    def get_prunable_weights(self):
        return [self.w, self.bias]

    def build(self, input_shape):
        super().build(input_shape)
        self.bias = self.add_weight(shape=(8,), name="bias")


def test_a_rank_1_weight_the_protocol_names_is_skipped_with_the_reason():
    layer = _ProjectionWithBias()
    layer.build((None, 8))
    eligible, reasons = tf_sparse24.registry.scan_layer(layer)
    assert [(path, axis) for path, _, axis in eligible] == [("w", 0)]
    assert reasons == ["bias has rank 1: nothing to group"]


def test_bad_specs_name_the_layer():
    dense = keras.layers.Dense(4, name="odd")
    dense(np.ones((1, 6), "float32"))
    with pytest.raises(ValueError, match=r"'odd'.*not a multiple of 4"):
        Sparse24(dense)(np.ones((1, 6), "float32"))
    dense8 = keras.layers.Dense(4, name="d8")
    dense8(np.ones((1, 8), "float32"))
    with pytest.raises(
        ValueError, match=r"'d8' has no variable 'kernal'.*'bias', 'kernel'"
    ):
        Sparse24(dense8, weights={"kernal": 0})(np.ones((1, 8), "float32"))
    with pytest.raises(ValueError, match="Received: pattern='2/4'"):
        Sparse24(dense8, pattern="2/4")
    depthwise = keras.layers.DepthwiseConv2D(3)
    depthwise(IMG)
    with pytest.raises(ValueError, match="depthwise"):
        Sparse24(depthwise)(IMG)


def _masked_model():
    inp = keras.Input((6, 8))
    h = Sparse24(keras.layers.MultiHeadAttention(2, 4), pattern="1:4")(inp, inp)
    h = Sparse24(keras.layers.LSTM(8))(h)
    out = Sparse24(keras.layers.Dense(4))(h)
    model = keras.Model(inp, out)
    for layer in model.layers:
        if isinstance(layer, Sparse24):
            layer.update_masks()
    return model


def _reset_masks(model):
    for layer in model.layers:
        if isinstance(layer, Sparse24):
            for pw in layer.pruned_weights:
                pw.mask.assign(tf.ones_like(pw.mask))


def _masks(model):
    return [
        pw.mask.numpy()
        for layer in model.layers
        if isinstance(layer, Sparse24)
        for pw in layer.pruned_weights
    ]


@pytest.mark.parametrize("suffix", [".keras", ".h5"])  # .h5: Keras' legacy whole-model format
def test_keras_file_round_trip(suffix, tmp_path):
    model = _masked_model()
    path = str(tmp_path / f"m{suffix}")
    model.save(path)
    loaded = keras.models.load_model(
        path
    )  # registered as tf_sparse24>Sparse24: no custom_objects
    assert [type(layer).__name__ for layer in loaded.layers] == [
        type(layer).__name__ for layer in model.layers
    ]
    assert loaded.layers[1].pattern == "1:4"
    for a, b in zip(_masks(model), _masks(loaded)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loaded(SEQ), model(SEQ), atol=1e-6)


def test_weights_h5_and_checkpoint_round_trips(tmp_path):
    model = _masked_model()
    expected = np.asarray(model(SEQ))
    model.save_weights(str(tmp_path / "m.weights.h5"))
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    _reset_masks(model)
    model.load_weights(str(tmp_path / "m.weights.h5"))
    np.testing.assert_allclose(model(SEQ), expected, atol=1e-6)

    _reset_masks(model)
    tf.train.Checkpoint(model=model).restore(prefix).assert_existing_objects_matched()
    assert all(
        float(tf.reduce_mean(m)) == (0.25 if i < 4 else 0.5)
        for i, m in enumerate(_masks(model))
    )
    np.testing.assert_allclose(model(SEQ), expected, atol=1e-6)


def test_keras_sequence_masks_pass_through_wrappers():
    tokens = np.array([[3, 4, 0, 0, 0], [1, 2, 3, 0, 0]])
    emb = keras.layers.Embedding(10, 8, mask_zero=True)
    dense, lstm, last = (
        keras.layers.Dense(8),
        keras.layers.LSTM(8, return_sequences=True),
        keras.layers.LSTM(4),
    )

    def build(wrap):
        inp = keras.Input((None,), dtype="int32")
        h = wrap(dense)(emb(inp))
        return keras.Model(inp, last(wrap(lstm)(h)))

    reference, wrapped = build(lambda layer: layer), build(Sparse24)
    np.testing.assert_allclose(wrapped(tokens), reference(tokens), atol=1e-6)
    out = np.asarray(wrapped(tokens))
    for row, length in ((0, 2), (1, 3)):  # masking padded steps == truncating them
        np.testing.assert_allclose(
            out[row],
            np.asarray(reference(tokens[row : row + 1, :length]))[0],
            atol=1e-5,
        )


def test_stateful_rnn_carries_its_state_like_the_unwrapped_layer():
    """Keras keeps a stateful RNN's state variables out of `layer.variables`."""
    def model(wrap):
        lstm = keras.layers.LSTM(8, stateful=True)
        return keras.Sequential([keras.Input((6, 8), batch_size=2), wrap(lstm)]), lstm
    plain, plain_lstm = model(lambda layer: layer)
    wrapped, lstm = model(Sparse24)
    (wrapper,) = wrapped.layers
    wrapper.update_masks()
    masks = {id(pw.variable): pw.mask.numpy() for pw in wrapper.pruned_weights}
    for mine, theirs in zip(plain_lstm.weights, lstm.weights):  # plain = the masked weights
        mine.assign(theirs.numpy() * masks.get(id(theirs), 1.0))
    outputs = [(np.asarray(plain(SEQ)), np.asarray(wrapped(SEQ))) for _ in range(3)]
    for expected, got in outputs:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(outputs[1][0] - outputs[0][0]).max() > 1e-3  # the state really moved
    for a, b in zip(plain_lstm.states, lstm.states):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    # Keras 3 models have no reset_states(): users reset every layer that has one.
    for layer in wrapped.layers:
        if hasattr(layer, "reset_state"):
            layer.reset_state()
    np.testing.assert_allclose(np.asarray(wrapped(SEQ)), outputs[0][0], rtol=1e-5, atol=1e-6)
    wrapper.reset_states()
    assert not hasattr(Sparse24(keras.layers.Dense(4)), "reset_state")  # a layer without state


class NormedDense(keras.layers.Layer):
    """A block with state that each training call updates (BatchNormalization)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="fc")
        self.norm = keras.layers.BatchNormalization(momentum=0.9, name="bn")

    def call(self, x, training=None):
        return self.norm(self.dense(x), training=training)


@pytest.mark.parametrize("kind", ["numpy", "variable"])
def test_first_eager_call_of_an_unbuilt_wrapper_runs_the_layer_once(kind):
    x = np.random.default_rng(4).normal(size=(16, 12)).astype("float32")
    wrapper = Sparse24(NormedDense(), weights={"fc/kernel": 0})  # unbuilt: built by the call
    wrapper(x if kind == "numpy" else tf.Variable(x), training=True)
    block = wrapper.layer
    kernel, bias = (w.numpy().astype(np.float64) for w in (block.dense.kernel, block.dense.bias))
    batch_mean = (x.astype(np.float64) @ kernel + bias).mean(axis=0)  # masks are ones
    # One update from 0 with momentum 0.9; a second call would make it 0.1 + 0.09 of the mean.
    moving_mean = block.norm.moving_mean.numpy()
    np.testing.assert_allclose(moving_mean, 0.1 * batch_mean, rtol=1e-5, atol=1e-7)


class RaggedDense(keras.layers.Layer):
    """Takes a ragged batch, which a symbolic call cannot stand for."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="fc")

    def call(self, x):
        return self.dense(x.to_tensor(shape=[None, 8]))


def test_first_call_with_inputs_a_symbolic_call_cannot_stand_for():
    ragged = tf.ragged.constant([[1.0] * 8, [2.0] * 4])
    dense = ragged.to_tensor(shape=[None, 8]).numpy()
    unbuilt = Sparse24(RaggedDense(), weights={"fc/kernel": 0})  # the real call builds it
    got = np.asarray(unbuilt(ragged))
    layer = unbuilt.layer.dense
    kernel, bias = (w.numpy().astype(np.float64) for w in (layer.kernel, layer.bias))
    # float64 reference; float32 summation order may differ by an ulp of the terms (~1e-7)
    np.testing.assert_allclose(got, dense @ kernel + bias, rtol=1e-6, atol=1e-6)


class DataDependent(keras.layers.Layer):
    """No build(); its call needs the data in Python, so a symbolic call cannot trace it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="fc")

    def call(self, x):
        return self.dense(x * 0 if float(keras.ops.max(x)) > 1e9 else x)


def test_first_call_of_a_layer_a_symbolic_call_cannot_trace():
    x = np.random.default_rng(5).normal(size=(4, 8)).astype("float32")
    wrapper = Sparse24(DataDependent(), weights={"fc/kernel": 0})
    got = np.asarray(wrapper(x))  # Keras marks it built after the failed trace: still built
    layer = wrapper.layer.dense
    np.testing.assert_allclose(got, x @ layer.kernel.numpy() + layer.bias.numpy(), rtol=1e-5)


def test_regularizers_see_the_effective_weight():
    """Keras evaluates kernel regularizers on the raw variable, outside the wrapper's scope."""
    layer = keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.1))
    wrapper = Sparse24(layer)
    wrapper(SEQ[:, 0])
    wrapper.update_masks()
    (pw,) = wrapper.pruned_weights
    effective = pw.variable.numpy().astype(np.float64) * pw.mask.numpy()
    (loss,) = wrapper.losses
    np.testing.assert_allclose(float(loss), 0.1 * np.sum(effective**2), rtol=1e-5)
    with tf.GradientTape() as tape:
        total = tf.add_n(wrapper.losses)
    grad = tape.gradient(total, pw.variable).numpy()
    assert np.all(grad[pw.mask.numpy() == 0] == 0)
    np.testing.assert_allclose(grad, 0.2 * effective, rtol=1e-5, atol=1e-7)


def test_a_layer_wrapped_again_regularizes_and_constrains_the_new_wrappers_effective_weight():
    # The second wrapper kept the first one's masked regularizer and constraint: its loss and
    # constraint used the first wrapper's 2:4 mask, not its own 1:4 one.
    layer = keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(1.0),
                               kernel_constraint=keras.constraints.NonNeg())
    first = Sparse24(layer)
    first(SEQ[:, 0])
    first.update_masks()
    # New weights, so that the second wrapper keeps positions the first one pruned: a 1:4 mask of
    # the same weights lies inside their 2:4 one, and both masks applied would look like one.
    layer.kernel.assign(np.random.default_rng(5).normal(size=layer.kernel.shape))
    second = Sparse24(layer, pattern="1:4")
    second(SEQ[:, 0])
    second.update_masks()
    (pw,) = second.pruned_weights
    w, mask = pw.variable.numpy().astype(np.float64), pw.mask.numpy()
    first_mask = first.pruned_weights[0].mask.numpy()
    assert np.any((mask == 1) & (first_mask == 0) & (w < 0))  # where the two wrappers differ
    (loss,) = second.losses
    np.testing.assert_allclose(float(loss), np.sum((w * mask) ** 2), rtol=1e-5)
    constrained = pw.variable.constraint(pw.variable).numpy()
    np.testing.assert_array_equal(constrained, np.where(mask == 1, np.maximum(w, 0), w))


def test_lora_enabled_after_wrapping_is_refused_by_name():
    wrapper = Sparse24(keras.layers.Dense(4, name="proj"))
    wrapper(SEQ[:, 0])
    wrapper.layer.enable_lora(2)
    with pytest.raises(ValueError, match=r"LoRA is enabled on \['proj'\]"):
        wrapper(SEQ[:, 0])


def test_output_shape_is_the_wrapped_layers():
    wrapper = Sparse24(keras.layers.Dense(4))
    assert wrapper.compute_output_shape((None, 6, 8)) == (None, 6, 4)
    inp = keras.Input((6, 8))
    out = keras.layers.TimeDistributed(Sparse24(keras.layers.Dense(4)))(inp)
    assert tuple(out.shape) == (None, 6, 4)


def test_constraints_hold_for_the_effective_weight():
    """Keras applies a kernel constraint to the raw variable after each update: masked, the weight
    the forward uses satisfies it and pruned positions do not move (plain SGD)."""
    inp = keras.Input((8,))
    wrapper = Sparse24(
        keras.layers.Dense(8, kernel_constraint=keras.constraints.UnitNorm(axis=0))
    )
    model = keras.Model(inp, wrapper(inp))
    wrapper.update_masks()
    (pw,) = wrapper.pruned_weights
    before = pw.variable.numpy().copy()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(SEQ[:, 0].repeat(4, 0), np.ones((8, 8), "float32"), epochs=2, verbose=0)
    effective = pw.variable.numpy().astype(np.float64) * pw.mask.numpy()
    np.testing.assert_allclose(np.linalg.norm(effective, axis=0), 1.0, rtol=1e-5)
    pruned = pw.mask.numpy() == 0
    np.testing.assert_array_equal(pw.variable.numpy()[pruned], before[pruned])


REMAT_SCOPES = {
    "full": {"mode": "full"},
    "larger_than": {"mode": "larger_than", "output_size_threshold": 1},
    "list_of_layers": {"mode": "list_of_layers", "layer_names": ["conv", "sparse24_conv"]},
    "activations": {"mode": "activations"},
}


@pytest.mark.parametrize("scope", sorted(REMAT_SCOPES))
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_layers_made_under_a_remat_scope_train_their_kept_weights(scope, graph):
    """Keras recomputes a layer's call made under a RematScope with tf.recompute_grad, which gave
    a wrapped kernel no gradient at all: the wrapper turns that off (once, with a warning) and the
    gradient is a plain layer's on the effective weight, masked. Recomputed activations are kept."""
    with keras.RematScope(**REMAT_SCOPES[scope]):
        wrapper = Sparse24(keras.layers.Conv2D(4, 3, activation="relu", name="conv"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        wrapper(IMG)
    wrapper.update_masks()
    (pw,) = wrapper.pruned_weights
    plain = keras.layers.Conv2D(4, 3, activation="relu")
    plain(IMG)
    plain.set_weights([np.asarray(wrapper.effective_weight(pw)), wrapper.layer.bias.numpy()])

    def grad(layer, variable):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(IMG)))
        return tape.gradient(loss, variable)

    def wrapper_grad():
        return grad(wrapper, pw.variable)

    run = tf.function(wrapper_grad) if graph else wrapper_grad
    with warnings.catch_warnings(record=True) as said_later:
        warnings.simplefilter("always")
        got = [run() for _ in range(2)]
    expected = np.asarray(grad(plain, plain.kernel)) * pw.mask.numpy()
    for g in got:
        assert g is not None
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(expected) > 0
    dropped = [w for w in said + said_later if "RematScope does not rematerialize" in str(w)]
    assert len(dropped) == (scope != "activations")  # once


def test_a_layer_that_assigns_its_own_kernel_keeps_the_pruned_positions():
    """SpectralNormalization assigns kernel / sigma in a training call. Made from the masked
    kernel, that value is zero at the pruned positions: only the kept ones may take it, or a later
    mask recomputation could never bring the others back."""
    keras.utils.set_random_seed(0)
    x = SEQ[:, 0]
    wrapper = Sparse24(keras.layers.SpectralNormalization(keras.layers.Dense(8)),
                       weights={"kernel": 0})  # as prune() finds it
    wrapper(x)
    wrapper.update_masks()
    (pw,) = wrapper.pruned_weights
    before, kept = pw.variable.numpy().copy(), pw.mask.numpy() == 1
    twin = keras.layers.SpectralNormalization(keras.layers.Dense(8))
    twin(x)
    twin.set_weights([np.asarray(wrapper.effective_weight(pw)) if w is pw.variable else w.numpy()
                      for w in wrapper.layer.weights])
    np.testing.assert_allclose(wrapper(x, training=True), twin(x, training=True), rtol=1e-5)
    after = pw.variable.numpy()
    np.testing.assert_array_equal(after[~kept], before[~kept])
    np.testing.assert_allclose(after[kept], twin.layer.kernel.numpy()[kept], rtol=1e-6)
    assert np.abs(after[kept] - before[kept]).max() > 1e-3  # the layer did assign its kernel


def rnn_model(seed):
    """Automatic sublayer names: a second copy in this process gets other ones (`lstm_cell_3`)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 8))
    h = keras.layers.RNN(keras.layers.LSTMCell(8), return_sequences=True)(inp)
    return keras.Model(inp, keras.layers.Bidirectional(keras.layers.GRU(8))(h))


def test_checkpoint_restores_masks_into_a_model_made_again_with_other_names(tmp_path):
    saved = tf_sparse24.prune(rnn_model(0))
    path = tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt"))
    restored = tf_sparse24.prune(rnn_model(1))
    names = [[pw.mask.name for pw in w.pruned_weights] for w in tf_sparse24.pruned_layers(restored)]
    assert names != [[pw.mask.name for pw in w.pruned_weights]
                     for w in tf_sparse24.pruned_layers(saved)]  # other automatic names
    tf.train.Checkpoint(model=restored).read(path).assert_existing_objects_matched()
    for a, b in zip(tf_sparse24.pruned_layers(saved), tf_sparse24.pruned_layers(restored)):
        for pa, pb in zip(a.pruned_weights, b.pruned_weights):
            np.testing.assert_array_equal(pa.mask.numpy(), pb.mask.numpy())
    np.testing.assert_array_equal(np.asarray(restored(SEQ)), np.asarray(saved(SEQ)))


def test_checkpoint_with_masks_named_by_path_still_restores(tmp_path):
    """Checkpoints written before masks were tracked by position name them by their path."""
    from tensorflow.python.trackable.autotrackable import AutoTrackable

    inp = keras.Input((6, 8))
    cell = keras.layers.LSTMCell(8, name="cell")
    model = tf_sparse24.prune(keras.Model(inp, keras.layers.RNN(cell, name="rnn")(inp)))
    (wrapper,) = tf_sparse24.pruned_layers(model)
    old, node = AutoTrackable(), AutoTrackable()
    old._operations = [AutoTrackable(), node]  # the wrapper is the model's operation 1
    rng = np.random.default_rng(0)
    want = [rng.integers(0, 2, pw.mask.shape).astype("float32") for pw in wrapper.pruned_weights]
    for pw, value in zip(wrapper.pruned_weights, want):
        setattr(node, pw.mask.name, tf.Variable(value))  # "cell_kernel_mask", ...
    path = tf.train.Checkpoint(model=old).write(str(tmp_path / "old"))
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    for pw, value in zip(wrapper.pruned_weights, want):
        np.testing.assert_array_equal(pw.mask.numpy(), value)


@pytest.mark.parametrize("saved_pattern, pattern", [("2:4", "1:4"), ("1:4", "2:4")])
def test_checkpoint_from_another_pattern_is_refused_before_anything_is_restored(
    tmp_path, saved_pattern, pattern
):
    saved = tf_sparse24.prune(rnn_model(0), saved_pattern)
    path = tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt"))
    model = tf_sparse24.prune(rnn_model(1), pattern)
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match=f"written from a model pruned {saved_pattern}, but this "
                                         f"layer is {pattern}"):
        tf.train.Checkpoint(model=model).read(path)
    for w, value in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), value, err_msg=w.path)
    assert all(r.valid for r in tf_sparse24.report(model, print_fn=None) if r.status == "pruned")
    same = tf_sparse24.prune(rnn_model(2), saved_pattern)
    tf.train.Checkpoint(model=same).read(path).assert_consumed()
    np.testing.assert_array_equal(np.asarray(same(SEQ)), np.asarray(saved(SEQ)))


def test_checkpoint_from_another_pattern_restored_before_build_fails_at_the_build(tmp_path):
    def model(pattern):
        return keras.Sequential([Sparse24(keras.layers.Dense(8), pattern), Sparse24(
            keras.layers.Dense(4), pattern)])

    saved = model("2:4")
    saved(SEQ)
    path = tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt"))
    unbuilt = model("1:4")
    tf.train.Checkpoint(model=unbuilt).read(path)  # deferred: no layer is tracked yet
    with pytest.raises(ValueError, match="pruned 2:4, but this layer is 1:4"):
        unbuilt(SEQ)


def mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(4)])


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_checkpoint_of_the_model_before_prune_is_refused_before_anything_is_restored(
    tmp_path, with_optimizer
):
    """A checkpoint of the unpruned model holds each layer where the pruned one has a wrapper:
    it restored nothing into the wrappers (a warning at exit), and the run went on from the
    weights and masks prune() saw. The recipe (restore, then prune) gives the checkpoint's
    weights their numpy magnitude masks."""
    dense = mlp(0)
    path = tf.train.Checkpoint(model=dense).write(str(tmp_path / "dense"))
    model = tf_sparse24.prune(mlp(1))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")  # optimizer not built yet
    parts = {"model": model, "optimizer": model.optimizer} if with_optimizer else {"model": model}
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match="holds the unwrapped layer .* before prune()"):
        tf.train.Checkpoint(**parts).read(path)
    for w, value in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), value, err_msg=w.path)

    unbuilt = keras.Sequential([Sparse24(keras.layers.Dense(8)), Sparse24(keras.layers.Dense(4))])
    tf.train.Checkpoint(model=unbuilt).read(path)  # deferred: refused when the layers exist
    with pytest.raises(ValueError, match="holds the unwrapped layer"):
        unbuilt(np.ones((1, 8), "float32"))

    again = mlp(2)
    tf.train.Checkpoint(model=again).read(path).assert_consumed()
    for w, layer in zip(tf_sparse24.pruned_layers(tf_sparse24.prune(again)), dense.layers):
        np.testing.assert_array_equal(
            w.pruned_weights[0].mask.numpy(), reference_mask(layer.kernel.numpy(), 2, 4, 0))


def test_containers_written_by_hand_find_the_weights_inside():
    """Sparse24(Bidirectional(LSTM)) and Sparse24(TimeDistributed(Dense)) without `weights`."""
    bi = Sparse24(keras.layers.Bidirectional(keras.layers.LSTM(8, name="lstm")))
    bi(SEQ)
    assert {pw.name: pw.axis for pw in bi.pruned_weights} == {
        f"{d}_lstm/lstm_cell/{k}": 0
        for d in ("forward", "backward")
        for k in ("kernel", "recurrent_kernel")
    }
    td = Sparse24(keras.layers.TimeDistributed(keras.layers.Dense(4, name="inner")))
    td(SEQ)
    assert [(pw.name, pw.axis) for pw in td.pruned_weights] == [("inner/kernel", 0)]


@keras.saving.register_keras_serializable(package="test_wrapper")
class Block(keras.layers.Layer):
    """A user block: a Dense and an already wrapped Dense as attributes, a norm of no kind."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.out = Sparse24(keras.layers.Dense(4, name="out"))

    def build(self, shape):
        self.proj.build(shape)
        self.norm.build((*shape[:-1], 8))
        self.out.build((*shape[:-1], 8))

    def call(self, x):
        return self.out(self.norm(self.proj(x)))


def test_a_block_written_by_hand_finds_the_weights_of_the_layers_inside(tmp_path):
    """As prune() plans a block of a Functional model; the wrapper inside keeps its own kernel."""
    x = SEQ[:, 0]
    wrapper = Sparse24(Block(name="blk"))
    wrapper(x)
    assert [(pw.name, pw.axis) for pw in wrapper.pruned_weights] == [("proj/kernel", 0)]
    wrapper.update_masks()
    wrapper.layer.out.update_masks()
    kernel = wrapper.layer.proj.kernel.numpy().astype(np.float64)
    h = x @ (kernel * reference_mask(kernel, 2, 4, 0)) + wrapper.layer.proj.bias.numpy()
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-3)
    out = wrapper.layer.out.layer
    w = out.kernel.numpy().astype(np.float64)
    want = h @ (w * reference_mask(w, 2, 4, 0)) + out.bias.numpy()
    np.testing.assert_allclose(wrapper(x), want, rtol=1e-5, atol=1e-5)
    model = keras.Sequential([keras.Input((8,)), wrapper])
    model.save(tmp_path / "block.keras")
    loaded = keras.models.load_model(tmp_path / "block.keras")
    np.testing.assert_allclose(loaded(x), want, rtol=1e-5, atol=1e-5)
    empty = Sparse24(keras.layers.Dropout(0.1), name="nothing")
    with pytest.raises(ValueError, match=r"not a prunable kind, nor any layer inside it.*weights="):
        empty(x)


def test_an_axis_the_weight_does_not_have_is_refused_not_wrapped_around():
    x = SEQ[:, 0]
    dense = keras.layers.Dense(8, name="d")
    dense(x)
    for axis in (2, -3):
        wrapper = Sparse24(dense, weights={"kernel": 0, "bias": axis})
        with pytest.raises(ValueError, match=rf"'d': weight 'bias' \(8,\) has no axis {axis}"):
            wrapper(x)
        assert not wrapper.pruned_weights and not wrapper.weights[2:]  # nothing made
    with pytest.raises(ValueError, match=r"weight 'kernel' \(8, 8\) has no axis 2 \(axes -2..1\)"):
        Sparse24(dense, weights={"kernel": 2})(x)

    class Counted(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 4), name="w")
            self.count = self.add_weight(shape=(), dtype="int32", name="count", trainable=False)

        def call(self, x):
            return x @ self.w

        def get_prunable_weights(self):
            return [(self.w, 5)]

    counted = Counted(name="counted")
    counted(x)
    with pytest.raises(ValueError, match=r"'counted': weight 'count' \(\) has no axis 0: a scalar"):
        Sparse24(counted, weights={"w": 0, "count": 0})(x)
    with pytest.raises(ValueError, match=r"returned counted/w \(8, 4\) with axis 5"):
        Sparse24(counted)(x)


@pytest.mark.parametrize("dtype, tol", [("float16", 1e-2), ("bfloat16", 5e-2), ("float64", 1e-12)])
def test_a_layer_of_another_float_dtype_runs_in_its_own_dtype(dtype, tol):
    """A Dense(dtype="float16") etc. in a float32 world: its weights are mapped in its dtype (they
    were cast to floatx, and the layer refused the float32 bias)."""
    wrapper = Sparse24(keras.layers.Dense(4, dtype=dtype))
    wrapper.build((None, 8))
    rng = np.random.default_rng(11)
    for v in wrapper.layer.weights:
        v.assign(rng.normal(size=v.shape))
    wrapper.update_masks()
    x = rng.normal(size=(3, 8))
    kernel, bias = (np.asarray(v.numpy(), np.float64) for v in wrapper.layer.weights)
    mask = np.asarray(wrapper.pruned_weights[0].mask.numpy(), np.float64)
    with tf.GradientTape() as tape:
        y = wrapper(tf.cast(x, dtype))
        loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(tf.cast(y, tf.float64)), x @ (kernel * mask) + bias,
                               rtol=tol, atol=tol)
    grad = tape.gradient(loss, wrapper.layer.kernel)
    assert np.all(np.asarray(tf.cast(grad, tf.float64))[mask == 0] == 0)


class _CachedBlock(keras.layers.Layer):
    """keras_hub's decoder call: a tensor cache and a Python int index as keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")

    def build(self, input_shape):
        self.proj.build(input_shape)

    def call(self, x, cache=None, cache_update_index=0):
        y = self.proj(x)
        return y, keras.ops.slice_update(cache, (0, cache_update_index, 0), y)


def test_wrapper_takes_tensor_and_python_keyword_arguments_together():
    # Bound as one **kwargs argument, Keras refused a mix of tensors and Python values.
    rng = np.random.default_rng(0)
    inp = keras.Input((6, 16))
    mask = keras.Input((6, 6), dtype="bool")
    mha = keras.layers.MultiHeadAttention(2, 8, name="mha")
    model = keras.Model([inp, mask], mha(inp, inp, attention_mask=mask, use_causal_mask=True))
    x = rng.normal(size=(2, 6, 16)).astype("float32")
    m = rng.random((2, 6, 6)) > 0.3
    pruned = tf_sparse24.prune(model)
    # Reference: Keras' own layer with numpy top-2-of-4 masked kernels.
    reference = keras.layers.MultiHeadAttention(2, 8)
    reference(x, x)
    for name in ("query", "key", "value", "output"):
        kernel = getattr(mha, f"_{name}_dense").kernel.numpy()
        keep = reference_mask(kernel, 2, 4, axis=1 if name == "output" else 0)
        getattr(reference, f"_{name}_dense").kernel.assign(kernel * keep)
        getattr(reference, f"_{name}_dense").bias.assign(getattr(mha, f"_{name}_dense").bias)
    expected = reference(x, x, attention_mask=m, use_causal_mask=True)
    np.testing.assert_allclose(pruned([x, m]), expected, rtol=1e-5, atol=1e-5)

    block = _CachedBlock()
    block.build((None, None, 8))
    wrapped = Sparse24(block, weights={"proj/kernel": 0})
    wrapped.build()
    wrapped.update_masks()
    cache = np.zeros((1, 4, 8), "float32")
    y, new_cache = wrapped(np.ones((1, 1, 8), "float32"), cache=cache, cache_update_index=2)
    np.testing.assert_array_equal(new_cache[0, 2:3], y[0])
    np.testing.assert_array_equal(new_cache[0, :2], 0.0)


class _Repeat(keras.layers.Layer):
    """Takes a Python int positionally (`block(x, 2)`) and keeps its input's dtype: two
    per-instance __call__ policies Keras lets a layer set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")
        self._allow_non_tensor_positional_args = True
        self._convert_input_args = False

    def build(self, input_shape):
        self.proj.build(input_shape)

    def call(self, x, times=1):
        seen = x.dtype
        for _ in range(times):
            x = self.proj(x)
        return x, tf.constant(seen.name)


def test_wrapper_follows_the_layers_positional_and_input_cast_policies():
    block = _Repeat()
    block.build((None, 8))
    wrapped = Sparse24(block, weights={"proj/kernel": 0})
    wrapped.build()
    wrapped.update_masks()
    x = np.random.default_rng(0).normal(size=(3, 8)).astype("float32")
    kernel = block.proj.kernel.numpy() * wrapped.pruned_weights[0].mask.numpy()
    expected = (x @ kernel + block.proj.bias.numpy()) @ kernel + block.proj.bias.numpy()
    y, _ = wrapped(x, 2)  # Keras refused a positional Python value for the wrapper
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    _, seen = wrapped(tf.constant(x, tf.float64))
    assert seen.numpy() == b"float64"  # not cast to the wrapper's float32 first


def test_weights_named_out_of_variable_order_keep_their_masks_through_a_keras_file(tmp_path):
    # Positions saved in the config follow `weights`, not the layer's variable order: sorted, they
    # paired each path with the other's axis and mask, and a reloaded LSTM (kernel and
    # recurrent_kernel both [8, 32]) silently ran with the two masks swapped.
    inp = keras.Input((6, 8))
    wrapper = Sparse24(keras.layers.LSTM(8, name="lstm"), weights={
        "lstm_cell/recurrent_kernel": 0, "lstm_cell/kernel": 0})
    model = keras.Model(inp, wrapper(inp))
    wrapper.update_masks()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path).layers[1]
    assert [pw.name for pw in loaded.pruned_weights] == [
        "lstm_cell/recurrent_kernel", "lstm_cell/kernel"]
    for pw, original in zip(loaded.pruned_weights, wrapper.pruned_weights, strict=True):
        w = original.variable.numpy()
        np.testing.assert_array_equal(pw.mask.numpy(), reference_mask(w, 2, 4, 0))
        np.testing.assert_array_equal(pw.variable.numpy(), w)
    np.testing.assert_allclose(loaded(SEQ), masked_reference(wrapper, SEQ), rtol=1e-5, atol=1e-6)
