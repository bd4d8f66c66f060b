"""prune / strip / report / pruned_layers on Sequential, Functional and subclassed models."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.examples import example
from test_masks import reference_mask

import tf_sparse24 as ts
from tf_sparse24.layer_calls import calls_replaced

RNG = np.random.default_rng(1)
X = RNG.normal(size=(4, 6, 8)).astype("float32")


def functional_model():
    """Nested model, a shared layer, MHA, conv, LSTM, and an output layer too narrow to prune."""
    sub_in = keras.Input((6, 8))
    sub = keras.Model(
        sub_in, keras.layers.Dense(8, name="sub_dense")(sub_in), name="sub"
    )
    shared = keras.layers.Dense(8, name="shared")
    inp = keras.Input((6, 8))
    h = shared(shared(sub(inp)))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = keras.layers.Conv1D(8, 3, name="conv")(h)
    h = keras.layers.LSTM(8, name="lstm")(h)
    h = keras.layers.Dense(3, name="narrow")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="out")(h))


def all_layers(model):
    out = []
    for layer in model.layers:
        out += [layer] + (all_layers(layer) if isinstance(layer, keras.Model) else [])
    return out


def masked_copy(model, axes):
    """The original model with its prunable weights replaced by numpy-reference 2:4 weights."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    # Paths from the original (built in its layers' name scopes), matched to the copy by position.
    masked = set()
    for layer, twin in zip(all_layers(model), all_layers(copy)):
        for var, target in zip(layer.weights, twin.weights):
            suffix = var.path.split(layer.name + "/", 1)[-1]
            if suffix in axes.get(layer.name, {}):
                w = var.numpy()
                target.assign(w * reference_mask(w, 2, 4, axes[layer.name][suffix]))
                masked.add((layer.name, suffix))
    assert masked == {(name, path) for name, paths in axes.items() for path in paths}
    return copy


FUNCTIONAL_AXES = {
    "sub_dense": {"kernel": 0},
    "shared": {"kernel": 0},
    "mha": {
        "query/kernel": 0,
        "key/kernel": 0,
        "value/kernel": 0,
        "attention_output/kernel": 1,
    },
    "conv": {"kernel": 1},
    "lstm": {"lstm_cell/kernel": 0, "lstm_cell/recurrent_kernel": 0},
    "narrow": {"kernel": 0},
}


def test_functional_prune_is_a_new_model_equal_to_masked_original():
    model = functional_model()
    weights = [w.copy() for w in model.get_weights()]
    pruned = ts.prune(model)
    assert pruned is not model and not ts.pruned_layers(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    names = sorted(layer.layer.name for layer in ts.pruned_layers(pruned))
    assert names == ["conv", "lstm", "mha", "narrow", "shared", "sub_dense"]
    reference = masked_copy(model, FUNCTIONAL_AXES)
    np.testing.assert_allclose(pruned(X), reference(X), rtol=1e-5, atol=1e-6)
    # The shared layer stays one layer (one set of weights and masks).
    shared = [
        layer for layer in ts.pruned_layers(pruned) if layer.layer.name == "shared"
    ]
    assert len(shared) == 1 and len(shared[0].pruned_weights) == 1


def test_functional_model_with_op_nodes_prunes_and_strips():
    """Tensor slicing in a Functional graph becomes a stateless `GetItem` node, not a Layer."""
    inp = keras.Input((6, 8))
    h = keras.layers.Dense(8, name="first")(inp)[:, 0]
    model = keras.Model(inp, keras.layers.Dense(4, name="last")(h))
    pruned = ts.prune(model)
    reference = masked_copy(model, {"first": {"kernel": 0}, "last": {"kernel": 0}})
    np.testing.assert_allclose(pruned(X), reference(X), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ts.strip(pruned)(X), reference(X), rtol=1e-5, atol=1e-6)


def test_strip_gives_plain_model_with_exact_24_weights():
    pruned = ts.prune(functional_model())
    pruned.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", run_eagerly=True)
    pruned.fit(
        X, np.ones((4, 2), "float32"), epochs=2, verbose=0
    )  # variables drift; masks hold
    stripped = ts.strip(pruned)
    flat = all_layers(stripped)
    assert not any(isinstance(layer, ts.Sparse24) for layer in flat)
    np.testing.assert_allclose(stripped(X), pruned(X), rtol=1e-5, atol=1e-6)
    for layer in flat:
        for path, axis in FUNCTIONAL_AXES.get(layer.name, {}).items():
            (var,) = [v for v in layer.weights if v.path.endswith(path)]
            assert ts.is_nm_sparse(var, "2:4", axis), var.path
            assert np.count_nonzero(var.numpy()) == var.numpy().size // 2


def test_sequential_layers_and_skip_selection():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(8, name="a"),
            keras.layers.Dense(8, name="b"),
            keras.layers.Dense(4, name="c"),
        ]
    )
    assert [l.layer.name for l in ts.pruned_layers(ts.prune(model))] == ["a", "b", "c"]
    assert [l.layer.name for l in ts.pruned_layers(ts.prune(model, layers=["b"]))] == [
        "b"
    ]
    assert [
        l.layer.name for l in ts.pruned_layers(ts.prune(model, skip=["a", "c"]))
    ] == ["b"]
    pruned = ts.prune(model, "1:4", skip=[model.get_layer("a")])
    np.testing.assert_allclose(
        pruned(X[:, 0].repeat(2, axis=1)),
        masked_copy_1of4(model, X[:, 0].repeat(2, axis=1)),
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match=r"layers: no layer named \['nope'\]"):
        ts.prune(model, layers=["nope"])
    # An empty selection is a mistake, not "everything" (None is the default that selects all).
    with pytest.raises(ValueError, match=r"layers: \(\) selects no layer of model"):
        ts.prune(model, layers=())
    assert len(ts.pruned_layers(ts.prune(model, skip=[]))) == 3


def masked_copy_1of4(model, x):
    h = x.astype(np.float64)
    for layer in model.layers:
        kernel, bias = (w.astype(np.float64) for w in layer.get_weights())
        if layer.name != "a":
            kernel = kernel * reference_mask(kernel, 1, 4, 0)
        h = h @ kernel + bias
    return h


def test_pruning_a_pruned_model_with_another_pattern_is_refused_not_ignored():
    """Its wrappers keep the pattern they have: asking for another one must not pass silently."""
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(4, name="b")]
    )
    pruned = ts.prune(model, layers=["a"])
    with pytest.raises(ValueError, match=r"pattern='1:4', but the Sparse24 layers \['sparse24_a'\] "
                                         r".* prune tf_sparse24.strip\(model\) instead"):
        ts.prune(pruned, "1:4")
    # The rest of the model, or the stripped copy, takes the new pattern.
    x = X[:, 0].repeat(2, axis=1)
    partly = ts.prune(pruned, "1:4", layers=["b"])
    assert [(l.layer.name, l.pattern) for l in ts.pruned_layers(partly)] == [
        ("a", "2:4"), ("b", "1:4")
    ]
    h = x.astype(np.float64)
    for layer, n in zip(model.layers, (2, 1)):
        kernel, bias = (w.astype(np.float64) for w in layer.get_weights())
        h = h @ (kernel * reference_mask(kernel, n, 4, 0)) + bias
    np.testing.assert_allclose(partly(x), h, rtol=1e-5, atol=1e-6)
    again = ts.prune(ts.strip(pruned), "1:4")
    assert [l.pattern for l in ts.pruned_layers(again)] == ["1:4", "1:4"]
    for wrapper in ts.pruned_layers(again):
        assert ts.is_nm_sparse(wrapper.effective_weight(wrapper.pruned_weights[0]), "1:4", 0)


@keras.saving.register_keras_serializable(package="test_prune")
class TwoLayer(keras.Model):
    """A subclassed model that opts in by wrapping its prunable layers itself."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = ts.Sparse24(keras.layers.Dense(units, activation="relu"))
        self.head = ts.Sparse24(keras.layers.Dense(4))

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_subclassed_model_prune_returns_masked_copy():
    model = TwoLayer()
    x = X[:, 0]
    dense_out = np.asarray(model(x))  # masks of ones: the model is dense
    pruned = ts.prune(model)
    assert pruned is not model
    assert all(
        float(np.mean(pw.mask.numpy())) == 1.0
        for l in ts.pruned_layers(model)
        for pw in l.pruned_weights
    )
    np.testing.assert_allclose(model(x), dense_out)
    h = x.astype(np.float64)
    for wrapper in (model.hidden, model.head):
        kernel, bias = (w.astype(np.float64) for w in wrapper.layer.get_weights())
        h = h @ (kernel * reference_mask(kernel, 2, 4, 0)) + bias
        if wrapper is model.hidden:
            h = np.maximum(h, 0)
    np.testing.assert_allclose(pruned(x), h, rtol=1e-5, atol=1e-6)
    assert pruned.built  # so prune/strip of the copy say what they say of the model
    with pytest.raises(ValueError, match=r"pattern='1:4', but the Sparse24 layers \[.*\] of"):
        ts.prune(model, "1:4")  # the wrappers' own pattern (2:4) would be used: refused
    assert ts.prune(model, "2:4").built
    with pytest.raises(TypeError, match="supports Sequential and Functional"):
        ts.strip(pruned)
    head_skipped = ts.prune(model, skip=[model.head])  # selection is kept in the copy
    hidden, head = ts.pruned_layers(head_skipped)
    assert hidden.pruned_weights[0].mask.numpy().mean() == 0.5
    assert head.pruned_weights[0].mask.numpy().min() == 1.0
    # Pruning it again keeps the masks it has (fine-tuned with), as for a Functional model: here
    # masks keeping the two smallest of each group, which magnitude would replace.
    for wrapper in ts.pruned_layers(pruned):
        for pw in wrapper.pruned_weights:
            smallest = reference_mask(1 / (np.abs(pw.variable.numpy()) + 1e-6), 2, 4, 0)
            pw.mask.assign(smallest.astype("float32"))
    kept = [pw.mask.numpy() for w in ts.pruned_layers(pruned) for pw in w.pruned_weights]
    again = ts.prune(pruned)
    assert all(np.array_equal(a, pw.mask.numpy()) for a, pw in
               zip(kept, [pw for w in ts.pruned_layers(again) for pw in w.pruned_weights]))
    np.testing.assert_allclose(again(x), pruned(x), rtol=1e-6, atol=1e-6)


def test_subclassed_selectors_reach_the_wrapped_layers():
    model = TwoLayer()
    model(X[:, 0])

    def densities(pruned):
        return [float(w.pruned_weights[0].mask.numpy().mean()) for w in ts.pruned_layers(pruned)]

    inner = model.head.layer
    assert densities(ts.prune(model, layers=keras.layers.Dense)) == [0.5, 0.5]
    with pytest.warns(UserWarning, match="no layer of model .* was pruned"):
        assert densities(ts.prune(model, skip=keras.layers.Dense)) == [1.0, 1.0]
    assert densities(ts.prune(model, skip=inner)) == [0.5, 1.0]
    assert densities(ts.prune(model, layers=[inner.name])) == [1.0, 0.5]


def test_selecting_or_skipping_a_block_covers_the_wrappers_it_holds():
    """USAGE: selecting or skipping a layer covers the layers inside it, also a subclassed
    block's own wrappers (skip="block" used to compute their masks all the same, and
    layers="block" to leave them dense)."""
    inp = keras.Input((16,))
    block = TwoLayer(units=16, name="block")
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(block(inp)))
    want = {w: reference_mask(w.layer.kernel.numpy(), 2, 4, 0) for w in (block.hidden, block.head)}

    def masks(pruned):  # the block's two wrappers (copies: fresh names), then "out" if wrapped
        return [w.pruned_weights[0].mask.numpy() for w in ts.pruned_layers(pruned)]

    hidden, head, out = masks(ts.prune(model, skip="block"))
    assert hidden.min() == 1.0 and head.min() == 1.0  # left as they were: never computed
    np.testing.assert_array_equal(
        out, reference_mask(model.get_layer("out").kernel.numpy(), 2, 4, 0))
    hidden, head = masks(ts.prune(model, layers="block"))  # "out" is not wrapped
    np.testing.assert_array_equal(hidden, want[block.hidden])
    np.testing.assert_array_equal(head, want[block.head])


def test_a_prune_whose_copy_would_train_dense_says_so():
    """A model whose own wrappers are all skipped comes back with masks of ones, as dense as a
    model without wrappers: prune() warns, as it does when it wraps nothing."""
    model = TwoLayer()
    model(X[:, 0])
    with pytest.warns(UserWarning, match=r"no layer of model 'two_layer.*' was pruned: .*report"):
        ts.prune(model, skip=keras.layers.Dense)
    inp = keras.Input((16,))
    functional = keras.Model(inp, keras.layers.Dense(4, name="out")(TwoLayer(16, name="b")(inp)))
    with pytest.warns(UserWarning, match=r"no layer of model .* was pruned: .* can prune '2:4'"):
        ts.prune(functional, skip=["b", "out"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head_dense = ts.prune(model, skip=model.head)
        ts.prune(head_dense, skip=keras.layers.Dense)  # the hidden layer keeps its masks


def test_wrappers_inside_a_subclassed_block_of_a_functional_model_get_masks():
    """A Functional model holding a subclassed block that wraps its own layers (what prune()'s
    error for unreachable layers asks for): the block's wrappers get magnitude masks too."""
    inp = keras.Input((16,))
    block = TwoLayer(units=16, name="block")
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(block(inp)))
    pruned = ts.prune(model)
    x = X[:, 0].repeat(2, axis=1)
    h = x.astype(np.float64)
    for wrapper in (block.hidden, block.head):
        kernel, bias = (w.astype(np.float64) for w in wrapper.layer.get_weights())
        h = h @ (kernel * reference_mask(kernel, 2, 4, 0)) + bias
        h = np.maximum(h, 0) if wrapper is block.hidden else h
    out = model.get_layer("out")
    kernel, bias = (w.astype(np.float64) for w in out.get_weights())
    want = h @ (kernel * reference_mask(kernel, 2, 4, 0)) + bias
    np.testing.assert_allclose(pruned(x), want, rtol=1e-5, atol=1e-5)
    assert all(row.valid for row in ts.report(pruned, print_fn=None) if row.status == "pruned")
    with pytest.raises(TypeError, match=r"strip\(\): the Sparse24 layers \[.*\] .* inside a layer"):
        ts.strip(pruned)


class Plain(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x)


def test_bad_inputs_raise_before_any_change():
    with pytest.raises(TypeError, match="expects a keras.Model. Received: Dense"):
        ts.prune(keras.layers.Dense(4))
    with pytest.raises(ValueError, match="unbuilt model"):
        ts.prune(keras.Sequential([keras.layers.Dense(4)]))
    plain = Plain()
    plain(X[:, 0])
    with pytest.raises(ValueError, match="has no Sparse24 layers"):
        ts.prune(plain)

    model = functional_model()
    with pytest.raises(ValueError, match="Received: pattern='2:4:8'"):
        ts.prune(model, "2:4:8")
    # A layer object of another model (the one a copy was made from) would select nothing.
    with pytest.raises(ValueError, match=r"layer objects \['conv'\] are not in model"):
        ts.prune(ts.prune(model), layers=[model.get_layer("conv")])
    with pytest.raises(TypeError, match=r"layer names, layer objects or layer classes, got \[3\]"):
        ts.prune(model, skip=[3])
    lstm = model.get_layer("lstm")
    weights = lstm.get_weights()
    weights[1][3, 5] = np.nan  # recurrent kernel
    lstm.set_weights(weights)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"lstm/lstm_cell/recurrent_kernel.*NaN/Inf"):
        ts.prune(model)
    after = model.get_weights()
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))
    assert not ts.pruned_layers(model)


def test_report_rows_and_table():
    model = functional_model()
    depthwise_in = keras.Input((5, 5, 8))
    depthwise = keras.Model(
        depthwise_in, keras.layers.DepthwiseConv2D(3, name="dw")(depthwise_in)
    )
    lines = []
    rows = ts.report(ts.prune(model), print_fn=lines.append)
    by_name = {r.layer: r for r in rows}
    assert by_name["sparse24_lstm"].status == "pruned"
    assert by_name["sparse24_lstm"].params == 8 * 32 + 8 * 32
    assert by_name["sparse24_lstm"].density == 0.5 and by_name["sparse24_lstm"].valid
    assert (
        by_name["out"].status == "skipped"
        and "(3, 2): axis 0 size 3" in by_name["out"].reason
    )
    table = lines[0]
    assert "sparse24_mha" in table and "total pruned" in table and "6 layers" in table
    (dw_row,) = ts.report(depthwise, print_fn=None)
    assert dw_row.status == "skipped" and "depthwise" in dw_row.reason
    # The total line, on a model small enough that a count off by one shows in the density.
    tiny = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d")])
    lines = []
    ts.report(ts.prune(tiny), print_fn=lines.append)
    assert lines[0].splitlines()[-1].split() == ["total", "pruned", "1", "layers", "16", "0.500",
                                                 "yes"]


@pytest.mark.parametrize("pattern", ["4:8", "3:4"])
def test_patterns_keeping_more_than_2_of_4_prune_and_strip_without_warnings(pattern):
    """N:M weights are judged by their own pattern: 4:8 or 3:4 weights are not 2:4, and were
    taken for masks never computed ("no layer was pruned", strip's "not N:M")."""
    n, m = map(int, pattern.split(":"))
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="d")])
    x = RNG.normal(size=(3, 16)).astype("float32")
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    expected = x @ (kernel * reference_mask(kernel, n, m, 0)) + bias
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pruned = ts.prune(model, pattern)
        stripped = ts.strip(pruned)
    (row,) = ts.report(pruned, print_fn=None)
    assert row.valid and row.density == n / m
    for copy in (pruned, stripped):
        np.testing.assert_allclose(copy(x), expected, rtol=1e-5, atol=1e-5)


def test_eligible_weights():
    conv = keras.layers.Conv2D(4, 3)
    conv.build((None, 5, 5, 8))
    ((path, var, axis),) = ts.eligible_weights(conv)
    assert (path, axis) == ("kernel", 2) and var is conv.kernel
    einsum = keras.layers.EinsumDense(
        "abc,dc->abd", output_shape=(None, 4)
    )  # kernel [d, c]
    einsum.build((None, 6, 8))
    ((path, var, axis),) = ts.eligible_weights(einsum)  # contracted on its last axis
    assert (path, axis) == ("kernel", 1) and var is einsum.kernel
    # Two contracted axes (an attention output projection, kernel [heads, dim, out]): the last one,
    # as MultiHeadAttention's own table has it; heads (2 here) would skip the layer.
    heads = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, 8))
    heads.build((None, 6, 2, 8))
    assert [(p, a) for p, _, a in ts.eligible_weights(heads)] == [("kernel", 1)]
    # A kernel axis kept in the output (per-position weights, kernel [c, b]) is not summed over.
    positions = keras.layers.EinsumDense("abc,cb->ab", output_shape=(8,))
    positions.build((None, 8, 8))
    assert [(p, a) for p, _, a in ts.eligible_weights(positions)] == [("kernel", 0)]
    x = RNG.normal(size=(2, 8, 8)).astype("float32")
    kernel = positions.kernel.numpy().astype(np.float64)
    expected = np.einsum("abc,cb->ab", x, kernel * reference_mask(kernel, 2, 4, 0))
    pruned = ts.prune(keras.Sequential([keras.Input((8, 8)), positions]))
    np.testing.assert_allclose(pruned(x), expected, rtol=1e-5, atol=1e-5)


class _UnitsBlock(keras.layers.Layer):
    """A test block of sublayers whose config is its `units`."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_prune")
class Block(_UnitsBlock):
    """A user layer holding two Dense sublayers (attributes, not a model)."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.fc1 = keras.layers.Dense(units, activation="relu", name="fc1")
        self.fc2 = keras.layers.Dense(units, name="fc2")

    def build(self, input_shape):
        self.fc1.build(input_shape)
        self.fc2.build((*input_shape[:-1], self.units))

    def call(self, x):
        return self.fc2(self.fc1(x))


@keras.saving.register_keras_serializable(package="test_prune")
class UnnamedBlock(Block):
    """Block with automatically named sublayers ("dense_7"): the names differ in every copy."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.fc1 = keras.layers.Dense(units, activation="relu")
        self.fc2 = keras.layers.Dense(units)


def test_a_block_with_automatic_sublayer_names_is_made_again_from_its_config(tmp_path):
    """The wrapper finds its weights by position when the layer is made from config (the names
    that a path holds change), in a .keras load, clone_model, from_config and a second prune."""
    inp = keras.Input((8,))
    model = keras.Model(inp, UnnamedBlock(name="block")(inp))
    pruned = ts.prune(model)
    x = X[:, 0]
    want = np.asarray(pruned(x))
    path = str(tmp_path / "unnamed.keras")
    pruned.save(path)
    copies = {
        "load_model": keras.models.load_model(path),
        "from_config": keras.Model.from_config(pruned.get_config()),
        "prune again": ts.prune(pruned),
    }
    copies["from_config"].set_weights(pruned.get_weights())
    for name, copy in copies.items():
        (wrapper,) = ts.pruned_layers(copy)
        assert len(wrapper.pruned_weights) == 2, name
        np.testing.assert_allclose(np.asarray(copy(x)), want, rtol=1e-6, atol=1e-6, err_msg=name)


def container_model():
    """Layers that hold the prunable layers inside them: clone_model only sees the containers."""
    inp = keras.Input((6, 8))
    h = keras.layers.TimeDistributed(keras.layers.Dense(8, name="inner"), name="td")(inp)
    h = keras.layers.Bidirectional(
        keras.layers.LSTM(8, return_sequences=True, name="lstm"), name="bi"
    )(h)
    h = Block(8, name="block")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, keras.layers.Dense(4, name="out")(h))


CONTAINER_AXES = {
    "td": {"inner/kernel": 0},
    "bi": {
        f"{d}_lstm/lstm_cell/{k}": 0
        for d in ("forward", "backward")
        for k in ("kernel", "recurrent_kernel")
    },
    "block": {"fc1/kernel": 0, "fc2/kernel": 0},
    "out": {"kernel": 0},
}


def names_of(model):
    """The names of the layers `Sparse24` wraps in `model`, in model order."""
    return [layer.layer.name for layer in ts.pruned_layers(model)]


def test_layers_inside_containers_are_pruned_through_the_container(tmp_path):
    model = container_model()
    pruned = ts.prune(model)
    wrapped = {layer.layer.name: layer for layer in ts.pruned_layers(pruned)}
    assert sorted(wrapped) == ["bi", "block", "out", "td"]
    assert sorted(pw.name for pw in wrapped["bi"].pruned_weights) == sorted(CONTAINER_AXES["bi"])
    x = X.repeat(1, axis=0)
    np.testing.assert_allclose(
        pruned(x), masked_copy(model, CONTAINER_AXES)(x), rtol=1e-5, atol=1e-6
    )
    rows = {r.layer: r for r in ts.report(pruned, print_fn=None)}
    assert rows["sparse24_bi"].status == "pruned" and rows["sparse24_bi"].valid
    assert rows["sparse24_bi"].density == 0.5
    # The containers' wrappers survive a .keras round trip and strip to plain layers.
    path = str(tmp_path / "containers.keras")
    pruned.save(path)
    np.testing.assert_allclose(keras.models.load_model(path)(x), pruned(x), rtol=1e-6)
    stripped = ts.strip(pruned)
    assert not ts.pruned_layers(stripped)
    np.testing.assert_allclose(stripped(x), pruned(x), rtol=1e-5, atol=1e-6)


def rnn_cells_model():
    """ConvLSTM2D, RNN(cell), and Bidirectional(RNN(StackedRNNCells)): pruned through the cells."""
    cells = [keras.layers.GRUCell(8, name="a"), keras.layers.SimpleRNNCell(4, name="b")]
    stacked = keras.layers.RNN(keras.layers.StackedRNNCells(cells, name="stack"), name="stacked")
    frames = keras.Input((3, 6, 6, 4))
    h = keras.layers.ConvLSTM2D(8, 3, name="conv_lstm")(frames)
    h = keras.layers.Reshape((16, 8))(h)
    cell = keras.layers.LSTMCell(8, name="cell")
    h = keras.layers.RNN(cell, return_sequences=True, name="rnn")(h)
    h = keras.layers.Bidirectional(stacked, name="bi")(h)
    return keras.Model(frames, keras.layers.Dense(4, name="out")(h))


RNN_CELLS_AXES = {
    "conv_lstm": {"conv_lstm_cell/kernel": 2, "conv_lstm_cell/recurrent_kernel": 2},
    "rnn": {"cell/kernel": 0, "cell/recurrent_kernel": 0},
    "bi": {
        f"{d}_stacked/stack/{c}/{k}": 0
        for d in ("forward", "backward")
        for c in "ab"
        for k in ("kernel", "recurrent_kernel")
    },
    "out": {"kernel": 0},
}


def test_rnn_layers_made_of_cells_and_conv_lstm_are_pruned_through_their_cells(tmp_path):
    model = rnn_cells_model()
    pruned = ts.prune(model)
    wrapped = {layer.layer.name: layer for layer in ts.pruned_layers(pruned)}
    assert {name: {pw.name: pw.axis for pw in w.pruned_weights} for name, w in wrapped.items()} == (
        RNN_CELLS_AXES
    )
    x = RNG.normal(size=(2, 3, 6, 6, 4)).astype("float32")
    reference = masked_copy(model, RNN_CELLS_AXES)(x)
    np.testing.assert_allclose(pruned(x), reference, rtol=1e-5, atol=1e-5)
    assert np.abs(model(x) - reference).max() > 1e-3  # the masks change the output
    rows = {r.layer: r for r in ts.report(pruned, print_fn=None)}
    assert {r.status for r in rows.values()} == {"pruned"} and all(r.valid for r in rows.values())
    assert sorted(rows) == sorted(f"sparse24_{name}" for name in RNN_CELLS_AXES)
    path = str(tmp_path / "cells.keras")
    pruned.save(path)
    np.testing.assert_allclose(keras.models.load_model(path)(x), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ts.strip(pruned)(x), reference, rtol=1e-5, atol=1e-5)


def test_selecting_or_skipping_a_container_covers_its_layers():
    model = container_model()
    assert names_of(ts.prune(model, layers=["td"])) == ["td"]
    assert names_of(ts.prune(model, layers=["forward_lstm"])) == ["bi"]  # an inner layer's name
    assert names_of(ts.prune(model, layers=keras.layers.LSTM)) == ["bi"]  # one selector, no list
    assert sorted(names_of(ts.prune(model, skip="bi"))) == ["block", "out", "td"]
    only_fc1 = ts.prune(model, layers=["fc1"])
    (block,) = ts.pruned_layers(only_fc1)
    assert [pw.name for pw in block.pruned_weights] == ["fc1/kernel"]
    rows = {r.layer: r for r in ts.report(only_fc1, print_fn=None)}
    assert rows["out"].status == "not pruned"
    assert "eligible, left dense: kernel" in rows["out"].reason
    assert rows["fc2"].status == "not pruned"  # inside the wrapped block, left dense


def test_report_has_one_row_per_attention_layer():
    """MultiHeadAttention's sublayers repeat none of its row; a wrapper's leftovers get theirs."""
    inp = keras.Input((6, 8))
    h = keras.layers.MultiHeadAttention(2, 3, name="mha")(inp, inp)  # attention_output axis 3
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(h))
    rows = ts.report(ts.prune(model, skip="mha"), print_fn=None)
    assert [(r.layer, r.status) for r in rows] == [
        ("mha", "not pruned"), ("sparse24_out", "pruned")
    ]
    assert "attention_output/kernel (2, 3, 8): axis 1 size 3" in rows[0].reason
    rows = ts.report(ts.prune(model), print_fn=None)
    assert [(r.layer, r.status) for r in rows] == [
        ("sparse24_mha", "pruned"), ("attention_output", "skipped"), ("sparse24_out", "pruned")
    ]


def test_skipping_a_sublayer_class_keeps_the_owners_table_off_it():
    inp = keras.Input((6, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(h))
    assert names_of(ts.prune(model, skip=keras.layers.EinsumDense)) == ["out"]


class Tower(keras.Model):
    """A subclassed model used as a layer of a Functional one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = keras.layers.Dense(8, name="tower_fc")

    def call(self, x):
        return self.fc(x)


def test_layers_inside_a_nested_subclassed_model_are_an_error_not_a_silent_skip():
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(Tower(name="tower")(inp)))
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"cannot reach layers \['tower_fc'\].*subclassed"):
        ts.prune(model)
    assert names_of(ts.prune(model, skip=["tower"])) == ["out"]
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


class HandWrappedBlock(keras.layers.Layer):
    """A user's block holding its own Sparse24 next to a plain Dense."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = ts.Sparse24(keras.layers.Dense(8, name="fc"))
        self.other = keras.layers.Dense(8, name="other")

    def call(self, x):
        return self.other(keras.ops.relu(self.fc(x)))


def test_a_block_holding_its_own_wrapper_is_not_wrapped_around_it():
    """Pruning `other` would wrap the whole block, the user's wrapper inside ours, out of reach
    of pruned_layers(), strip() and the callback's check: refused; skipping `other` works."""
    inp = keras.Input((8,))
    model = keras.Model(inp, HandWrappedBlock(name="blk")(inp))
    with pytest.raises(ValueError, match=r"layer 'blk' holds Sparse24 layers of its own "
                                         r"\['sparse24_fc'\], and also the prunable layers "
                                         r"\['other'\]"):
        ts.prune(model)
    pruned = ts.prune(model, skip="blk/other")
    assert [w.name for w in ts.pruned_layers(pruned)] == ["sparse24_fc"]
    (pw,) = ts.pruned_layers(pruned)[0].pruned_weights
    np.testing.assert_array_equal(pw.mask.numpy(), reference_mask(pw.variable.numpy(), 2, 4, 0))


def test_selectors_may_be_any_iterable_but_not_a_number():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
                              keras.layers.Dense(8, name="top"), keras.layers.Dense(4, name="c")])
    for chosen in (iter(["top"]), (n for n in ["top"]), filter(lambda l: l.name == "top",
                                                               model.layers)):
        assert names_of(ts.prune(model, layers=chosen)) == ["top"]  # all three, before
    with pytest.raises(TypeError, match=r"layers: expected a layer name.* Received: layers=3"):
        ts.prune(model, layers=3)
    # A predicate is not a selector: the error says how to pass what it picks.
    for chosen in (lambda layer: layer.name == "top", [lambda layer: layer.name == "top"]):
        with pytest.raises(TypeError, match=r"layers=filter\(predicate, model.layers\)"):
            ts.prune(model, layers=chosen)


def test_unknown_selector_names_list_the_models_layers_and_the_close_ones():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="encoder_a"),
                              keras.layers.Dense(4, name="head")])
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError) as err:
        ts.prune(model, skip=["encoder_b", "nothing"])
    message = str(err.value)
    assert "skip: no layer named ['encoder_b', 'nothing']" in message
    assert "'encoder_b': did you mean ['encoder_a']? Its layers" in message  # not '?.'
    assert "Its layers: ['encoder_a', 'head']." in message and "'nothing': did" not in message
    many = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(4, name=f"d{i}")
                                                     for i in range(45)])
    with pytest.raises(ValueError, match=r"'d39'\] and 5 more\.$"):
        ts.prune(many, layers="x")
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def test_a_prune_that_prunes_nothing_says_so():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Embedding(10, 8, name="embedding"),
                              keras.layers.Dense(4, name="d")])
    with pytest.warns(UserWarning, match=r"no layer of model .* was pruned: .*report\(model\) says why"):
        ts.prune(model, layers=["embedding"])
    with pytest.warns(UserWarning, match=r"no layer .* can prune '8:16'"):
        ts.prune(model, "8:16")


def test_state_outside_the_weights_is_copied_adapted_preprocessing():
    # An adapted Normalization derives its mean from stored statistics (finalize_state), a
    # StringLookup keeps its vocabulary in a table, not a weight: set_weights copies neither.
    rng = np.random.default_rng(3)
    numbers = tf.constant(rng.normal(5.0, 3.0, size=(32, 8)).astype("float32"))
    words = tf.constant([["red", "green", "blue", "red"][i % 4] for i in range(32)])[:, None]
    norm, lookup = keras.layers.Normalization(name="norm"), keras.layers.StringLookup(name="vocab")
    norm.adapt(numbers)
    lookup.adapt(words)
    num_in, word_in = keras.Input((8,)), keras.Input((1,), dtype="string")
    h = keras.layers.Dense(8, name="d1")(norm(num_in))
    e = keras.layers.Flatten()(keras.layers.Embedding(8, 4, name="emb")(lookup(word_in)))
    out = keras.layers.Dense(4, name="d2")(keras.layers.Concatenate()([h, e]))
    model = keras.Model([num_in, word_in], out)
    pruned = ts.prune(model)
    stripped = ts.strip(pruned)
    for layer in ts.pruned_layers(pruned):  # the reference: the original, with the 2:4 kernels
        pw = layer.pruned_weights[0]
        model.get_layer(layer.layer.name).kernel.assign(np.asarray(layer.effective_weight(pw)))
    want = np.asarray(model([numbers, words]))
    for copy in (pruned, stripped):
        np.testing.assert_array_equal(copy.get_layer("norm").mean, norm.mean)
        np.testing.assert_allclose(np.asarray(copy([numbers, words])), want, atol=1e-6)


@keras.saving.register_keras_serializable(package="test_prune")
class TiedOutput(keras.layers.Layer):
    """An output projection reading another layer's kernel (transposed): a tied weight."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.source.kernel))

    def get_config(self):
        source = keras.saving.serialize_keras_object(self.source)
        return {**super().get_config(), "source": source}

    @classmethod
    def from_config(cls, config):
        config["source"] = keras.saving.deserialize_keras_object(config["source"])
        return cls(**config)


def test_weights_tied_across_layers_are_refused_not_untied():
    inp = keras.Input((16,))
    encoder = keras.layers.Dense(8, name="encoder")
    model = keras.Model(inp, TiedOutput(encoder, name="tied")(encoder(inp)))
    weights = [w.copy() for w in model.get_weights()]
    message = r"weight 'encoder/kernel' is shared by layers 'encoder' and 'tied'.*untie"
    with pytest.raises(ValueError, match=message):
        ts.prune(model)
    with pytest.raises(ValueError, match=message):
        ts.prune(model, skip=["encoder", "tied"])  # a copy unties it, pruned or not
    with pytest.raises(ValueError, match=message):
        ts.strip(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


@keras.saving.register_keras_serializable(package="test_prune")
class LossyBlock(Block):
    """A block that adds losses: its own add_loss, and an activity regularizer inside."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.fc2 = keras.layers.Dense(
            units, name="fc2", activity_regularizer=keras.regularizers.L2(0.5)
        )

    def call(self, x):
        h = self.fc1(x)
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
        return self.fc2(h)


def test_losses_added_inside_a_wrapped_layer_reach_the_model():
    inp = keras.Input((8,))
    model = keras.Model(inp, LossyBlock(8, name="block")(inp))
    pruned = ts.prune(model)
    assert names_of(pruned) == ["block"]
    stripped = ts.strip(pruned)  # plain layers holding the effective weights: the reference
    x = X[:, 0]
    pruned(x), stripped(x)
    assert len(pruned.losses) == len(stripped.losses) == 2
    np.testing.assert_allclose(
        sorted(float(v) for v in pruned.losses), sorted(float(v) for v in stripped.losses),
        rtol=1e-5,
    )


def test_lambda_layers_are_kept_as_they_are():
    inp = keras.Input((8,))
    h = keras.layers.Lambda(lambda t: t * 2.0, name="twice")(keras.layers.Dense(8, name="a")(inp))
    model = keras.Model(inp, keras.layers.Dense(4, name="b")(h))
    pruned = ts.prune(model)
    (wa, ba), (wb, bb) = (
        [np.float64(v) for v in model.get_layer(n).get_weights()] for n in ("a", "b")
    )
    x = X[:, 0]
    masked = lambda w: w * reference_mask(w, 2, 4, 0)
    reference = (x @ masked(wa) + ba) * 2.0 @ masked(wb) + bb  # float64, from the original
    np.testing.assert_allclose(pruned(x), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ts.strip(pruned)(x), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "layer",
    [lambda: keras.layers.Dense(4, name="d"),
     lambda: keras.layers.EinsumDense("ab,bc->ac", 4, name="d")],  # its `kernel` is computed
)  # fmt: skip
def test_lora_enabled_layers_are_skipped_with_the_reason(layer):
    model = keras.Sequential([keras.Input((8,)), layer()])
    model.layers[0].enable_lora(2)
    model.layers[0].lora_kernel_b.assign(np.ones((2, 4), "float32"))  # trained adapters
    pruned = ts.prune(model)
    assert not ts.pruned_layers(pruned)
    (row,) = ts.report(pruned, print_fn=None)
    assert row.status == "skipped" and "LoRA" in row.reason
    # Copied as they are: a .keras file would merge the adapters into the kernel and zero them.
    for copy in (pruned, ts.strip(pruned)):
        for got, want in zip(copy.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "make",
    [lambda: keras.layers.MultiHeadAttention(2, 4, name="att"),
     lambda: keras.layers.GroupQueryAttention(4, 4, 2, name="att")],
    ids=["mha", "gqa"],
)  # fmt: skip
def test_lora_on_an_attention_projection_is_kept_and_the_other_projections_pruned(make):
    """The attention layer's config does not record LoRA on its projections: the copies get it
    back (same rank and alpha, the trained adapters), and only that projection stays dense."""
    inp = keras.Input((6, 8))
    att = make()
    model = keras.Model(inp, att(inp, inp))
    query = att._query_dense
    query.enable_lora(2, lora_alpha=4)
    query.lora_kernel_b.assign(RNG.normal(size=query.lora_kernel_b.shape).astype("float32"))
    pruned = ts.prune(model)
    (wrapper,) = ts.pruned_layers(pruned)
    assert [pw.name for pw in wrapper.pruned_weights] == [
        "key/kernel", "value/kernel", "attention_output/kernel"]
    reason = next(r.reason for r in ts.report(pruned, print_fn=None) if r.layer == "query")
    assert "LoRA is enabled on 'query'" in reason
    # Reference: the original layer with those three kernels masked (numpy masks), LoRA as it is.
    others = {"key": 0, "value": 0, "attention_output": 1}
    saved = {n: getattr(att, f"_{n}_dense" if n != "attention_output" else "_output_dense")
             for n in others}
    values = {n: d.kernel.numpy() for n, d in saved.items()}
    try:
        for n, d in saved.items():
            d.kernel.assign(values[n] * reference_mask(values[n], 2, 4, others[n]))
        want = np.asarray(model(X), np.float64)
    finally:
        for n, d in saved.items():
            d.kernel.assign(values[n])
    np.testing.assert_allclose(pruned(X), want, rtol=1e-5, atol=1e-6)
    stripped = ts.strip(pruned)
    np.testing.assert_allclose(stripped(X), want, rtol=1e-5, atol=1e-6)
    (copy,) = [layer for layer in stripped._flatten_layers() if layer.name == "query"]
    assert copy.lora_enabled and (copy.lora_rank, copy.lora_alpha) == (2, 4)
    for mine, theirs in [(copy.lora_kernel_a, query.lora_kernel_a),
                         (copy.lora_kernel_b, query.lora_kernel_b), (copy._kernel, query._kernel)]:
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


class Post(keras.layers.Layer):
    """No weights of its own; makes its sublayers in build()."""

    def build(self, shape):
        self.act = keras.layers.Activation("relu")
        self.drop = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return self.drop(self.act(x), training=training)


def test_weightless_layer_with_sublayers_made_in_build_is_copied():
    inp = keras.Input((16,))
    h = Post(name="post")(keras.layers.Dense(16, name="d1")(inp))
    out = keras.layers.Dense(4, name="d2")(h)
    model = keras.Model(inp, out)
    assert names_of(ts.prune(model)) == ["d1", "d2"]


def test_quantization_and_masks_do_not_mix_silently():
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(4, 16)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="d")])
    quantized = ts.strip(ts.prune(model))
    quantized.quantize("int8")  # the supported order: prune, strip, quantize; still 2:4
    assert ts.is_nm_sparse(quantized.get_layer("d")._kernel.numpy().astype("float32"), "2:4", 0)
    # Already quantized: skipped, with the reason.
    (row,) = ts.report(ts.prune(quantized), print_fn=None)
    assert row.status == "skipped" and "quantized ['d']" in row.reason
    # Quantized after pruning: Keras rebuilds the kernel from the raw weight; the wrapper refuses.
    pruned = ts.prune(model)
    pruned.quantize("int8")
    with pytest.raises(ValueError, match=r"\['d'\] inside 'd' were quantized.*strip\(model\)"):
        pruned(x)


@pytest.mark.parametrize("change", ["int8", "int4", "lora"])
def test_strip_and_report_refuse_a_pruned_layer_keras_changed_after_pruning(change):
    """Quantizing the pruned model or enabling LoRA on a wrapped layer makes the layer use a
    kernel rebuilt outside the masks: strip() would copy that dense kernel into the 'plain, 2:4'
    model (int8/int4: the dense quantized kernel, outputs far from the masked ones)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="d")])
    pruned = ts.prune(model)
    if change == "lora":
        ts.pruned_layers(pruned)[0].layer.enable_lora(2)
    else:
        pruned.quantize(change)
    before = [w.copy() for w in pruned.get_weights()]
    what = "LoRA is enabled on" if change == "lora" else "were quantized"
    with pytest.raises(ValueError, match=r"strip\(\): Sparse24: .*\['d'\]") as err:
        ts.strip(pruned)
    assert what in str(err.value)
    for got, want in zip(pruned.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    (row, *_) = ts.report(pruned, print_fn=None)
    assert row.layer == "sparse24_d" and row.valid is False
    assert ("LoRA" if change == "lora" else "quantized") in row.reason


@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_a_model_with_quantized_layers_is_copied_exactly(mode):
    """The quantized layer is copied as it is (a float8 Dense made from its config creates its
    variables in another order: copied by name) and the float layer after it is pruned."""
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(1).normal(size=(4, 16)).astype("float32")
    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(16, name="q"), keras.layers.Dense(8, name="d"),
    ])  # fmt: skip
    model.get_layer("q").quantize(mode)
    pruned = ts.prune(model)
    q = np.asarray(model.get_layer("q")(x), np.float64)
    d = model.get_layer("d")
    kernel = d.kernel.numpy().astype(np.float64)
    want = q @ (kernel * reference_mask(kernel, 2, 4, 0)) + d.bias.numpy()
    np.testing.assert_allclose(np.asarray(pruned(x)), want, rtol=1e-5, atol=1e-5)
    copied = pruned.get_layer("q")
    for v in model.get_layer("q").weights:
        (twin,) = [w for w in copied.weights if w.name == v.name]
        np.testing.assert_array_equal(twin.numpy(), v.numpy(), err_msg=v.name)


class StatefulTagger(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = ts.Sparse24(keras.layers.Dense(8))
        self.rnn = keras.layers.LSTM(4, stateful=True)

    def call(self, x):
        return self.rnn(self.fc(x))


def test_stateful_rnn_state_is_copied_and_an_uncopyable_subclassed_model_is_named():
    x = np.random.default_rng(6).normal(size=(2, 3, 8)).astype("float32")
    inp = keras.Input((3, 8), batch_size=2)
    model = keras.Model(inp, keras.layers.LSTM(8, stateful=True, name="rnn")(inp))
    model(x)  # the state has moved on: a copy must go on from there
    state = [s.numpy() for s in model.get_layer("rnn").states]
    assert np.abs(state[0]).max() > 0.05
    pruned = ts.prune(model)
    for copy in (pruned, ts.strip(pruned)):
        rnn = next(l for l in copy._flatten_layers() if isinstance(l, keras.layers.LSTM))
        for got, want in zip(rnn.states, state):
            np.testing.assert_array_equal(got.numpy(), want)
    # A subclassed model whose stateful LSTM its build config cannot rebuild: named, with the
    # in-place alternative, instead of Keras' "was never built ... weights file" error.
    tagger = StatefulTagger()
    tagger(x)
    with pytest.raises(TypeError, match=r"layers \[.*lstm.*\] are not built.*in place"):
        ts.prune(tagger)


class TwoInputNet(keras.Model):
    """Takes its inputs as two positional arguments: Keras records the first one's shape only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.image = ts.Sparse24(keras.layers.Dense(8))
        self.text = ts.Sparse24(keras.layers.Dense(8))

    def call(self, image, text):
        return self.image(image) - self.text(text)


class TwoInputNetWithBuild(TwoInputNet):
    """The same, rebuilt by Keras from both shapes."""

    def build(self, image_shape, text_shape):
        self.image.build(image_shape)
        self.text.build(text_shape)


def test_a_subclassed_model_with_two_positional_inputs_is_copied_through_its_build():
    rng = np.random.default_rng(7)
    image = rng.normal(size=(2, 16)).astype("float32")
    text = rng.normal(size=(2, 12)).astype("float32")
    without = TwoInputNet()
    without(image, text)
    with pytest.raises(TypeError, match=r"not built .*give it a build\(\) that builds its layers"):
        ts.prune(without)
    model = TwoInputNetWithBuild()
    model(image, text)
    pruned = ts.prune(model)
    kernels = [layer.layer.kernel.numpy() for layer in (model.image, model.text)]
    image_w, text_w = (np.where(reference_mask(k, 2, 4, 0), k, 0.0) for k in kernels)
    np.testing.assert_allclose(pruned(image, text), image @ image_w - text @ text_w, atol=1e-5)


@pytest.mark.parametrize("saved, loaded", [("2:4", "1:4"), ("1:4", "2:4")])
def test_weights_saved_for_another_pattern_are_refused(saved, loaded, tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="d")])
    path = str(tmp_path / "saved.weights.h5")
    ts.prune(model, saved).save_weights(path)
    target = ts.prune(model, loaded)
    (wrapper,) = ts.pruned_layers(target)
    mask = wrapper.pruned_weights[0].mask
    before = mask.numpy().copy()
    with pytest.raises(ValueError, match=rf"mask of 'kernel' being loaded keeps .* is {loaded}"):
        target.load_weights(path)
    assert np.array_equal(mask.numpy(), before)  # the masks are kept


@keras.saving.register_keras_serializable(package="test_prune")
class SameNameBlock(keras.layers.Layer):
    """A block whose sublayer has the block's own name."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, name=self.name)

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x)


def test_a_wrapper_config_saved_before_weight_positions_still_loads():
    """Earlier versions saved paths cut after the layer's name in the variable path ('kernel'
    here, where the sublayer tree says 'blk/kernel') and no positions."""
    inp = keras.Input((8,))
    model = keras.Model(inp, SameNameBlock(name="blk")(inp))
    pruned = ts.prune(model)
    config = pruned.get_config()
    (wrapper,) = [c for c in config["layers"] if c["class_name"] == "Sparse24"]
    assert wrapper["config"]["weights"] == {"blk/kernel": 0}
    wrapper["config"]["weights"] = {"kernel": 0}  # as saved before
    del wrapper["config"]["weight_positions"]
    old = keras.Model.from_config(config)
    old.set_weights(pruned.get_weights())
    np.testing.assert_array_equal(np.asarray(old(X[:, 0])), np.asarray(pruned(X[:, 0])))


@keras.saving.register_keras_serializable(package="test_prune")
class MinimalCell(keras.layers.Layer):
    """A user RNN cell the registry does not know."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")

    def call(self, x, states):
        h = keras.ops.matmul(x, self.kernel) + states[0]
        return h, [h]

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_an_rnn_with_an_unknown_cell_gets_a_report_row_with_the_reason():
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.RNN(MinimalCell(name="mine"), name="rnn")(inp))
    rows = {r.layer: r for r in ts.report(ts.prune(model), print_fn=None)}
    assert rows["rnn"].status == "skipped"
    assert "'mine' (MinimalCell) is not a prunable kind" in rows["rnn"].reason


@keras.saving.register_keras_serializable(package="test_prune")
class DenseCell(keras.layers.Layer):
    """A user RNN cell computing with a Dense of its own (which gets pruned)."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units
        self.proj = keras.layers.Dense(units, name="proj")

    def build(self, input_shape):
        self.proj.build((input_shape[0], input_shape[-1] + self.units))

    def call(self, x, states):
        h = self.proj(keras.ops.concatenate([x, states[0]], axis=-1))
        return h, [h]

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_an_rnn_whose_cell_holds_a_dense_reports_only_the_pruned_row():
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.RNN(DenseCell(name="mine"), name="rnn")(inp))
    (row,) = ts.report(ts.prune(model), print_fn=None)  # no "not a prunable kind" row or reason
    assert (row.status, row.reason, row.params) == ("pruned", "2:4: mine/proj/kernel", 16 * 8)


def test_a_partly_pruned_layer_reports_why_the_rest_is_left_dense():
    inp = keras.Input((6, 3))
    model = keras.Model(inp, keras.layers.LSTM(8, name="lstm")(inp))
    (row,) = ts.report(ts.prune(model), print_fn=None)
    assert row.status == "pruned" and row.params == 8 * 32  # the recurrent kernel only
    assert row.reason == (
        "2:4: lstm_cell/recurrent_kernel; "
        "lstm_cell/kernel (3, 32): axis 0 size 3 is not a multiple of 4"
    )


def test_report_judges_plain_layers_by_the_models_group_size():
    inp = keras.Input((12,))
    out = keras.layers.Dense(8, name="out")(keras.layers.Dense(8, name="on_12")(inp))
    rows = {r.layer: r for r in ts.report(ts.prune(keras.Model(inp, out), "4:8"), print_fn=None)}
    assert rows["on_12"].status == "skipped"  # was "eligible, left dense" (judged by groups of 4)
    assert rows["on_12"].reason == "kernel (12, 8): axis 0 size 12 is not a multiple of 8"
    assert rows["sparse24_out"].status == "pruned"


@pytest.mark.parametrize("tie_weights", [False, True])
def test_reversible_embedding_prunes_its_separate_reverse_projection(tie_weights, tmp_path):
    inp = keras.Input((5,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(32, 16, tie_weights=tie_weights, name="emb")
    model = keras.Model(inp, emb(keras.layers.Dense(16, name="mix")(emb(inp)), reverse=True))
    rng = np.random.default_rng(8)
    for v in model.weights:
        v.assign(rng.normal(size=v.shape))
    tokens = rng.integers(0, 32, (3, 5)).astype("int32")
    pruned = ts.prune(model)
    rows = {r.layer: r for r in ts.report(pruned, print_fn=None)}
    table, kernel, bias = (np.float64(model.get_layer(n).get_weights()[i])
                           for n, i in (("emb", 0), ("mix", 0), ("mix", 1)))  # fmt: skip
    hidden = table[tokens] @ np.where(reference_mask(kernel, 2, 4, 0), kernel, 0.0) + bias
    if tie_weights:  # the table serves the lookup too: left dense, with the reason
        assert rows["emb"].status == "skipped" and "tied embeddings" in rows["emb"].reason
        expected = hidden @ table.T
    else:  # reverse_embeddings [16, 32]: x @ W, grouped along its 16 inputs
        assert rows["sparse24_emb"].reason.startswith("2:4: reverse_embeddings")
        reverse = np.float64(model.get_layer("emb").reverse_embeddings.numpy())
        expected = hidden @ np.where(reference_mask(reverse, 2, 4, 0), reverse, 0.0)
    for copy in (pruned, ts.strip(pruned)):
        np.testing.assert_allclose(copy(tokens), expected, rtol=1e-4, atol=1e-4)
    ts.export(pruned, tmp_path / "1")
    served = tf.saved_model.load(str(tmp_path / "1")).signatures["serving_default"]
    np.testing.assert_allclose(served(inputs=tokens)["emb"], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "make, shape",
    [(lambda: keras.layers.Conv1DTranspose(6, 3, strides=2, name="up"), (7, 8)),
     (lambda: keras.layers.Conv2DTranspose(6, 3, strides=2, padding="same", name="up"), (5, 5, 8)),
     (lambda: keras.layers.Conv3DTranspose(4, 2, strides=2, name="up"), (3, 3, 3, 8))],
)  # fmt: skip
def test_transposed_convs_are_grouped_along_their_input_channels(make, shape, tmp_path):
    """Kernel `[..., out, in]`: the input channels, summed over, are the last axis."""
    inp = keras.Input(shape)
    model = keras.Model(inp, make()(inp))
    x = np.random.default_rng(9).normal(size=(2, *shape)).astype("float32")
    kernel = model.get_layer("up").kernel.numpy()
    mask = reference_mask(kernel, 2, 4, kernel.ndim - 1)
    assert np.all(mask.reshape(-1, 4).sum(-1) == 2)  # 2 of every 4 consecutive input channels
    reference = keras.models.clone_model(model)  # Keras' own transposed conv, masked kernel
    reference.get_layer("up").kernel.assign(np.where(mask, kernel, 0.0))
    reference.get_layer("up").bias.assign(model.get_layer("up").bias)
    pruned = ts.prune(model)
    (row,) = ts.report(pruned, print_fn=None)
    assert row.status == "pruned" and row.valid and row.density == 0.5
    for copy in (pruned, ts.strip(pruned)):
        np.testing.assert_allclose(copy(x), reference(x), rtol=1e-5, atol=1e-5)
    metadata = ts.export(pruned, tmp_path / "1")
    assert [e["axis"] for e in metadata["sparse"]] == [kernel.ndim - 1]
    served = tf.saved_model.load(str(tmp_path / "1")).signatures["serving_default"]
    (out,) = served(inputs=x).values()
    np.testing.assert_allclose(out, reference(x), rtol=1e-5, atol=1e-5)


def test_a_layer_that_cannot_be_copied_from_its_config_is_named():
    class Unregistered(keras.layers.Layer):  # not registered: RNN.from_config cannot find it
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.state_size = 8

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 8), name="kernel")

        def call(self, x, states):
            return x @ self.kernel, states

    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.RNN(Unregistered(), name="rnn")(inp))
    with pytest.raises(TypeError, match=r"copy layer 'rnn' \(RNN\).*Unregistered(.|\n)*register"):
        ts.prune(model)


@keras.saving.register_keras_serializable("test_prune")
class _BuildsInInit(keras.layers.Layer):
    """Builds itself in __init__ when its config has the input size, like keras_hub's
    TransformerDecoder (GPT2, OPT, BART decoders): from_config returns a built layer."""

    def __init__(self, units=8, input_dim=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.input_dim = units, input_dim
        self.proj = keras.layers.Dense(units, name="proj")
        if input_dim:
            self.build((None, input_dim))

    def build(self, input_shape):
        self.input_dim = input_shape[-1]
        self.proj.build(input_shape)

    def call(self, x):
        return self.proj(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "input_dim": self.input_dim}


def test_a_layer_built_by_its_own_constructor_is_copied():
    inp = keras.Input((16,))
    model = keras.Model(inp, _BuildsInInit(8, name="block")(inp))
    x = np.random.default_rng(0).normal(size=(3, 16)).astype("float32")
    pruned = ts.prune(model)
    kernel = model.get_layer("block").proj.kernel.numpy()
    expected = x @ (kernel * ts.compute_mask(kernel).numpy()) + model.get_layer("block").proj.bias
    np.testing.assert_allclose(pruned(x), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ts.strip(pruned)(x), expected, rtol=1e-5, atol=1e-5)


class _OwnConfigBackbone(keras.Model):
    """A Functional model class with its own constructor and config, like keras_hub's backbones
    and task models: Keras' clone_model cannot make it again, only a plain Functional model."""

    def __init__(self, hidden=16, **kwargs):
        inputs = keras.Input((8,), name="features")
        x = keras.layers.Dense(hidden, activation="relu", name="d1")(inputs)
        outputs = keras.layers.Dense(4, name="d2")(x)
        super().__init__(inputs, outputs, **kwargs)
        self.hidden = hidden

    def get_config(self):
        return {"hidden": self.hidden, "name": self.name, "trainable": self.trainable}

    def describe(self):
        return "a method of the class"


def test_a_functional_subclass_copy_warns_that_its_class_is_lost_and_the_recipe_restores_it():
    model = _OwnConfigBackbone(name="bb")
    x = np.random.default_rng(0).normal(size=(5, 8)).astype("float32")
    with pytest.warns(UserWarning, match=r"prune\(\): the copy of model 'bb' is a plain Keras "
                      r"Functional model, not a _OwnConfigBackbone"):
        pruned = ts.prune(model)
    assert not hasattr(pruned, "describe")
    plain = ts.strip(pruned)
    restored = _OwnConfigBackbone(name="restored")
    restored.set_weights(plain.get_weights())
    np.testing.assert_allclose(restored(x), pruned(x), rtol=1e-6, atol=1e-6)
    assert restored.describe() == "a method of the class"
    assert all(ts.is_nm_sparse(layer.kernel) for layer in restored.layers[1:])
    with pytest.warns(UserWarning, match=r"permute\(\).*not a _OwnConfigBackbone"):
        permuted, reports = ts.permute(model, kicks=1, progress=False)  # its get_config has no graph
    np.testing.assert_allclose(permuted(x), model(x), rtol=1e-5, atol=1e-5)
    assert [(r.producer, r.permuted) for r in reports if r.producer] == [("d1", True)]
    with warnings.catch_warnings():  # a plain Functional model: nothing to warn about
        warnings.simplefilter("error")
        ts.prune(keras.Model(model.input, model.output))


def test_a_layer_quantized_inside_its_owner_is_a_clear_copy_error():
    # model.quantize() quantizes MultiHeadAttention's projections, not the layer's own config:
    # its copy from config cannot take the int8 variables. Both entry points name the layers.
    inputs = keras.Input((5, 16))
    x = keras.layers.MultiHeadAttention(2, 8, name="mha")(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    model.get_layer("mha").output_dense.quantize("int8")
    for copy in (ts.prune, ts.permute):
        with pytest.raises(TypeError, match=r"Cannot copy layer 'mha' \(MultiHeadAttention\): "
                                            r"the layers \['attention_output'\] inside it are "
                                            r"quantized"):
            copy(model)


def test_a_block_whose_sublayers_build_on_first_call_is_copied_saved_and_stripped(tmp_path):
    tokens = keras.Input((6,), dtype="int32")
    h = example("text_transformer").TransformerBlock(8, 2, 16, name="block")(
        keras.layers.Embedding(50, 8)(tokens))  # keras.io's: no build(), no get_config()
    model = keras.Model(tokens, keras.layers.Dense(4, name="out")(h))
    x = np.random.default_rng(0).integers(0, 50, size=(3, 6))
    block = model.get_layer("block")
    axes = {"block": {p.split("block/", 1)[-1]: 0 for p in (
        block.att.query_dense.kernel.path, block.att.key_dense.kernel.path,
        block.att.value_dense.kernel.path, *(d.kernel.path for d in block.ffn.layers))},
        "out": {"kernel": 0}}
    axes["block"][block.att.output_dense.kernel.path.split("block/", 1)[-1]] = 1
    reference = masked_copy(model, axes)(x)

    pruned = ts.prune(model)
    assert sorted(len(w.pruned_weights) for w in ts.pruned_layers(pruned)) == [1, 6]
    np.testing.assert_allclose(pruned(x), reference, rtol=1e-5, atol=1e-5)
    path = str(tmp_path / "lazy.keras")
    pruned.save(path)
    copies = {"load_model": keras.models.load_model(path), "strip": ts.strip(pruned),
              "prune again": ts.prune(pruned), "permute": ts.permute(model, progress=False)[0]}
    for name, copy in copies.items():
        want = model(x) if name == "permute" else reference
        np.testing.assert_allclose(copy(x), want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert not ts.pruned_layers(copies["strip"])
    stripped = copies["strip"].get_layer("block")
    for kernel in (stripped.att.query_dense.kernel, stripped.ffn.layers[0].kernel):
        assert ts.is_nm_sparse(kernel, "2:4", axis=0)


@keras.saving.register_keras_serializable("test_prune")
class _HalfBuilt(_UnitsBlock):
    """Its build() builds the second Dense only; the first makes its weights when first called."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.lazy = keras.layers.Dense(units)
        self.eager = keras.layers.Dense(units)

    def build(self, shape):
        self.eager.build(shape)

    def call(self, x):
        return self.eager(x) + 2.0 * self.lazy(x)


@keras.saving.register_keras_serializable("test_prune")
class _DenseThenDropout(_UnitsBlock):
    """No build(); Dropout's seed state exists before the Dense's kernel does."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.dense = keras.layers.Dense(units)
        self.drop = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


@pytest.mark.parametrize("make", [_HalfBuilt, _DenseThenDropout])
def test_a_partly_lazy_blocks_masks_load_onto_the_weights_they_were_made_for(make, tmp_path):
    """The wrapper waits for its layer's first call until the layer has all the variables it had
    when saved: masks are matched to weights by position in that full list."""
    inputs = keras.Input((8,))
    block = make(name="block")
    model = keras.Model(inputs, block(inputs))
    x = RNG.normal(size=(4, 8)).astype("float32")
    skip = [block.eager] if make is _HalfBuilt else None
    lazy = block.lazy if make is _HalfBuilt else block.dense
    kernel = lazy.kernel.numpy()
    reference = masked_copy(model, {"block": {lazy.kernel.path.split("block/", 1)[-1]: 0}})(x)

    pruned = ts.prune(model, skip=skip)
    path = str(tmp_path / "partly_lazy.keras")
    pruned.save(path)
    loaded = keras.models.load_model(path)

    for copy in (pruned, loaded, ts.prune(pruned)):  # its wrapper keeps what it prunes
        (wrapper,) = ts.pruned_layers(copy)
        (pw,) = wrapper.pruned_weights
        np.testing.assert_array_equal(pw.variable.numpy(), kernel)  # the same weight, masked
        np.testing.assert_allclose(copy(x), reference, rtol=1e-5, atol=1e-5)


@keras.saving.register_keras_serializable("test_prune")
class _Optional(_UnitsBlock):
    """No build(); its feed-forward Dense runs only when asked."""

    def __init__(self, units=8, **kwargs):
        super().__init__(units, **kwargs)
        self.proj = keras.layers.Dense(units)
        self.ffn = keras.layers.Dense(units)

    def call(self, x, use_ffn=False):
        x = self.proj(x)
        return x + self.ffn(x) if use_ffn else x


def test_a_shared_block_whose_first_call_leaves_weights_unmade_is_refused_before_pruning():
    inputs = keras.Input((8,))
    block = _Optional(name="block")
    model = keras.Model(inputs, block(block(inputs), use_ffn=True))
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(TypeError, match=r"layer 'block' \(_Optional\): its first call .* build\(\)"):
        ts.prune(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    ts.strip(model)  # copies that are not wrapped are made by replaying its calls
    ts.permute(model, progress=False)


def test_report_and_selectors_name_layers_inside_blocks():
    class OwnKernel(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 8), name="w")

        def call(self, x):
            return x @ self.w

    tokens = keras.Input((6,), dtype="int32")
    block_type = example("text_transformer").TransformerBlock
    h = keras.layers.Embedding(50, 8)(tokens)
    h = block_type(8, 2, 16, name="b2")(block_type(8, 2, 16, name="b1")(h))
    model = keras.Model(tokens, OwnKernel(name="mine")(h))

    pruned = ts.prune(model, skip=["b1/ffn/ffn2"])  # one block's layer, by its path
    kept = {w.layer.name: {pw.name for pw in w.pruned_weights} for w in ts.pruned_layers(pruned)}
    assert "ffn/ffn2/kernel" not in kept["b1"] and "ffn/ffn2/kernel" in kept["b2"]
    rows = {r.layer: r for r in ts.report(pruned, print_fn=None)}
    assert rows["mine"].status == "skipped" and "no rule for this layer's own weights (w)" in (
        rows["mine"].reason)
    with pytest.raises(ValueError, match=r"no layer named \['b1/ffn/nothing'\]"):
        ts.prune(model, skip=["b1/ffn/nothing"])


def _calls_in_a_gradient(model, name: str) -> int:
    """How many times the layer `name` of `model` runs in one eager forward + gradient: 1, or 2
    when Keras recomputes its call (a layer made under a RematScope)."""
    layer = model.get_layer(name)
    calls, call = [], layer.call

    def counting(*args, **kwargs):
        calls.append(1)
        return call(*args, **kwargs)

    with calls_replaced([(layer, counting)]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(X[:4, 0], training=True)))
        tape.gradient(loss, model.trainable_variables)
    return len(calls)


@keras.saving.register_keras_serializable("test_prune")
class _NormedHead(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, name="hidden")
        self.ln = keras.layers.LayerNormalization(name="ln")
        self.head = ts.Sparse24(keras.layers.Dense(8, name="head"))

    def call(self, x):
        return self.head(self.ln(self.hidden(x)))


@pytest.mark.parametrize("scope", [{"mode": "full"},
                                   {"mode": "list_of_layers", "layer_names": ["ln"]}])
def test_copies_recompute_as_the_layers_they_copy_made_under_a_remat_scope(scope):
    """Keras reads the RematScope when a layer is made, so copies made outside it (prune() after
    the scope, as usual) held every activation of layers the user had chosen to recompute."""
    with keras.RematScope(**scope):
        inputs = keras.Input((X.shape[-1],))
        h = keras.layers.Dense(16, name="kept")(inputs)
        layers = [keras.layers.LayerNormalization(name="ln"), keras.layers.Dense(8, name="fc")]
        outputs = layers[1](layers[0](h))
        subclassed = _NormedHead()
        subclassed(X[:1, 0])
    # Made outside: Keras 3.15 cannot trace a model whose own call is rematerialized (its
    # custom_gradient takes no keyword arguments in a tf.function), so fit() would fail.
    functional = keras.Model(inputs, outputs)
    expected = {name: _calls_in_a_gradient(functional, name) for name in ("kept", "ln")}
    assert expected == ({"kept": 2, "ln": 2} if scope["mode"] == "full" else {"kept": 1, "ln": 2})

    pruned = ts.prune(functional, skip=["kept"])
    assert {name: _calls_in_a_gradient(pruned, name) for name in expected} == expected
    stripped = ts.strip(pruned)
    assert {name: _calls_in_a_gradient(stripped, name) for name in expected} == expected
    recomputed = _calls_in_a_gradient(subclassed, "ln")  # 3 under "full": the model's call too
    assert recomputed > 1 and _calls_in_a_gradient(ts.prune(subclassed), "ln") == recomputed


def test_a_frozen_layer_stays_frozen_and_says_so_through_prune_and_a_keras_file(tmp_path):
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(4, name="b")]
    )
    model.get_layer("a").trainable = False
    pruned = ts.prune(model)
    path = str(tmp_path / "frozen.keras")
    pruned.save(path)
    loaded = keras.models.load_model(path)
    for copy in (pruned, loaded):
        assert [(w.trainable, w.layer.trainable) for w in copy.layers] == [(False, False),
                                                                           (True, True)]
        assert [v.path for v in copy.trainable_variables] == ["b/kernel", "b/bias"]
    loaded.layers[0].trainable = True  # unfreezing the wrapper unfreezes the layer it wraps
    assert [v.path for v in loaded.trainable_variables] == [
        "a/kernel", "a/bias", "b/kernel", "b/bias"
    ]
    kernel = loaded.layers[0].layer.kernel.numpy()
    loaded.compile(keras.optimizers.SGD(0.1), "mse")
    loaded.fit(X[:, 0].repeat(2, axis=1), np.ones((4, 4), "float32"), verbose=0)
    assert not np.array_equal(loaded.layers[0].layer.kernel.numpy(), kernel)


def test_report_rows_for_the_layers_of_a_block_with_a_kernel_of_its_own():
    # A user's block holding Dense layers and a weight of its own: the row saying the block's own
    # weight has no rule left out the rows of its Dense layers (eligible, or skipped and why).
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.narrow = keras.layers.Dense(3, name="narrow")
            self.wide = keras.layers.Dense(8, name="wide")
            self.proj = keras.layers.Dense(8, name="proj")

        def build(self, shape):
            self.narrow.build(shape)
            self.wide.build((None, 3))
            self.proj.build(shape)
            self.w = self.add_weight(shape=(8, 8), name="w")

        def call(self, x):
            return self.wide(self.narrow(x)) + self.proj(x) @ self.w

    inputs = keras.Input((8,))
    model = keras.Model(inputs, Block(name="blk")(inputs))
    rows = {r.layer: r for r in ts.report(model, print_fn=None)}
    assert rows["blk"].status == "skipped" and rows["blk"].params == 64
    assert "no rule for this layer's own weights (w)" in rows["blk"].reason
    assert rows["proj"].status == "not pruned" and rows["proj"].params == 64
    assert rows["narrow"].status == "not pruned" and rows["narrow"].params == 24
    assert rows["wide"].status == "skipped"
    assert "size 3 is not a multiple of 4" in rows["wide"].reason
    pruned = ts.prune(model, skip="blk/proj")
    rows = {r.layer: r for r in ts.report(pruned, print_fn=None)}
    (wrapper,) = ts.pruned_layers(pruned)
    assert rows[wrapper.name].status == "pruned" and rows[wrapper.name].params == 24
    assert rows["proj"].status == "not pruned" and rows["proj"].params == 64
    assert rows[wrapper.layer.name].params == 64 and rows["wide"].status == "skipped"


def test_prune_refuses_a_block_whose_config_hands_over_a_layer_it_builds():
    # get_config() returns the layer object; the block's build() builds it, so building the copy
    # rebuilt the original's built Dense: Keras' "cannot add new elements of state" ValueError,
    # not the error that says what is wrong.
    class Holder(keras.layers.Layer):
        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner

        def build(self, shape):
            self.inner.build(shape)

        def call(self, x):
            return self.inner(x)

        def get_config(self):
            return {**super().get_config(), "inner": self.inner}

    inputs = keras.Input((8,))
    h = Holder(keras.layers.Dense(8, name="inner"), name="holder")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(h))
    before = [w.copy() for w in model.get_weights()]
    for kwargs in ({}, {"skip": "holder"}):
        with pytest.raises(TypeError, match=r"'holder' \(Holder\): the copy made from its "
                                            r"get_config\(\) holds the layer's own variables "
                                            r"\['holder/inner/kernel', 'holder/inner/bias'\]"):
            ts.prune(model, **kwargs)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_frozen_layers_inside_blocks_stay_frozen_in_the_copies():
    # A block's config does not record that a layer it holds was frozen: the copies trained the
    # frozen Dense and updated the frozen BatchNormalization's moving statistics.
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1 = keras.layers.Dense(8, name="d1")
            self.bn = keras.layers.BatchNormalization(name="bn")
            self.d2 = keras.layers.Dense(8, name="d2")

        def build(self, shape):
            self.d1.build(shape)
            self.bn.build((None, 8))
            self.d2.build((None, 8))

        def call(self, x, training=None):
            return self.d2(self.bn(self.d1(x), training=training))

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = ts.Sparse24(keras.layers.Dense(8))
            self.head = ts.Sparse24(keras.layers.Dense(4))

        def call(self, x):
            return self.head(self.hidden(x))

    inputs = keras.Input((8,))
    block = Block(name="blk")
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(block(inputs)))
    block.d1.trainable = block.bn.trainable = False
    net = Net()
    net(X[0])
    net.hidden.trainable = False
    trainable = lambda m: sorted(v.path for v in m.trainable_weights)  # noqa: E731
    pruned = ts.prune(model)
    for copy in (pruned, ts.strip(pruned), ts.prune(model, skip="blk")):
        assert trainable(copy) == trainable(model) == ["blk/d2/bias", "blk/d2/kernel",
                                                       "out/bias", "out/kernel"]
    assert not ts.prune(net).hidden.trainable and len(ts.prune(net).trainable_weights) == 2
    before = {v.path: v.numpy() for v in pruned.weights if "/d1/" in v.path or "/bn/" in v.path}
    assert len(before) == 6  # d1's kernel and bias, bn's gamma, beta and moving statistics
    pruned.compile(keras.optimizers.SGD(0.1), "mse")
    pruned.fit(X[:, 0], X[:, 0, :4], epochs=1, verbose=0)
    for v in pruned.weights:
        if v.path in before:
            np.testing.assert_array_equal(v.numpy(), before[v.path], err_msg=v.path)


def test_report_counts_the_nonzeros_of_skipped_weights():
    # Skipped rows gave nonzeros = params (density 1.000) whatever the weights held.
    inputs = keras.Input((8, 8, 3))
    first = keras.layers.Conv2D(8, 3, name="first")
    model = keras.Model(inputs, keras.layers.Conv2D(8, 1, name="second")(first(inputs)))
    kernel = first.kernel.numpy()
    kernel[..., :4] = 0
    first.kernel.assign(kernel)
    for m in (model, ts.prune(model)):
        row = next(r for r in ts.report(m, print_fn=None) if r.layer == "first")
        assert row.status == "skipped" and (row.params, row.nonzeros) == (216, 108)
        assert row.density == 0.5
