"""Sparse24Callback: invariant, logs, dense warm-up, mask recomputation, resume, reuse."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_masks import reference_mask

import tf_sparse24 as ts

RNG = np.random.default_rng(2)
X = RNG.normal(size=(64, 16)).astype("float32")
Y = (X[:, :4].sum(axis=1) > 0).astype("int32")


def pruned_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8),
            keras.layers.Dense(2),
        ]
    )
    return ts.prune(model)


def compile_(model, optimizer, eager=True):
    """Eager keeps these tests fast; the optimizer tests below also run the compiled train step."""
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=eager,
    )


def masks(model):
    return [
        pw.mask.numpy().copy()
        for layer in ts.pruned_layers(model)
        for pw in layer.pruned_weights
    ]


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    ],
    ids=["sgd_momentum", "adam", "adamw"],
)
def test_fit_keeps_exact_24_and_logs(optimizer, tmp_path):
    model = pruned_mlp()
    compile_(model, optimizer(), eager=False)
    before = masks(model)
    log = tmp_path / "log.csv"
    history = model.fit(
        X,
        Y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[ts.Sparse24Callback(), keras.callbacks.CSVLogger(str(log))],
    )
    assert history.history["sparsity"] == [0.5, 0.5]
    assert history.history["sparse24_valid"] == [1.0, 1.0]
    with open(log) as f:
        assert [row["sparsity"] for row in csv.DictReader(f)] == ["0.5", "0.5"]
    for old, new in zip(before, masks(model)):
        np.testing.assert_array_equal(old, new)
    for layer in ts.pruned_layers(model):
        for pw in layer.pruned_weights:
            effective = np.asarray(layer.effective_weight(pw))
            assert ts.is_nm_sparse(effective, "2:4", 0)
            assert (
                np.count_nonzero(effective) == effective.size // 2
            )  # kept weights stay non-zero


class Recorder(keras.callbacks.Callback):
    """Snapshots (step, weights, masks) at every batch begin, after Sparse24Callback acted."""

    def __init__(self):
        super().__init__()
        self.snapshots = []

    def on_train_batch_begin(self, batch, logs=None):
        layers = ts.pruned_layers(self.model)
        self.snapshots.append(
            (
                int(self.model.optimizer.iterations),
                [pw.variable.numpy().copy() for l in layers for pw in l.pruned_weights],
                [pw.mask.numpy().copy() for l in layers for pw in l.pruned_weights],
            )
        )


def test_dense_warmup_then_masks_at_start_step_then_periodic_updates():
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.05))
    recorder = Recorder()
    cb = ts.Sparse24Callback(start_step=5, update_every=3)
    history = model.fit(
        X, Y, batch_size=16, epochs=4, verbose=0, callbacks=[cb, recorder]
    )
    assert history.history["sparse24_valid"] == [
        0.0,
        1.0,
        1.0,
        1.0,
    ]  # 4 steps/epoch: dense in epoch 0
    assert history.history["sparsity"][0] == 0.0
    previous = None
    for step, weights, step_masks in recorder.snapshots:
        if step < 5:
            assert all(m.min() == 1.0 for m in step_masks), step
        elif step == 5 or (step - 5) % 3 == 0:
            for w, m in zip(weights, step_masks):
                np.testing.assert_array_equal(
                    m.astype(bool), reference_mask(w, 2, 4, 0)
                )
        else:
            for m, p in zip(step_masks, previous):
                np.testing.assert_array_equal(m, p)
        previous = step_masks
    changed = [
        any(
            not np.array_equal(a, b)
            for a, b in zip(recorder.snapshots[i][2], recorder.snapshots[i - 3][2])
        )
        for i in (8, 11, 14)
    ]
    assert any(
        changed
    )  # recomputation can move masks (pruned weights keep their values)


def test_warm_up_that_discards_computed_masks_says_so(recwarn):
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.05))
    cb = ts.Sparse24Callback(start_step=2)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    # prune()'s masks reset for a warm-up: the usual recipe, nothing to say.
    assert not [w for w in recwarn if "Sparse24Callback" in str(w.message)]
    phase_one = masks(model)
    compile_(model, keras.optimizers.Adam(0.01))  # a new optimizer starts again at step 0
    with pytest.warns(UserWarning, match=r"before start_step=2: the masks of .* are reset"):
        model.fit(X, Y, batch_size=64, epochs=1, verbose=0, callbacks=[cb])
    assert all(m.min() == 1.0 for m in masks(model))  # as documented: dense until start_step
    for layer, mask in zip(ts.pruned_layers(model), phase_one):  # phase two without start_step
        layer.pruned_weights[0].mask.assign(mask)
    compile_(model, keras.optimizers.Adam(0.01))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[ts.Sparse24Callback()])
    assert all(np.array_equal(a, b) for a, b in zip(masks(model), phase_one))


class TwoWrapped(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = ts.Sparse24(keras.layers.Dense(16, activation="relu"))
        self.head = ts.Sparse24(keras.layers.Dense(2))

    def call(self, x):
        return self.head(self.hidden(x))


def test_masks_due_at_step_0_of_a_model_built_by_fit_come_one_step_later():
    keras.utils.set_random_seed(0)
    model = TwoWrapped()  # unbuilt: Keras builds it inside the first train step
    compile_(model, keras.optimizers.Adam(0.05))
    recorder = Recorder()
    with pytest.warns(UserWarning, match="not built before fit.*one step later"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[ts.Sparse24Callback(start_step=0), recorder])
    steps = {step: step_masks for step, _, step_masks in recorder.snapshots}
    assert steps[0] == []  # no weights yet at step 0: Keras builds the model inside it
    assert len(steps[1]) == 2 and all(m.mean() == 0.5 for m in steps[1])


class WithUnusedHead(TwoWrapped):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.aux = ts.Sparse24(keras.layers.Dense(3))  # never called: never built


def test_a_wrapper_the_model_never_calls_does_not_hold_up_the_others():
    keras.utils.set_random_seed(0)
    model = WithUnusedHead()
    model(X[:1])
    compile_(model, keras.optimizers.Adam(0.05))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0,
              callbacks=[ts.Sparse24Callback(start_step=1)])
    assert [m.mean() for m in masks(model)] == [0.5, 0.5]  # aux has no weights to mask


@pytest.mark.parametrize("keep_optimizer", [True, False])
def test_resume_with_initial_epoch_does_not_recompute(keep_optimizer):
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.05))
    model.fit(
        X,
        Y,
        batch_size=32,
        epochs=2,
        verbose=0,
        callbacks=[ts.Sparse24Callback(start_step=2)],
    )
    after_first = masks(model)
    assert all(m.mean() == 0.5 for m in after_first)
    if (
        not keep_optimizer
    ):  # e.g. weights restored from .weights.h5: optimizer.iterations is 0
        compile_(model, keras.optimizers.Adam(0.05))
    recorder = Recorder()
    history = model.fit(
        X,
        Y,
        batch_size=32,
        epochs=4,
        initial_epoch=2,
        verbose=0,
        callbacks=[ts.Sparse24Callback(start_step=2), recorder],
    )
    assert history.history["sparse24_valid"] == [1.0, 1.0]
    for _, _, step_masks in recorder.snapshots:
        for m, first in zip(step_masks, after_first):
            np.testing.assert_array_equal(m, first)


class MaskWatch(keras.callbacks.Callback):
    """Records optimizer.iterations at every batch whose masks differ from the previous batch's
    (placed after Sparse24Callback, so it sees the masks the coming steps use)."""

    def __init__(self):
        super().__init__()
        self.changes, self._last = [], None

    def on_train_begin(self, logs=None):
        self._last = None  # a new fit(): compare within it only

    def on_train_batch_begin(self, batch, logs=None):
        now = masks(self.model)
        last, self._last = self._last, now
        if last is not None and any(not np.array_equal(a, b) for a, b in zip(now, last)):
            self.changes.append(int(self.model.optimizer.iterations.numpy()))


def test_steps_per_execution_keeps_the_schedule_in_optimizer_steps_across_fits():
    """One callback per execution of 4 steps: masks due at steps 3 and 3 + 6k run at the next
    execution boundary, and a run split over two fit() calls matches one uninterrupted run."""
    def run(splits):
        model = pruned_mlp()
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=4,
        )
        callback, watch = ts.Sparse24Callback(start_step=3, update_every=6), MaskWatch()
        epoch = 0
        for end in splits:
            model.fit(X, Y, batch_size=8, epochs=end, initial_epoch=epoch, shuffle=False,
                      verbose=0, callbacks=[callback, watch])
            epoch = end
        return model, watch.changes

    whole, changes = run([3])  # 8 steps per epoch, 24 in all
    assert changes[0] == 4  # start_step 3 falls inside steps 0-3: computed before step 4
    split, _ = run([1, 3])
    for a, b in zip(whole.get_weights(), split.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("keep_optimizer", [True, False])
def test_gradient_accumulation_keeps_the_schedule_in_optimizer_updates_across_fits(keep_optimizer):
    """8 batches an epoch, 4 optimizer updates (2 batches accumulated each): masks due at updates 6
    and 11, whether fit() runs once or resumes at epoch 1, with or without the optimizer state."""
    def optimizer():
        return keras.optimizers.SGD(0.05, gradient_accumulation_steps=2)

    def run(splits):
        model = pruned_mlp()
        compile_(model, optimizer(), eager=False)
        callback, watch = ts.Sparse24Callback(start_step=6, update_every=5), MaskWatch()
        epoch = 0
        for end in splits:
            if epoch and not keep_optimizer:  # e.g. resumed from .weights.h5
                compile_(model, optimizer(), eager=False)
            model.fit(X, Y, batch_size=8, epochs=end, initial_epoch=epoch, shuffle=False,
                      verbose=0, callbacks=[callback, watch])
            epoch = end
        return model, watch.changes

    whole, changes = run([3])
    assert changes == [6, 11]
    split, changes = run([1, 3])  # the second fit() starts at update 4 (or 0 without state)
    assert changes == ([6, 11] if keep_optimizer else [2, 7])
    assert all(m.mean() == 0.5 for m in masks(split))
    if keep_optimizer:
        for a, b in zip(whole.get_weights(), split.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_broken_invariant_fails_loudly_with_layer_name():
    model = pruned_mlp()
    compile_(model, "sgd")
    wrapper = ts.pruned_layers(model)[1]
    wrapper.pruned_weights[0].mask.assign(
        np.ones(wrapper.pruned_weights[0].mask.shape, "float32")
    )
    with pytest.raises(
        RuntimeError, match=rf"{wrapper.name}/kernel \(16, 8\) is not 2:4"
    ):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[ts.Sparse24Callback()])


def test_diverged_weights_are_named_as_nan_not_as_a_broken_mask():
    model = pruned_mlp()
    compile_(model, "sgd")
    pw = ts.pruned_layers(model)[0].pruned_weights[0]
    pw.variable.assign(np.full(pw.variable.shape, np.nan, "float32"))  # NaN * 0 = NaN
    callback = ts.Sparse24Callback()
    callback.set_model(model)
    callback.on_train_begin()
    with pytest.raises(RuntimeError, match=r"is not 2:4 .* holds NaN/Inf \(training diverged\)"):
        callback.on_epoch_end(0, {})


def test_callback_is_reusable_and_validates():
    cb = ts.Sparse24Callback()
    first, second = (
        pruned_mlp(0),
        keras.Sequential([keras.Input((16,)), ts.Sparse24(keras.layers.Dense(4))]),
    )
    second.layers[0].update_masks()
    for model in (first, second):
        compile_(model, "sgd")
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[cb])
    assert cb._layers == ts.pruned_layers(second)
    plain = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2)])
    compile_(plain, "sgd")
    with pytest.raises(ValueError, match="has no Sparse24 layers"):
        plain.fit(X, Y, epochs=1, verbose=0, callbacks=[cb])
    with pytest.raises(ValueError, match="update_every=0"):
        ts.Sparse24Callback(update_every=0)
    with pytest.raises(ValueError, match="start_step=-1"):
        ts.Sparse24Callback(start_step=-1)
    with pytest.raises(ValueError, match="Unknown mask method.*method='bogus'"):
        ts.Sparse24Callback(method="bogus")


def test_a_warm_up_that_discards_masks_loaded_from_a_file_says_so(tmp_path, recwarn):
    """Masks loaded from a file (an earlier phase, another process) are not prune()'s."""
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.05))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0,
              callbacks=[ts.Sparse24Callback(start_step=2)])
    path = str(tmp_path / "phase1.weights.h5")
    model.save_weights(path)
    assert not [w for w in recwarn if "Sparse24Callback" in str(w.message)]
    resumed = pruned_mlp(seed=1)
    resumed.load_weights(path)
    compile_(resumed, keras.optimizers.Adam(0.01))
    with pytest.warns(UserWarning, match=r"the masks of .* are reset to ones.*or a file"):
        resumed.fit(X, Y, batch_size=64, epochs=1, verbose=0,
                    callbacks=[ts.Sparse24Callback(start_step=2)])


def test_resuming_a_schedule_on_data_of_unknown_size_without_optimizer_state_is_refused():
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.01))
    before = masks(model)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda a, b: True).batch(16)
    with pytest.raises(ValueError, match=r"initial_epoch=2.*unknown size.*steps_per_epoch"):
        model.fit(data, initial_epoch=2, epochs=3, verbose=0,
                  callbacks=[ts.Sparse24Callback(start_step=5)])
    assert all(np.array_equal(a, b) for a, b in zip(masks(model), before))  # nothing reset


class EpochEndMasks(keras.callbacks.Callback):
    """Masks as an epoch-end checkpoint (listed after Sparse24Callback) would save them."""

    def __init__(self):
        super().__init__()
        self.at_epoch_end = []

    def on_epoch_end(self, epoch, logs=None):
        self.at_epoch_end.append(masks(self.model))


def fit_in_executions_of_4(model, callbacks, epochs=1, optimizer=None):
    model.compile(optimizer or keras.optimizers.SGD(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=4)
    # 8 steps an epoch: executions 0-3 and 4-7.
    return model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


def test_masks_due_inside_the_last_execution_are_in_the_epoch_end_checkpoint():
    """Step 6 is due inside the last execution of epoch 0: computed at the end of that
    execution, so an epoch-end checkpoint (or BackupAndRestore) holds them, and a run resumed
    from it does not lose them."""
    model, saved = pruned_mlp(), EpochEndMasks()
    fit_in_executions_of_4(model, [ts.Sparse24Callback(start_step=6), saved])
    assert [m.mean() for m in saved.at_epoch_end[0]] == [0.5] * 3
    for layer in ts.pruned_layers(model):
        for pw in layer.pruned_weights:
            assert ts.is_nm_sparse(layer.effective_weight(pw), "2:4", pw.axis)


class SaveAtStep(keras.callbacks.Callback):
    """A batch-frequency checkpoint listed before Sparse24Callback: saves in its own batch end."""

    def __init__(self, step, path):
        super().__init__()
        self.step, self.path = step, path

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self.step:
            self.model.save(self.path)


def test_a_run_resumed_past_start_step_with_masks_never_computed_computes_them(tmp_path):
    """The checkpoint at step 8 holds the warm-up's masks of ones (start_step 6 fell inside the
    execution it ended); resuming from it computes them at once, from the same weights."""
    model, path = pruned_mlp(), str(tmp_path / "at_8.keras")
    fit_in_executions_of_4(model, [SaveAtStep(8, path), ts.Sparse24Callback(start_step=6)])
    resumed = keras.saving.load_model(path)
    assert all(m.min() == 1.0 for m in masks(resumed))
    resumed.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                callbacks=[ts.Sparse24Callback(start_step=6)])  # raised: not 2:4 after epoch 0
    assert [m.mean() for m in masks(resumed)] == [0.5] * 3
    for got, want in zip(masks(resumed), masks(model)):
        np.testing.assert_array_equal(got, want)


def test_a_resumed_run_computes_the_masks_never_computed_beside_a_frozen_layers_masks(tmp_path):
    """As above, with a frozen pruned layer: the warm-up keeps its masks, so the checkpoint at
    step 8 holds those beside the others' ones; resuming computes the others' (not only when
    every mask is ones), and leaves the frozen layer's as they are."""
    model, path = pruned_mlp(), str(tmp_path / "at_8.keras")
    model.layers[1].trainable = False
    fit_in_executions_of_4(model, [SaveAtStep(8, path), ts.Sparse24Callback(start_step=6)])
    resumed = keras.saving.load_model(path)
    frozen = masks(resumed)[1]
    assert [m.min() for m in masks(resumed)] == [1.0, 0.0, 1.0] and frozen.mean() == 0.5
    resumed.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                callbacks=[ts.Sparse24Callback(start_step=6)])  # raised: not 2:4 after epoch 0
    assert [m.mean() for m in masks(resumed)] == [0.5] * 3
    np.testing.assert_array_equal(masks(resumed)[1], frozen)
    for got, want in zip(masks(resumed), masks(model)):
        np.testing.assert_array_equal(got, want)


class StopAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("preempted")


def test_a_run_resumed_by_backup_and_restore_equals_the_uninterrupted_one(tmp_path):
    def run(extra=()):
        model = pruned_mlp()
        callbacks = [keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                     ts.Sparse24Callback(start_step=6, update_every=5), *extra]
        fit_in_executions_of_4(model, callbacks, epochs=2)
        return model

    whole = run()
    with pytest.raises(RuntimeError, match="preempted"):
        run([StopAfterFirstEpoch()])
    resumed = run()
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_early_stopping_restores_the_best_epoch_without_new_masks_after_it():
    """The masks due inside epoch 1's last execution are computed before EarlyStopping restores
    epoch 0's weights, not after: the model fit() returns is the restored one."""
    model = pruned_mlp()
    best = EpochEndMasks()
    stop = keras.callbacks.EarlyStopping("loss", patience=1, mode="max",
                                         restore_best_weights=True)  # "max": epoch 0 is best
    callbacks = [stop, ts.Sparse24Callback(update_every=7), best]  # the documented order
    fit_in_executions_of_4(model, callbacks, epochs=3, optimizer=keras.optimizers.Adam(0.05))
    assert stop.stopped_epoch == 1
    for got, want in zip(masks(model), best.at_epoch_end[0]):
        np.testing.assert_array_equal(got, want)


def test_a_method_a_layer_cannot_take_fails_before_the_first_step():
    model = pruned_mlp()  # the last kernel, 8 x 2, has no 4x4 blocks
    compile_(model, keras.optimizers.SGD(0.05))
    before = masks(model)
    name = ts.pruned_layers(model)[-1].name
    with pytest.raises(ValueError, match=rf"{name}/kernel with shape \(8, 2\).*4x4"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[ts.Sparse24Callback(start_step=2, method="transposable")])
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(masks(model), before))


def test_a_layer_that_fails_its_mask_computation_leaves_every_mask_as_it_was():
    model = pruned_mlp()
    first, last = ts.pruned_layers(model)[0], ts.pruned_layers(model)[-1]
    first.pruned_weights[0].variable.assign(RNG.normal(size=(16, 16)))  # other masks due
    bad = last.pruned_weights[0].variable
    bad.assign(np.where(np.eye(*bad.shape), np.nan, bad.numpy()))
    compile_(model, keras.optimizers.SGD(0.05))
    before = masks(model)
    with pytest.raises(ValueError, match=f"{last.name}/kernel .* NaN"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[ts.Sparse24Callback(start_step=0)])
    assert all(np.array_equal(a, b) for a, b in zip(masks(model), before))


class RestoreDenseWarmUp(keras.callbacks.Callback):
    """Stands for EarlyStopping(restore_best_weights=True) picking an epoch of the warm-up."""

    def on_train_begin(self, logs=None):
        self.snapshot = self.model.get_weights()

    def on_train_end(self, logs=None):
        self.model.set_weights(self.snapshot)


def test_weights_restored_from_the_dense_warm_up_are_reported_at_the_end_of_fit():
    model = pruned_mlp()
    compile_(model, keras.optimizers.Adam(0.01))
    for layer in ts.pruned_layers(model):  # masks of ones, as during a warm-up
        for pw in layer.pruned_weights:
            pw.mask.assign(np.ones(pw.mask.shape, pw.mask.dtype))
    callbacks = [RestoreDenseWarmUp(), ts.Sparse24Callback(start_step=1)]
    with pytest.warns(UserWarning, match=r"end of fit\(\) the effective weights .* are not N:M"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
    with pytest.warns(UserWarning, match=r"strip\(\): the effective weights .* are not N:M"):
        ts.strip(model)


def test_masks_due_at_the_step_after_the_last_are_left_to_the_next_fit():
    """start_step = the number of steps run: due before a step that never runs in this fit."""
    model = pruned_mlp()
    compile_(model, keras.optimizers.SGD(0.05))
    before = masks(model)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
              callbacks=[ts.Sparse24Callback(start_step=8)])  # 8 steps: 0..7
    assert all(m.min() == 1.0 for m in masks(model))  # still the dense warm-up
    assert not all(np.array_equal(a, b) for a, b in zip(masks(model), before))


def test_a_schedule_leaves_the_masks_of_frozen_layers_alone():
    """A frozen layer's weights never change, so the warm-up must not run it dense; the trainable
    layers follow the schedule (ones before start_step, computed at it)."""
    model = pruned_mlp()
    frozen = model.layers[1]
    frozen.trainable = False
    weights = [v.numpy().copy() for v in frozen.weights]
    compile_(model, keras.optimizers.Adam(0.05))
    recorder = Recorder()
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0,
              callbacks=[ts.Sparse24Callback(start_step=3, update_every=2),
                         recorder])
    want = reference_mask(weights[0], 2, 4, 0)  # prune()'s magnitude mask of the frozen kernel
    for step, _, (first, middle, _) in recorder.snapshots:
        np.testing.assert_array_equal(middle.astype(bool), want)
        assert (first.min() == 1.0) == (step < 3), step
    for old, new in zip(weights, frozen.weights):
        np.testing.assert_array_equal(old, new.numpy())


def test_a_frozen_base_inside_a_transfer_learning_model_keeps_its_masks():
    base = pruned_mlp()
    base.trainable = False
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(2)(base(inputs, training=False)))
    before = [v.numpy().copy() for v in base.weights]
    compile_(model, keras.optimizers.SGD(0.1, momentum=0.9))
    recorder = Recorder()
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0,
              callbacks=[ts.Sparse24Callback(start_step=2), recorder])
    for _, kernels, step_masks in recorder.snapshots:  # at every step, not only at the end
        for w, m in zip(kernels, step_masks):
            np.testing.assert_array_equal(m.astype(bool), reference_mask(w, 2, 4, 0))
    for old, new in zip(before, base.weights):
        np.testing.assert_array_equal(old, new.numpy())
    assert all(ts.is_nm_sparse(l.effective_weight(pw), "2:4", 0)
               for l in ts.pruned_layers(base) for pw in l.pruned_weights)


def test_a_custom_training_loop_drives_the_callback_through_a_callback_list():
    """The documented custom-loop use: the loop's optimizer given to model.compile, the callback
    driven by keras.callbacks.CallbackList as fit() would; logs reach a History listed after it."""
    model = pruned_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer)
    history = keras.callbacks.History()
    callbacks = keras.callbacks.CallbackList(
        [ts.Sparse24Callback(start_step=2), history], model=model)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    seen = []
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for batch in range(4):
            callbacks.on_train_batch_begin(batch)
            seen.append([m.min() for m in masks(model)])
            x, y = X[batch * 16:(batch + 1) * 16], Y[batch * 16:(batch + 1) * 16]
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            callbacks.on_train_batch_end(batch)
        callbacks.on_epoch_end(epoch, {"loss": float(loss)})
    callbacks.on_train_end()
    assert [min(s) for s in seen] == [1.0, 1.0] + [0.0] * 6  # warm-up, then masks at step 2
    assert history.history["sparse24_valid"] == [1.0, 1.0]
    for layer in ts.pruned_layers(model):
        for pw in layer.pruned_weights:
            assert ts.is_nm_sparse(layer.effective_weight(pw), "2:4", 0)


def test_a_schedule_without_an_optimizer_to_count_steps_is_refused_by_name():
    model = pruned_mlp()  # a custom loop's model, never compiled
    before = masks(model)
    callbacks = keras.callbacks.CallbackList([ts.Sparse24Callback(update_every=2)], model=model)
    with pytest.raises(ValueError, match=r"update_every=2\): model .* has no optimizer"):
        callbacks.on_train_begin()
    assert all(np.array_equal(a, b) for a, b in zip(masks(model), before))
    unscheduled = keras.callbacks.CallbackList([ts.Sparse24Callback()], model=model)
    unscheduled.on_train_begin()
    unscheduled.on_epoch_begin(0)  # checks and logs only: no step needed
    logs = {"loss": 0.0}
    unscheduled.callbacks[0].on_epoch_end(0, logs)
    assert logs["sparse24_valid"] == 1.0
