"""The examples run end to end (tiny versions) and their numbers are consistent: the MNIST one,
and the digits MLP through examples/workflow.py, the recipe bench/accuracy.py's runs share."""

import importlib.util
import os

import numpy as np

import tf_sparse24 as ts
from helpers.examples import example

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


def test_digits_example_runs_the_shared_recipe_with_and_without_permutation(capsys, monkeypatch):
    digits = example("digits_mlp")
    monkeypatch.setattr(digits, "EPOCHS", 4)
    monkeypatch.setattr(digits, "FINETUNE_EPOCHS", 1)
    results = digits.main(["--seed", "0"])
    out = capsys.readouterr().out
    assert "digits MLP, seed 0 (1437 train / 360 test)" in out
    assert "fc1 -> fc2 [256 ch]: kept |w|" in out  # permute's report, printed by the recipe
    assert set(results) == {"dense", "2:4, one-shot", "2:4, fine-tuned",
                            "2:4 + permutation, one-shot", "2:4 + permutation, fine-tuned"}
    assert results["dense"] > 80.0  # 4 epochs on 1,437 digits; chance is 10%
    assert results["2:4, fine-tuned"] > 70.0 and results["2:4 + permutation, fine-tuned"] > 70.0
