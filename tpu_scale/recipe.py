"""The training recipe of a run: its optimizer, learning rate, warmup, regularization and
augmentation, chosen from what the run knows (batch size, length, data).

`recipe_for_batch` returns a `Recipe`; `Recipe.build_optimizer` puts the optimizer on its schedule
(`tpu_scale.schedules`) and `Recipe.input_config` is the inputs' augmentation. The one rule of the
one command that is not the training's is the model's: `small_resnet` pools its stem from
`tpu_scale.models.resnet.POOLED_STEM_MIN_SIZE` pixels up.
"""

import dataclasses
import math

from tpu_scale.data.image_ops import ASPECT_RATIOS
from tpu_scale.data.input_config import InputConfig
from tpu_scale.schedules import WarmupPolynomialDecay, is_whole_number, reference_lars_hparams

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
# Momentum SGD warms up for SGD_WARMUP_EPOCHS from batch SGD_WARMUP_FULL_BATCH on, and for
# proportionally fewer epochs below it (0.5 at batch 64): the warmup is there for the large
# batch's rate (Goyal et al., 2017), and a small batch would otherwise spend its first epochs, its
# fast start, below the rate it learns at.
SGD_WARMUP_EPOCHS = 2.0
SGD_WARMUP_FULL_BATCH = 256
# The warmup is at least this many optimizer steps when the steps per epoch are known: an epoch
# of a small dataset at a large batch is a handful of steps, too few to warm up in. Momentum SGD's
# floor shrinks with its warmup below SGD_WARMUP_FULL_BATCH (12.5 steps at batch 64).
MIN_WARMUP_STEPS = 50
# From batch SHORT_RUN_MAX_BATCH on, where a short run's rate is at its largest (2.26), momentum
# SGD warms up for at least LARGE_BATCH_MIN_WARMUP_STEPS: 2 epochs of a 20,000-image folder at
# batch 512 are 80-90 steps, too steep a climb to that rate (0.9 points of top-1 lost against 200
# steps on the tuning set photoletters, benchmarks/README.md); at batch 256 and below the rule's
# epochs are twice those steps or more.
LARGE_BATCH_MIN_WARMUP_STEPS = 200
# The longest warmup, as a fraction of the run, when the run's length is known.
MAX_WARMUP_FRACTION = 0.4
OPTIMIZERS = ("sgd", "lars")

# Augmentation levels: the `InputConfig` fields of the training crop, shift and flip, and of the
# evaluation view. Every level below ImageNet's shows the whole image, whatever its shape: resized
# to the square (`WHOLE_IMAGE_ASPECT_RATIO`), as Keras's `image_dataset_from_directory` does, in
# training and evaluation alike.
WHOLE_IMAGE_ASPECT_RATIO = "stretch"
_WHOLE = dict(
    crop_area_range=None,
    random_flip=False,
    translate_fraction=0.0,
    center_crop_fraction=1.0,
    aspect_ratio=WHOLE_IMAGE_ASPECT_RATIO,
)
AUGMENTATIONS = {
    # The whole image, unmirrored, in training and evaluation.
    "none": _WHOLE,
    # The whole image shifted by up to an eighth of its side (CIFAR's 4 pixels at 32: zero
    # padding, then a random square), unmirrored: every label stays true, as no stroke is
    # resized, mirrored or cut by more than an eighth.
    "translate": dict(_WHOLE, translate_fraction=0.125),
    # Random boxes of three quarters of the image or more, of its own shape within 3/4 to 4/3,
    # unmirrored: small shifts and scales; the whole image in evaluation.
    "shift": dict(_WHOLE, crop_area_range=(0.75, 1.0)),
    # Random boxes of half the image or more, unmirrored; the whole image in evaluation.
    "light": dict(_WHOLE, crop_area_range=(0.5, 1.0)),
    # The ImageNet recipe: Inception boxes of 8% of the image or more (aspect ratios 3/4 to 4/3),
    # mirrored half the time; the centred square of 224 / 256 of the short side in evaluation.
    "imagenet": dict(
        crop_area_range=(0.08, 1.0),
        random_flip=True,
        translate_fraction=0.0,
        center_crop_fraction=224 / 256,
        aspect_ratio="crop",
    ),
}
# How `Recipe.describe` names each `InputConfig.aspect_ratio` in a run's log.
_ASPECT_WORDS = {
    "stretch": "whole images resized to squares",
    "pad": "whole images padded to squares",
    "crop": "centred squares",
}
# Small data: fewer than SMALL_DATA_EXAMPLES training examples (ImageNet has 1.28 million). Its
# default augmentation is none for runs of up to LIGHT_AUGMENTATION_MIN_EPOCHS epochs and light
# for longer ones, not ImageNet's; in its place momentum SGD regularizes by a stronger weight
# decay and a slower finish (below). The line is drawn by the whole count, not by a count a class:
# a folder of 2,000 images a class and 20,000 in all is still learned by heart in a short run,
# and ImageNet, 1,281 a class, keeps the reference recipe.
SMALL_DATA_EXAMPLES = 100_000
LIGHT_AUGMENTATION_MIN_EPOCHS = 30
# Small data of which at least this share is not square train at the "shift" level, not "none"
# (chosen on the non-square tuning set, benchmarks/README.md).
NON_SQUARE_SHIFT_FRACTION = 0.5
# Momentum SGD's weight decay: SMALL_DATA_WEIGHT_DECAY on small data, WEIGHT_DECAY (the reference
# recipe's) from SMALL_DATA_EXAMPLES on and when the data are unknown.
WEIGHT_DECAY = 1e-4
SMALL_DATA_WEIGHT_DECAY = 5e-4
# Momentum SGD's decay after warmup: linear (power SMALL_DATA_DECAY_POWER) on small data,
# quadratic (DECAY_POWER, the reference recipe's) from SMALL_DATA_EXAMPLES on and when the data
# are unknown. The linear decay keeps the rate higher through the run's second half, a slower
# finish: the weights keep moving, with the stronger weight decay pulling them in, after a small
# dataset is learned by heart.
DECAY_POWER = 2.0
SMALL_DATA_DECAY_POWER = 1.0
# Momentum SGD's weights are evaluated and saved as their moving average (Keras's `use_ema`) with
# this momentum: the package's batch norm's moving-statistics momentum, so that the averaged
# weights and the statistics they are evaluated with cover the same last ~10 steps.
EMA_MOMENTUM = 0.9


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
            cropped, shifted and mirrored.
        aspect_ratio: String or None, how an image that is not square becomes the square input
            (`InputConfig.aspect_ratio`: "stretch", "pad" or "crop"); None takes the level's.
        ema_momentum: Float, the momentum of the weights' moving average that is evaluated and
            saved (Keras's `use_ema=True, ema_momentum=...`); 0 evaluates the weights themselves.
            Evaluating in `fit` needs `keras.callbacks.SwapEMAWeights()` (`Recipe.callbacks`).
    """

    global_batch_size: int
    optimizer: str
    peak_learning_rate: float
    warmup_epochs: float
    decay_power: float = DECAY_POWER
    end_learning_rate: float = 0.0
    weight_decay: float = WEIGHT_DECAY
    momentum: float = 0.9
    nesterov: bool = True
    eta: float = 0.001
    label_smoothing: float = 0.1
    augmentation: str = "imagenet"
    aspect_ratio: str | None = None
    ema_momentum: float = 0.0

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
        if self.aspect_ratio is not None and self.aspect_ratio not in ASPECT_RATIOS:
            raise ValueError(f"`aspect_ratio` must be None (the augmentation level's) or one of {ASPECT_RATIOS}; received {self.aspect_ratio!r}.")
        if not 0.0 <= self.ema_momentum < 1.0:
            raise ValueError(
                f"`ema_momentum` must be in [0, 1): 0 (no moving average) or a momentum such as "
                f"0.9; received {self.ema_momentum!r}."
            )

    def with_settings(self, **settings):
        """A copy with the given settings changed; one given as None (a flag left unset) keeps the
        recipe's value."""
        return dataclasses.replace(self, **{k: v for k, v in settings.items() if v is not None})

    def describe(self) -> str:
        """One line for a run's log: the optimizer, its peak rate, the warmup, the augmentation."""
        return (
            f"{self.optimizer}, peak LR {self.peak_learning_rate:.3g}, warmup "
            f"{self.warmup_epochs:.2f} epochs, augmentation {self.augmentation} "
            f"({_ASPECT_WORDS[self.input_config().aspect_ratio]}), weights "
            + (f"averaged (EMA {self.ema_momentum:g})" if self.ema_momentum else "as trained")
        )

    def input_config(self, config: InputConfig | None = None) -> InputConfig:
        """The inputs' configuration with the recipe's augmentation (training crop, shift and
        flip, evaluation view): `config` (default `InputConfig()`) with those five fields replaced. Give
        it to both the training and the evaluation input (`Inputs.with_config`)."""
        fields = dict(AUGMENTATIONS[self.augmentation])
        if self.aspect_ratio is not None:
            fields["aspect_ratio"] = self.aspect_ratio
        return (config or InputConfig()).replace(**fields)

    def callbacks(self):
        """The `fit` callbacks the recipe's optimizer needs: with a moving average, Keras's
        `SwapEMAWeights`, so that `fit`'s validation sees the averaged weights (`fit` itself puts
        them in the model when it ends)."""
        import keras

        return [keras.callbacks.SwapEMAWeights()] if self.ema_momentum else []

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

    def build_optimizer(
        self, steps_per_epoch, total_epochs, learning_rate=None, weight_update_sharding=False, **kwargs
    ):
        """The optimizer of the recipe, on its schedule.

        Args:
            steps_per_epoch: Integer > 0, optimizer steps per epoch.
            total_epochs: Float, the length of the run in epochs.
            learning_rate: Optional learning rate or schedule to use instead of
                `self.schedule(steps_per_epoch, total_epochs)`.
            **kwargs: other arguments of the optimizer's constructor, e.g.
                `gradient_accumulation_steps` or `clipnorm` (accumulation needs a recipe
                without a moving average, `ema_momentum=0.0`: Keras cannot run both under a
                strategy).
            weight_update_sharding: True to shard the update over the strategy's replicas.

        Returns:
            A `tpu_scale.optimizers.LARS` or a `keras.optimizers.SGD` whose weight decay
            skips batch-norm parameters and biases; wrapped in `tpu_scale.DistributedOptimizer`
            when the run shards the update or accumulates gradients (what a strategy needs of
            the optimizer then). Create it under the strategy's scope.
        """
        import keras

        from tpu_scale import optimizers

        if learning_rate is None:
            learning_rate = self.schedule(steps_per_epoch, total_epochs)
        if self.ema_momentum:
            if kwargs.get("gradient_accumulation_steps"):
                raise ValueError(
                    f"The recipe evaluates a moving average of the weights (ema_momentum={self.ema_momentum:g}), which Keras cannot keep with gradient_accumulation_steps under a strategy: build the optimizer of recipe.with_settings(ema_momentum=0.0)."
                )
            kwargs = dict(use_ema=True, ema_momentum=self.ema_momentum, **kwargs)
        if self.optimizer == "lars":
            optimizer = optimizers.LARS(
                learning_rate,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                eta=self.eta,
                **kwargs,
            )
        else:
            optimizer = keras.optimizers.SGD(
                learning_rate,
                momentum=self.momentum,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay or None,
                **kwargs,
            )
            if self.weight_decay:
                optimizer.exclude_from_weight_decay(
                    var_names=list(optimizers.DEFAULT_EXCLUDE_PATTERNS)
                )
        if weight_update_sharding or kwargs.get("gradient_accumulation_steps"):
            from tpu_scale.keras_hook import DistributedOptimizer

            return DistributedOptimizer(optimizer, weight_update_sharding=weight_update_sharding)
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
    non_square_fraction=None,
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
    | warmup | SGD 2 epochs from batch 256, scaled with the batch below (0.5 at 64); at least |
    | | 50 optimizer steps, scaled alike for SGD (12.5 at 64), and for SGD 200 from batch 512; |
    | | at most 40% of the run |
    | decay | to 0 (`WarmupPolynomialDecay`); SGD: `default_decay_power(train_examples)`, |
    | | linear below 100,000 training examples, else quadratic; LARS quadratic |
    | weight decay | SGD: `default_weight_decay(train_examples)`, 5e-4 below 100,000 training |
    | | examples, else 1e-4; LARS 1e-4 (none on batch-norm parameters and biases) |
    | label smoothing | 0.1 |
    | weights evaluated and saved | SGD: their moving average, momentum 0.9 (Keras's `use_ema`; |
    | | `Recipe.callbacks` for `fit`'s validation); LARS: the weights as trained |
    | augmentation | `default_augmentation(train_examples, total_epochs, non_square_fraction)`: |
    | | ImageNet's crop and flip from 100,000 examples (or unknown data); below, light crops past |
    | | 30 epochs, else none, or shift where most images are not square |

    Small data (below 100,000 training examples, where ImageNet's augmentation is off) get SGD's
    stronger weight decay and a linear decay of the rate (a slower finish) and keep the rest: a
    short run on a few hundred or a few thousand images a class learns them by heart halfway
    through, and of the candidates measured on the tuning sets (stronger decay, label-safe crops
    and translation, more label smoothing, AdamW) these two lost beyond the seeds' spread on no
    set while keeping the fast start that augmentation slows
    (`--weight_decay`, `--augmentation` and the other flags of `examples/train_imagenet.py`
    override each part). No setting depends on the image size. SGD's weights are evaluated as their
    moving average over the last ~10 steps, the window of the batch norm's moving statistics
    (momentum 0.9): at the short-run rate the weights themselves jump from step to step, and the
    rate decays to 0, so the two meet at the end; a longer window lags the statistics. Below batch
    256 the warmup is shorter, and so is its floor of steps: a small dataset's first epoch is then
    already past chance. From batch 512 its floor is longer: a folder of 20,000 images is 40
    steps an epoch there, and a climb to the largest rate in 2 epochs costs a point. The rules
    were chosen on real datasets (scikit-learn's digits, animal silhouettes and letters on photos)
    and checked on others the choice never saw, against a sweep around the default, Adam with its
    defaults and a practised Keras script (`benchmarks/recipe_datasets.py`,
    `benchmarks/time_to_accuracy.py`; figures in `benchmarks/README.md`). LARS below 16K lost to
    momentum SGD there at every rate tried, which is why the paper's LARS settings are kept for
    the batch sizes they were found at and nowhere else.

    Args:
        global_batch_size: Integer > 0, examples per optimizer step over all replicas (with
            gradient accumulation, the effective batch: per-step batch times the steps).
        total_epochs: Optional float, the length of the run. If given, the warmup is cut to
            `MAX_WARMUP_FRACTION` (0.4) of it if longer.
        steps_per_epoch: Optional integer, optimizer steps per epoch (defaults to
            `train_examples // global_batch_size` when that is known). If known, the warmup
            lasts at least `MIN_WARMUP_STEPS` (50) steps, for SGD below batch 256 proportionally
            fewer and from batch 512 `LARGE_BATCH_MIN_WARMUP_STEPS` (200).
        train_examples: Optional integer, training examples per epoch; it chooses the
            augmentation, SGD's weight decay and its decay power (small data below
            `SMALL_DATA_EXAMPLES`, see above).
        num_classes: Optional integer, the number of classes; checked, no setting depends on
            it.
        image_size: Optional integer, the training image size; checked, no setting depends on
            it (see above).
        optimizer: Optional `"sgd"` or `"lars"`: that optimizer with its own rule at any
            batch size (LARS below 16384: the reference rate scaled by the square root of the
            batch ratio). None picks by batch size.
        augmentation: `"auto"` or a key of `AUGMENTATIONS` (`"none"`, `"translate"`,
            `"shift"`, `"light"`, `"imagenet"`).
        non_square_fraction: Optional float, the share of the images that are not square
            (`data.LabelMap.non_square_fraction`, counted by the writer); it chooses the
            augmentation of small data.

    Returns:
        A frozen `Recipe`: its `build_optimizer(steps_per_epoch, total_epochs)` makes the
        optimizer on its schedule and `input_config` is the inputs' augmentation.

    Reference:
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677)
        - [You et al., 2017](https://arxiv.org/abs/1708.03888)
        - [Krizhevsky, 2014](https://arxiv.org/abs/1404.5997)
        - [Hoffer et al., 2017](https://arxiv.org/abs/1705.08741)
    """
    if not is_whole_number(global_batch_size) or global_batch_size <= 0:
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
        if value is not None and (not is_whole_number(value) or value <= 0):
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
        # Below the full batch, the warmup and its floor shrink with the batch (see above).
        small_batch = min(1.0, global_batch_size / SGD_WARMUP_FULL_BATCH)
        warmup = SGD_WARMUP_EPOCHS * small_batch
        min_warmup_steps = MIN_WARMUP_STEPS * small_batch
        if global_batch_size >= SHORT_RUN_MAX_BATCH:
            min_warmup_steps = LARGE_BATCH_MIN_WARMUP_STEPS
    else:
        reference = reference_lars_hparams(global_batch_size)
        peak, warmup = reference["peak_learning_rate"], reference["warmup_epochs"]
        first_batch = LARS_MIN_BATCH
        if global_batch_size < first_batch:
            peak *= math.sqrt(global_batch_size / first_batch)
        min_warmup_steps = MIN_WARMUP_STEPS
    if steps_per_epoch is not None:
        warmup = max(warmup, min_warmup_steps / steps_per_epoch)
    if total_epochs is not None:
        warmup = min(warmup, MAX_WARMUP_FRACTION * total_epochs)
    if augmentation == "auto":
        augmentation = default_augmentation(train_examples, total_epochs, non_square_fraction)
    weight_decay, decay_power = WEIGHT_DECAY, DECAY_POWER
    if optimizer == "sgd":
        weight_decay = default_weight_decay(train_examples)
        decay_power = default_decay_power(train_examples)
    return Recipe(
        int(global_batch_size),
        optimizer,
        float(peak),
        float(warmup),
        decay_power=decay_power,
        weight_decay=weight_decay,
        augmentation=augmentation,
        ema_momentum=EMA_MOMENTUM if optimizer == "sgd" else 0.0,
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


def default_weight_decay(train_examples=None):
    """Momentum SGD's weight decay for a dataset: stronger on small data.

    - `SMALL_DATA_WEIGHT_DECAY` (5e-4) below `SMALL_DATA_EXAMPLES` (100,000) training examples:
      a few hundred or a few thousand images a class are learned by heart (training top-1 1.0)
      halfway through a short run, and the stronger decay keeps the weights small enough to
      generalize (CIFAR-10's ResNets train with 5e-4 too).
    - `WEIGHT_DECAY` (1e-4, the reference recipe's) from there on, and when the number of
      examples is unknown.

    Args:
        train_examples: Optional integer, training examples per epoch.

    Returns:
        A float.
    """
    return SMALL_DATA_WEIGHT_DECAY if is_small_data(train_examples) else WEIGHT_DECAY


def default_decay_power(train_examples=None):
    """Momentum SGD's decay of the rate after warmup (the power of `WarmupPolynomialDecay`):
    slower to finish on small data.

    - `SMALL_DATA_DECAY_POWER` (1, linear) below `SMALL_DATA_EXAMPLES` (100,000) training
      examples: halfway through the decay the rate is still half its peak (a quarter with the
      quadratic decay), so the weights keep moving, under the small data's stronger weight
      decay, once the training images are learned by heart.
    - `DECAY_POWER` (2, the reference recipe's quadratic decay) from there on, and when the
      number of examples is unknown.

    Args:
        train_examples: Optional integer, training examples per epoch.

    Returns:
        A float.
    """
    return SMALL_DATA_DECAY_POWER if is_small_data(train_examples) else DECAY_POWER


def is_small_data(train_examples=None):
    """True below `SMALL_DATA_EXAMPLES` training examples: the data that get momentum SGD's
    small-data settings and no ImageNet augmentation. False when the count is unknown."""
    return train_examples is not None and train_examples < SMALL_DATA_EXAMPLES


def default_augmentation(train_examples=None, total_epochs=None, non_square_fraction=None):
    """The augmentation level (a key of `AUGMENTATIONS`) for a dataset and a run length.

    - ImageNet's (Inception crop of 8-100% of the area, flip) from `SMALL_DATA_EXAMPLES`
      (100,000) training examples on, or when the dataset's size is unknown: the reference
      recipe's data.
    - Smaller datasets: none (the whole image, no flip) for runs of up to
      `LIGHT_AUGMENTATION_MIN_EPOCHS` (30) epochs; light (crops of 50-100%, no flip) for longer
      runs, which see each image often enough to learn it by heart. Where at least
      `NON_SQUARE_SHIFT_FRACTION` (half) of the images are not square, shift (boxes of 75-100%
      of the image, of its own shape) in place of none: objects that sit anywhere in frames of
      many shapes, each stretched to the square, are learned from boxes around them.

    A flip is only part of ImageNet's level: a mirrored digit or letter is another symbol.

    Args:
        train_examples: Optional integer, training examples per epoch.
        total_epochs: Optional float, the length of the run.
        non_square_fraction: Optional float, the share of the images that are not square.

    Returns:
        `"none"`, `"shift"`, `"light"` or `"imagenet"`.
    """
    if not is_small_data(train_examples):
        return "imagenet"
    if total_epochs is not None and total_epochs > LIGHT_AUGMENTATION_MIN_EPOCHS:
        return "light"
    if non_square_fraction is not None and non_square_fraction >= NON_SQUARE_SHIFT_FRACTION:
        return "shift"
    return "none"


