"""Tests for transposable 2:4 masks (tf_sparse24.transposable) against numpy references."""

import functools
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from test_masks import reference_mask

from tf_sparse24.masks import MASK_METHODS, compute_mask
from tf_sparse24 import SRSTE, Sparse24Callback
from tf_sparse24.prune import prune, pruned_layers
from tf_sparse24.transposable import PATTERNS_4X4


@functools.cache
def _all_patterns():
    """Every 4x4 0/1 matrix with two ones per row and per column, by brute force over 2^16."""
    out = []
    for bits in range(1 << 16):
        m = np.array([(bits >> i) & 1 for i in range(16)]).reshape(4, 4)
        if (m.sum(0) == 2).all() and (m.sum(1) == 2).all():
            out.append(m)
    return np.array(out)


def _blocks_2d(w2d):
    k, n = w2d.shape
    for bk, bn in itertools.product(range(0, k, 4), range(0, n, 4)):
        yield (slice(bk, bk + 4), slice(bn, bn + 4))


def _exact_reference_kept(w2d):
    patterns = _all_patterns()
    total = 0.0
    for block in _blocks_2d(w2d):
        mag = np.abs(w2d[block]).astype(np.float64)
        total += (patterns * mag).sum(axis=(1, 2)).max()
    return total


def _greedy_reference(w2d):
    mask = np.zeros_like(w2d)
    for block in _blocks_2d(w2d):
        mag = np.abs(w2d[block])
        rows, cols = [0] * 4, [0] * 4
        for flat in sorted(range(16), key=lambda i: (-mag.flat[i], i)):
            r, c = divmod(flat, 4)
            if rows[r] < 2 and cols[c] < 2:
                rows[r] += 1
                cols[c] += 1
                mask[block][r, c] = 1
    return mask


def _to_2d(w, axis):
    return w.reshape(int(np.prod(w.shape[: axis + 1])), -1)


def _assert_transposable(mask2d, exact_two=True):
    k, n = mask2d.shape
    along_k = mask2d.reshape(k // 4, 4, n).sum(1)
    along_n = mask2d.reshape(k, n // 4, 4).sum(2)
    if exact_two:
        assert (along_k == 2).all() and (along_n == 2).all()
    else:
        assert (along_k <= 2).all() and (along_n <= 2).all()


def test_patterns_are_the_90_transposable_4x4_masks():
    assert PATTERNS_4X4.shape == (90, 4, 4)
    ours = {p.tobytes() for p in PATTERNS_4X4.astype(np.int64)}
    assert ours == {p.tobytes() for p in _all_patterns().astype(np.int64)}
    assert set(MASK_METHODS) >= {"magnitude", "transposable", "transposable_greedy"}


@settings(max_examples=8, deadline=None)
@given(
    shape=st.sampled_from([(8, 8), (16, 4), (4, 12), (3, 3, 8, 4), (2, 4, 8)]),
    seed=st.integers(0, 10_000),
)
def test_exact_matches_brute_force_and_greedy_matches_loop_reference(shape, seed):
    axis = len(shape) - 2
    w = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w2d = _to_2d(w, axis)
    exact = compute_mask(w, axis=axis, method="transposable").numpy()
    assert exact.shape == w.shape and exact.dtype == np.float32
    _assert_transposable(_to_2d(exact, axis))
    kept = float((np.abs(w2d).astype(np.float64) * _to_2d(exact, axis)).sum())
    assert kept == pytest.approx(_exact_reference_kept(w2d), rel=1e-6)

    greedy = compute_mask(w, axis=axis, method="transposable_greedy").numpy()
    np.testing.assert_array_equal(_to_2d(greedy, axis), _greedy_reference(w2d))
    _assert_transposable(_to_2d(greedy, axis), exact_two=False)
    # (Greedy can keep more than the exact method: its <=2-per-line masks are not always subsets of
    # the 90 two-per-line patterns.)


def test_float64_weights_are_compared_in_float64():
    """Differences of 1e-9 around 1 (or magnitudes below float32's range) vanish in float32."""
    r = np.random.default_rng(3).random((8, 8))
    for w in (1.0 + 1e-9 * r, 1e-50 * r):
        exact = compute_mask(w, axis=0, method="transposable").numpy()
        kept = (np.abs(w) * exact).sum()
        assert kept == pytest.approx(_exact_reference_kept(w), rel=1e-14)  # the float64 optimum
        greedy = compute_mask(w, axis=0, method="transposable_greedy").numpy()
        np.testing.assert_array_equal(greedy, _greedy_reference(w))


def test_float32_and_integer_weights_are_compared_exactly():
    # Six entries of 2^24 fix all but a 2x2 rectangle, whose two matchings keep 1 + 1 or 3 + 0: the
    # float32 scores 6 * 2^24 + 2 and + 3 round to the same value, and the tie rule kept the 2.
    w = np.zeros((4, 4), np.float32)
    for r, c in [(0, 2), (1, 3), (2, 0), (2, 2), (3, 1), (3, 3)]:
        w[r, c] = 2**24
    w[0, 0] = w[1, 1] = 1
    w[0, 1] = 3
    exact = compute_mask(w, method="transposable").numpy()
    assert (w.astype(np.float64) * exact).sum() == _exact_reference_kept(w) == 6 * 2**24 + 3
    # 2^24 + 1 is the largest of row 0 (float32 rounds it to 2^24: a three-way tie, cols 0 and 1).
    wi = np.zeros((4, 4), np.int32)
    wi[0, :3] = [2**24, 2**24, 2**24 + 1]
    for method in ("transposable", "transposable_greedy"):
        mask = compute_mask(wi, method=method).numpy()
        assert mask.dtype == np.int32
        np.testing.assert_array_equal(mask[0], [1, 0, 1, 0])
    np.testing.assert_array_equal(
        compute_mask(wi, method="transposable_greedy").numpy(), _greedy_reference(wi)
    )


def test_transposable_keeps_no_more_than_plain_2to4_and_masks_both_ways():
    w = np.random.default_rng(1).normal(size=(64, 32)).astype(np.float32)
    plain = compute_mask(w).numpy()
    exact = compute_mask(w, method="transposable").numpy()
    assert (np.abs(w) * exact).sum() <= (np.abs(w) * plain).sum() + 1e-4
    assert (compute_mask(w.T * exact.T, method="magnitude").numpy() * exact.T == exact.T).all()


def test_ties_are_deterministic_and_half_precision_works():
    w = tf.ones([8, 8], tf.float16)
    a = compute_mask(w, method="transposable").numpy()
    b = compute_mask(w, method="transposable").numpy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:4, :4], PATTERNS_4X4[0])  # first pattern wins ties
    assert a.dtype == np.float16
    _assert_transposable(a.astype(np.float32))


def test_bad_shapes_and_patterns_raise():
    with pytest.raises(ValueError, match=r"Weight head/kernel with shape \(8, 6\): .*Received: N=6"):
        compute_mask(tf.ones([8, 6]), method="transposable", name="head/kernel")
    with pytest.raises(ValueError, match="2:4 pattern only"):
        compute_mask(tf.ones([8, 8]), pattern="1:4", method="transposable_greedy")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="hidden"),
                              keras.layers.Dense(2, name="head")])  # fmt: skip
    with pytest.raises(ValueError, match=r"head/kernel with shape \(32, 2\)"):
        prune(model, method="transposable")
    assert len(pruned_layers(prune(model, method="transposable", skip="head"))) == 1


def _transposable_mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="hidden"),
                             keras.layers.Dense(8, name="out")])  # fmt: skip


def test_masks_recomputed_later_keep_the_method_prune_used(tmp_path):
    """`Sparse24Callback(update_every=...)` and SR-STE's every-step masks recompute with the
    wrapper's method, which prune() sets, the config saves, and a mismatch asked for refuses."""
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.normal(size=(32, 8)).astype("float32")

    def check(model):
        for layer in pruned_layers(model):
            assert layer.method == "transposable"
            for pw in layer.pruned_weights:
                _assert_transposable((np.asarray(layer.effective_weight(pw)) != 0) * 1.0,
                                     exact_two=False)
                _assert_transposable(pw.mask.numpy())

    fixed = prune(_transposable_mlp(), method="transposable")
    fixed.compile(keras.optimizers.SGD(0.5), "mse")
    fixed.fit(x, y, epochs=2, batch_size=8, verbose=0,
              callbacks=[Sparse24Callback(update_every=1)])
    check(fixed)
    srste = prune(_transposable_mlp(), method="transposable", wrapper=SRSTE)
    srste.compile(keras.optimizers.SGD(0.5), "mse")
    before = [pw.mask.numpy() for layer in pruned_layers(srste) for pw in layer.pruned_weights]
    srste.fit(x, y, epochs=2, batch_size=8, verbose=0)
    check(srste)
    after = [pw.mask.numpy() for layer in pruned_layers(srste) for pw in layer.pruned_weights]
    assert any((a != b).any() for a, b in zip(before, after))  # the masks did move
    path = str(tmp_path / "srste.keras")
    srste.save(path)
    loaded = keras.models.load_model(path)
    loaded.compile(keras.optimizers.SGD(0.5), "mse")
    loaded.fit(x, y, epochs=1, batch_size=8, verbose=0)
    check(loaded)
    # Pruned again with another method: refused, as the masks (and method) are kept.
    for again in (fixed, srste):
        with pytest.raises(ValueError, match=r"method='magnitude', but the Sparse24 layers .* "
                                             r"hold masks computed by another method"):
            prune(again, method="magnitude")
        assert all(layer.method == "transposable" for layer in pruned_layers(prune(again)))
    # A wrapper made with a method prune() was not asked for is refused, not overridden.
    with pytest.raises(ValueError, match=r"method='magnitude', but the Sparse24 layer .* "
                                         r"method='transposable'"):
        prune(_transposable_mlp(), wrapper=functools.partial(SRSTE, method="transposable"))


def test_update_masks_with_a_method_makes_it_the_wrappers_method():
    """`update_masks(method)` says the method becomes the wrapper's: a later recomputation without
    one (Sparse24Callback(update_every=...)), and the config, use it, not the old magnitude."""
    from tf_sparse24 import Sparse24

    wrapper = Sparse24(keras.layers.Dense(16))
    wrapper(np.ones((2, 16), "float32"))
    wrapper.update_masks("transposable")
    assert wrapper.method == "transposable"
    (pw,) = wrapper.pruned_weights
    pw.variable.assign(np.random.default_rng(6).normal(size=(16, 16)))
    assert not _is_transposable(reference_mask(pw.variable.numpy(), 2, 4, 0))  # magnitude's isn't
    wrapper.update_masks()
    _assert_transposable(pw.mask.numpy())
    assert Sparse24.from_config(wrapper.get_config()).method == "transposable"


def _is_transposable(mask2d):
    try:
        _assert_transposable(mask2d * 1.0)
    except AssertionError:
        return False
    return True


def test_a_callback_method_recomputes_magnitude_masks_with_it():
    """`Sparse24Callback(method=...)` computes every layer's masks by that method, not by the
    method prune() used."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(16, 16)).astype("float32"), rng.normal(size=(16, 8)).astype("float32")
    model = prune(_transposable_mlp())
    model.compile(keras.optimizers.SGD(0.1), "mse")
    masks = [pw.mask.numpy() for layer in pruned_layers(model) for pw in layer.pruned_weights]
    assert not all(map(_is_transposable, masks))  # prune()'s magnitude masks
    model.fit(x, y, epochs=1, batch_size=8, verbose=0,
              callbacks=[Sparse24Callback(start_step=1, method="transposable")])
    for layer in pruned_layers(model):
        assert layer.method == "transposable"
        for pw in layer.pruned_weights:
            _assert_transposable(pw.mask.numpy())
