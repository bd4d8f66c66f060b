"""Tests of tf_sparse24.export / load / verify and the stock-TF decompression.

References are independent of the code under test: a numpy float64 magnitude 2:4 pruner written
here, `tf_sparse24.format` (the numpy definition of sparse24/v1), fresh Python processes that never
import tf_sparse24, `saved_model_cli`, and a dense SavedModel of the same variables.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_sparse24
from tf_sparse24 import format as fmt
from tf_sparse24 import metadata as md
from tf_sparse24 import portable
from tf_sparse24.export import _always_2to4, einsum_matmul, export, graph_ops, load, nonstock_ops
from tf_sparse24.metadata import ExportError
from tf_sparse24.registry import eligible_weights
from tf_sparse24.signature import signature_output_names
from tf_sparse24.verify import _input_order, describe, verify
from tf_sparse24.wrapper import Sparse24

BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


# --- references -----------------------------------------------------------------------------


def prune_24(w: np.ndarray, axis: int) -> np.ndarray:
    """Keeps the 2 largest |w| of every 4 consecutive elements along `axis` (float64 reference)."""
    moved = np.moveaxis(np.asarray(w, np.float64), axis, -1)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 4, 4)
    order = np.argsort(-np.abs(groups), axis=-1, kind="stable")
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, order[..., :2], True, axis=-1)
    pruned = np.where(keep, groups, 0.0).reshape(moved.shape)
    return np.moveaxis(pruned, -1, axis).astype(w.dtype)


def prune_plain_layers(model: keras.Model) -> None:
    """Makes every registry-eligible kernel of the model's plain layers exactly 2:4 in place."""
    for layer in model.layers:
        if isinstance(layer, Sparse24):
            continue
        for _, variable, axis in eligible_weights(layer):
            variable.assign(prune_24(variable.numpy(), axis))


def mixed_model() -> keras.Model:
    """Conv2D -> MultiHeadAttention -> LSTM -> Dense -> Dense; 3 wrapped, 2 plain, all 2:4."""
    keras.utils.set_random_seed(0)
    wrap = Sparse24
    pixels = keras.Input((8, 8, 4), name="pixels")
    x = wrap(keras.layers.Conv2D(8, 3, padding="same", name="conv"))(pixels)
    x = keras.layers.Reshape((8, 64))(x)
    x = wrap(keras.layers.MultiHeadAttention(2, 8, name="mha"))(x, x)
    x = keras.layers.LSTM(16, name="lstm")(x)
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = wrap(keras.layers.Dense(16, activation="relu", name="hidden"))(x)
    logits = keras.layers.Dense(4, name="logits")(x)
    model = keras.Model(pixels, logits, name="mixed")
    for layer in model.layers:
        if isinstance(layer, Sparse24):
            layer.update_masks()
    prune_plain_layers(model)
    return model


SPARSE_NAMES = [
    "conv/kernel", "mha/query/kernel", "mha/key/kernel", "mha/value/kernel",
    "mha/attention_output/kernel", "lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel",
    "hidden/kernel", "logits/kernel",
]  # fmt: skip


def kernel_by_path(model: keras.Model) -> dict[str, np.ndarray]:
    """The forward's effective kernels keyed by variable path (wrapped ones masked)."""
    out = {v.path: v.numpy() for v in model.variables}
    for layer in model.layers:
        if isinstance(layer, Sparse24):
            for pw in layer.pruned_weights:
                out[pw.variable.path] = keras.ops.convert_to_numpy(layer.effective_weight(pw))
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    model = mixed_model()
    x = np.random.default_rng(1).standard_normal((3, 8, 8, 4)).astype(np.float32)
    root = tmp_path_factory.mktemp("exports")
    data = os.path.join(root, "data.npz")
    y = keras.ops.convert_to_numpy(model(x, training=False))
    np.savez(data, x=x, y=y)
    model_path = os.path.join(root, "mixed.keras")
    model.save(model_path)
    return {"model": model, "x": x, "y": y, "root": str(root), "data": data, "keras": model_path,
            "portable": os.path.join(root, "mixed", "1"),
            "accelerated": os.path.join(root, "mixed_accelerated", "1"),
            "metadata": export(model, os.path.join(root, "mixed", "1"))}


# --- stock-TF decompression -----------------------------------------------------------------


def test_portable_decompress_worked_example():
    # Column 0 keeps rows 1 and 3 of group 0 (meta nibble 0b1101) and rows 4, 6 of group 1
    # (0b1000 in the high nibble); column 1 keeps rows 0, 1 and 6, 7 (0b0100, 0b1110).
    values = tf.constant([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    meta = tf.constant([[0b1000_1101], [0b1110_0100]], tf.uint8)
    dense = portable.decompress(values, meta, 8).numpy()
    expected = np.zeros((8, 2), np.float32)
    expected[[1, 3, 4, 6], 0] = [1, 2, 3, 4]
    expected[[0, 1, 6, 7], 1] = [5, 6, 7, 8]
    np.testing.assert_array_equal(dense, expected)


@settings(max_examples=25, deadline=None)
@given(
    groups=st.integers(1, 9),
    n=st.integers(0, 6),
    dtype=st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_portable_decompress_matches_format_bit_exactly(groups, n, dtype, seed):
    rng = np.random.default_rng(seed)
    k = 4 * groups  # odd `groups` covers K % 8 == 4 (a half-used last meta byte)
    w = rng.standard_normal((k, n)).astype(dtype)
    w[rng.random((k, n)) < 0.1] = np.array([np.nan, np.inf, -0.0], dtype)[rng.integers(0, 3)]
    w = np.where(prune_24(np.nan_to_num(w.astype(np.float64), nan=9.0), 0) != 0, w, 0).astype(dtype)
    values, meta = fmt.compress(w)
    got = portable.decompress(values, meta, k).numpy()
    want = fmt.decompress(values, meta, k)
    assert got.dtype == want.dtype and got.shape == (k, n)
    np.testing.assert_array_equal(got.view(np.uint16 if dtype != np.float32 else np.uint32),
                                  want.view(np.uint16 if dtype != np.float32 else np.uint32))


def test_portable_decompress_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 4"):
        portable.decompress(tf.zeros([1, 3]), tf.zeros([1, 1], tf.uint8), 6)
    with pytest.raises(ValueError, match=r"values must be \[2, 4\] and meta \[2, 1\]"):
        portable.decompress(tf.zeros([2, 4]), tf.zeros([2, 2], tf.uint8), 8)


# --- export layout and metadata -------------------------------------------------------------


def test_export_layout_and_metadata(mixed):
    d, metadata = mixed["portable"], mixed["metadata"]
    assert sorted(os.listdir(d)) == ["assets", "assets.extra", "fingerprint.pb", "saved_model.pb",
                                     "variables"]
    assert not [f for f in os.listdir(os.path.dirname(d)) if f != "1"]  # no temp dirs left
    # The graph's and the assets' sha256 in sha256sum's format: coreutils checks them from the
    # export directory.
    check = subprocess.run(["sha256sum", "-c", md.CHECKSUMS], cwd=d, capture_output=True,
                           text=True, check=False)
    assert check.returncode == 0, check
    assert check.stdout.splitlines() == ["saved_model.pb: OK", "assets/sparse24.json: OK"]
    with open(md.path_in(d)) as f:
        assert json.load(f) == metadata
    assert metadata["format"] == "sparse24/v1" and metadata["mode"] == "portable"
    assert metadata["tensorflow_version"] == tf.__version__
    assert metadata["package_version"] == tf_sparse24.__version__
    pixels = {"shape": [None, 8, 8, 4], "dtype": "float32"}
    assert metadata["signature"]["inputs"] == {"pixels": pixels}
    assert metadata["signature"]["outputs"] == {"logits": {"shape": [None, 4], "dtype": "float32"}}
    assert sorted(e["name"] for e in metadata["sparse"]) == sorted(SPARSE_NAMES)
    kernels = kernel_by_path(mixed["model"])
    for entry in metadata["sparse"]:
        # The stored tensors are exactly the reference compression of the forward's kernel.
        w = kernels[entry["name"]]
        values, meta = fmt.compress(fmt.to_2d(w, entry["axis"]))
        for part, array in (("values", values), ("meta", meta)):
            # hashlib over the C-order bytes, not md.sha256 (which made the records)
            assert entry[part] == {
                "name": f"{entry['name']}:{part}", "shape": list(array.shape),
                "dtype": array.dtype.name, "bytes": array.size * array.itemsize,
                "sha256": hashlib.sha256(array.tobytes(order="C")).hexdigest(),
            }, entry["name"]
        assert entry["shape"] == list(w.shape) and entry["kernel"] == "dense_at_load"
        assert entry["pattern"] == "2:4"
    assert {e["name"]: e["axis"] for e in metadata["sparse"]}["mha/attention_output/kernel"] == 1
    assert {e["name"]: e["axis"] for e in metadata["sparse"]}["conv/kernel"] == 2
    dense_names = {r["name"] for r in metadata["dense"]}
    assert "norm/moving_variance" in dense_names and "logits/bias" in dense_names
    assert not any("mask" in name for name in dense_names)  # masks are implied by meta
    assert not dense_names & set(SPARSE_NAMES)


def test_load_checks_and_serves(mixed):
    loaded = load(mixed["portable"])
    assert loaded.sparse24_metadata == mixed["metadata"]
    assert json.loads(json.dumps(loaded.sparse24_metadata)) == mixed["metadata"]  # a plain dict
    assert json.loads(loaded.metadata().numpy()) == mixed["metadata"]
    out = loaded.signatures["serving_default"](pixels=tf.constant(mixed["x"]))
    np.testing.assert_allclose(out["logits"].numpy(), mixed["y"], rtol=1e-5, atol=1e-5)
    report = verify(mixed["portable"], against=mixed["model"])
    assert report["nonstock_ops"] == [] and report["max_abs_diff"]["logits"] < 1e-5
    assert report["tensors"] == 2 * len(SPARSE_NAMES) + len(mixed["metadata"]["dense"])
    text = describe(mixed["portable"])
    assert "mha/attention_output/kernel" in text and "variables/" in text


# Runs in a process that must never import tf_sparse24 (it reports what it imported), so it walks
# the SavedModel proto itself rather than calling export.graph_ops.
FRESH_SCRIPT = """
import json, sys
import numpy as np, tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

portable_dir, data_path, accelerated_dir = sys.argv[1:]
data = np.load(data_path)
result = {}
fn = tf.saved_model.load(portable_dir).signatures["serving_default"]
out = fn(pixels=tf.constant(data["x"]))
result["outputs"] = sorted(out)
result["diff"] = float(np.abs(out["logits"].numpy() - data["y"]).max())
result["diff1"] = float(np.abs(fn(pixels=tf.constant(data["x"][:1]))["logits"].numpy()
                               - data["y"][:1]).max())
proto = saved_model_pb2.SavedModel()
proto.ParseFromString(open(portable_dir + "/saved_model.pb", "rb").read())
ops, functions = set(), set()
for graph in proto.meta_graphs:
    ops |= {node.op for node in graph.graph_def.node}
    for f in graph.graph_def.library.function:
        functions.add(f.signature.name)
        ops |= {node.op for node in f.node_def}
ops -= functions
result["ops"] = len(ops)
result["unregistered"] = sorted(op for op in ops if not hasattr(tf.raw_ops, op))
result["imported"] = sorted(m for m in sys.modules if m.startswith("tf_sparse24"))
try:
    tf.saved_model.load(accelerated_dir)
    result["accelerated_without_import"] = "loaded"
except Exception as e:
    result["accelerated_without_import"] = str(e)
import tf_sparse24
loaded = tf_sparse24.load(accelerated_dir)
out = loaded.signatures["serving_default"](pixels=tf.constant(data["x"]))
result["accelerated_diff"] = float(np.abs(out["logits"].numpy() - data["y"]).max())
print(json.dumps(result))
"""


def test_fresh_processes_serve_the_exports(mixed):
    """A fresh interpreter and `saved_model_cli run`, started side by side (one test, so that
    pytest-xdist starts them once).

    The interpreter serves the portable export without importing tf_sparse24 and checks every op
    of every function graph against its (stock) op registry; then loading the accelerated export
    fails with "Op type not registered" until `import tf_sparse24`, after which it matches.
    """
    export(mixed["model"], mixed["accelerated"], mode="accelerated")
    root = mixed["root"]
    np.save(os.path.join(root, "x.npy"), mixed["x"])
    cli = [os.path.join(BIN, "saved_model_cli"), "run", "--dir", mixed["portable"],
           "--tag_set", "serve", "--signature_def", "serving_default",
           "--inputs", f"pixels={os.path.join(root, 'x.npy')}",
           "--outdir", os.path.join(root, "cli")]
    python = [sys.executable, "-c", FRESH_SCRIPT, mixed["portable"], mixed["data"],
              mixed["accelerated"]]
    procs = {name: subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=root)
             for name, cmd in (("cli", cli), ("python", python))}  # fmt: skip
    done = {name: (proc, *proc.communicate(timeout=400)) for name, proc in procs.items()}

    proc, stdout, stderr = done["python"]
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert result["outputs"] == ["logits"]
    assert result["diff"] < 1e-5 and result["diff1"] < 1e-5
    assert result["ops"] > 10 and result["unregistered"] == []
    assert nonstock_ops(graph_ops(mixed["portable"])) == set()
    assert "Op type not registered 'Sparse24" in result["accelerated_without_import"]
    assert result["accelerated_diff"] < 1e-5
    assert nonstock_ops(graph_ops(mixed["accelerated"])) == {"Sparse24MatMul", "Sparse24Decompress"}
    entries = load(mixed["accelerated"]).sparse24_metadata["sparse"]
    kernels = {e["name"]: e["kernel"] for e in entries}
    # MHA's EinsumDense projections and the Dense layers run sparse; Conv and LSTM do not.
    assert [n for n, k in kernels.items() if k == "dense_at_load"] == [
        "conv/kernel", "lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel"]

    proc, _, stderr = done["cli"]
    assert proc.returncode == 0, stderr[-3000:]
    got = np.load(os.path.join(root, "cli", "logits.npy"))
    np.testing.assert_allclose(got, mixed["y"], atol=1e-5)


def test_stripped_model_exports_the_same_tensors(mixed, tmp_path):
    stripped = tf_sparse24.strip(mixed["model"])
    assert not any(isinstance(layer, Sparse24) for layer in stripped.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every kernel is exactly 2:4: nothing to warn about
        metadata = export(stripped, tmp_path / "1")
    by_name = {e["name"]: e for e in metadata["sparse"]}
    assert sorted(by_name) == sorted(SPARSE_NAMES)
    for entry in mixed["metadata"]["sparse"]:
        assert by_name[entry["name"]]["values"] == entry["values"]
        assert by_name[entry["name"]]["meta"] == entry["meta"]
    out = load(tmp_path / "1").signatures["serving_default"](pixels=tf.constant(mixed["x"]))
    np.testing.assert_allclose(out["logits"].numpy(), mixed["y"], rtol=1e-5, atol=1e-5)


def test_a_stripped_kernel_trained_off_2to4_is_stored_dense_with_a_warning(mixed, tmp_path):
    stripped = tf_sparse24.strip(mixed["model"])
    hidden = stripped.get_layer("hidden").kernel
    kernel = hidden.numpy()
    # Training without masks moves every pruned zero a little: 2:4 up to tiny values.
    noise = np.random.default_rng(4).uniform(1e-6, 1e-5, kernel.shape).astype(np.float32)
    hidden.assign(np.where(kernel == 0, noise, kernel))

    with pytest.warns(UserWarning, match=r"'hidden/kernel' is stored dense: it is not exactly "
                      r"2:4, but 100% of its groups are 2:4 up to values below 0.001"):
        metadata = export(stripped, tmp_path / "1")

    assert "hidden/kernel" not in {e["name"] for e in metadata["sparse"]}
    assert len(metadata["sparse"]) == len(SPARSE_NAMES) - 1
    out = load(tmp_path / "1").signatures["serving_default"](pixels=tf.constant(mixed["x"]))
    np.testing.assert_allclose(out["logits"].numpy(),
                               keras.ops.convert_to_numpy(stripped(mixed["x"], training=False)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, mode", [("bfloat16", "accelerated"), ("float16", "portable")])
def test_half_precision_models(tmp_path, dtype, mode):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,), name="features", dtype=dtype),
        keras.layers.Dense(8, activation="relu", dtype=dtype, name="hidden"),
        keras.layers.Dense(4, dtype=dtype, name="scores"),
    ])  # fmt: skip
    prune_plain_layers(model)
    metadata = export(model, tmp_path / "1", mode=mode)
    assert {e["dtype"] for e in metadata["sparse"]} == {dtype}
    assert metadata["signature"]["inputs"]["features"]["dtype"] == dtype
    x = tf.cast(np.random.default_rng(0).standard_normal((3, 16)), dtype)
    got = load(tmp_path / "1").signatures["serving_default"](features=x)["scores"]
    want = model(x)
    np.testing.assert_allclose(tf.cast(got, tf.float32), tf.cast(want, tf.float32), atol=2e-2)


class TwoLayerNet(keras.Model):
    def __init__(self):
        super().__init__(name="two_layer_net")
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def test_subclassed_model_needs_and_uses_an_input_signature(tmp_path):
    keras.utils.set_random_seed(0)
    model = TwoLayerNet()
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    spec = [tf.TensorSpec([None, 8], tf.float32, name="features")]
    with pytest.raises(ValueError, match="needs a built model: call model 'two_layer_net' on"):
        export(model, tmp_path / "1", input_signature=spec)  # was: "prune it ... first"
    model(x)
    prune_plain_layers(model)
    with pytest.raises(ValueError, match="pass input_signature"):
        export(model, tmp_path / "1")
    metadata = export(model, tmp_path / "1", mode="accelerated", input_signature=spec)
    # The layers' calls are replaced while the serving function is traced: both run sparse.
    assert [e["kernel"] for e in metadata["sparse"]] == ["sparse24_matmul"] * 2
    assert nonstock_ops(graph_ops(tmp_path / "1")) == {"Sparse24MatMul"}
    out = load(tmp_path / "1").signatures["serving_default"](features=tf.constant(x))
    np.testing.assert_allclose(out["output_0"].numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    export(model, tmp_path / "2", input_signature=spec[0])  # one spec, as Keras' export takes it
    out = load(tmp_path / "2").signatures["serving_default"](features=tf.constant(x))
    np.testing.assert_allclose(out["output_0"].numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


class DictInputNet(keras.Model):
    """A subclassed model called with a dict of two inputs."""

    def __init__(self):
        super().__init__(name="dict_input_net")
        self.seq = Sparse24(keras.layers.Dense(16, activation="relu", name="seq_proj"))
        self.ctx = Sparse24(keras.layers.Dense(16, name="ctx_proj"))

    def call(self, inputs):
        return self.seq(inputs["seq"]) + self.ctx(inputs["ctx"])[:, None, :]


def test_subclassed_model_called_with_a_dict_takes_a_dict_signature(tmp_path):
    keras.utils.set_random_seed(0)
    model = DictInputNet()
    x = {"seq": np.random.default_rng(1).random((2, 5, 8), np.float32),
         "ctx": np.random.default_rng(2).random((2, 12), np.float32)}  # fmt: skip
    model(x)
    for layer in tf_sparse24.pruned_layers(model):
        layer.update_masks()
    signature = {"seq": tf.TensorSpec([None, 5, 8]), "ctx": tf.TensorSpec([None, 12])}
    metadata = export(model, tmp_path / "1", mode="accelerated", input_signature=signature)
    assert metadata["signature"]["input_order"] == ["seq", "ctx"]
    served = load(tmp_path / "1").signatures["serving_default"](**x)["output_0"]
    np.testing.assert_allclose(served.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["output_0"] < 1e-4
    with pytest.raises(ValueError, match=r"start with a letter .*Received: \['not valid'\]"):
        export(model, tmp_path / "2", input_signature={"not valid": tf.TensorSpec([None, 12])})


class TwoArgumentNet(keras.Model):
    """A subclassed model taking its two inputs as positional arguments."""

    def __init__(self):
        super().__init__(name="two_argument_net")
        self.image = Sparse24(keras.layers.Dense(8, name="image_proj"))
        self.text = Sparse24(keras.layers.Dense(8, name="text_proj"))

    def call(self, image, text):
        return self.image(image) - 2.0 * self.text(text)


def test_subclassed_model_with_positional_inputs_gets_one_signature_input_each(tmp_path):
    keras.utils.set_random_seed(0)
    model = TwoArgumentNet()
    rng = np.random.default_rng(3)
    image, text = rng.random((2, 16), np.float32), rng.random((2, 12), np.float32)
    model(image, text)
    for layer in tf_sparse24.pruned_layers(model):
        layer.update_masks()
    image_kernel, text_kernel = (prune_24(w.layer.kernel.numpy(), 0) for w in model.layers)
    want = image @ image_kernel - 2.0 * (text @ text_kernel)  # biases start at zero
    # Named like the parameters: bound by name, whatever the order of the list.
    signature = [tf.TensorSpec([None, 12], name="text"), tf.TensorSpec([None, 16], name="image")]
    for version in ("1", "2"):  # a second export of the same model binds the same way
        export(model, tmp_path / version, mode="accelerated", input_signature=signature)
        served = load(tmp_path / version).signatures["serving_default"](image=image, text=text)
        np.testing.assert_allclose(served["output_0"].numpy(), want, rtol=1e-5, atol=1e-5)
        assert verify(tmp_path / version, against=model)["max_abs_diff"]["output_0"] < 1e-5
    with pytest.raises(ValueError, match=r"takes 2 positional inputs \['image', 'text'\]"):
        export(model, tmp_path / "3", input_signature=[tf.TensorSpec([None, 16], name="image")])
    assert not (tmp_path / "3").exists()


class TrainingArgumentNet(keras.Model):
    """`call(self, inputs, training)`, training without a default (many TF tutorials)."""

    def __init__(self):
        super().__init__(name="training_argument_net")
        self.dense = Sparse24(keras.layers.Dense(8))
        self.drop = keras.layers.Dropout(0.5)

    def call(self, inputs, training):
        return self.drop(self.dense(inputs), training=training)


def test_keras_call_arguments_without_defaults_are_not_inputs(tmp_path):
    model = TrainingArgumentNet()
    x = np.random.default_rng(4).random((2, 16), np.float32)
    model(x, training=False)
    model.dense.update_masks()
    export(model, tmp_path / "1", input_signature=[tf.TensorSpec([None, 16], name="x")])
    served = load(tmp_path / "1").signatures["serving_default"](x=x)["output_0"]
    want = x @ prune_24(model.dense.layer.kernel.numpy(), 0)  # inference: no dropout
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)


# --- accelerated: Sparse24MatMul wherever a Dense or matmul-shaped EinsumDense runs ----------


@pytest.mark.parametrize(
    "equation, contracted",
    [("ab,bc->ac", 1), ("abc,cd->abd", 1), ("abc,cde->abde", 1), ("abcd,cde->abe", 2),
     ("ab,bcd->acd", 1), ("...b,bc->...c", 1), ("abc,cd->adb", None), ("abc,bcd->acd", None),
     ("abc,dc->abd", None), ("ab,bc->ca", None), ("abc,bc->ab", None)],
)  # fmt: skip
def test_einsum_matmul_recognizes_plain_matmuls(equation, contracted):
    assert einsum_matmul(equation) == contracted


def randomize_biases(model: keras.Model, seed: int) -> None:
    """Non-zero biases (Keras starts them at zero), so that the bias adds are checked too."""
    rng = np.random.default_rng(seed)
    for variable in model.variables:
        if variable.name == "bias":
            variable.assign(rng.standard_normal(variable.shape).astype(variable.dtype))


def attention_model() -> keras.Model:
    """MultiHeadAttention, then EinsumDense layers that split heads (bias over one output axis),
    merge them (two contracted axes) and use an ellipsis, then Dense; pruned with `prune`."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    tokens = keras.Input((6, 16), name="tokens")
    x = L.MultiHeadAttention(2, 8, name="mha")(tokens, tokens)
    x = L.EinsumDense("abc,cde->abde", (None, 4, 8), bias_axes="d", name="split")(x)
    x = L.EinsumDense("abcd,cde->abe", (None, 16), bias_axes="e", activation="relu",
                      name="merge")(x)
    x = L.EinsumDense("...b,bc->...c", 8, bias_axes="c", name="ellipsis")(x)
    model = keras.Model(tokens, L.Dense(4, name="scores")(x), name="attention")
    randomize_biases(model, 1)
    return tf_sparse24.prune(model)


ATTENTION_SPARSE = ["mha/query/kernel", "mha/key/kernel", "mha/value/kernel",
                    "mha/attention_output/kernel", "split/kernel", "merge/kernel",
                    "ellipsis/kernel", "scores/kernel"]  # fmt: skip


class Block(keras.layers.Layer):
    """A custom layer holding a wrapped and a plain Dense layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = Sparse24(keras.layers.Dense(16, activation="relu", name="up"))
        self.down = keras.layers.Dense(8, name="down")

    def call(self, x):
        return x + self.down(self.up(x))


class BlockNet(keras.Model):
    def __init__(self):
        super().__init__(name="block_net")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(x))


def block_net(x: np.ndarray) -> tuple[keras.Model, np.ndarray]:
    """A subclassed model with Dense layers nested in a custom layer, and its float64 output."""
    keras.utils.set_random_seed(0)
    model = BlockNet()
    model(x)
    model.block.up.update_masks()
    for dense in (model.block.down, model.head):
        dense.kernel.assign(prune_24(dense.kernel.numpy(), 0))
    randomize_biases(model, 2)
    up = model.block.up
    w = {"up": keras.ops.convert_to_numpy(up.effective_weight(up.pruned_weights[0])),
         "down": model.block.down.kernel.numpy(), "head": model.head.kernel.numpy()}
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b = {k: layer.bias.numpy().astype(np.float64)
         for k, layer in (("up", up.layer), ("down", model.block.down), ("head", model.head))}
    x64 = x.astype(np.float64)
    h = x64 + np.maximum(x64 @ w["up"] + b["up"], 0) @ w["down"] + b["down"]
    return model, h @ w["head"] + b["head"]


def op_count(export_dir, op_type: str) -> int:
    """How many nodes of `op_type` the SavedModel's function library holds."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((export_dir / "saved_model.pb").read_bytes())
    return sum(node.op == op_type for graph in proto.meta_graphs
               for f in graph.graph_def.library.function for node in f.node_def)  # fmt: skip


@pytest.fixture(scope="module")
def everywhere(tmp_path_factory):
    """Accelerated exports of the attention model and the subclassed BlockNet."""
    root = tmp_path_factory.mktemp("everywhere")
    rng = np.random.default_rng(3)
    tokens = rng.standard_normal((3, 6, 16)).astype(np.float32)
    features = rng.standard_normal((3, 8)).astype(np.float32)
    attention = attention_model()
    blocks, blocks_want = block_net(features)
    spec = [tf.TensorSpec([None, 8], tf.float32, name="features")]
    data = root / "data.npz"
    np.savez(data, tokens=tokens, features=features, blocks_want=blocks_want,
             attention_want=keras.ops.convert_to_numpy(attention(tokens, training=False)))
    return {
        "root": root, "data": data, "attention": attention, "blocks": blocks,
        "attention_dir": root / "attention" / "1", "blocks_dir": root / "blocks" / "1",
        "attention_metadata": export(attention, root / "attention" / "1", mode="accelerated"),
        "blocks_metadata": export(blocks, root / "blocks" / "1", mode="accelerated",
                                  input_signature=spec),
    }  # fmt: skip


def test_accelerated_runs_mha_einsum_and_subclassed_dense_sparse(everywhere, tmp_path):
    data = np.load(everywhere["data"])
    kernels = {e["name"]: e["kernel"] for e in everywhere["attention_metadata"]["sparse"]}
    assert kernels == dict.fromkeys(ATTENTION_SPARSE, "sparse24_matmul")
    kernels = {e["name"]: e["kernel"] for e in everywhere["blocks_metadata"]["sparse"]}
    assert sorted(kernels) == ["block_net/block/down/kernel", "block_net/block/up/kernel",
                               "block_net/head/kernel"]  # fmt: skip
    assert set(kernels.values()) == {"sparse24_matmul"}
    for d, n in ((everywhere["attention_dir"], 8), (everywhere["blocks_dir"], 3)):
        assert nonstock_ops(graph_ops(d)) == {"Sparse24MatMul"}  # no Sparse24Decompress
        assert op_count(d, "Sparse24MatMul") == n
    serve = load(everywhere["attention_dir"]).signatures["serving_default"]
    got = serve(tokens=tf.constant(data["tokens"]))["scores"].numpy()
    np.testing.assert_allclose(got, data["attention_want"], rtol=1e-5, atol=1e-5)
    serve = load(everywhere["blocks_dir"]).signatures["serving_default"]
    got = serve(features=tf.constant(data["features"]))["output_0"].numpy()
    np.testing.assert_allclose(got, data["blocks_want"], rtol=1e-5, atol=1e-5)
    # The traced layers are left as they were, and still compute the dense forward.
    assert not [layer for layer in everywhere["attention"]._flatten_layers() if "call" in
                vars(layer)]  # fmt: skip
    np.testing.assert_allclose(everywhere["blocks"](data["features"]).numpy(), data["blocks_want"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip

    # Stripped (no wrappers): the same stored tensors, kernels and outputs.
    stripped = export(tf_sparse24.strip(everywhere["attention"]), tmp_path / "1",
                      mode="accelerated")  # fmt: skip
    assert stripped["sparse"] == everywhere["attention_metadata"]["sparse"]
    serve = load(tmp_path / "1").signatures["serving_default"]
    np.testing.assert_allclose(serve(tokens=tf.constant(data["tokens"]))["scores"].numpy(),
                               data["attention_want"], rtol=1e-5, atol=1e-5)  # fmt: skip


EVERYWHERE_SCRIPT = """
import json, sys
import numpy as np, tensorflow as tf
import tf_sparse24

attention_dir, blocks_dir, data_path = sys.argv[1:]
data = np.load(data_path)
serve = tf_sparse24.load(attention_dir).signatures["serving_default"]
attention = serve(tokens=tf.constant(data["tokens"]))["scores"].numpy()
serve = tf_sparse24.load(blocks_dir).signatures["serving_default"]
blocks = serve(features=tf.constant(data["features"]))["output_0"].numpy()
print(json.dumps({"attention": float(np.abs(attention - data["attention_want"]).max()),
                  "blocks": float(np.abs(blocks - data["blocks_want"]).max())}))
"""


@pytest.mark.slow
def test_accelerated_exports_serve_in_a_fresh_process(everywhere):
    proc = subprocess.run(
        [sys.executable, "-c", EVERYWHERE_SCRIPT, str(everywhere["attention_dir"]),
         str(everywhere["blocks_dir"]), str(everywhere["data"])],
        env=ENV, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert diffs["attention"] < 1e-5 and diffs["blocks"] < 1e-5, diffs


class TiedNet(keras.Model):
    """`encode`'s kernel is also read outside its call (a tied decoder); `rows` has a transposed
    einsum output."""

    def __init__(self):
        super().__init__(name="tied_net")
        self.encode = keras.layers.Dense(8, name="encode")
        self.rows = keras.layers.EinsumDense("abc,cd->adb", (4, 2), name="rows")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        h = self.encode(x)
        tied = keras.ops.matmul(h, keras.ops.transpose(self.encode.kernel))
        return self.head(keras.ops.reshape(self.rows(keras.ops.reshape(tied, (-1, 2, 4))),
                                           (-1, 8)))  # fmt: skip


def test_accelerated_decompresses_other_kernels_at_load(tmp_path):
    keras.utils.set_random_seed(0)
    model = TiedNet()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    model(x)
    for layer, axis in ((model.encode, 0), (model.rows, 0), (model.head, 0)):
        layer.kernel.assign(prune_24(layer.kernel.numpy(), axis))
    randomize_biases(model, 4)
    spec = [tf.TensorSpec([None, 8], tf.float32, name="features")]
    metadata = export(model, tmp_path / "1", mode="accelerated", input_signature=spec)
    kernels = {e["name"]: e["kernel"] for e in metadata["sparse"]}
    assert kernels == {"tied_net/encode/kernel": "dense_at_load",
                       "tied_net/rows/kernel": "dense_at_load",
                       "tied_net/head/kernel": "sparse24_matmul"}  # fmt: skip
    assert op_count(tmp_path / "1", "Sparse24Decompress") == 2
    out = load(tmp_path / "1").signatures["serving_default"](features=tf.constant(x))
    np.testing.assert_allclose(out["output_0"].numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)


def test_xla_compiles_a_portable_export_and_refuses_an_accelerated_one(tmp_path):
    # docs/EXPORT.md: the Sparse24 ops have no XLA lowering, so only the portable export (stock
    # ops) runs under jit_compile=True; the accelerated one fails naming the op.
    model = tiny_model()
    x = tf.constant(np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32))
    expected = keras.ops.convert_to_numpy(model(x))
    for mode in ("portable", "accelerated"):
        export(model, tmp_path / mode / "1", mode=mode)
    loaded = {mode: load(tmp_path / mode / "1") for mode in ("portable", "accelerated")}
    portable, accelerated = (loaded[mode].signatures["serving_default"] for mode in loaded)

    out = tf.function(lambda x: portable(features=x), jit_compile=True)(x)

    np.testing.assert_allclose(out["scores"].numpy(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Sparse24MatMul.*XLA"):
        tf.function(lambda x: accelerated(features=x), jit_compile=True)(x)


def test_tflite_converts_a_portable_export_and_refuses_an_accelerated_one(tmp_path):
    # docs/EXPORT.md "TensorFlow Lite": the converter folds the portable decompression into dense
    # constants; with Optimize.EXPERIMENTAL_SPARSITY TFLite stores the 2:4 kernels in its own
    # sparse encoding. The custom op has no TFLite kernel, so an accelerated export is refused.
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((256,), name="features"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    prune_plain_layers(model)
    x = np.random.default_rng(7).standard_normal((1, 256)).astype(np.float32)
    (w1, b1), (w2, b2) = ([np.asarray(v, np.float64) for v in layer.get_weights()]
                          for layer in model.layers)
    expected = np.maximum(x @ w1 + b1, 0) @ w2 + b2  # float64 reference
    for mode in ("portable", "accelerated"):
        export(model, tmp_path / mode / "1", mode=mode)

    sizes = {}
    for sparsity in (False, True):
        converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "portable" / "1"))
        if sparsity:
            converter.optimizations = [tf.lite.Optimize.EXPERIMENTAL_SPARSITY]
        blob = converter.convert()
        sizes[sparsity] = len(blob)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # tf.lite.Interpreter -> LiteRT notice
            runner = tf.lite.Interpreter(model_content=blob).get_signature_runner("serving_default")
        (out,) = runner(features=x).values()
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    dense_bytes = 4 * (256 * 128 + 128 * 10)
    assert sizes[False] > dense_bytes  # folded back to dense constants
    assert sizes[True] < 0.8 * sizes[False]

    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "accelerated" / "1"))
    with pytest.raises(Exception, match="Sparse24MatMul' op is neither a custom op nor a flex op"):
        converter.convert()


RELOAD_SCRIPT = """
import gc, json, sys
import numpy as np, tensorflow as tf
export_dir, loads = sys.argv[1], int(sys.argv[2])
x = tf.constant(np.load(sys.argv[3]))
def rss_mib():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1]) / 1024
served = tf.saved_model.load(export_dir).signatures["serving_default"]  # the loaded object goes
gc.collect()
first = served(x)["output_0"].numpy()
rss = []
for _ in range(loads):
    loaded = tf.saved_model.load(export_dir)
    loaded.signatures["serving_default"](x)
    del loaded
    gc.collect()
    rss.append(rss_mib())
np.save(sys.argv[4], first)
print(json.dumps({"rss": rss, "again": float(np.abs(served(x)["output_0"].numpy() - first).max())}))
"""


def test_reloading_an_export_frees_the_kernels_rebuilt_at_load(tmp_path):
    """Each load of an export rebuilds its dense-at-load kernels; they must go with the loaded
    object. They were variables shared by a name TensorFlow makes unique per load, never freed:
    every load kept another 16 MiB for this 2048 x 2048 float32 kernel (seen: +168 MiB over 7
    loads). Also, a signature kept while its loaded object is collected still serves. In a fresh
    process (memory of this one is noise), without tf_sparse24."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((2048,))
    model = tf_sparse24.prune(keras.Model(inp, keras.layers.Dense(2048)(inp)))
    export(model, tmp_path / "1")
    x = np.random.default_rng(0).standard_normal((2, 2048)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    loads, kernel_mib = 8, 2048 * 2048 * 4 / 2**20
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, str(tmp_path / "1"), str(loads),
         str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        env={**ENV, "MALLOC_MMAP_THRESHOLD_": "1048576"},  # big buffers freed to the OS at once
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), model(x), rtol=1e-5, atol=1e-5)
    assert result["again"] == 0
    grown = result["rss"][-1] - result["rss"][0]  # over loads - 1 loads
    assert grown < kernel_mib, result["rss"]  # without the mmap threshold: +-60 MiB of noise


# --- size -----------------------------------------------------------------------------------


def dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def test_variables_of_a_dense_model_shrink_to_056x(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,), name="features"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(12),
    ])  # fmt: skip
    prune_plain_layers(model)
    # The dense reference stores every variable once (Keras' `model.export` stores each twice).
    dense_module = tf.Module()
    dense_module.weights = [tf.Variable(v.numpy()) for v in model.variables]
    tf.saved_model.save(dense_module, str(tmp_path / "dense"))
    export(model, tmp_path / "sparse" / "1")
    dense = dir_bytes(tmp_path / "dense" / "variables")
    sparse = dir_bytes(tmp_path / "sparse" / "1" / "variables")
    params = sum(int(np.prod(v.shape)) for v in model.variables)
    assert dense >= 4 * params  # the reference really stores the dense float32 weights
    assert sparse <= 0.56 * dense, (sparse, dense, sparse / dense)


# --- errors ---------------------------------------------------------------------------------


def test_unpruned_model_is_rejected_and_nothing_written(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="no 2:4 sparse weights"):
        export(model, tmp_path / "m" / "1")
    assert not (tmp_path / "m").exists()


def test_a_quantized_stripped_model_is_sent_to_keras_export_not_told_to_prune(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")])
    plain = tf_sparse24.strip(tf_sparse24.prune(model))
    plain.quantize("int8")
    kernel = plain.get_layer("d")._kernel.numpy()
    assert kernel.dtype == np.int8 and tf_sparse24.is_nm_sparse(kernel.astype("float32"), "2:4", 0)
    with pytest.raises(ValueError, match=r"layers \['d'\] are quantized .*model\.export\(\)"):
        export(plain, tmp_path / "m" / "1")
    assert not (tmp_path / "m").exists()


def test_a_pattern_that_is_not_always_2to4_is_named_in_the_error(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="wide")])
    with pytest.raises(ValueError, match=r"'wide/kernel'.*pattern '4:8'.*only 2:4"):
        export(tf_sparse24.prune(model, pattern="4:8"), tmp_path / "m" / "1")
    assert not (tmp_path / "m").exists()
    export(tf_sparse24.prune(model, pattern="2:8"), tmp_path / "m" / "1")  # always 2:4


def most_kept_in_a_window_of_4(n: int, m: int) -> int:
    """Brute force over every N:M mask of one period (lcm(4, M) elements): the most elements any
    aligned window of 4 keeps."""
    period = np.lcm(4, m)
    choices = list(itertools.combinations(range(m), n))
    most = 0
    for picks in itertools.product(choices, repeat=period // m):
        mask = np.zeros(period, int)
        for g, kept in enumerate(picks):
            mask[[g * m + i for i in kept]] = 1
        most = max(most, int(mask.reshape(-1, 4).sum(axis=1).max()))
    return most


@pytest.mark.parametrize("pattern", ["1:2", "1:3", "2:4", "1:4", "2:5", "2:6", "3:6", "1:8",
                                     "2:8", "3:8", "4:8", "2:12", "3:12"])
def test_always_2to4_matches_brute_force(pattern):
    n, m = (int(v) for v in pattern.split(":"))
    assert _always_2to4(pattern) == (most_kept_in_a_window_of_4(n, m) <= 2)


def test_bad_arguments(mixed, tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        export(mixed["model"], tmp_path / "1", mode="fast")
    with pytest.raises(ValueError, match="expects a keras.Model"):
        export(keras.layers.Dense(3), tmp_path / "1")
    with pytest.raises(ExportError, match="not a tf_sparse24 export"):
        load(tmp_path)
    # A wrapper whose masks were never computed holds a dense weight: named, nothing written.
    unmasked = keras.Sequential([keras.Input((8,)), Sparse24(keras.layers.Dense(4, name="fc"))])
    message = r"weight '.*fc/kernel' \(shape \[8, 4\], axis 0\): not 2:4"
    with pytest.raises(ValueError, match=message):
        export(unmasked, tmp_path / "m" / "1")
    assert not (tmp_path / "m").exists()
    # Failing while writing (here: tracing) removes the parent directories it made.
    class Broken(keras.layers.Layer):
        def compute_output_shape(self, shape):  # so only a real call (the export's trace) fails
            return shape

        def call(self, x):
            raise RuntimeError("broken layer")

    inp = keras.Input((8,), name="features")
    broken = keras.Model(inp, Broken()(tiny_model()(inp)))
    with pytest.raises(RuntimeError, match="broken layer"):
        export(broken, tmp_path / "deep" / "m" / "1")
    assert not (tmp_path / "deep").exists()
    stateful = keras.Sequential([
        keras.Input((3, 8), batch_size=2), keras.layers.LSTM(4, stateful=True, name="rnn"),
    ])  # fmt: skip
    with pytest.raises(ValueError, match=r"stateful RNN layers \['rnn'\]"):
        export(stateful, tmp_path / "s" / "1")


def tiny_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,), name="features"), keras.layers.Dense(4, name="scores")]
    )
    prune_plain_layers(model)
    return model


def test_warns_when_export_dir_is_not_a_version_number(tmp_path):
    model = tiny_model()
    with pytest.warns(UserWarning, match="not a numeric version directory"):
        export(model, tmp_path / "latest")
    assert load(tmp_path / "latest").sparse24_metadata  # still written and loadable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(model, tmp_path / "m" / "7")


def test_refuses_to_overwrite_unless_asked(tmp_path):
    model = tiny_model()
    target = tmp_path / "m" / "1"
    export(model, target)
    (target / "marker").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(model, target)
    assert "marker" in os.listdir(target)
    export(model, target, overwrite=True)
    assert not (target / "marker").exists()
    assert sorted(os.listdir(tmp_path / "m")) == ["1"]  # the old one is gone, no temp left
    # A directory that is not an export is the user's: the model directory (version forgotten),
    # or anything else not empty, is never replaced.
    (tmp_path / "m" / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match=r"version directories \[1\]: export to .*m/2\?"):
        export(model, tmp_path / "m", overwrite=True)
    other = tmp_path / "data"
    other.mkdir()
    (other / "keep.npy").write_text("x")
    with pytest.raises(FileExistsError, match=r"not a SavedModel \(it holds keep.npy\)"):
        export(model, other, overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == sorted(
        [*before, "data", "data/keep.npy"])
    (other / "keep.npy").unlink()
    export(model, other, overwrite=True)  # an empty directory is replaced
    assert (other / "saved_model.pb").exists()
    shutil.rmtree(target)
    target.write_text("a file where the export goes")
    export(model, target, overwrite=True)
    assert sorted(os.listdir(tmp_path / "m")) == ["1", "notes.txt"]  # the replaced file is gone
    x = np.ones((2, 8), np.float32)
    out = load(target).signatures["serving_default"](features=tf.constant(x))
    np.testing.assert_allclose(out["scores"].numpy(), model(x).numpy(), rtol=1e-6)


def test_a_dangling_link_at_export_dir_is_refused_before_writing_or_replaced(tmp_path):
    # os.path.exists follows links: a dangling one passed the overwrite check, the whole export
    # was written, and the final rename failed naming the temporary directory.
    model = tiny_model()
    (tmp_path / "m").mkdir()
    link = tmp_path / "m" / "1"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(model, link)
    assert sorted(os.listdir(tmp_path / "m")) == ["1"] and link.is_symlink()
    export(model, link, overwrite=True)
    assert not link.is_symlink() and (link / "saved_model.pb").exists()
    assert sorted(os.listdir(tmp_path / "m")) == ["1"]


def _corrupt_copy(mixed, tmp_path, edit):
    target = tmp_path / "1"
    shutil.copytree(mixed["portable"], target)
    edit(target)
    return target


def _edit_json(change):
    def edit(target):
        path = md.path_in(target)
        with open(path) as f:
            metadata = json.load(f)
        change(metadata)
        with open(path, "w") as f:
            json.dump(metadata, f)

    return edit


def _resummed(edit):
    """`edit`, then the checksum file rewritten to match: only the checks behind it can tell."""
    def edit_and_resum(target):
        edit(target)
        md.write_checksums(target)

    return edit_and_resum


def _data_file(target):
    return target / "variables" / "variables.data-00000-of-00001"


def _flip_byte_of_first_tensor(target):
    data = bytearray(_data_file(target).read_bytes())
    data[16] ^= 0x40
    _data_file(target).write_bytes(bytes(data))


def _forge_checksum_everywhere(target):
    """Changes one sha256 in the asset AND the copy embedded in saved_model.pb (same length),
    and writes the edited graph's checksum: only the tensor's own checksum is left to tell."""
    sha = md.read(target)["dense"][0]["sha256"]
    for path in (md.path_in(target), target / "saved_model.pb"):
        data = open(path, "rb").read()
        assert sha.encode() in data
        open(path, "wb").write(data.replace(sha.encode(), b"0" * 64))
    md.write_checksums(target)


def _flip_bit_of_a_graph_constant(target):
    """One bit of the first float32 1.0 in saved_model.pb: the graph still parses, so only the
    graph's checksum can tell."""
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415

    data = bytearray((target / "saved_model.pb").read_bytes())
    data[data.index(np.float32(1.0).tobytes())] ^= 0x01
    (target / "saved_model.pb").write_bytes(bytes(data))
    saved_model_pb2.SavedModel().ParseFromString(bytes(data))


def _checksums_without_the_graph(target):
    """The checksum list with the graph's line dropped: the graph would go unchecked."""
    lines = (target / md.CHECKSUMS).read_text().splitlines(keepends=True)
    assert lines[0].endswith("  saved_model.pb\n")
    (target / md.CHECKSUMS).write_text("".join(lines[1:]))


def _checksum_of_a_deleted_file(target):
    """An asset listed in the checksum list, then deleted."""
    notes = target / "assets" / "notes.txt"
    notes.write_text("release notes")
    md.write_checksums(target)
    notes.unlink()


def test_an_export_without_the_graph_checksum_loads_with_a_warning(mixed, tmp_path):
    """Exports written before the graph's checksum existed still load; the warning says what
    was not checked."""
    target = _corrupt_copy(mixed, tmp_path, lambda t: shutil.rmtree(t / "assets.extra"))
    with pytest.warns(UserWarning, match=r"the graph \(saved_model.pb\) is not"):
        loaded = load(target)
    out = loaded.signatures["serving_default"](pixels=tf.constant(mixed["x"]))
    np.testing.assert_allclose(out["logits"].numpy(), mixed["y"], atol=1e-5)


def test_an_export_with_the_older_graph_only_checksum_file_is_checked(mixed, tmp_path):
    """Exports of 2026-12-01 to 12-03 listed the graph alone, under another name: still read."""
    def to_legacy(target):
        with open(target / md.CHECKSUMS) as f:
            graph_line = f.readline()
        os.remove(target / md.CHECKSUMS)
        (target / md.LEGACY_CHECKSUMS).write_text(graph_line)

    target = _corrupt_copy(mixed, tmp_path, to_legacy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not checked" warning
        load(target)
    _flip_bit_of_a_graph_constant(target)
    with pytest.raises(ExportError, match="checksum mismatch for saved_model.pb"):
        load(target)


class _VocabularyIds(keras.layers.Layer):
    """One-hot ids from a vocabulary file through tf.lookup: the file becomes an export asset."""

    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        index = tf.lookup.TextFileIndex
        self.table = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
            path, tf.string, index.WHOLE_LINE, tf.int64, index.LINE_NUMBER), -1)

    def call(self, words):
        return tf.one_hot(self.table.lookup(words)[:, 0], 8)


def test_a_vocabulary_asset_is_checksummed(tmp_path):
    """A table's vocabulary file is served from assets/: an edited one changes the outputs
    silently, so its sha256 is listed with the graph's and checked at load."""
    vocabulary = tmp_path / "vocab.txt"
    vocabulary.write_text("red\ngreen\nblue\n")
    words = keras.Input((1,), dtype="string", name="words")
    h = keras.layers.Dense(8, name="hidden")(_VocabularyIds(str(vocabulary))(words))
    model = keras.Model(words, keras.layers.Dense(4, name="scores")(h))
    keras.utils.set_random_seed(0)
    pruned = tf_sparse24.prune(model)
    target = tmp_path / "m" / "1"
    export(pruned, target)
    with open(target / md.CHECKSUMS) as f:
        listed = [line.split()[1] for line in f]
    assert listed == ["saved_model.pb", "assets/sparse24.json", "assets/vocab.txt"]
    batch = tf.constant([["blue"], ["red"]])
    served = load(target).signatures["serving_default"](words=batch)["scores"]
    np.testing.assert_allclose(served.numpy(), np.asarray(pruned(batch)), atol=1e-6)
    with open(target / md.CHECKSUMS, "a") as f:  # only files of the export are read
        f.write(f"{'0' * 64}  assets/../../vocab.txt\n")
    with pytest.raises(ExportError, match=r"lists 'assets/\.\./\.\./vocab.txt', a file outside"):
        load(target)
    md.write_checksums(target)
    (target / "assets" / "vocab.txt").write_text("blue\ngreen\nred\n")  # same size, reordered
    with pytest.raises(ExportError, match="checksum mismatch for assets/vocab.txt"):
        load(target)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: open(md.path_in(t), "w").write("{oops"), "is not valid JSON"),
        (_edit_json(lambda m: m.update(format="sparse24/v2")), "unsupported compressed format"),
        (_edit_json(lambda m: m.update(schema="tf_sparse24.export/9")), "unsupported metadata"),
        (_edit_json(lambda m: m["sparse"][0]["values"].update(sha256="0" * 64)),
         "checksum mismatch for assets/sparse24.json"),
        (_resummed(_edit_json(lambda m: m["sparse"][0]["values"].update(sha256="0" * 64))),
         "differs from the metadata embedded"),
        (lambda t: os.remove(md.path_in(t)), "not found"),
        (lambda t: _data_file(t).write_bytes(_data_file(t).read_bytes()[:1000]), "cannot load"),
        (_flip_byte_of_first_tensor, "tensor 'conv/kernel:values'"),
        (lambda t: os.remove(_data_file(t)),
         r"variables\.data-00000-of-00001 is missing; (?!.*is corrupted)"),
        (_forge_checksum_everywhere, "checksum mismatch for tensor 'conv/bias'"),
        (_flip_bit_of_a_graph_constant, "checksum mismatch for saved_model.pb"),
        (_edit_json(lambda m: m["sparse"][1].pop("values")),
         r"sparse\[1\] \('mha/query/kernel'\) is missing the fields \['values'\]"),
        (_edit_json(lambda m: m["dense"][0].pop("sha256")), r"dense\[0\] .* \['sha256'\]"),
        (_edit_json(lambda m: m.update(mode="turbo")), r"mode must be one of .*'turbo'"),
        (lambda t: open(md.path_in(t), "w").write("[1, 2]"), "must hold a JSON object. Received: list"),
        (_checksums_without_the_graph, "not a sha256sum list starting with saved_model.pb"),
        (_checksum_of_a_deleted_file, r"assets/notes.txt not found \(it is listed in"),
    ],
    ids=["bad-json", "format-v2", "schema", "edited-checksum", "edited-and-resummed", "missing", "truncated", "bit-flip",
         "no-data-file", "forged-checksum", "graph-bit-flip", "no-values-record", "no-sha256",
         "unknown-mode", "json-list", "graph-not-listed", "listed-file-deleted"],
)
def test_corrupted_exports_fail_clearly(mixed, tmp_path, edit, message):
    target = _corrupt_copy(mixed, tmp_path, edit)
    with pytest.raises(ExportError, match=message):
        load(target)


LOOKUP_SCRIPT = """
import json, sys
import numpy as np, tensorflow as tf
export_dir, words = sys.argv[1], json.loads(sys.argv[2])
out = tf.saved_model.load(export_dir).signatures["serving_default"](words=tf.constant(words))
print(json.dumps({"scores": out["scores"].numpy().tolist(),
                  "imported": sorted(m for m in sys.modules if m.startswith("tf_sparse24"))}))
"""


def test_lookup_tables_are_exported_and_served_by_plain_tensorflow(tmp_path):
    """A StringLookup's table and vocabulary are resources, not variables: the export holds them."""
    keras.utils.set_random_seed(0)
    lookup = keras.layers.StringLookup(name="vocab")
    lookup.adapt(tf.constant([["red"], ["green"], ["blue"], ["red"]]))
    words = keras.Input((3,), dtype="string", name="words")
    h = keras.layers.Flatten()(keras.layers.Embedding(8, 4, name="emb")(lookup(words)))
    model = keras.Model(words, keras.layers.Dense(4, name="scores")(h))
    pruned = tf_sparse24.prune(model)
    export(pruned, tmp_path / "1")
    batch = [["red", "blue", "pink"], ["green", "green", "red"]]  # "pink": out of vocabulary
    want = np.asarray(pruned(tf.constant(batch)))
    proc = subprocess.run([sys.executable, "-c", LOOKUP_SCRIPT, str(tmp_path / "1"),
                           json.dumps(batch)], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    assert served["imported"] == []
    np.testing.assert_allclose(np.asarray(served["scores"]), want, rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=pruned)["max_abs_diff"]["scores"] < 1e-5  # string input


def test_automatic_layer_names_do_not_become_signature_keys(tmp_path):
    """`dense_3` depends on how many Dense layers the process made before: not a stable key."""
    keys = []
    for run in range(2):  # the same model twice in one process: other automatic names
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(4)])
        prune_plain_layers(model)
        keys.append(sorted(export(model, tmp_path / str(run) / "1")["signature"]["outputs"]))
    assert keys == [["output_0"], ["output_0"]]
    inp = keras.Input((8,), name="features")
    h = keras.layers.Dense(8)(inp)
    model = keras.Model(inp, [keras.layers.Dense(4, name="scores")(h), keras.layers.Dense(4)(h)])
    prune_plain_layers(model)
    outputs = export(model, tmp_path / "mixed" / "1")["signature"]["outputs"]
    assert sorted(outputs) == ["output_1", "scores"]  # a chosen name is kept
    ends_in_an_op = keras.Model(inp, keras.ops.softmax(keras.layers.Dense(4, name="p")(h)))
    assert signature_output_names(ends_in_an_op, ends_in_an_op.outputs) == ["output_0"]


def test_a_dict_input_models_unnamed_inputs_are_served_under_their_keys(tmp_path):
    """`keras.Model({"age": keras.Input(...), ...})` without `name=`: the dict keys are the names
    the model is called with, so they name the signature's inputs (not `input_0`, `input_1`, which
    a client would have to map back through the sorted key order)."""
    keras.utils.set_random_seed(0)
    inputs = {"income": keras.Input((2,)), "age": keras.Input((4,)), "zip-code": keras.Input((2,))}
    h = keras.layers.Concatenate()([inputs["age"], inputs["income"] * 3.0, inputs["zip-code"]])
    model = tf_sparse24.prune(keras.Model(inputs, keras.layers.Dense(4, name="score")(h)))
    metadata = export(model, tmp_path / "1")
    assert metadata["signature"]["input_order"] == ["age", "income", "zip_code"]
    rng = np.random.default_rng(3)
    x = {name: rng.standard_normal((3, t.shape[1])).astype("float32")
         for name, t in inputs.items()}
    served = load(tmp_path / "1").signatures["serving_default"](
        age=x["age"], income=x["income"], zip_code=x["zip-code"])["score"]
    dense = model.get_layer("sparse24_score").layer
    want = (np.concatenate([x["age"], 3.0 * x["income"], x["zip-code"]], axis=1).astype(np.float64)
            @ prune_24(dense.kernel.numpy(), 0) + dense.bias.numpy())
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)
    # verify calls the model with a dict of these names: a served input bound to the wrong key
    # would show.
    assert verify(tmp_path / "1", against=model)["input_shapes"] == {
        "age": [2, 4], "income": [2, 2], "zip_code": [2, 2]}


def ordered_dict_model(alpha_width: int, named: bool, seed: int):
    """A pruned model on `OrderedDict(zeta=[4], alpha=[alpha_width])` (inputs named by their keys
    or not), inputs for it, and its output in float64: `[zeta, 2 * alpha] @ 2:4 kernel + bias`."""
    keras.utils.set_random_seed(0)
    widths = {"zeta": 4, "alpha": alpha_width}
    inputs = collections.OrderedDict(
        (key, keras.Input((width,), name=key if named else None)) for key, width in widths.items())
    h = keras.layers.Concatenate()([inputs["zeta"], 2.0 * inputs["alpha"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: keys that are not the inputs' names
        model = tf_sparse24.prune(keras.Model(inputs, keras.layers.Dense(4, name="score")(h)))
    rng = np.random.default_rng(seed)
    x = {key: rng.standard_normal((3, width)).astype("float32") for key, width in widths.items()}
    dense = model.get_layer("sparse24_score").layer
    want = (np.concatenate([x["zeta"], 2.0 * x["alpha"]], axis=1).astype(np.float64)
            @ prune_24(dense.kernel.numpy(), 0) + dense.bias.numpy())
    return model, x, want


def test_an_ordered_dict_input_models_inputs_are_served_under_their_own_keys(tmp_path):
    """An OrderedDict of inputs flattens in insertion order, not sorted: each served name is the
    key of the input it feeds ("zeta" 4 wide, "alpha" 8 wide), with the automatic names and with
    an input_signature named by the keys; verify agrees."""
    model, x, want = ordered_dict_model(alpha_width=8, named=False, seed=4)
    named = [tf.TensorSpec([None, 8], tf.float32, name="alpha"),
             tf.TensorSpec([None, 4], tf.float32, name="zeta")]
    for version, signature in ((1, None), (2, named)):
        metadata = export(model, tmp_path / str(version), input_signature=signature)
        assert metadata["signature"]["input_order"] == ["zeta", "alpha"]
        served = load(tmp_path / str(version)).signatures["serving_default"](**x)["score"]
        np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)
        # verify's reference call is an OrderedDict too: Keras binds a plain dict's values in
        # sorted order, which would feed zeta's values to alpha.
        assert verify(tmp_path / str(version), against=model)["input_shapes"] == {
            "zeta": [2, 4], "alpha": [2, 8]}


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_a_dict_input_signature_feeds_an_ordered_dict_models_inputs_by_key(tmp_path, mode):
    """A dict input_signature for a model built on an OrderedDict: each spec reaches the input
    under its key. (Keras binds a plain dict's values in sorted order to an OrderedDict's inputs
    in insertion order: called with one, the model took alpha's values as zeta's.)"""
    model, x, want = ordered_dict_model(alpha_width=4, named=True, seed=5)
    signature = {"alpha": tf.TensorSpec([None, 4]), "zeta": tf.TensorSpec([None, 4])}
    export(model, tmp_path / "1", mode=mode, input_signature=signature)
    served = load(tmp_path / "1").signatures["serving_default"](**x)["score"]
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["score"] < 1e-5


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_time_distributed_with_an_unknown_number_of_steps_is_refused(tmp_path, mode):
    """Keras 3.15's TimeDistributed, traced with an unknown time axis, maps its layer over as many
    steps as the batch has rows (a plain Keras model in a tf.function does the same): such an
    export would serve [batch, batch, ...] outputs. Refused, naming the layer, nothing written;
    with the steps known it serves the float64 reference."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    frames = keras.Input((None, 16), name="frames")
    model = tf_sparse24.prune(keras.Model(frames, L.TimeDistributed(L.Dense(8), name="td")(frames)))
    with pytest.raises(ValueError, match=r"layer 'td' \(TimeDistributed\) .*input shape "
                                         r"\(None, None, 16\)"):
        export(model, tmp_path / "m" / "1", mode=mode)
    assert not (tmp_path / "m").exists()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 16)).astype("float32")
    fixed = [tf.TensorSpec([None, 5, 16], tf.float32, name="frames")]
    export(model, tmp_path / "1", mode=mode, input_signature=fixed)
    (served,) = load(tmp_path / "1").signatures["serving_default"](frames=x).values()
    dense = model.get_layer("sparse24_td").layer.layer  # Sparse24(TimeDistributed(Dense))
    want = x.astype(np.float64) @ prune_24(dense.kernel.numpy(), 0) + dense.bias.numpy()
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)


def test_signature_names_order_and_precision_survive_verify(tmp_path):
    """Inputs not in sorted order, output keys that map to one identifier, and mixed precision
    with a float32 head: served like the Keras model, and `verify --against` agrees."""
    keras.utils.set_random_seed(0)
    zeta, alpha = keras.Input((8,), name="zeta"), keras.Input((4,), name="alpha")
    h = keras.layers.Dense(8, name="h")(keras.layers.Concatenate()([zeta, alpha]))
    model = keras.Model(
        [zeta, alpha],
        {"a-b": keras.layers.Dense(4, name="p")(h), "a_b": keras.layers.Dense(8, name="q")(h)},
    )
    prune_plain_layers(model)
    metadata = export(model, tmp_path / "io" / "1")
    assert metadata["signature"]["input_order"] == ["zeta", "alpha"]
    assert sorted(metadata["signature"]["outputs"]) == ["a_b", "a_b_1"]  # none lost
    x = {"zeta": tf.ones((2, 8)), "alpha": tf.fill((2, 4), 0.5)}
    served = load(tmp_path / "io" / "1").signatures["serving_default"](**x)
    want = model([x["zeta"], x["alpha"]])
    np.testing.assert_allclose(served["a_b"], want["a-b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served["a_b_1"], want["a_b"], rtol=1e-5, atol=1e-6)
    assert set(verify(tmp_path / "io" / "1", against=model)["max_abs_diff"]) == {"a_b", "a_b_1"}
    # Exports written before `input_order` existed: the order comes from the model's own names.
    old = {k: v for k, v in metadata["signature"].items() if k != "input_order"}
    assert _input_order(model, old) == ["zeta", "alpha"]

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(1)
        inp = keras.Input((64,), name="features")
        h = keras.layers.Dense(64, activation="relu", name="hidden")(inp)
        out = keras.layers.Dense(16, dtype="float32", name="logits")(h)
        mixed = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    prune_plain_layers(mixed)
    export(mixed, tmp_path / "bf16" / "1", mode="accelerated")
    report = verify(tmp_path / "bf16" / "1", against=mixed)
    assert report["max_abs_diff"]["logits"] > 0  # bf16 kernels round differently; still passes

    bf16 = keras.Sequential([
        keras.Input((8,), name="features", dtype="bfloat16"),
        keras.layers.Dense(4, dtype="bfloat16", name="scores"),
    ])  # fmt: skip
    prune_plain_layers(bf16)
    export(bf16, tmp_path / "bf16_in" / "1")
    assert "scores" in verify(tmp_path / "bf16_in" / "1", against=bf16)["max_abs_diff"]


def test_input_names_tensorflow_cannot_take_as_arguments_get_a_suffix(tmp_path):
    """TensorFlow refuses signature arguments that differ only in case, Python keywords and a
    leading underscore, and binds `self` to the function: such model inputs are renamed like
    other clashes; chosen specs are refused."""
    names = ("x", "X", "self", "Self", "_y", "class", "y")  # TensorFlow takes only "self" itself
    inputs = [keras.Input((8,), name=n) for n in names]
    scaled = [keras.layers.Dense(4, name=f"d{i}")(t) * (i + 1) for i, t in enumerate(inputs)]
    model = tf_sparse24.prune(keras.Model(inputs, keras.layers.Add(name="out")(scaled)))
    metadata = export(model, tmp_path / "1")
    # "_y" is stripped to "y", which the input named "y" keeps.
    assert metadata["signature"]["input_order"] == [
        "x", "X_1", "self_1", "Self", "y_1", "class_1", "y"]
    rng = np.random.default_rng(2)
    x = [rng.standard_normal((3, 8)).astype("float32") for _ in names]
    served = load(tmp_path / "1").signatures["serving_default"](
        **dict(zip(metadata["signature"]["input_order"], x))
    )["out"]
    np.testing.assert_allclose(served.numpy(), model(x), rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["out"] < 1e-5
    others = ["s", "t", "u", "v", "w"]
    for first in (["x", "X"], ["x", "self"], ["x", "in"], ["_x", "y"], ["a b", "X"]):
        specs = [tf.TensorSpec([None, 8], tf.float32, name=n) for n in first + others]
        with pytest.raises(ValueError, match=r"start with a letter .* not Python keywords or "
                                             r"'self', unique also ignoring case"):
            export(model, tmp_path / "2", input_signature=specs)
    # A string cannot be cast to the model's float input: every served call would fail.
    strings = [tf.TensorSpec([None, 8], tf.string, name=n) for n in ["x", "X_1", *others]]
    with pytest.raises(ValueError, match=r"input 'x' is string, but model .* takes float32"):
        export(model, tmp_path / "2", input_signature=strings)
    assert not (tmp_path / "2").exists()


def two_input_models():
    a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b")
    out = keras.layers.Dense(4, name="out")(keras.layers.Dense(8, name="h")(a) - b)
    return {"dict": keras.Model({"a": a, "b": b}, out), "list": keras.Model([a, b], out)}


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_a_list_input_signature_binds_the_models_inputs_by_name(kind, tmp_path, monkeypatch):
    """Specs named like the model's inputs, in another order: served `a` is the model's `a`. And
    verify calls the model by input name, so a binding by position would not pass it."""
    model = tf_sparse24.prune(two_input_models()[kind])
    signature = [tf.TensorSpec([None, 8], tf.float32, name=n) for n in ("b", "a")]
    rng = np.random.default_rng(0)
    x = {n: rng.standard_normal((3, 8)).astype("float32") for n in ("a", "b")}
    export(model, tmp_path / "1", input_signature=signature)
    served = load(tmp_path / "1").signatures["serving_default"](**x)["out"].numpy()
    np.testing.assert_allclose(served, model(x), rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["out"] < 1e-5
    # The binding by position this replaced: verify must see it.
    monkeypatch.setattr(sys.modules["tf_sparse24.signature"], "model_input_names", lambda m: None)
    export(model, tmp_path / "2", input_signature=signature)
    with pytest.raises(ExportError, match="output 'out' differs"):
        verify(tmp_path / "2", against=model)


@pytest.mark.parametrize("structure", ["nested list", "tuple of dicts"])
def test_verify_calls_a_model_with_nested_named_inputs_in_their_structure(structure, tmp_path):
    """Inputs named in a nested structure ([[z, y], x], ({"q": q}, {"p": p})): served by name,
    and verify feeds the model by those names in its own structure (it passed a flat dict, which
    Keras refuses for a nested structure: 'could not be compared')."""
    keras.utils.set_random_seed(0)
    z, y, x = (keras.Input((w,), name=n) for n, w in (("z", 4), ("y", 8), ("x", 4)))
    h = keras.layers.Concatenate()([z, 2.0 * y, 3.0 * x])
    inputs = [[z, y], x] if structure == "nested list" else ({"y": y}, {"x": x, "z": z})
    model = tf_sparse24.prune(keras.Model(inputs, keras.layers.Dense(4, name="out")(h)))
    rng = np.random.default_rng(7)
    data = {n: rng.standard_normal((3, w)).astype("float32") for n, w in (("z", 4), ("y", 8),
                                                                           ("x", 4))}
    dense = model.get_layer("sparse24_out").layer
    want = (np.concatenate([data["z"], 2.0 * data["y"], 3.0 * data["x"]], axis=1).astype(np.float64)
            @ prune_24(dense.kernel.numpy(), 0) + dense.bias.numpy())
    export(model, tmp_path / "1")
    served = load(tmp_path / "1").signatures["serving_default"](**data)["out"]
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-5, atol=1e-5)
    assert verify(tmp_path / "1", against=model)["input_shapes"] == {
        "z": [2, 4], "y": [2, 8], "x": [2, 4]}


def test_a_list_input_signature_of_labels_for_an_unsorted_dict_model_is_refused(tmp_path):
    """Labels are bound by position; a model taking {"zeta": ..., "alpha": ...} has none a reader
    can tell (its values flatten sorted, as alpha, zeta; Keras refuses to call it with a list):
    'first' was bound to alpha. Refused, naming the keys; a dict whose keys are sorted keeps
    the binding by position."""
    zeta, alpha = keras.Input((4,), name="zeta"), keras.Input((4,), name="alpha")
    h = keras.layers.Concatenate()([zeta, 3.0 * alpha])
    out = keras.layers.Dense(4, name="p")(h)
    labels = [tf.TensorSpec([None, 4], name=n) for n in ("first", "second")]
    model = tf_sparse24.prune(keras.Model({"zeta": zeta, "alpha": alpha}, out))
    with pytest.raises(ValueError, match=r"keys \['zeta', 'alpha'\]: name the input_signature's"):
        export(model, tmp_path / "1", input_signature=labels)
    assert not (tmp_path / "1").exists()
    model = tf_sparse24.prune(keras.Model({"alpha": alpha, "zeta": zeta}, out))
    export(model, tmp_path / "2", input_signature=labels)
    x = np.random.default_rng(8).standard_normal((2, 2, 4)).astype("float32")
    served = load(tmp_path / "2").signatures["serving_default"](first=x[0], second=x[1])["p"]
    np.testing.assert_allclose(served, model({"alpha": x[0], "zeta": x[1]}), rtol=1e-5, atol=1e-6)


def test_a_dict_input_signature_is_checked_against_the_inputs_it_names(tmp_path):
    """A dict input_signature for a model taking a list of a string and an int input, the keys in
    another order than the list: each spec's dtype is compared with the input of its name (it was
    compared by position: 'ids' with the string input, and a right signature refused)."""
    keras.utils.set_random_seed(0)
    words = keras.Input((1,), dtype="string", name="word")
    ids = keras.Input((5,), dtype="int32", name="ids")
    one_hot = keras.layers.StringLookup(vocabulary=["a", "b", "c"], output_mode="one_hot")
    h = keras.layers.Concatenate()([
        keras.layers.Flatten()(keras.layers.Embedding(10, 4)(ids)),
        keras.layers.Reshape((4,))(one_hot(words)),
    ])  # fmt: skip
    model = tf_sparse24.prune(keras.Model([words, ids], keras.layers.Dense(8, name="out")(h)))
    signature = {"ids": tf.TensorSpec([None, 5], tf.int32),
                 "word": tf.TensorSpec([None, 1], tf.string)}
    export(model, tmp_path / "1", input_signature=signature)
    x = {"ids": np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], "int32"),
         "word": np.array([["a"], ["c"]], object)}
    served = load(tmp_path / "1").signatures["serving_default"](**x)["out"]
    np.testing.assert_allclose(served, model([x["word"], x["ids"]]), rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["out"] < 1e-5
    signature["ids"] = tf.TensorSpec([None, 5], tf.string)  # still refused where it is wrong
    with pytest.raises(ValueError, match=r"input 'ids' is string, but model .* takes int32"):
        export(model, tmp_path / "2", input_signature=signature)


def test_nested_outputs_under_a_dict_get_one_key_per_leaf_and_repeated_names_a_suffix(tmp_path):
    inp = keras.Input((8,), name="x")
    first = keras.layers.Dense(4, name="first")(inp)
    second = keras.layers.Dense(8, name="second")(inp)
    nested = tf_sparse24.prune(keras.Model(inp, {"y": [first, second], "z": first}))
    outputs = export(nested, tmp_path / "1")["signature"]["outputs"]
    assert sorted(outputs) == ["y_0", "y_1", "z"]
    x = np.random.default_rng(1).standard_normal((2, 8)).astype("float32")
    served = load(tmp_path / "1").signatures["serving_default"](x=x)
    want = nested(x)
    for key, value in [("y_0", want["y"][0]), ("y_1", want["y"][1]), ("z", want["z"])]:
        np.testing.assert_allclose(served[key].numpy(), value, rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=nested)["max_abs_diff"].keys() == {"y_0", "y_1", "z"}
    twice = tf_sparse24.prune(keras.Model(inp, [first, first]))
    assert sorted(export(twice, tmp_path / "2")["signature"]["outputs"]) == ["first", "first_1"]


class TwoHeads(keras.layers.Layer):
    """A last layer returning two tensors (a Sequential model with two outputs)."""

    def build(self, shape):
        self.head = keras.layers.Dense(4)
        self.head.build(shape)

    def call(self, x):
        return self.head(x), x * 2.0


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_keras_tfsmlayer_reloads_exports_through_serve(mixed, tmp_path, mode):
    """`keras.layers.TFSMLayer`, Keras 3's way to reuse a SavedModel, calls the `serve` endpoint
    (its default) as the model is called: one tensor, a list or a dict, returning the model's
    output structure. It copies every variable the endpoint reads, so the kernels rebuilt at load
    (conv, LSTM; every kernel in portable mode) must have their full shape there."""
    if mode == "accelerated":
        export(mixed["model"], tmp_path / "mixed" / "1", mode=mode)
    path = mixed["portable"] if mode == "portable" else str(tmp_path / "mixed" / "1")
    reloaded = keras.layers.TFSMLayer(path)
    np.testing.assert_allclose(reloaded(mixed["x"]), mixed["y"], atol=1e-5)
    pixels = keras.Input((8, 8, 4))
    inner = keras.Model(pixels, reloaded(pixels))
    np.testing.assert_allclose(inner.predict(mixed["x"], verbose=0), mixed["y"], atol=1e-5)
    conv = mixed["model"].get_layer("sparse24_conv").layer.kernel
    assert tuple(conv.shape) in {tuple(w.shape) for w in reloaded.weights}

    rng = np.random.default_rng(2)
    for kind, model in two_input_models().items():
        model = tf_sparse24.prune(model)
        x = {n: rng.standard_normal((3, 8)).astype("float32") for n in ("a", "b")}
        x = x if kind == "dict" else [x["a"], x["b"]]
        export(model, tmp_path / kind / "1", mode=mode)
        served = keras.layers.TFSMLayer(tmp_path / kind / "1")(x)
        np.testing.assert_allclose(served, model(x), rtol=1e-5, atol=1e-6)
    inp = keras.Input((8,), name="x")
    first, second = keras.layers.Dense(4)(inp), keras.layers.Dense(8)(inp)
    nested = tf_sparse24.prune(keras.Model(inp, {"y": [first, second], "z": first}))
    export(nested, tmp_path / "nested" / "1", mode=mode)
    x = rng.standard_normal((2, 8)).astype("float32")
    served, want = keras.layers.TFSMLayer(tmp_path / "nested" / "1")(x), nested(x)
    assert keras.tree.map_structure(lambda t: t.shape, served) == keras.tree.map_structure(
        lambda t: t.shape, want)
    for got, ref in zip(keras.tree.flatten(served), keras.tree.flatten(want)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # A Sequential model (the demo's) is called with one tensor and returns one, as Keras' own
    # export of it is.
    sequential = tf_sparse24.prune(keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                                                     keras.layers.Dense(4)]))
    export(sequential, tmp_path / "sequential" / "1", mode=mode)
    served = keras.layers.TFSMLayer(tmp_path / "sequential" / "1")(x)
    assert isinstance(served, tf.Tensor)
    np.testing.assert_allclose(served, sequential(x), rtol=1e-5, atol=1e-6)
    # ...and one whose last layer returns two tensors returns both.
    two = tf_sparse24.prune(keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                                              TwoHeads()]))
    export(two, tmp_path / "two" / "1", mode=mode)
    served = keras.layers.TFSMLayer(tmp_path / "two" / "1")(x)
    for got, want in zip(served, two(x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert set(verify(tmp_path / "two" / "1", against=two)["max_abs_diff"]) == {
        "output_0", "output_1"}


def test_ordered_dict_outputs_come_back_under_their_own_keys_through_serve(tmp_path):
    """An OrderedDict of outputs flattens as inserted: `serve` (TFSMLayer) returns each output
    under its own key (it packed them in sorted key order: 'zz' got 'aa''s tensor)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    outputs = collections.OrderedDict([("zz", keras.layers.Dense(4, name="p")(inp)),
                                       ("aa", keras.layers.Dense(8, name="q")(inp))])
    model = tf_sparse24.prune(keras.Model(inp, outputs))
    x = np.random.default_rng(3).standard_normal((2, 8)).astype("float32")
    want = model(x)
    export(model, tmp_path / "1")
    by_signature = load(tmp_path / "1").signatures["serving_default"](x=x)
    for served in (by_signature, keras.layers.TFSMLayer(tmp_path / "1")(x)):
        assert {k: tuple(v.shape) for k, v in served.items()} == {"zz": (2, 4), "aa": (2, 8)}
        for key in ("zz", "aa"):
            np.testing.assert_allclose(served[key], want[key], rtol=1e-5, atol=1e-6)
    assert verify(tmp_path / "1", against=model)["max_abs_diff"].keys() == {"zz", "aa"}


@pytest.mark.parametrize("sparse", [False, True])
def test_accelerated_dense_on_a_lookups_integer_or_sparse_one_hot(sparse, tmp_path):
    """StringLookup's multi-hot is int64 (Keras' matmul promotes it); a sparse one is a
    SparseTensor, which Keras' own call multiplies (its kernel then decompressed at load)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((1,), dtype="string", name="token")
    lookup = keras.layers.StringLookup(vocabulary=list("abcdefg"), output_mode="multi_hot",
                                       sparse=sparse)
    model = keras.Model(inp, keras.layers.Dense(4, name="logits")(lookup(inp)))
    randomize_biases(model, 1)
    pruned = tf_sparse24.prune(model)
    dense = pruned.get_layer("sparse24_logits").layer
    kernel, bias = prune_24(dense.kernel.numpy(), 0), dense.bias.numpy()
    tokens = tf.constant([["a"], ["q"], ["g"]])
    one_hot = np.eye(8)[[1, 0, 7]]  # index 0: out of vocabulary
    metadata = export(pruned, tmp_path / "1", mode="accelerated")
    assert [e["kernel"] for e in metadata["sparse"]] == [
        "dense_at_load" if sparse else "sparse24_matmul"
    ]
    served = load(tmp_path / "1").signatures["serving_default"](token=tokens)["logits"]
    np.testing.assert_allclose(served.numpy(), one_hot @ kernel + bias, rtol=1e-6, atol=1e-6)


def test_accelerated_float64_layers_are_decompressed_at_load_with_stock_ops(tmp_path):
    """The ops have float32/bfloat16/float16 kernels: float64 weights take the stock-op path."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), dtype="float64")
    model = keras.Model(inp, keras.layers.Dense(4, dtype="float64", name="out")(inp))
    randomize_biases(model, 2)
    pruned = tf_sparse24.prune(model)
    dense = pruned.get_layer("sparse24_out").layer
    x = np.random.default_rng(5).normal(size=(3, 8))
    metadata = export(pruned, tmp_path / "1", mode="accelerated")
    assert [(e["dtype"], e["kernel"]) for e in metadata["sparse"]] == [("float64", "dense_at_load")]
    served = load(tmp_path / "1").signatures["serving_default"](inputs=x)["out"]
    want = x @ prune_24(dense.kernel.numpy(), 0) + dense.bias.numpy()
    np.testing.assert_allclose(served.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["portable", "accelerated"])
def test_einsum_kernels_contracted_on_an_inner_axis_are_pruned_and_served(tmp_path, mode):
    # Gemma's query/key/value projection `btd,ndh->btnh` (kernel [heads, d, head_dim], contracted
    # on axis 1) and a transposed kernel `abc,dc->abd` ([out, in]): grouped along d / c.
    L = keras.layers
    tokens = keras.Input((5, 16), name="tokens")
    q = L.EinsumDense("btd,ndh->btnh", (None, 2, 8), name="q")(tokens)
    y = L.EinsumDense("abc,dc->abd", (None, 12), name="t")(L.Reshape((5, 16))(q))
    model = keras.Model(tokens, y)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 5, 16)).astype("float32")
    wq, wt = (model.get_layer(n).kernel.numpy() for n in ("q", "t"))
    pruned = tf_sparse24.prune(model)
    rows = {r.layer: r for r in tf_sparse24.report(pruned, print_fn=None)}
    assert rows["sparse24_q"].status == rows["sparse24_t"].status == "pruned"
    mq, mt = prune_24(wq, 1), prune_24(wt, 1)
    expected = np.einsum("abc,dc->abd", np.einsum("btd,ndh->btnh", x, mq).reshape(3, 5, 16), mt)
    np.testing.assert_allclose(pruned(x), expected, rtol=1e-5, atol=1e-5)
    metadata = tf_sparse24.export(pruned, tmp_path / "1", mode=mode)
    assert sorted((e["name"], e["axis"]) for e in metadata["sparse"]) == [
        ("q/kernel", 1), ("t/kernel", 1)]
    (served,) = load(tmp_path / "1").signatures["serving_default"](tokens=x).values()
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_verify_compares_with_the_model_in_graph_mode(tmp_path):
    # Graph mode rewrites swish (and batch norm after a convolution) into fused kernels that
    # round differently from eager execution; sin(20 x) blows those roundings up (as in an
    # untrained EfficientNetV2), so eager and graph outputs differ by a third of their size.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 8), name="image")
    x = inputs
    for _ in range(16):
        x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.ops.sin(keras.layers.Activation("swish")(x) * 20.0)
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x)))
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_variance.assign(np.full(16, 0.3, "float32"))
    pruned = tf_sparse24.prune(model)
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 8)).astype("float32")
    eager = pruned(x, training=False).numpy()
    graph = tf.function(lambda a: pruned(a, training=False))(x).numpy()
    assert np.abs(eager - graph).max() > 1e-2  # the premise: eager differs from graph mode
    tf_sparse24.export(pruned, tmp_path / "1")
    (served,) = load(tmp_path / "1").signatures["serving_default"](image=x).values()
    np.testing.assert_allclose(served.numpy(), graph, rtol=1e-5, atol=1e-5)
    assert verify(tmp_path / "1", against=pruned)["max_abs_diff"]["output_0"] <= 1e-4


def test_verify_sizes_unknown_dimensions_so_the_model_has_outputs(tmp_path):
    """A fully convolutional model (height and width unknown) with four 'valid' 3x3 convolutions
    cannot take 8x8 inputs (the first size tried); verify takes a larger one. One that can take
    nothing says which sizes it tried."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 4), name="image")
    x = inputs
    for _ in range(4):
        x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    model = tf_sparse24.prune(keras.Model(inputs, x))
    export(model, tmp_path / "1")
    report = verify(tmp_path / "1", against=model)
    assert report["input_shapes"] == {"image": [2, 32, 32, 4]}
    assert report["max_abs_diff"]["output_0"] <= 1e-4
    for _ in range(60):  # 120 pixels lost: more than the largest size tried
        x = keras.layers.Conv2D(8, 3)(x)
    deep = tf_sparse24.prune(keras.Model(inputs, x))
    export(deep, tmp_path / "2")
    with pytest.raises(ExportError, match=r"unknown input dimensions set to any of \[8, 32, 96\]"):
        verify(tmp_path / "2", against=deep)


def test_verify_compares_string_outputs_exactly(tmp_path):
    """Class labels served as strings (StringLookup(invert=True)) match or not; a model whose
    labels differ is refused, naming the first that does."""
    keras.utils.set_random_seed(0)
    features = keras.Input((8,), name="features")
    logits = keras.layers.Dense(4, name="logits")(features)
    classes = keras.ops.argmax(logits, axis=-1)

    def labelled(vocabulary):
        label = keras.layers.StringLookup(vocabulary=vocabulary, invert=True)(classes)
        return keras.Model(features, {"logits": logits, "label": label})

    model = tf_sparse24.prune(labelled(["cat", "dog", "cow"]))
    export(model, tmp_path / "1")
    assert verify(tmp_path / "1", against=model)["max_abs_diff"]["label"] == 0.0
    swapped = labelled(["cow", "cat", "dog"])  # the same logits: only the labels differ
    with pytest.raises(ExportError, match=r"output 'label': \d+ of \d+ strings differ from the "
                                          r"Keras model \(first at index"):
        verify(tmp_path / "1", against=tf_sparse24.prune(swapped))
    wrong_input = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
    with pytest.raises(ExportError, match=r"could not be compared: ") as error:
        verify(tmp_path / "1", against=wrong_input)
    assert "unknown input dimensions" not in str(error.value)  # the export has none


def test_accelerated_runs_group_query_attention(tmp_path):
    # Grouped-query attention (4 query heads sharing 2 key/value heads, a sigmoid gate): every
    # projection, the gate's too, runs as Sparse24MatMul and the export serves what it computes.
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6, 16), name="tokens")
    x = keras.layers.GroupQueryAttention(8, 4, 2, use_gate=True, name="gqa")(tokens, tokens)
    model = tf_sparse24.prune(keras.Model(tokens, keras.layers.Dense(4, name="scores")(x)))
    randomize_biases(model, 4)
    x = np.random.default_rng(5).standard_normal((3, 6, 16)).astype(np.float32)
    want = keras.ops.convert_to_numpy(model(x, training=False))

    metadata = export(model, tmp_path / "1", mode="accelerated")

    kernels = {e["name"]: e["kernel"] for e in metadata["sparse"]}
    assert kernels == dict.fromkeys(
        ["gqa/query/kernel", "gqa/key/kernel", "gqa/gate/kernel", "gqa/value/kernel",
         "gqa/attention_output/kernel", "scores/kernel"], "sparse24_matmul")
    assert op_count(tmp_path / "1", "Sparse24MatMul") == 6
    serve = load(tmp_path / "1").signatures["serving_default"]
    got = serve(tokens=tf.constant(x))["scores"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _swap_positions(meta: np.ndarray) -> np.ndarray:
    """Each group's two 2-bit positions swapped (descending: invalid sparse24/v1), in numpy."""
    swap = lambda nib: ((nib & 3) << 2) | (nib >> 2)  # noqa: E731
    return (swap(meta & 15) | (swap(meta >> 4) << 4)).astype(np.uint8)


def test_verify_refuses_an_export_whose_stored_meta_is_not_ascending(tmp_path, monkeypatch):
    """The export's checksums are consistent (the bad meta is what was written), so only verify's
    meta check can see it. Kills: verify skipping `fmt.check_meta`."""
    model = tiny_model()
    export_module = sys.modules["tf_sparse24.export"]
    stored = export_module._stored
    monkeypatch.setattr(export_module, "_stored",
                        lambda values, meta: stored(values, _swap_positions(meta)))
    export(model, tmp_path / "1")
    meta = load(tmp_path / "1").sparse_meta[0].numpy()
    nibbles = np.stack([meta & 15, meta >> 4], -1).reshape(meta.shape[0], -1)[:, :2]
    assert ((nibbles & 3) > (nibbles >> 2)).all()  # independent: every group is descending
    with pytest.raises(ExportError, match=r"weight '\w*/?scores/kernel': invalid meta: row n=0, group "
                                          r"g=0 .* strictly ascending"):
        verify(tmp_path / "1")


def test_verify_refuses_a_portable_export_that_uses_the_op_library(tmp_path, monkeypatch):
    """A `portable` export must run on stock TensorFlow: one whose graph holds Sparse24Decompress
    fails verify, naming the op. Kills: verify allowing the accelerated ops in any mode."""
    from tf_sparse24 import ops  # noqa: PLC0415

    model = tiny_model()
    monkeypatch.setattr(portable, "decompress", ops.sparse24_decompress)
    export(model, tmp_path / "1")  # mode="portable"
    assert load(tmp_path / "1").sparse24_metadata["mode"] == "portable"
    assert nonstock_ops(graph_ops(tmp_path / "1")) == {"Sparse24Decompress"}
    with pytest.raises(ExportError, match=r"the portable export uses ops that stock TensorFlow "
                                          r"does not register: \['Sparse24Decompress'\]"):
        verify(tmp_path / "1")
    monkeypatch.undo()
    export(model, tmp_path / "2")
    assert verify(tmp_path / "2")["nonstock_ops"] == []


class _OutputGroupedDense(keras.layers.Layer):
    """Opts its Dense sublayer's kernel in grouped along axis 1 (the outputs), not the input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="proj")

    def build(self, shape):
        self.dense.build(shape)

    def call(self, x):
        return self.dense(x)

    def get_prunable_weights(self):
        return [(self.dense.kernel, 1)]


def test_accelerated_a_dense_kernel_grouped_along_its_outputs_is_decompressed_at_load(tmp_path):
    """Sparse24MatMul groups along K: a Dense kernel grouped along N must not be fed to it
    (rebuilt at load instead). Kills: `_sparse_call` ignoring the grouping axis."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,), name="x")
    model = keras.Model(inputs, _OutputGroupedDense(name="og")(inputs))
    dense = model.get_layer("og").dense
    dense.bias.assign(np.linspace(-1, 1, 8).astype("float32"))
    w, b = dense.kernel.numpy().astype(np.float64), dense.bias.numpy().astype(np.float64)
    metadata = export(tf_sparse24.prune(model), tmp_path / "1", mode="accelerated")
    assert [(e["axis"], e["kernel"]) for e in metadata["sparse"]] == [(1, "dense_at_load")]
    x = np.random.default_rng(1).standard_normal((3, 12))
    served = load(tmp_path / "1").signatures["serving_default"](x=tf.constant(x, tf.float32))
    want = x @ prune_24(w, 1) + b  # numpy, float64
    np.testing.assert_allclose(served[list(served)[0]].numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_repeated_output_name_does_not_take_the_key_of_another_output(tmp_path):
    """Outputs named first, first, first_1: the repeat becomes first_2, and `first_1` serves the
    layer named first_1 (numpy float64 reference). Kills: `unique_names` suffixing a repeat with a
    name another output already has."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    first = keras.layers.Dense(4, name="first")
    other = keras.layers.Dense(4, name="first_1")
    model = keras.Model(inp, [first(inp), first(inp), other(inp)])
    prune_plain_layers(model)
    other.bias.assign(np.full(4, 3.0, np.float32))
    outputs = export(model, tmp_path / "1")["signature"]["outputs"]
    assert sorted(outputs) == ["first", "first_1", "first_2"]
    x = np.random.default_rng(2).standard_normal((3, 8))
    served = load(tmp_path / "1").signatures["serving_default"](x=tf.constant(x, tf.float32))
    ref = {layer.name: x @ layer.kernel.numpy().astype(np.float64) + layer.bias.numpy()
           for layer in (first, other)}
    for key, want in [("first", ref["first"]), ("first_2", ref["first"]),
                      ("first_1", ref["first_1"])]:
        np.testing.assert_allclose(served[key].numpy(), want, rtol=1e-5, atol=1e-5, err_msg=key)


def test_metadata_k_and_n_are_the_2d_view_of_each_stored_kernel(tmp_path):
    """`k` / `n` in the metadata: K = prod(shape[:axis+1]), N = the rest, as the stored values
    [N, K/2] and meta [N, ceil(K/8)] hold them (numpy). Kills: `n` counted from the grouping axis."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 4), name="image"), keras.layers.Conv2D(8, 3, name="conv"),
        keras.layers.Flatten(), keras.layers.Dense(4, name="head"),
    ])  # fmt: skip
    prune_plain_layers(model)
    metadata = export(model, tmp_path / "1")
    loaded = load(tmp_path / "1")
    assert len(metadata["sparse"]) == 2
    for entry, values, meta in zip(metadata["sparse"], loaded.sparse_values, loaded.sparse_meta):
        shape, axis = entry["shape"], entry["axis"]
        k, n = int(np.prod(shape[: axis + 1])), int(np.prod(shape[axis + 1 :]))
        assert (entry["k"], entry["n"]) == (k, n), entry["name"]
        assert values.shape == (n, k // 2) and meta.shape == (n, -(-k // 8)), entry["name"]
