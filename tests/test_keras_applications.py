"""A real architecture end to end: Keras' MobileNetV2 (depthwise convs, BatchNorm, residual adds,
ReLU6), pruned, stripped and exported, against the Keras model. No weights are downloaded
(`weights=None`); the check is that every step handles a real graph, not accuracy."""

import keras
import numpy as np

import tf_sparse24 as ts


def test_mobilenet_v2_prunes_strips_and_exports(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2((32, 32, 3), alpha=0.35, weights=None, classes=10)
    pruned = ts.prune(model)
    rows = ts.report(pruned, print_fn=None)
    statuses = {r.status for r in rows}
    assert statuses == {"pruned", "skipped"}, statuses  # nothing eligible left dense
    pruned_rows = [r for r in rows if r.status == "pruned"]
    assert len(pruned_rows) == 35 and all(r.valid and r.density == 0.5 for r in pruned_rows)
    skipped = {r.kind for r in rows if r.status == "skipped"}
    assert skipped == {"Conv2D", "DepthwiseConv2D"}  # the 3-channel stem conv, depthwise convs
    x = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(ts.strip(pruned)(x), pruned(x), rtol=1e-5, atol=1e-6)
    ts.export(pruned, tmp_path / "1")
    report = ts.verify_export(tmp_path / "1", against=pruned)
    assert report["sparse_weights"] == 35 and report["max_abs_diff"]["predictions"] < 1e-5
