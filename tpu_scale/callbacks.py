"""Keras callbacks of the recipe: `LossGuard` backs a diverging run off to a lower learning rate
(or stops it, naming the setting to change); `AverageMovingStatistics` keeps evaluation,
checkpoints and the saved model on one set of batch-norm statistics."""

import logging
import math

import keras
import numpy as np

from tpu_scale import keras_hook
from tpu_scale.layers.batch_normalization import average_moving_statistics

_logger = logging.getLogger("tpu_scale")


class LossGuard(keras.callbacks.Callback):
    """Backs a diverging run off to its last good state at a lower learning rate; stops it, naming
    the fix, when backing off does not help.

    A learning rate that is too high for a run does not always fail loudly: the loss climbs for a
    few steps, then the run limps on to a poor accuracy. This callback watches the loss of every
    training step. The run diverges at the first step where either

    - the loss is NaN or infinite, or
    - the mean loss of the last `window` steps exceeds `factor` times the reference loss, the
      mean of the first `reference_steps` steps of the run.

    The reference is the loss of a freshly initialized network (the first step's loss, or the
    median of the first steps if lower), close to `log(num_classes)` for a classifier whose
    logits start small; a healthy run stays below it after its first steps,
    warmup included. Three times that means the network predicts confidently and wrongly: at 10
    classes, a mean loss of 6.9 against 2.3 at the start. The check runs from the step after the
    reference is complete, warmup included: runs blow up near the end of warmup, when the
    learning rate peaks.

    When the run diverges, the model's weights and the optimizer's variables (momentum, step
    count) go back to their values at the end of the last epoch whose every step passed the check
    (or at the start of `fit`), and training continues in the same `fit` with every later
    learning rate multiplied by `backoff_factor` (a schedule keeps its shape: it is wrapped in a
    `tpu_scale.schedules.ScaledSchedule` and the training step is traced again). A warning names
    the step, the loss and the new rate. After `max_backoffs` back-offs the next divergence stops
    `fit` at the last good state instead, and the warning names the settings to change; it is
    also kept in `message`. So the model is never left in the state a NaN update made, which is
    where `keras.callbacks.TerminateOnNaN` leaves it.

    Every worker of a multi-worker run sees the same losses, so all of them back off (or stop) at
    the same step. A back-off lives in this `fit`: a run resumed from a backup starts again at the
    rate it was given (`backoffs` says which factor to give it).

    Each epoch's end also checks the mean loss of its steps (those since its last back-off)
    against the same threshold, before the epoch is kept as the last good one: a run that blows up
    while the reference steps are still being taken, or in the few steps after a back-off, is
    caught there although no window filled. At the end of the last epoch, with no step left to
    take at a lower rate, a divergence stops the run (the last good weights restored).

    Per-step losses are recovered from the running epoch mean Keras passes to
    `on_train_batch_end` (every step of an epoch has the same number of examples there). With
    `steps_per_execution > 1` a "step" is one execution.

    Example:

    ```python
    guard = tpu_scale.callbacks.LossGuard(learning_rate_flag="--peak_learning_rate")
    model.fit(data, epochs=20, callbacks=[guard])
    if guard.stopped:
        print(guard.message)
    ```

    Args:
        factor: Float > 1, how far above the reference loss the recent mean may go. Defaults to
            `3.0`.
        reference_steps: Integer >= 1, the number of first steps whose median (capped at the first
            step's loss) is the reference.
            Defaults to `10`.
        window: Integer >= 1, the number of recent steps averaged for the check (one noisy
            small-batch step does not stop a run). Defaults to `5`.
        max_backoffs: Integer >= 0, how many times a diverging run continues at a lower rate
            before the guard stops it. `0` stops at the first divergence. Defaults to `3`.
        backoff_factor: Float in (0, 1), the learning-rate multiplier of each back-off.
            Defaults to `0.5`.
        restore_weights: Boolean, whether to set the model back to the last good weights on
            backing off or stopping (backing off needs it). Defaults to `True`.
        restore_optimizer: Boolean, whether to restore the optimizer's variables as well, so
            that training continues (or `fit` can be called again) from the good state.
            Defaults to `True`.
        learning_rate_flag: Optional string, the name under which a user sets the peak learning
            rate (e.g. `"--peak_learning_rate"`); the message names it.
        optimizer_flag: Optional string, the name under which a user picks the optimizer (e.g.
            `"--optimizer"`); the message names it.
        suggested_learning_rate: Optional float, the peak learning rate the message proposes
            on stopping. Defaults to `backoff_factor` times the last peak learning rate tried.

    Attributes:
        stopped: Whether this callback stopped the last `fit`.
        message: The warning it stopped with, or `None`.
        backoffs: One dict per back-off of the last `fit`: `epoch`, `step` (1-based), `loss`
            and `learning_rate_scale` (the product of the factors so far).
        learning_rate_scale: The product of the back-off factors applied in the last `fit`.
        stopped_epoch, stopped_step: Where it stopped (0-based epoch, step within the epoch).
        reference_loss: The reference loss of the last `fit`.
    """

    def __init__(
        self,
        factor=3.0,
        reference_steps=10,
        window=5,
        max_backoffs=3,
        backoff_factor=0.5,
        restore_weights=True,
        restore_optimizer=True,
        learning_rate_flag=None,
        optimizer_flag=None,
        suggested_learning_rate=None,
    ):
        super().__init__()
        if not float(factor) > 1.0:
            raise ValueError(f"`factor` must be > 1; received {factor}: use e.g. 3.0.")
        for name, value in (("reference_steps", reference_steps), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; received {value!r}.")
        if isinstance(max_backoffs, bool) or not isinstance(max_backoffs, int) or max_backoffs < 0:
            raise ValueError(f"`max_backoffs` must be an integer >= 0; received {max_backoffs!r}: 0 stops at the first divergence.")
        if not 0.0 < float(backoff_factor) < 1.0:
            raise ValueError(
                f"`backoff_factor` must be in (0, 1); received {backoff_factor}: use e.g. 0.5."
            )
        if max_backoffs and not restore_weights:
            raise ValueError("Backing off needs the last good weights: pass restore_weights=True, or max_backoffs=0 to stop at the first divergence.")
        self.factor = float(factor)
        self.reference_steps = reference_steps
        self.window = window
        self.max_backoffs = max_backoffs
        self.backoff_factor = float(backoff_factor)
        self.restore_weights = bool(restore_weights)
        self.restore_optimizer = bool(restore_optimizer)
        self.learning_rate_flag = learning_rate_flag
        self.optimizer_flag = optimizer_flag
        self.suggested_learning_rate = suggested_learning_rate
        self._reset()

    def _reset(self):
        self.stopped = False
        self.message = None
        self.stopped_epoch = None
        self.stopped_step = None
        self.reference_loss = None
        self.backoffs = []
        self.learning_rate_scale = 1.0
        self._first_losses = []
        self._recent = []
        self._good = None
        self._good_epoch = None

    def on_train_begin(self, logs=None):
        self._reset()
        self._good = self._snapshot()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._previous_mean = 0.0
        self._epoch_ok = True
        self._epoch_losses = []  # this epoch's step losses since its last back-off

    def on_train_batch_end(self, batch, logs=None):
        if self.stopped or not logs or "loss" not in logs:
            return
        running_mean = float(np.asarray(logs["loss"]))
        # Keras reports the mean over the epoch's steps so far; the step's own loss follows.
        loss = running_mean * (batch + 1) - self._previous_mean * batch
        self._previous_mean = running_mean
        if not math.isfinite(running_mean):
            self._diverged(batch, running_mean, "is not finite")
            return
        self._epoch_losses.append(loss)
        self._last_step = batch
        if self.reference_loss is None:
            self._first_losses.append(loss)
            if len(self._first_losses) == self.reference_steps:
                self.reference_loss = _reference_of(self._first_losses)
            return
        self._recent = (self._recent + [loss])[-self.window :]
        recent = float(np.mean(self._recent))
        if len(self._recent) == self.window and recent > self.factor * self.reference_loss:
            self._diverged(
                batch,
                recent,
                f"averaged over the last {self.window} steps is more than "
                f"{self.factor:g}x the first steps' {self.reference_loss:.4g}",
            )

    def on_epoch_end(self, epoch, logs=None):
        # The window's check needs `window` steps past the reference steps (or a back-off): the
        # epoch's steps are checked here on their mean, against the reference (or, before it is
        # set, the same rule on the first steps seen so far).
        reference = self.reference_loss
        if reference is None and self._first_losses:
            reference = _reference_of(self._first_losses)
        mean = float(np.mean(self._epoch_losses)) if self._epoch_losses else None
        if not self.stopped and mean is not None and mean > self.factor * reference:
            why = (
                f"averaged over the epoch's last {len(self._epoch_losses)} steps is more than "
                f"{self.factor:g}x the first steps' {reference:.4g}"
            )
            if epoch + 1 >= (self.params or {}).get("epochs", math.inf):
                self._stop(self._last_step, mean, why)  # no step is left to take at a lower rate
            else:
                self._diverged(self._last_step, mean, why)
            return
        if not self.stopped and self._epoch_ok:
            self._good = self._snapshot()
            self._good_epoch = epoch

    # ------------------------------------------------------------------ internals

    def _snapshot(self):
        if not self.restore_weights:
            return None
        weights = self.model.get_weights()
        optimizer = getattr(self.model, "optimizer", None)
        opt_values = None
        if self.restore_optimizer and optimizer is not None and optimizer.built:
            opt_values = [np.array(v.numpy()) for v in optimizer.variables]
        return weights, opt_values

    def _restore(self):
        weights, opt_values = self._good
        self.model.set_weights(weights)
        optimizer = getattr(self.model, "optimizer", None)
        if self.restore_optimizer and optimizer is not None and optimizer.built:
            if opt_values is None:
                # Snapshotted before the optimizer was built: its state at the start is zeros.
                opt_values = [np.zeros(v.shape, v.dtype) for v in optimizer.variables]
            for variable, value in zip(optimizer.variables, opt_values):
                variable.assign(value)
        if self._good_epoch is None:
            return "restored the weights from the start of training"
        return f"restored the weights of the end of epoch {self._good_epoch + 1}"

    def _peak_learning_rate(self):
        optimizer = getattr(self.model, "optimizer", None)
        rate = keras_hook.learning_rate_of(optimizer) if optimizer is not None else None
        if hasattr(rate, "peak_learning_rate"):
            return float(rate.peak_learning_rate)
        try:
            return float(np.asarray(optimizer.learning_rate))
        except (TypeError, ValueError, AttributeError):
            return None

    def _advice(self):
        peak = self._peak_learning_rate()
        target = self.suggested_learning_rate
        if target is None and peak is not None:
            target = peak * self.backoff_factor
        what = self.learning_rate_flag or "the peak learning rate"
        advice = f"lower {what}"
        if peak is not None:
            advice += f" from {peak:.4g}"
        if target is not None:
            advice += f" to {target:.4g}"
        optimizer = getattr(self.model, "optimizer", None)
        if type(optimizer).__name__ == "LARS":
            advice += (
                f", or use {self.optimizer_flag} sgd"
                if self.optimizer_flag
                else ", or use momentum SGD"
            ) + " below batch 16384"
        else:
            advice += ", or warm up for longer"
        return advice

    def _diverged(self, batch, value, why):
        if len(self.backoffs) < self.max_backoffs and self._good is not None:
            self._back_off(batch, value, why)
        else:
            self._stop(batch, value, why)

    def _back_off(self, batch, value, why):
        optimizer = self.model.optimizer
        rate = keras_hook.learning_rate_of(optimizer)
        # A float rate is an optimizer variable, which the restore sets back: read it first.
        before = None if callable(rate) else float(np.asarray(optimizer.learning_rate))
        restored = self._restore()
        self.learning_rate_scale *= self.backoff_factor
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            from tpu_scale.schedules import ScaledSchedule

            inner = rate.schedule if isinstance(rate, ScaledSchedule) else rate
            optimizer.learning_rate = ScaledSchedule(inner, self.learning_rate_scale)
            self.model.make_train_function(force=True)  # the step reads the schedule when traced
        elif callable(rate):
            scale = self.backoff_factor

            def scaled(original=rate):
                return scale * original()

            optimizer.learning_rate = scaled
            self.model.make_train_function(force=True)
        else:
            optimizer.learning_rate = before * self.backoff_factor
        self._recent, self._epoch_losses = [], []
        self.backoffs.append(
            {
                "epoch": self._epoch + 1,
                "step": batch + 1,
                "loss": value,
                "learning_rate_scale": self.learning_rate_scale,
            }
        )
        peak = self._peak_learning_rate()
        _logger.warning(
            "LossGuard: at epoch %d, step %d the loss %.4g %s; %s and continues at %g times the "
            "learning rate%s (back-off %d of %d).",
            self._epoch + 1,
            batch + 1,
            value,
            why,
            restored,
            self.learning_rate_scale,
            "" if peak is None else f", peak {peak:.4g}",
            len(self.backoffs),
            self.max_backoffs,
        )

    def _stop(self, batch, value, why):
        self.stopped = True
        self._epoch_ok = False
        self.stopped_epoch, self.stopped_step = self._epoch, batch
        self.model.stop_training = True
        restored = self._restore() if self._good is not None else "left the weights as they are"
        tried = (
            f" after {len(self.backoffs)} back-off(s) to {self.learning_rate_scale:g} times the "
            "learning rate"
            if self.backoffs
            else ""
        )
        self.message = (
            f"LossGuard: stopped training at epoch {self._epoch + 1}, step {batch + 1}{tried}: "
            f"the loss {value:.4g} {why}; {restored}. The learning rate is too high for this "
            f"run: {self._advice()}."
        )
        _logger.warning("%s", self.message)


def _reference_of(first_losses):
    """The reference loss of `LossGuard`'s first steps. The first step's loss is the initial
    network's; the median of the first steps smooths a noisy one, but a run that blows up within
    them must not raise it."""
    return float(min(first_losses[0], np.median(first_losses)))


class AverageMovingStatistics(keras.callbacks.Callback):
    """Puts every replica on the mean of the batch-norm moving statistics wherever `fit` hands the
    model on.

    For Keras's own `BatchNormalization` layers (the package's `DistributedBatchNormalization`
    keeps one set at every step and needs none of this). Each replica keeps its own copy of such a
    layer's moving statistics and updates it from its own batch, so without this a
    strategy's `evaluate`, fit's validation metrics, the checkpoints and the saved model each see
    other statistics, and the top-1 a run reports is not the saved model's. This callback averages
    them over the replicas before every evaluation (fit's validation included) and prediction, at
    the end of every epoch and at the end of training. Place it ahead of the callbacks that save
    (`ModelCheckpoint`, `BackupAndRestore`): Keras calls callbacks in list order.

    The cost is one all-reduce of the moving statistics at each of those points (two vectors a
    batch-norm layer; and building its step once per model), none in the training steps. On one
    replica it does nothing.
    """

    def on_test_begin(self, logs=None):
        average_moving_statistics(self.model)

    def on_predict_begin(self, logs=None):
        average_moving_statistics(self.model)

    def on_epoch_end(self, epoch, logs=None):
        average_moving_statistics(self.model)

    def on_train_end(self, logs=None):
        average_moving_statistics(self.model)
