"""The MNIST example runs end to end (tiny version) and its numbers are consistent."""

import importlib.util
import os

import numpy as np

import tf_sparse24 as ts

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
EXAMPLE = os.path.join(EXAMPLES, "mnist_2to4.py")


def test_mnist_example_tiny(capsys, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)  # as when run as a script: its folder is on sys.path
    spec = importlib.util.spec_from_file_location("mnist_2to4", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(
        ["--limit", "500", "--epochs", "3", "--finetune-epochs", "1"]
    )
    out = capsys.readouterr().out
    assert "2:4 after fine-tune" in out and "total pruned" in out
    assert 10.0 < results["dense"] <= 100.0
    assert (
        results["finetuned"] > 40.0
    )  # 400 training digits, 3+1 epochs: far above chance (10%)
    rows = {r.layer: r for r in results["report"]}
    assert rows["conv1"].status == "skipped"
    assert all(
        rows[name].valid and rows[name].density == 0.5
        for name in ("sparse24_conv2", "sparse24_fc1")
    )
    x = np.random.default_rng(0).random((2, 28, 28, 1), dtype=np.float32)
    stripped = ts.strip(results["model"])
    np.testing.assert_allclose(stripped(x), results["model"](x), rtol=1e-5, atol=1e-5)
