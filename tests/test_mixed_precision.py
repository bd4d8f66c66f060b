"""Mixed precision and XLA: masks stay exact in the float32 master weights and in the cast compute
weights, loss scaling skips overflowing steps without touching masks, and jit_compile=True trains
the same model as eager/graph mode.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import scenario

import tf_sparse24
from tf_sparse24 import format as fmt

COMPUTE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


@contextlib.contextmanager
def global_policy(name: str):
    """Sets Keras' global dtype policy and always restores the previous one."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def kernels(model) -> dict[str, np.ndarray]:
    return {f"{layer.name}/kernel": layer.kernel.numpy() for layer in model.layers}


def fine_tune(policy: str, jit_compile: bool, epochs: int = 1):
    """Prunes the tiny model under `policy` and fine-tunes it; returns (model, initial kernels)."""
    with global_policy(policy):
        dense = scenario.dense_model(seed=0)
        initial = kernels(dense)
        model = tf_sparse24.prune(dense)
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", jit_compile=jit_compile)
        x, y = scenario.data()
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[tf_sparse24.Sparse24Callback()],
        )
    return model, initial


def probe_compute_weight(wrapper, dtype: str) -> np.ndarray:
    """Which kernel entries the wrapped Dense multiplies with, as non-zero in its compute dtype.

    Row k of `layer(e_k) - layer(0)` is the compute-dtype kernel row k (the bias cancels exactly
    wherever the kernel entry is zero), so entries equal to the zero-input output are exact zeros.
    """
    k = wrapper.layer.kernel.shape[0]
    eye = wrapper(np.eye(k, dtype="float32"))
    zero = wrapper(np.zeros((k, k), "float32"))
    got = keras.backend.standardize_dtype(eye.dtype)
    assert got == dtype, f"{wrapper.name} computes in {got}, expected {dtype}"
    return np.asarray(eye != zero)


@pytest.mark.parametrize("policy", sorted(COMPUTE))
def test_mixed_precision_masks_exact_in_master_and_compute_weights(policy):
    model, initial = fine_tune(policy, jit_compile=True)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    with global_policy(policy):
        for wrapper in tf_sparse24.pruned_layers(model):
            (pw,) = wrapper.pruned_weights
            key = f"{wrapper.layer.name}/kernel"
            assert pw.variable.dtype == "float32" and pw.mask.dtype == "float32", key
            mask = pw.mask.numpy()
            np.testing.assert_array_equal(mask, scenario.magnitude_mask(initial[key], pw.axis), key)
            effective = np.asarray(wrapper.effective_weight(pw))
            assert scenario.is_nm(effective, pw.axis) and not effective[mask == 0].any(), key
            used = probe_compute_weight(wrapper, COMPUTE[policy])
            assert not used[mask == 0].any(), (
                f"{key}: {COMPUTE[policy]} compute weight non-zero where masked"
            )
            assert scenario.is_nm(used, pw.axis), key

        x, _ = scenario.data(8, seed=5)
        np.testing.assert_allclose(
            np.asarray(model(x), np.float64), float64_forward(model, x), rtol=0.05, atol=0.05
        )


def float64_forward(model, x: np.ndarray) -> np.ndarray:
    """Numpy float64 forward of the tiny model from its effective (masked) weights."""
    hidden, out = tf_sparse24.pruned_layers(model)

    def dense(wrapper, h):
        return (
            h @ np.asarray(wrapper.effective_weight(wrapper.pruned_weights[0]), np.float64)
            + wrapper.layer.bias.numpy()
        )

    return dense(out, np.maximum(dense(hidden, x.astype(np.float64)), 0))


def test_loss_scaling_skips_overflow_steps_and_keeps_masks():
    with global_policy("mixed_float16"):
        model = tf_sparse24.prune(scenario.dense_model(seed=0))
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=2.0**24
        )
        model.compile(optimizer, "mse", jit_compile=True)
        x, y = scenario.data(16)
        before = {k: v["variable"] for k, v in scenario.pruned_state(model).items()}
        masks = {k: v["mask"] for k, v in scenario.pruned_state(model).items()}
        model.train_on_batch(x, y)  # 2**24 overflows float16 gradients: the step must be skipped
        assert float(optimizer.dynamic_scale.numpy()) < 2.0**24
        for key, state in scenario.pruned_state(model).items():
            np.testing.assert_array_equal(
                state["variable"], before[key], f"{key}: skipped step changed weights"
            )
        for _ in range(14):
            model.train_on_batch(x, y)
        after = scenario.pruned_state(model)
    assert any(not np.array_equal(after[k]["variable"], before[k]) for k in after), (
        "no step was ever applied"
    )
    for key, state in after.items():
        axis = int(state["axis"])
        assert np.isfinite(state["variable"]).all(), key
        np.testing.assert_array_equal(state["mask"], masks[key], key)
        assert scenario.is_nm(state["effective"], axis), key
        pruned = masks[key] == 0
        np.testing.assert_array_equal(
            state["variable"][pruned],
            before[key][pruned],
            f"{key}: pruned positions received updates",
        )


def test_jit_compile_trains_like_graph_mode():
    jit, _ = fine_tune("float32", jit_compile=True)
    graph, _ = fine_tune("float32", jit_compile=False)
    jit_state, graph_state = scenario.pruned_state(jit), scenario.pruned_state(graph)
    for key, state in graph_state.items():
        np.testing.assert_array_equal(jit_state[key]["mask"], state["mask"], key)
        assert scenario.is_nm(jit_state[key]["effective"], int(state["axis"])), key
        np.testing.assert_allclose(
            jit_state[key]["effective"], state["effective"], rtol=1e-4, atol=1e-6
        )


class PlainLinear(keras.layers.Layer):
    """A user layer without compute_output_shape: Keras traces its call for the output spec."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")

    def call(self, x):
        return x @ self.kernel

    def get_prunable_weights(self):
        return [self.kernel]


@pytest.mark.parametrize("make", [lambda: keras.layers.Dense(4, dtype="float32"),
                                  lambda: PlainLinear(dtype="float32")])
def test_a_float32_layer_under_mixed_precision_keeps_float32_when_wrapped(make):
    """The wrapper takes the wrapped layer's policy, not the global one (no 16-bit input cast)."""
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
    with global_policy("mixed_float16"):
        inner = make()
        wrapper = tf_sparse24.Sparse24(inner)
        symbolic = wrapper(keras.Input((8,)))
        assert symbolic.dtype == "float32"
        wrapper.update_masks()
        got = np.asarray(wrapper(x))
    (pw,) = wrapper.pruned_weights
    want = x.astype(np.float64) @ (pw.variable.numpy() * pw.mask.numpy())  # float32 math
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_a_layer_that_does_not_autocast_keeps_float32_when_pruned_stripped_and_exported(
        mode, tmp_path):
    """Dense(autocast=False) multiplies its float32 kernel under mixed precision; Keras' config
    leaves the flag out, so copies (prune, strip) and the export must carry it themselves."""
    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((16,), name="x")  # straight from the float32 input: no cast
        head = keras.layers.Dense(8, name="head", autocast=False)
        model = keras.Model(inputs, head(inputs))
        pruned = tf_sparse24.prune(model)
        stripped = tf_sparse24.strip(pruned)
    (pw,) = pruned.get_layer("sparse24_head").pruned_weights
    want = x.astype(np.float64) @ (pw.variable.numpy() * pw.mask.numpy()) + head.bias.numpy()
    for net in (pruned, stripped):
        got = np.asarray(net(x))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32 math
    metadata = tf_sparse24.export(pruned, tmp_path / "1", mode)
    assert {e["layer"]: e["dtype"] for e in metadata["sparse"]}["head"] == "float32"
    served = tf_sparse24.load(tmp_path / "1").signatures["serving_default"](x=tf.constant(x))
    np.testing.assert_allclose(served["head"].numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", sorted(COMPUTE))
@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_export_stores_16_bit_compute_weights_and_serves_the_same(policy, mode, tmp_path):
    """Under mixed precision a pruned weight is stored in its layer's compute dtype (what Keras
    multiplies with), a float32 layer's in float32; the served outputs match the model."""
    with global_policy(policy):
        inp = keras.Input((6, 16), name="x")
        h = keras.layers.Conv1D(16, 3, padding="same", name="conv")(inp)  # dense at load
        h = keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h)
        h = keras.layers.LSTM(16, return_sequences=True, name="lstm")(h)  # read in a while loop
        h = keras.layers.Dense(16, activation="relu", name="fc")(h)
        out = keras.layers.Dense(4, dtype="float32", name="head")(h)
        model = tf_sparse24.prune(keras.Model(inp, out))
    export_dir = str(tmp_path / "1")
    metadata = tf_sparse24.export(model, export_dir, mode=mode)
    compute = COMPUTE[policy]
    effective = {
        pw.variable.path: (layer, pw)
        for layer in tf_sparse24.pruned_layers(model)
        for pw in layer.pruned_weights
    }
    loaded = tf_sparse24.load(export_dir)
    assert len(metadata["sparse"]) == 9  # conv, 4 attention kernels, 2 LSTM kernels, fc, head
    for entry, values, meta in zip(metadata["sparse"], loaded.sparse_values, loaded.sparse_meta):
        want = "float32" if entry["layer"] == "head" else compute
        assert (entry["dtype"], entry["variable_dtype"]) == (want, "float32"), entry["name"]
        layer, pw = effective[entry["name"]]
        # Exactly Keras' own cast of the masked float32 weight (float32 holds both exactly).
        cast = tf.cast(layer.effective_weight(pw), want).numpy()
        rebuilt = fmt.decompress(values.numpy(), meta.numpy(), entry["k"])
        assert rebuilt.dtype == cast.dtype
        np.testing.assert_array_equal(
            rebuilt.astype(np.float32), fmt.to_2d(cast, pw.axis).astype(np.float32)
        )
    report = tf_sparse24.verify_export(export_dir, against=model)
    if mode == "portable":  # the same kernels and ops as Keras' own forward
        assert report["max_abs_diff"]["head"] == 0.0
    fc = next(e for e in metadata["sparse"] if e["layer"] == "fc")
    assert fc["values"]["bytes"] == 16 * 16 // 2 * 2  # half the elements, 2 bytes each


@keras.saving.register_keras_serializable(package="test_mixed_precision")
class RoutedBlock(keras.layers.Layer):
    """A 16-bit block with a float32 sublayer (a router or gate kept in float32)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.router = keras.layers.Dense(8, dtype="float32", name="router")

    def build(self, input_shape):
        self.router.build(input_shape)

    def call(self, x):
        return self.router(x)


def test_a_float32_sublayer_of_a_wrapped_block_keeps_float32_weights():
    """The wrapper maps weights in their own dtype: a float32 sublayer is not rounded to 16 bits."""
    with global_policy("mixed_bfloat16"):
        inp = keras.Input((64,))
        model = tf_sparse24.prune(keras.Model(inp, RoutedBlock(name="block")(inp)))
    (wrapper,) = tf_sparse24.pruned_layers(model)
    (pw,) = wrapper.pruned_weights
    x = np.random.default_rng(0).standard_normal((16, 64)).astype("float32")
    x16 = np.asarray(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32"), np.float64)
    effective = pw.variable.numpy().astype(np.float64) * pw.mask.numpy()
    want = x16 @ effective  # the block casts its input to bfloat16; the router computes in float32
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(tf_sparse24.strip(model)(x)))


def test_srste_masks_are_computed_from_float32_weights_under_mixed_precision():
    """0.5 and 0.5001 tie in bfloat16: the forward's mask must be the float32 one that strip,
    export and report use."""
    with global_policy("mixed_bfloat16"):
        inp = keras.Input((4,))
        dense = keras.layers.Dense(1, use_bias=False)
        model = tf_sparse24.prune(keras.Model(inp, dense(inp)), wrapper=tf_sparse24.SRSTE)
    (wrapper,) = tf_sparse24.pruned_layers(model)
    (pw,) = wrapper.pruned_weights
    pw.variable.assign(np.array([[1.0], [0.5], [0.5001], [0.1]], "float32"))
    picks = np.eye(4, dtype="float32")  # row k reads kernel row k
    np.testing.assert_array_equal(np.asarray(model(picks))[:, 0], [1.0, 0.0, 0.5, 0.0])
    np.testing.assert_array_equal(
        np.asarray(model(picks)), np.asarray(tf_sparse24.strip(model)(picks))
    )


class TiedHead(keras.layers.Layer):
    """A float32 layer reading another layer's kernel (a tied projection)."""

    def __init__(self, source, **kwargs):
        super().__init__(dtype="float32", **kwargs)
        self.source = source

    def call(self, x):
        return keras.ops.matmul(x, self.source.kernel)


class TiedNet(keras.Model):
    def __init__(self, wrapper=tf_sparse24.Sparse24, **kwargs):
        super().__init__(**kwargs)
        self.enc = wrapper(keras.layers.Dense(16, use_bias=False))
        self.head = TiedHead(self.enc.layer)

    def call(self, x):
        encoded = keras.ops.cast(self.enc(x), "float32")  # builds the kernel the head reads
        return self.head(x) + encoded


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_a_weight_a_float32_layer_also_reads_is_exported_in_float32(mode, tmp_path):
    with global_policy("mixed_bfloat16"):
        net = TiedNet()
        x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
        net(x)
        net.enc.update_masks()
        (pw,) = net.enc.pruned_weights  # the head reads the raw kernel: make it the masked one
        pw.variable.assign(pw.variable.numpy() * pw.mask.numpy())
    metadata = tf_sparse24.export(
        net, tmp_path / "1", mode,
        input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")],
    )  # fmt: skip
    (entry,) = metadata["sparse"]
    assert (entry["dtype"], entry["kernel"]) == ("float32", "dense_at_load")
    served = tf_sparse24.load(tmp_path / "1").signatures["serving_default"](x=tf.constant(x))
    np.testing.assert_array_equal(served["output_0"].numpy(), np.asarray(net(x)))


def test_a_weight_kept_in_float32_is_the_effective_weight_srste_too(tmp_path):
    """SR-STE's effective weight uses the mask of the current weights, not its mask variable
    (ones before training): the float32 values stored must still be the effective ones."""
    with global_policy("mixed_bfloat16"):
        net = TiedNet(wrapper=tf_sparse24.SRSTE)
        net(np.ones((2, 16), "float32"))
    (pw,) = net.enc.pruned_weights
    assert pw.mask.numpy().min() == 1.0  # the mask variable is not the mask in use
    tf_sparse24.export(net, tmp_path / "1",
                       input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    loaded = tf_sparse24.load(tmp_path / "1")
    (entry,) = loaded.sparse24_metadata["sparse"]
    assert entry["dtype"] == "float32"
    stored = fmt.decompress(loaded.sparse_values[0].numpy(), loaded.sparse_meta[0].numpy(), 16)
    np.testing.assert_array_equal(stored, net.enc.effective_weight(pw).numpy())
