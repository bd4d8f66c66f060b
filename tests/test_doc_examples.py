"""The examples a user copies run as written: the public docstrings' `Example:` sections, and the
Python blocks of docs/*.md that no other test runs (on small models, in a scratch directory).

Placeholder names the examples use (`model`, `x`, `kernel`, ...) are bound to small models and
random data; everything else runs as written. An example that shows an output must print it; one
that shows none only has to run.
"""

import doctest
import importlib
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse24

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")

# Modules whose docstrings hold the `Example:` sections of the public API (`tf_sparse24.__all__`
# and the modules FORMAT.md and ACCURACY.md send users to). Each example's placeholders are bound
# in `_namespace`.
MODULES = ["masks", "format", "ops", "portable", "permute_search", "wrapper", "registry", "prune",
           "callbacks", "srste", "permute", "transposable", "export", "verify"]


def _data(n=32, features=16, classes=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, rng.integers(0, classes, size=n)


def _mlp(name="mlp"):
    """A small Functional model with named input and output (the signature names EXPORT.md uses)."""
    inputs = keras.Input((16,), name="pixels")
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="logits")(hidden), name=name)


def _namespace():
    x, y = _data()
    model = _mlp()
    pruned = tf_sparse24.prune(model)
    pruned.compile("adam", "sparse_categorical_crossentropy")
    pruned.save("mnist_pruned.keras")
    dense = keras.layers.Dense(8, name="dense")
    dense.build((None, 16))
    return {
        "np": np, "tf": tf, "keras": keras, "tf_sparse24": tf_sparse24,
        "x": x, "y": y, "dense": dense, "kernel": model.layers[1].kernel,
        "pruned_model": pruned, "untrained_model": _mlp("untrained"),
    }


class _RunsOrMatches(doctest.OutputChecker):
    """An example that shows no output only has to run (`print(describe_export(...))`)."""

    def check_output(self, want, got, optionflags):
        return not want or super().check_output(want, got, optionflags)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _namespace()
    if module == "verify":  # its example checks the export that export's example writes
        tf_sparse24.export(ns["pruned_model"], "models/mnist/1")
    if module == "callbacks":  # `model.fit(...)`: a compiled pruned model
        ns["model"] = ns["pruned_model"]
    elif module == "srste":  # `model.compile("sgd", "mse"); model.fit(x, y)`: y shaped as outputs
        ns["y"] = np.zeros((len(ns["x"]), 8), "float32")
    else:
        ns["model"] = _mlp("trained")
    mod = importlib.import_module(f"tf_sparse24.{module}")
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(
        checker=_RunsOrMatches(), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {**vars(mod), **ns}  # as doctest runs them, plus the placeholders
    tests = [t for t in finder.find(mod) if t.examples]
    assert tests, f"tf_sparse24.{module} has no docstring example"
    for test in tests:
        test.globs = globs  # one namespace per module: later examples use what earlier ones made
        runner.run(test, clear_globs=False)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {module} failed"


def _blocks(doc):
    with open(os.path.join(DOCS, doc)) as f:
        text = f.read()
    fenced = re.findall(r"^( *)```python\n(.*?)^\1```", text, re.DOTALL | re.MULTILINE)
    return [block for _, block in fenced]


def test_export_md_first_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, _ = _data()
    model = tf_sparse24.prune(_mlp())
    scope = {"model": model, "x": x}
    exec(compile(_blocks("EXPORT.md")[0], "EXPORT.md", "exec"), scope)  # noqa: S102
    assert os.path.exists(tmp_path / "models" / "mnist_fast" / "1" / "saved_model.pb")
    out = scope["served"].signatures["serving_default"](pixels=x)["logits"]
    np.testing.assert_allclose(out, model(x), rtol=1e-5, atol=1e-5)


def test_format_md_api_block_runs():
    x, _ = _data(features=16)
    kernel = tf_sparse24.strip(tf_sparse24.prune(_mlp())).layers[1].kernel
    scope = {"kernel": kernel, "x": x}
    (block,) = [b for b in _blocks("FORMAT.md") if "sparse_matmul" in b]
    exec(compile(block, "FORMAT.md", "exec"), scope)  # noqa: S102
    np.testing.assert_array_equal(scope["w"], kernel)
    np.testing.assert_allclose(scope["y"], x @ kernel.numpy(), rtol=1e-5, atol=1e-5)


def test_usage_md_srste_and_subclassed_blocks_run():
    x, y = _data()
    srste_block, = [b for b in _blocks("USAGE.md") if "SRSTE" in b]
    scope = {"build_model": _mlp, "x": x, "y": y, "loss": "sparse_categorical_crossentropy"}
    srste_block = srste_block.replace("epochs=30", "epochs=1")
    exec(compile(srste_block, "USAGE.md", "exec"), scope)  # noqa: S102
    assert tf_sparse24.pruned_layers(scope["plain"]) == []
    assert tf_sparse24.is_nm_sparse(scope["plain"].layers[1].kernel, "2:4", 0)

    net_block, = [b for b in _blocks("USAGE.md") if "class Net" in b]
    scope = {"keras": keras, "tf_sparse24": tf_sparse24}
    exec(compile(re.sub(r"(?m)^  ", "", net_block), "USAGE.md", "exec"), scope)  # noqa: S102
    net = scope["Net"]()
    net(x)
    pruned = tf_sparse24.prune(net)
    assert [r.status for r in tf_sparse24.report(pruned, print_fn=None)] == ["pruned", "pruned"]


def test_accuracy_md_blocks_run():
    permute_block, transposable_block = _blocks("ACCURACY.md")
    printed = []
    scope = {"model": _mlp(), "print": printed.append}
    exec(compile(permute_block, "ACCURACY.md", "exec"), scope)  # noqa: S102
    assert printed and len(scope["reports"]) == len(printed)
    assert len(tf_sparse24.pruned_layers(scope["model"])) == 2
    model = _mlp()
    scope = {"model": model, "kernel": model.layers[1].kernel, "tf_sparse24": tf_sparse24}
    exec(compile(transposable_block, "ACCURACY.md", "exec"), scope)  # noqa: S102
    assert tf_sparse24.is_nm_sparse(tf.transpose(scope["mask"]), "2:4", 0)
    methods = [layer.method for layer in tf_sparse24.pruned_layers(scope["model"])]
    assert methods == ["transposable"] * 2
