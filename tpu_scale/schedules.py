"""Learning-rate schedules: the large-batch recipe's linear warmup + polynomial decay, a scaled
schedule for a run continued at a lower rate, and the reference LARS settings by batch size.

The recipe that chooses among them for a run is `tpu_scale.recipe`."""

import math
import numbers

import keras
from keras import ops

# Reference LARS settings by global batch size: (global batch, peak learning rate, warmup
# epochs), from the large-batch ResNet-50 runs on TPU pods (Ying et al., 2018).
_REFERENCE_POINTS = (
    (16384, 25.0, 5.0),
    (32768, 34.0, 12.0),
    (65536, 35.0, 34.0),
)


@keras.saving.register_keras_serializable(package="tpu_scale")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to a peak learning rate, then polynomial decay to an end rate.

    ```python
    if step < warmup_steps:
        lr = peak_learning_rate * step / warmup_steps
    else:
        progress = min(step - warmup_steps, decay_steps) / decay_steps
        lr = end_learning_rate + (peak_learning_rate - end_learning_rate) * (1 - progress) ** power
    # where decay_steps = total_steps - warmup_steps
    ```

    The rate is 0 at step 0, `peak_learning_rate` at `warmup_steps`, and
    `end_learning_rate` at `total_steps` and after.

    Example:

    ```python
    hparams = tpu_scale.schedules.reference_lars_hparams(global_batch_size=32768)
    schedule = WarmupPolynomialDecay.from_epochs(
        **hparams, total_epochs=72, steps_per_epoch=1281167 // 32768)
    optimizer = tpu_scale.optimizers.LARS(learning_rate=schedule, weight_decay=1e-4)
    ```

    Args:
        peak_learning_rate: Float > 0, the rate reached at the end of warmup.
        warmup_steps: Integer >= 0, the number of steps of linear warmup. 0 starts at
            the peak.
        total_steps: Integer > `warmup_steps`, the step at which the decay ends.
        end_learning_rate: Float in `[0, peak_learning_rate]`. Defaults to `0.0`.
        power: Float > 0, the exponent of the decay. Defaults to `2.0`.
        name: Optional name of the schedule.

    Reference:
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677) (warmup)
    """

    def __init__(
        self,
        peak_learning_rate,
        warmup_steps,
        total_steps,
        end_learning_rate=0.0,
        power=2.0,
        name="WarmupPolynomialDecay",
    ):
        super().__init__()
        peak_learning_rate = float(peak_learning_rate)
        end_learning_rate = float(end_learning_rate)
        power = float(power)
        if not peak_learning_rate > 0:
            raise ValueError(
                f"`peak_learning_rate` must be > 0; received {peak_learning_rate}: "
                "pass the rate reached after warmup, e.g. 25.0 for LARS at batch 16K."
            )
        if not is_whole_number(warmup_steps) or warmup_steps < 0:
            raise ValueError(
                f"`warmup_steps` must be an integer >= 0; received {warmup_steps!r}: "
                "pass 0 for no warmup."
            )
        if not is_whole_number(total_steps) or total_steps <= warmup_steps:
            raise ValueError(
                f"`total_steps` must be an integer > warmup_steps ({warmup_steps}); received "
                f"{total_steps!r}: it is the length of the whole run, warmup included."
            )
        if not 0 <= end_learning_rate <= peak_learning_rate:
            raise ValueError(
                f"`end_learning_rate` must be in [0, peak_learning_rate={peak_learning_rate}]; "
                f"received {end_learning_rate}."
            )
        if not power > 0:
            raise ValueError(f"`power` must be > 0; received {power}: use 2.0 for the recipe.")
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.name = name

    @classmethod
    def from_epochs(
        cls,
        peak_learning_rate,
        warmup_epochs,
        total_epochs,
        steps_per_epoch,
        end_learning_rate=0.0,
        power=2.0,
        name="WarmupPolynomialDecay",
    ):
        """Builds the schedule from lengths in epochs (possibly fractional).

        Args:
            peak_learning_rate: Float > 0, as in the constructor.
            warmup_epochs: Float >= 0, the warmup length in epochs.
            total_epochs: Float > `warmup_epochs`, the length of the run in epochs.
            steps_per_epoch: Integer > 0, optimizer steps per epoch (examples per epoch
                divided by the global batch size).
            end_learning_rate, power, name: as in the constructor.

        Returns:
            A `WarmupPolynomialDecay` with step counts rounded to the nearest integer.
        """
        if not is_whole_number(steps_per_epoch) or steps_per_epoch <= 0:
            raise ValueError(
                f"`steps_per_epoch` must be an integer > 0; received {steps_per_epoch!r}: "
                "use examples_per_epoch // global_batch_size."
            )
        if not warmup_epochs >= 0:
            raise ValueError(f"`warmup_epochs` must be >= 0; received {warmup_epochs}.")
        if not total_epochs > warmup_epochs:
            raise ValueError(
                f"`total_epochs` ({total_epochs}) must be greater than `warmup_epochs` "
                f"({warmup_epochs}): the run must last longer than its warmup."
            )
        warmup_steps = int(round(warmup_epochs * steps_per_epoch))
        total_steps = max(int(round(total_epochs * steps_per_epoch)), warmup_steps + 1)
        return cls(peak_learning_rate, warmup_steps, total_steps, end_learning_rate, power, name)

    def __call__(self, step):
        with keras.name_scope(self.name):
            step = ops.cast(step, "float32")
            peak = ops.cast(self.peak_learning_rate, "float32")
            end = ops.cast(self.end_learning_rate, "float32")
            warmup = float(self.warmup_steps)
            decay_steps = float(self.total_steps - self.warmup_steps)
            # max(warmup, 1) only guards the division; with warmup 0 this branch is unused.
            warmup_rate = peak * step / max(warmup, 1.0)
            progress = ops.clip((step - warmup) / decay_steps, 0.0, 1.0)
            decay_rate = end + (peak - end) * ops.power(1.0 - progress, self.power)
            return ops.where(step < warmup, warmup_rate, decay_rate)

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="tpu_scale")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Another learning-rate schedule times a constant factor.

    `tpu_scale.callbacks.LossGuard` puts a diverging run's schedule in one to continue it at a
    lower rate: the shape of the schedule (warmup, decay, its step count) stays, every rate is
    `factor` times the original's.

    Args:
        schedule: A `keras.optimizers.schedules.LearningRateSchedule`.
        factor: Float > 0, the multiplier.
    """

    def __init__(self, schedule, factor):
        super().__init__()
        if not float(factor) > 0:
            raise ValueError(f"`factor` must be > 0; received {factor}.")
        self.schedule = schedule
        self.factor = float(factor)

    @property
    def peak_learning_rate(self):
        """The scaled peak rate of a schedule that has one (e.g. `WarmupPolynomialDecay`)."""
        return self.factor * self.schedule.peak_learning_rate

    def __call__(self, step):
        return self.factor * self.schedule(step)

    def get_config(self):
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "factor": self.factor,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def reference_lars_hparams(global_batch_size):
    """Reference LARS peak learning rate and warmup length for a global batch size.

    The published large-batch ResNet-50 settings are:

    | global batch | peak learning rate | warmup epochs |
    |---|---|---|
    | <= 16384 | 25 | 5 |
    | 32768 | 34 | 12 |
    | 65536 | 35 | 34 |

    Between two rows both values are interpolated linearly in log2 of the batch size
    (batch 24576 gets about 30.3 and 9.1): the settings were found one doubling apart,
    and a doubling is the natural unit between them. Above 65536 the last row is returned
    unchanged; it has not been validated there. Below 16384 the first row holds, as in the
    reference. These rates go with `LARS(eta=0.001)`.

    Args:
        global_batch_size: Integer > 0, examples per optimizer step over all replicas.

    Returns:
        A dict `{"peak_learning_rate": float, "warmup_epochs": float}`, whose keys match
        the arguments of `WarmupPolynomialDecay.from_epochs`.

    Reference:
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
    """
    if not is_whole_number(global_batch_size) or global_batch_size <= 0:
        raise ValueError(
            f"`global_batch_size` must be an integer > 0; received {global_batch_size!r}: "
            "pass the per-replica batch times the number of replicas."
        )
    points = _REFERENCE_POINTS
    if global_batch_size <= points[0][0]:
        _, lr, warmup = points[0]
    elif global_batch_size >= points[-1][0]:
        _, lr, warmup = points[-1]
    else:
        for (b0, lr0, w0), (b1, lr1, w1) in zip(points, points[1:]):
            if b0 <= global_batch_size <= b1:
                t = (math.log2(global_batch_size) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                lr, warmup = lr0 + t * (lr1 - lr0), w0 + t * (w1 - w0)
                break
    return {"peak_learning_rate": float(lr), "warmup_epochs": float(warmup)}


def is_whole_number(value):
    """True for a whole number: an int, or a float such as 100.0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return float(value).is_integer()
