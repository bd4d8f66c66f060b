"""The README's "Using it" snippet runs as written (on a small model, in a scratch directory)."""

import os
import re

import keras
import numpy as np

import tf_sparse24 as ts

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def test_readme_usage_snippet_runs(tmp_path, monkeypatch):
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Using it"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=64)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )
    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "x": x, "y": y}
    exec(compile(snippet.replace("epochs=5", "epochs=1"), "README.md", "exec"), scope)  # noqa: S102
    assert len(ts.pruned_layers(scope["pruned"])) == 2
    assert os.path.exists(tmp_path / "models" / "my_model" / "1" / "assets" / "sparse24.json")
    np.testing.assert_allclose(scope["plain"](x), scope["pruned"](x), rtol=1e-5, atol=1e-5)
