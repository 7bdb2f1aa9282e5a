"""The large-batch recipe: its settings by batch size, and its linear-warmup + polynomial-decay
schedule."""

import dataclasses
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
        if _not_integer(warmup_steps) or warmup_steps < 0:
            raise ValueError(
                f"`warmup_steps` must be an integer >= 0; received {warmup_steps!r}: "
                "pass 0 for no warmup."
            )
        if _not_integer(total_steps) or total_steps <= warmup_steps:
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
        if _not_integer(steps_per_epoch) or steps_per_epoch <= 0:
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
    if _not_integer(global_batch_size) or global_batch_size <= 0:
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


# From this global batch on the recipe is LARS with the reference settings; below it, momentum SGD.
LARS_MIN_BATCH = 16384
# Momentum SGD, runs of LONG_RUN_STEPS optimizer steps or more (or of unknown length): peak rate
# SGD_LEARNING_RATE_AT_256 * batch / 256, the linear scaling rule of Goyal et al. (2017) for
# 90-epoch ImageNet runs. Runs of SHORT_RUN_STEPS or fewer: SHORT_RUN_RATE_AT_256 * sqrt(batch /
# 256), up to its value at SHORT_RUN_MAX_BATCH. Between the two lengths, the rate moves
# geometrically from one to the other.
SGD_LEARNING_RATE_AT_256 = 0.1
SHORT_RUN_RATE_AT_256 = 1.6
SHORT_RUN_STEPS = 1_000
SHORT_RUN_MAX_BATCH = 512
LONG_RUN_STEPS = 20_000
SGD_WARMUP_EPOCHS = 2.0
# The warmup is at least this many optimizer steps when the steps per epoch are known: an epoch
# of a small dataset at a large batch is a handful of steps, too few to warm up in.
MIN_WARMUP_STEPS = 50
# The longest warmup, as a fraction of the run, when the run's length is known.
MAX_WARMUP_FRACTION = 0.4
OPTIMIZERS = ("sgd", "lars")

# Augmentation levels: `ImageNetInput` arguments for the training crop, the flip and the eval crop.
AUGMENTATIONS = {
    # The whole image, unmirrored, in training and evaluation.
    "none": dict(crop_area_range=None, random_flip=False, center_crop_fraction=1.0),
    # Random boxes of half the image or more, unmirrored; the whole image in evaluation.
    "light": dict(crop_area_range=(0.5, 1.0), random_flip=False, center_crop_fraction=1.0),
    # The ImageNet recipe: Inception boxes of 8% of the image or more, mirrored half the time; the
    # 224 / 256 center crop in evaluation.
    "imagenet": dict(crop_area_range=(0.08, 1.0), random_flip=True, center_crop_fraction=224 / 256),
}
# From this many training examples on (ImageNet's scale), the default augmentation is ImageNet's;
# below, none for runs of up to LIGHT_AUGMENTATION_MIN_EPOCHS epochs, light for longer ones.
IMAGENET_AUGMENTATION_MIN_EXAMPLES = 100_000
LIGHT_AUGMENTATION_MIN_EPOCHS = 30


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The training settings of one run, as returned by `recipe_for_batch`.

    Change one setting with `dataclasses.replace(recipe, peak_learning_rate=5.0)`.

    Args:
        global_batch_size: Integer, examples per optimizer step over all replicas.
        optimizer: `"sgd"` (momentum SGD, `keras.optimizers.SGD`) or `"lars"`
            (`tpu_scale.optimizers.LARS`).
        peak_learning_rate: Float, the rate at the end of warmup.
        warmup_epochs: Float, the length of the linear warmup.
        decay_power: Float, the exponent of the polynomial decay after warmup.
        end_learning_rate: Float, the rate at the end of the run.
        weight_decay: Float, the L2 coefficient (LARS) or decoupled decay (SGD); batch-norm
            parameters and biases get none in either.
        momentum: Float, the momentum of either optimizer.
        nesterov: Boolean, Nesterov momentum for SGD (LARS has none).
        eta: Float, the LARS trust coefficient.
        label_smoothing: Float, for `tpu_scale.losses.SmoothedSparseCategoricalCrossentropy`.
        augmentation: String, a key of `AUGMENTATIONS`: how strongly the training images are
            cropped and mirrored.
    """

    global_batch_size: int
    optimizer: str
    peak_learning_rate: float
    warmup_epochs: float
    decay_power: float = 2.0
    end_learning_rate: float = 0.0
    weight_decay: float = 1e-4
    momentum: float = 0.9
    nesterov: bool = True
    eta: float = 0.001
    label_smoothing: float = 0.1
    augmentation: str = "imagenet"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"`optimizer` must be one of {OPTIMIZERS}; received {self.optimizer!r}."
            )
        if self.augmentation not in AUGMENTATIONS:
            raise ValueError(
                f"`augmentation` must be one of {tuple(AUGMENTATIONS)}; received "
                f"{self.augmentation!r}."
            )

    def with_settings(self, **settings):
        """A copy with the given settings changed; one given as None (a flag left unset) keeps the
        recipe's value."""
        return dataclasses.replace(self, **{k: v for k, v in settings.items() if v is not None})

    def describe(self) -> str:
        """One line for a run's log: the optimizer, its peak rate, the warmup, the augmentation."""
        return (
            f"{self.optimizer}, peak LR {self.peak_learning_rate:.3g}, warmup "
            f"{self.warmup_epochs:.2f} epochs, augmentation {self.augmentation}"
        )

    @property
    def input_arguments(self):
        """The `ImageNetInput` keyword arguments of the recipe's augmentation (training crop and
        flip, evaluation crop): pass them to both the training and the evaluation input."""
        return dict(AUGMENTATIONS[self.augmentation])

    def schedule(self, steps_per_epoch, total_epochs):
        """The learning-rate schedule of a run.

        Args:
            steps_per_epoch: Integer > 0, optimizer steps per epoch.
            total_epochs: Float, the length of the run in epochs. The warmup is cut to
                `MAX_WARMUP_FRACTION` (0.4) of it if longer.

        Returns:
            A `WarmupPolynomialDecay`.
        """
        warmup = min(self.warmup_epochs, MAX_WARMUP_FRACTION * total_epochs)
        return WarmupPolynomialDecay.from_epochs(
            self.peak_learning_rate,
            warmup,
            total_epochs,
            steps_per_epoch,
            end_learning_rate=self.end_learning_rate,
            power=self.decay_power,
        )

    def build_optimizer(self, steps_per_epoch, total_epochs, learning_rate=None, **kwargs):
        """The optimizer of the recipe, on its schedule.

        Args:
            steps_per_epoch: Integer > 0, optimizer steps per epoch.
            total_epochs: Float, the length of the run in epochs.
            learning_rate: Optional learning rate or schedule to use instead of
                `self.schedule(steps_per_epoch, total_epochs)`.
            **kwargs: other arguments of the optimizer's constructor, e.g.
                `gradient_accumulation_steps` or `clipnorm`.

        Returns:
            A `tpu_scale.optimizers.LARS` or a `keras.optimizers.SGD` whose weight decay
            skips batch-norm parameters and biases. Create it under the strategy's scope.
        """
        import keras

        from tpu_scale import optimizers

        if learning_rate is None:
            learning_rate = self.schedule(steps_per_epoch, total_epochs)
        if self.optimizer == "lars":
            return optimizers.LARS(
                learning_rate,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                eta=self.eta,
                **kwargs,
            )
        optimizer = keras.optimizers.SGD(
            learning_rate,
            momentum=self.momentum,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay or None,
            **kwargs,
        )
        if self.weight_decay:
            optimizer.exclude_from_weight_decay(var_names=list(optimizers.DEFAULT_EXCLUDE_PATTERNS))
        return optimizer


def recipe_for_batch(
    global_batch_size,
    total_epochs=None,
    *,
    steps_per_epoch=None,
    train_examples=None,
    num_classes=None,
    image_size=None,
    optimizer=None,
    augmentation="auto",
):
    """The default training settings of a run, from what the run knows: its global batch size,
    its length and its data.

    The rule:

    | setting | rule |
    |---|---|
    | optimizer | momentum SGD (Nesterov, 0.9) below batch 16384; LARS (`eta=0.001`) from 16384 |
    | SGD peak rate | `sgd_learning_rate(batch, total_steps)`: `0.1 * batch / 256` for runs of |
    | | 20,000 steps or more, or of unknown length; `1.6 * sqrt(batch / 256)` up to 1,000 steps |
    | | (at most 2.26, its value at batch 512) |
    | LARS peak rate, warmup | `reference_lars_hparams(batch)`: 25, 34, 35 and 5, 12, 34 epochs at |
    | | 16K, 32K, 64K, the paper's settings unchanged |
    | warmup | SGD 2 epochs; at least 50 optimizer steps; at most 40% of the run |
    | decay | quadratic to 0 (`WarmupPolynomialDecay`, power 2) |
    | weight decay | 1e-4 (none on batch-norm parameters and biases) |
    | label smoothing | 0.1 |
    | augmentation | `default_augmentation(train_examples, total_epochs)`: ImageNet's crop and |
    | | flip from 100,000 examples (or unknown data); none below, light crops past 30 epochs |

    Weight decay and label smoothing stay fixed: the classes and image size of the datasets the
    rule was checked on (4 and 10 classes, 28 to 64 pixels) asked for no other value. The
    short-run rate, the warmup floor and the augmentation levels were chosen on two real datasets
    (scikit-learn's digits and animal silhouettes) and checked on two others the choice never saw
    (MNIST digits, solar-cell scans), against a sweep around the default and against Adam with
    its defaults (`benchmarks/recipe_datasets.py`; figures in `benchmarks/README.md`). LARS below
    16K lost to momentum SGD there at every rate tried, which is why the paper's LARS settings are
    kept for the batch sizes they were found at and nowhere else.

    Args:
        global_batch_size: Integer > 0, examples per optimizer step over all replicas (with
            gradient accumulation, the effective batch: per-step batch times the steps).
        total_epochs: Optional float, the length of the run. If given, the warmup is cut to
            `MAX_WARMUP_FRACTION` (0.4) of it if longer.
        steps_per_epoch: Optional integer, optimizer steps per epoch (defaults to
            `train_examples // global_batch_size` when that is known). If known, the warmup
            lasts at least `MIN_WARMUP_STEPS` (50) steps.
        train_examples: Optional integer, training examples per epoch; it chooses the
            augmentation (ImageNet's from `IMAGENET_AUGMENTATION_MIN_EXAMPLES` on).
        num_classes: Optional integer, the number of classes; checked, no setting depends on
            it (see above).
        image_size: Optional integer, the training image size; checked, no setting depends on
            it (see above).
        optimizer: Optional `"sgd"` or `"lars"`: that optimizer with its own rule at any
            batch size (LARS below 16384: the reference rate scaled by the square root of the
            batch ratio). None picks by batch size.
        augmentation: `"auto"` or a key of `AUGMENTATIONS` (`"none"`, `"light"`,
            `"imagenet"`).

    Returns:
        A frozen `Recipe`: its `build_optimizer(steps_per_epoch, total_epochs)` makes the
        optimizer on its schedule and `input_arguments` are the inputs' augmentation.

    Reference:
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677)
        - [You et al., 2017](https://arxiv.org/abs/1708.03888)
        - [Krizhevsky, 2014](https://arxiv.org/abs/1404.5997)
        - [Hoffer et al., 2017](https://arxiv.org/abs/1705.08741)
    """
    if _not_integer(global_batch_size) or global_batch_size <= 0:
        raise ValueError(
            f"`global_batch_size` must be an integer > 0; received {global_batch_size!r}: "
            "pass the per-replica batch times the number of replicas."
        )
    if total_epochs is not None and not total_epochs > 0:
        raise ValueError(f"`total_epochs` must be > 0 or None; received {total_epochs!r}.")
    if optimizer not in (None,) + OPTIMIZERS:
        raise ValueError(
            f"`optimizer` must be None or one of {OPTIMIZERS}; received {optimizer!r}."
        )
    if augmentation != "auto" and augmentation not in AUGMENTATIONS:
        raise ValueError(
            f"`augmentation` must be 'auto' or one of {tuple(AUGMENTATIONS)}; received "
            f"{augmentation!r}."
        )
    for name, value in (
        ("steps_per_epoch", steps_per_epoch),
        ("train_examples", train_examples),
        ("num_classes", num_classes),
        ("image_size", image_size),
    ):
        if value is not None and (_not_integer(value) or value <= 0):
            raise ValueError(f"`{name}` must be an integer > 0 or None; received {value!r}.")
    if steps_per_epoch is None and train_examples is not None:
        steps_per_epoch = max(1, train_examples // global_batch_size)
    if optimizer is None:
        optimizer = "sgd" if global_batch_size < LARS_MIN_BATCH else "lars"
    if optimizer == "sgd":
        known = total_epochs is not None and steps_per_epoch is not None
        peak = sgd_learning_rate(
            global_batch_size, total_epochs * steps_per_epoch if known else None
        )
        warmup = SGD_WARMUP_EPOCHS
    else:
        reference = reference_lars_hparams(global_batch_size)
        peak, warmup = reference["peak_learning_rate"], reference["warmup_epochs"]
        first_batch = _REFERENCE_POINTS[0][0]
        if global_batch_size < first_batch:
            peak *= math.sqrt(global_batch_size / first_batch)
    if steps_per_epoch is not None:
        warmup = max(warmup, MIN_WARMUP_STEPS / steps_per_epoch)
    if total_epochs is not None:
        warmup = min(warmup, MAX_WARMUP_FRACTION * total_epochs)
    if augmentation == "auto":
        augmentation = default_augmentation(train_examples, total_epochs)
    return Recipe(
        int(global_batch_size), optimizer, float(peak), float(warmup), augmentation=augmentation
    )


def sgd_learning_rate(global_batch_size, total_steps=None):
    """The momentum-SGD peak learning rate of a run of `total_steps` optimizer steps.

    - Long runs (`LONG_RUN_STEPS`, 20,000 steps, or more) and runs of unknown length: the linear
      scaling rule, `0.1 * batch / 256` (Goyal et al., 2017: ResNet-50, 90 ImageNet epochs).
    - Short runs (`SHORT_RUN_STEPS`, 1,000 steps, or fewer): `1.6 * sqrt(batch / 256)`, 0.8 at
      batch 64 and 2.26 at 512, and 2.26 from there on (`SHORT_RUN_MAX_BATCH`). A run of a few
      hundred steps must travel in them as far as a long run does in tens of thousands, at a
      higher rate; its best rate grows about as the square root of the batch (Krizhevsky, 2014;
      Hoffer et al., 2017) up to a point: past batch 512 a short run's steps are too few for
      momentum SGD to settle at a larger rate, and the loss stalls or blows up at the peak.
    - In between, geometric in the number of steps from the short run's rate to the long run's.

    Args:
        global_batch_size: Integer > 0, examples per optimizer step.
        total_steps: Optional number of optimizer steps of the whole run.

    Returns:
        The peak learning rate, a float.
    """
    long_run = SGD_LEARNING_RATE_AT_256 * global_batch_size / 256
    if total_steps is None:
        return long_run
    batch = min(global_batch_size, SHORT_RUN_MAX_BATCH)
    short_run = SHORT_RUN_RATE_AT_256 * math.sqrt(batch / 256)
    position = math.log(max(total_steps, SHORT_RUN_STEPS) / SHORT_RUN_STEPS) / math.log(
        LONG_RUN_STEPS / SHORT_RUN_STEPS
    )
    position = min(position, 1.0)
    return short_run ** (1.0 - position) * long_run**position


def default_augmentation(train_examples=None, total_epochs=None):
    """The augmentation level (a key of `AUGMENTATIONS`) for a dataset and a run length.

    - ImageNet's (Inception crop of 8-100% of the area, flip) from
      `IMAGENET_AUGMENTATION_MIN_EXAMPLES` (100,000) training examples on, or when the dataset's
      size is unknown: the reference recipe's data.
    - Smaller datasets: none (the whole image, no flip) for runs of up to
      `LIGHT_AUGMENTATION_MIN_EPOCHS` (30) epochs; light (crops of 50-100%, no flip) for longer
      runs, which see each image often enough to learn it by heart.

    A flip is only part of ImageNet's level: a mirrored digit or letter is another symbol.

    Args:
        train_examples: Optional integer, training examples per epoch.
        total_epochs: Optional float, the length of the run.

    Returns:
        `"none"`, `"light"` or `"imagenet"`.
    """
    if train_examples is None or train_examples >= IMAGENET_AUGMENTATION_MIN_EXAMPLES:
        return "imagenet"
    if total_epochs is not None and total_epochs > LIGHT_AUGMENTATION_MIN_EPOCHS:
        return "light"
    return "none"


def _not_integer(value):
    """True unless `value` is a whole number (an int, or a float such as 100.0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return True
    return not float(value).is_integer()
