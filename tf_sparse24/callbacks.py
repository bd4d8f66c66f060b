"""`Sparse24Callback`: schedules mask computation and checks the N:M invariant during `fit`.

Masking itself happens in the `Sparse24` forward; the callback only observes and schedules, so the
optimizer is never patched. All state the model needs (the masks) lives in the wrappers' weights;
the callback reads the step from the optimizer and keeps only its schedule, reset in
`on_train_begin`, so one instance can be reused.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np

from tf_sparse24.masks import _mask_method, check_mask_shape, is_nm_sparse
from tf_sparse24.prune import not_nm_weights, pruned_layers


class Sparse24Callback(keras.callbacks.Callback):
    """Keeps a pruned model's masks on schedule, checks them, and logs sparsity.

    The training step is `optimizer.iterations` (saved with the optimizer; one per optimizer
    update), offset to the updates of `initial_epoch * steps_per_epoch` batches when resuming
    without optimizer state (an optimizer at step 0).
    It is read at each batch callback; with `steps_per_execution > 1` (one callback per
    execution) a computation due inside an execution runs at the end of that execution, at most
    `steps_per_execution - 1` steps late (masks stay as they were until then), before the
    epoch-end callbacks see the model (epoch-end checkpoints and backups hold the new masks;
    list a batch-frequency one, `save_freq=<int>`, after this callback).

    Order in `callbacks=[...]`: after EarlyStopping / ModelCheckpoint, before CSVLogger and
    TensorBoard. Callbacks listed after this one see its logs; at the end of `fit` it warns if a
    callback listed before it restored weights that are not N:M (EarlyStopping with
    `restore_best_weights=True` picking an epoch of the dense warm-up).

    Args:
        start_step: dense warm-up. Before this step every mask is ones (the model trains dense);
            masks are computed at this step (by `method`). None (default): keep the masks
            `prune()` computed.
        update_every: recompute masks every this many steps after `start_step` (or step 0). None
            (default): masks stay fixed, as in the paper's recipe. Resuming never recomputes
            masks off schedule. Frozen layers (weights not among the model's trainable weights)
            keep the masks they have through the warm-up and every recomputation.
        method: mask method (a key of `tf_sparse24.masks.MASK_METHODS`) for every layer; None
            (default): each layer's own (`Sparse24.method`, the one `prune()` used).
        check: verify at every epoch end that each effective weight is exactly N:M; raises
            RuntimeError naming the layer and weight otherwise.

    Logs (added to `logs` at each epoch end: History and the callbacks listed after this one see
    them): `sparsity` (fraction of zeros over all pruned weights) and `sparse24_valid` (1.0 or
    0.0).

    Raises:
        ValueError: a schedule on a model without an optimizer (a custom loop's model never
            compiled: compile it with the loop's optimizer). Resuming
            (`initial_epoch > 0`) with a schedule, an optimizer at step 0 and
            data of unknown size: the training step cannot be known. With a schedule, a
            method some pruned weight cannot take (in `on_train_begin`, before a step trains).

    Example:
        >>> model.fit(x, y, epochs=3, callbacks=[Sparse24Callback()])
    """

    def __init__(
        self,
        start_step: int | None = None,
        update_every: int | None = None,
        method: str | None = None,
        check: bool = True,
    ):
        super().__init__()
        for name, value, low in (
            ("start_step", start_step, 0),
            ("update_every", update_every, 1),
        ):
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(
                    f"{name} must be None or an int >= {low}. Received: {name}={value!r}"
                )
        if method is not None:
            _mask_method(method)  # an unknown method fails here, not at the first computation
        self.start_step = start_step
        self.update_every = update_every
        self.method = method
        self.check = check
        self._layers = []
        self._offset = None  # added to optimizer.iterations; set at the first epoch of a fit()
        self._next = None  # the next step at which masks are computed, or None
        self._warned_unbuilt = False

    def on_train_begin(self, logs=None):
        self._layers = pruned_layers(self.model)
        if not self._layers:
            raise ValueError(
                f"Sparse24Callback: model {self.model.name!r} has no Sparse24 layers; "
                "call tf_sparse24.prune(model) first."
            )
        if self._scheduled and getattr(self.model, "optimizer", None) is None:
            raise ValueError(
                f"Sparse24Callback(start_step={self.start_step}, update_every="
                f"{self.update_every}): model {self.model.name!r} has no optimizer, and the mask "
                "schedule counts optimizer.iterations. In a custom training loop, compile the "
                "model with the optimizer the loop applies (model.compile(optimizer=opt)), or "
                "use Sparse24Callback() without a schedule."
            )
        if self._scheduled:
            for layer in self._layers:  # a method a layer cannot take fails now, not mid-fit
                for pw in layer.pruned_weights:
                    check_mask_shape(tuple(pw.variable.shape), pw.pattern, pw.axis,
                                     self.method or layer.method, f"{layer.name}/{pw.name}")
        self._offset = self._next = None
        self._warned_unbuilt = False

    @property
    def _scheduled(self) -> bool:
        return self.start_step is not None or self.update_every is not None

    def _frozen_computed(self) -> set[int]:
        """Ids of the pruned variables the schedule leaves alone: frozen (not among the model's
        trainable weights: `layer.trainable = False`, a frozen base model) with masks already
        computed. Their weights do not change, so a reset (warm-up) or recomputation (another
        `method`) would only change what a frozen layer computes. Masks never computed (all
        ones) are computed on schedule like the others."""
        trainable = {id(v) for v in self.model.trainable_weights}
        return {
            id(pw.variable) for layer in self._layers for pw in layer.pruned_weights
            if id(pw.variable) not in trainable and not np.all(pw.mask.numpy())
        }

    def _iterations(self) -> int:
        # .numpy(): under tf.distribute `iterations` is a MirroredVariable; int() rejects it.
        return int(self.model.optimizer.iterations.numpy())

    def _accumulation(self) -> int:
        """Batches per optimizer update (`gradient_accumulation_steps`)."""
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        return getattr(optimizer, "gradient_accumulation_steps", None) or 1

    def _due_from(self, step: int) -> int | None:
        """The first step >= `step` at which masks are computed (start_step, then every
        update_every after it, or after 0), or None."""
        if self.start_step is not None and step <= self.start_step:
            return self.start_step
        if not self.update_every:
            return None
        start = self.start_step or 0
        return start + max(1, -(-(step - start) // self.update_every)) * self.update_every

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None and not self._scheduled:
            self._offset = 0  # nothing to schedule: no step needed (a custom loop's model may
            return  # have no optimizer)
        if self._offset is None:  # first epoch of this fit(): find where training resumes
            steps = (self.params or {}).get("steps")
            iterations = self._iterations()
            if epoch > 0 and iterations == 0 and not steps:
                raise ValueError(
                    f"Sparse24Callback: fit(initial_epoch={epoch}) with an optimizer at step 0 (no "
                    "optimizer state) on data of unknown size: the training step, and so the mask "
                    "schedule, is unknown. Pass steps_per_epoch to fit(), or restore the optimizer "
                    "state (a .keras file holds it)."
                )
            # An optimizer at step 0 after epoch 0: resumed without optimizer state. Any other
            # count is the real one (it lags the batches with gradient accumulation, or with
            # steps a LossScaleOptimizer skipped).
            self._offset = epoch * (steps or 0) // self._accumulation() if iterations == 0 else 0
            step = iterations + self._offset
            self._next = self._due_from(step)
            if self.start_step is not None and step < self.start_step:
                self._reset_masks(step)
            elif self.start_step is not None and step > self.start_step and self.model.built:
                # Past start_step with masks never computed (the frozen layers' kept theirs): saved
                # by a batch-frequency checkpoint that ran before this callback at the batch they
                # were due. Computed now, from the weights they would have been computed from.
                frozen = self._frozen_computed()
                if all(np.all(pw.mask.numpy()) for layer in self._layers
                       for pw in layer.pruned_weights if id(pw.variable) not in frozen):
                    self._compute_masks(step)

    def _reset_masks(self, step: int) -> None:
        """Masks of ones for the dense warm-up (frozen layers keep theirs); says so if that
        discards masks other than those `prune()` computed in this process (an earlier fit's, or
        loaded from a file)."""
        frozen = self._frozen_computed()
        weights = [(layer, pw) for layer in self._layers for pw in layer.pruned_weights
                   if id(pw.variable) not in frozen]
        if computed := [f"{layer.name}/{pw.name}" for layer, pw in weights
                        if layer.masks_source != "prune()" and not np.all(pw.mask.numpy())]:
            warnings.warn(
                f"Sparse24Callback: step {step} (optimizer.iterations) is before start_step="
                f"{self.start_step}: the masks of {computed} are reset to ones for the dense "
                f"warm-up and computed again at step {self.start_step}. If they come from an "
                "earlier fine-tuning phase or a file (a new optimizer starts at step 0), use "
                "Sparse24Callback() without start_step to keep them.",
                stacklevel=2,
            )
        for _, pw in weights:
            pw.mask.assign(np.ones(pw.mask.shape, pw.mask.dtype))

    def on_train_batch_begin(self, batch, logs=None):
        if self._next is None:
            return
        step = self._iterations() + self._offset
        if self._next <= step:
            if not self.model.built:
                # Keras builds a model it was given unbuilt inside the first train step, after
                # this callback: the computation waits for the next batch.
                if not self._warned_unbuilt:
                    self._warned_unbuilt = True
                    warnings.warn(
                        f"Sparse24Callback: model {self.model.name!r} was not built before fit(),"
                        f" so the masks due at step {self._next} are computed once Keras has "
                        "built it, one step later. Build it first (call it on a batch) to have "
                        "them on time.",
                        stacklevel=2,
                    )
                return
            self._compute_masks(step)

    def on_train_batch_end(self, batch, logs=None):
        # Due inside the execution that just ran (steps_per_execution > 1, or a model Keras built
        # in its first step): computed now, before an epoch-end checkpoint or EarlyStopping's
        # restore, rather than at the next batch (which a resumed run would never see).
        if self._next is not None and self.model.built:
            if self._next < (step := self._iterations() + self._offset):
                self._compute_masks(step)

    def _compute_masks(self, step: int) -> None:
        """Every layer's new masks, all computed before any is assigned: a layer that fails
        (NaN weights) leaves every mask as it was. Frozen layers' computed masks are kept."""
        frozen = self._frozen_computed()
        layers = [layer for layer in self._layers
                  if any(id(pw.variable) not in frozen for pw in layer.pruned_weights)]
        masks = [layer._computed_masks(self.method) for layer in layers]
        for layer, layer_masks in zip(layers, masks):
            layer._assign_masks([pw.mask.value if id(pw.variable) in frozen else mask
                                 for pw, mask in zip(layer.pruned_weights, layer_masks)],
                                self.method)
        self._next = self._due_from(step + 1)

    def on_train_end(self, logs=None):
        if self._offset is None:  # no epoch ran
            return
        # One due at the last step belongs to the next fit(), whose first step it precedes.
        if self.check and not self._in_warm_up and (broken := not_nm_weights(self._layers)):
            warnings.warn(
                f"Sparse24Callback: at the end of fit() the effective weights {broken} are not "
                "N:M. A callback listed before this one restored weights from before the masks "
                "were computed (EarlyStopping(restore_best_weights=True) picking an epoch of the "
                "dense warm-up?). Start EarlyStopping after the warm-up (start_from_epoch), or "
                "recompute the masks (update_masks()) and fine-tune.",
                stacklevel=2,
            )

    @property
    def _in_warm_up(self) -> bool:
        """Masks not computed yet: the dense warm-up before `start_step`."""
        return self.start_step is not None and self._next == self.start_step

    def on_epoch_end(self, epoch, logs=None):
        total = zeros = 0
        valid = True
        for layer in self._layers:
            for pw in layer.pruned_weights:
                w = layer.effective_weight(pw)
                total += int(np.prod(w.shape))
                zeros += int(np.size(w) - np.count_nonzero(w))
                ok = is_nm_sparse(w, pw.pattern, pw.axis)
                valid &= ok
                if self.check and not ok and not self._in_warm_up:
                    # NaN * 0 is NaN: a diverged optimizer, not a broken mask, breaks the pattern.
                    diverged = not np.all(np.isfinite(w))
                    raise RuntimeError(
                        f"Sparse24Callback: effective weight {layer.name}/{pw.name} "
                        f"{tuple(pw.variable.shape)} is not {pw.pattern} along axis {pw.axis} "
                        f"after epoch {epoch}"
                        + (": it holds NaN/Inf (training diverged)." if diverged else ".")
                    )
        if logs is not None:
            logs["sparsity"] = zeros / total if total else 0.0
            logs["sparse24_valid"] = float(valid)
