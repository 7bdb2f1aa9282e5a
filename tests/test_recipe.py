"""Tests for `tpu_scale.recipe`: a run's settings from what it knows, and its optimizer."""

import dataclasses

import keras
import numpy as np
import pytest

import tpu_scale
from tpu_scale import recipe as recipe_lib
from tpu_scale.optimizers import LARS
from tpu_scale.recipe import Recipe, recipe_for_batch
from tpu_scale.schedules import reference_lars_hparams


def _lr(schedule, step):
    return float(schedule(np.int64(step)))


BATCHES = [32, 48, 64, 128, 256, 384, 511, 512, 1024, 4096, 8192, 16384, 24576, 32768, 49152, 65536]


@pytest.mark.parametrize(
    "batch, lr, warmup", [(16384, 25.0, 5.0), (32768, 34.0, 12.0), (65536, 35.0, 34.0)]
)
def test_recipe_keeps_the_papers_settings_at_16k_to_64k(batch, lr, warmup):
    recipe = recipe_for_batch(batch)
    assert (recipe.optimizer, recipe.peak_learning_rate, recipe.warmup_epochs) == (
        "lars",
        lr,
        warmup,
    )
    assert (recipe.momentum, recipe.eta, recipe.weight_decay) == (0.9, 0.001, 1e-4)
    # A 90-epoch run keeps them; only a run too short for the warmup cuts it.
    assert recipe_for_batch(batch, total_epochs=90).warmup_epochs == warmup
    assert reference_lars_hparams(batch) == {"peak_learning_rate": lr, "warmup_epochs": warmup}


@pytest.mark.parametrize("batch", [32, 64, 128, 256, 500, 512, 1024, 8192, 16383])
def test_recipe_below_16k_is_momentum_sgd_on_the_linear_rule(batch):
    # The length of the run unknown: Goyal et al.'s 0.1 per 256 examples.
    recipe = recipe_for_batch(batch)
    assert recipe.optimizer == "sgd" and recipe.nesterov
    assert recipe.peak_learning_rate == pytest.approx(0.1 * batch / 256)
    # Two epochs of warmup from batch 256, proportionally fewer below.
    assert recipe.warmup_epochs == pytest.approx(2.0 * min(1.0, batch / 256))


def test_short_runs_get_a_higher_rate():
    # A few hundred steps: 1.6 * sqrt(batch / 256): 0.8 at batch 64, 2.26 at 512 and above.
    assert recipe_for_batch(64, 15, steps_per_epoch=25).peak_learning_rate == pytest.approx(0.8)
    assert recipe_for_batch(512, 30, train_examples=3600).peak_learning_rate == pytest.approx(
        1.6 * np.sqrt(2)
    )
    for batch in (1024, 4096):
        short = recipe_for_batch(batch, 30, steps_per_epoch=5)
        assert short.peak_learning_rate == pytest.approx(1.6 * np.sqrt(2))
    # ImageNet-length runs: the linear rule itself.
    imagenet = recipe_for_batch(256, 90, train_examples=1281167)
    assert imagenet.peak_learning_rate == pytest.approx(0.1)
    # In between, the rate falls with the number of steps, from the short run's to the long's.
    rates = [recipe_lib.sgd_learning_rate(64, t) for t in (10, 1000, 2000, 5000, 20000, 10**6)]
    assert rates[0] == rates[1] == pytest.approx(0.8)
    assert rates[1] > rates[2] > rates[3] > rates[4] == rates[5] == pytest.approx(0.025)
    assert recipe_lib.sgd_learning_rate(64) == pytest.approx(0.025)
    # Monotonic in the batch at every length.
    for steps in (None, 100, 3000, 50000):
        by_batch = [recipe_lib.sgd_learning_rate(b, steps) for b in (32, 64, 256, 1024, 8192)]
        assert by_batch == sorted(by_batch)


def test_recipe_table_values():
    table = {b: recipe_for_batch(b) for b in (32, 64, 256, 1024, 4096, 16384)}
    assert table[32].peak_learning_rate == pytest.approx(0.0125)
    assert table[256].peak_learning_rate == pytest.approx(0.1)
    assert table[4096].peak_learning_rate == pytest.approx(1.6)
    assert (table[16384].optimizer, table[16384].peak_learning_rate) == ("lars", 25.0)


def test_recipe_forced_optimizer_keeps_its_own_rule():
    lars = recipe_for_batch(512, optimizer="lars")
    # The reference rate scaled by the square root of the batch ratio below 16K: not 25, whose
    # plain-momentum steps on batch-norm parameters blow up at small batches.
    assert lars.optimizer == "lars"
    assert lars.peak_learning_rate == pytest.approx(25.0 * np.sqrt(512 / 16384))
    assert lars.warmup_epochs == 5.0
    sgd = recipe_for_batch(32768, optimizer="sgd")
    assert sgd.optimizer == "sgd" and sgd.peak_learning_rate == pytest.approx(0.1 * 128)
    assert recipe_for_batch(32768, optimizer="lars") == recipe_for_batch(32768)
    with pytest.raises(ValueError, match="optimizer"):
        recipe_for_batch(64, optimizer="adam")


def test_recipe_warmup_lasts_enough_steps():
    # 1617 examples at batch 256: 6 steps an epoch; 2 epochs would be 12 steps of warmup.
    short = recipe_for_batch(256, 60, train_examples=1617)
    assert short.warmup_epochs == pytest.approx(50 / 6)
    # ... but never more than 40% of the run.
    assert recipe_for_batch(256, 20, steps_per_epoch=3).warmup_epochs == pytest.approx(8.0)
    # From batch 512, at the short run's largest rate, momentum SGD's floor is 200 steps: 4.5
    # epochs of a 22,788-image folder (44 steps an epoch), where the rule's 2 are 88 steps.
    folder = recipe_for_batch(512, 15, train_examples=22_788, num_classes=10)
    assert folder.warmup_epochs == pytest.approx(200 / 44)
    assert recipe_for_batch(1024, 15, steps_per_epoch=22).warmup_epochs == pytest.approx(6.0)
    assert recipe_for_batch(511, 15, steps_per_epoch=44).warmup_epochs == 2.0
    # Enough steps an epoch (a 90-epoch ImageNet run at 8192: 156 an epoch): the rule's epochs.
    assert recipe_for_batch(8192, 90, train_examples=1281167).warmup_epochs == 2.0
    # Enough steps an epoch: the rule's epochs.
    assert recipe_for_batch(256, 15, steps_per_epoch=63).warmup_epochs == 2.0
    assert recipe_for_batch(64, 15, steps_per_epoch=300).warmup_epochs == 0.5
    # Below batch 256 momentum SGD's floor shrinks with its warmup: 12.5 steps at batch 64, 25 at
    # 128, so 0.5 epochs of 70 steps (35) is long enough, and 0.5 epochs of 10 steps is not.
    assert recipe_for_batch(64, 15, steps_per_epoch=70).warmup_epochs == 0.5
    assert recipe_for_batch(64, 15, steps_per_epoch=10).warmup_epochs == pytest.approx(1.25)
    assert recipe_for_batch(128, 15, steps_per_epoch=10).warmup_epochs == pytest.approx(2.5)
    # LARS keeps the whole floor at any batch: 50 steps of 5 an epoch are 10 epochs, not 5.
    lars = recipe_for_batch(1024, 90, steps_per_epoch=5, optimizer="lars")
    assert lars.warmup_epochs == pytest.approx(10.0)
    imagenet = recipe_for_batch(32768, 72, steps_per_epoch=1281167 // 32768)
    assert imagenet.warmup_epochs == 12.0


def test_recipe_augmentation_fits_the_data():
    # Small datasets: none in short runs, light crops in long ones; ImageNet's at its scale.
    assert recipe_for_batch(64, 15, train_examples=1617).augmentation == "none"
    assert recipe_for_batch(64, 30, train_examples=1617).augmentation == "none"
    assert recipe_for_batch(64, 60, train_examples=1617).augmentation == "light"
    assert recipe_for_batch(1024, 90, train_examples=1281167).augmentation == "imagenet"
    # Unknown data: the ImageNet recipe's.
    assert recipe_for_batch(1024).augmentation == "imagenet"
    assert recipe_for_batch(64, train_examples=1617, augmentation="light").augmentation == "light"
    # Small data whose images are mostly not square: boxes of the image's own shape, not none.
    for fraction, level in [(None, "none"), (0.2, "none"), (0.5, "shift"), (1.0, "shift")]:
        short = recipe_for_batch(64, 15, train_examples=1617, non_square_fraction=fraction)
        assert short.augmentation == level
    assert recipe_for_batch(64, 60, train_examples=1617, non_square_fraction=1.0).augmentation == "light"
    assert recipe_for_batch(1024, 90, train_examples=1281167, non_square_fraction=1.0).augmentation == "imagenet"
    from tpu_scale.data import InputConfig

    # Below ImageNet's level the whole image, resized to the square whatever its shape.
    assert recipe_for_batch(64, train_examples=1617).input_config() == InputConfig(
        crop_area_range=None, random_flip=False, center_crop_fraction=1.0, aspect_ratio="stretch"
    )
    assert recipe_for_batch(64, 60, train_examples=1617).input_config() == InputConfig(
        crop_area_range=(0.5, 1.0),
        random_flip=False,
        center_crop_fraction=1.0,
        aspect_ratio="stretch",
    )
    shift = recipe_for_batch(64, 15, train_examples=1617, augmentation="shift").input_config()
    assert shift.crop_area_range == (0.75, 1.0) and not shift.random_flip
    # Translation: the whole image, shifted by up to an eighth of its side, never mirrored.
    translate = recipe_for_batch(64, 15, train_examples=1617, augmentation="translate")
    assert translate.input_config() == InputConfig(
        crop_area_range=None,
        random_flip=False,
        translate_fraction=0.125,
        center_crop_fraction=1.0,
        aspect_ratio="stretch",
    )
    # Every level sets the shift too: a level without one takes it away from the given config.
    shifted = InputConfig(translate_fraction=0.25, seed=3)
    assert recipe_for_batch(64, 15, train_examples=1617).input_config(shifted).translate_fraction == 0
    # No level below ImageNet's mirrors: a folder cannot say whether a flip keeps its labels.
    for level, fields in recipe_lib.AUGMENTATIONS.items():
        assert set(fields) == {
            "crop_area_range",
            "random_flip",
            "translate_fraction",
            "center_crop_fraction",
            "aspect_ratio",
        }
        assert fields["aspect_ratio"] == ("crop" if level == "imagenet" else "stretch")
        assert fields["random_flip"] == (level == "imagenet")
    # The ImageNet recipe's augmentation is the configuration's default; other fields are kept.
    given = InputConfig(crop_area_range=None, seed=7, strict=True)
    assert recipe_for_batch(4096).input_config(given) == InputConfig(seed=7, strict=True)
    with pytest.raises(ValueError, match="augmentation"):
        recipe_for_batch(64, augmentation="strong")


def test_recipe_weight_decay_by_data_size():
    # Small data, below 100,000 examples in all, however many a class: SGD's stronger decay.
    assert recipe_for_batch(64, 15, train_examples=4500, num_classes=10).weight_decay == 5e-4
    assert recipe_for_batch(512, 30, train_examples=2361, num_classes=4).weight_decay == 5e-4
    assert recipe_for_batch(512, 15, train_examples=22_788, num_classes=10).weight_decay == 5e-4
    assert recipe_for_batch(4096, 10, train_examples=63_000, num_classes=10).weight_decay == 5e-4
    assert recipe_lib.default_weight_decay(99_999) == 5e-4
    # From 100,000 on, ImageNet's scale (1.28 million, 1,281 a class): the reference 1e-4.
    assert recipe_lib.default_weight_decay(100_000) == 1e-4
    imagenet = recipe_for_batch(1024, 90, train_examples=1281167, num_classes=1000)
    assert imagenet.weight_decay == 1e-4
    # Data unknown: the reference value.
    assert recipe_for_batch(64, 15).weight_decay == 1e-4
    assert recipe_for_batch(64, 15, num_classes=10).weight_decay == 1e-4
    # LARS keeps the paper's decay whatever the data.
    lars = recipe_for_batch(32768, 72, train_examples=4500, num_classes=10)
    assert lars.optimizer == "lars" and lars.weight_decay == 1e-4
    # A flag overrides it, and the optimizer gets the recipe's value.
    small = recipe_for_batch(64, 15, train_examples=4500, num_classes=10)
    assert small.with_settings(weight_decay=1e-4).weight_decay == 1e-4
    sgd = small.build_optimizer(steps_per_epoch=70, total_epochs=15)
    assert sgd.weight_decay == 5e-4


def test_recipe_decay_is_slower_on_small_data():
    # Below 100,000 examples, momentum SGD's rate decays linearly; quadratically from there, for
    # unknown data and for LARS.
    small = recipe_for_batch(64, 15, train_examples=4500, num_classes=10)
    assert small.decay_power == 1.0
    assert recipe_lib.default_decay_power(99_999) == 1.0
    assert recipe_lib.default_decay_power(100_000) == recipe_lib.default_decay_power() == 2.0
    imagenet = recipe_for_batch(1024, 90, train_examples=1281167, num_classes=1000)
    assert imagenet.decay_power == 2.0
    lars = recipe_for_batch(32768, 72, train_examples=4500, num_classes=10)
    assert lars.optimizer == "lars" and lars.decay_power == 2.0
    # The schedule follows it: halfway through the decay, half the peak (a quarter when quadratic).
    for recipe, fraction in ((small, 0.5), (imagenet, 0.25)):
        schedule = recipe.schedule(steps_per_epoch=100, total_epochs=15)
        assert schedule.power == recipe.decay_power
        halfway = (schedule.warmup_steps + schedule.total_steps) // 2
        rate = float(schedule(halfway))
        assert rate == pytest.approx(fraction * recipe.peak_learning_rate, rel=0.02)
    assert small.with_settings(decay_power=2.0).decay_power == 2.0


def test_recipe_evaluates_momentum_sgds_moving_average():
    # SGD's weights are evaluated and saved averaged, at the batch norm's momentum; LARS's as
    # trained (the paper's settings).
    small = recipe_for_batch(64, 15, train_examples=4500, num_classes=10)
    assert small.ema_momentum == recipe_lib.EMA_MOMENTUM == 0.9
    assert recipe_for_batch(1024, 90, train_examples=1281167).ema_momentum == 0.9
    assert recipe_for_batch(32768, 72).ema_momentum == 0.0
    sgd = small.build_optimizer(steps_per_epoch=70, total_epochs=15)
    assert sgd.use_ema and sgd.ema_momentum == 0.9
    assert [type(c) for c in small.callbacks()] == [keras.callbacks.SwapEMAWeights]
    # A flag turns it off: the weights themselves, no callback.
    plain = small.with_settings(ema_momentum=0.0)
    assert not plain.build_optimizer(steps_per_epoch=70, total_epochs=15).use_ema
    assert plain.callbacks() == []
    # Keras keeps no moving average with accumulation under a strategy: said at build, with the fix.
    with pytest.raises(ValueError, match=r"with_settings\(ema_momentum=0.0\)"):
        small.build_optimizer(70, 15, gradient_accumulation_steps=4)
    accumulating = plain.build_optimizer(70, 15, gradient_accumulation_steps=4)
    # The wrapper a strategy needs for accumulation, around Keras's optimizer.
    assert isinstance(accumulating, tpu_scale.DistributedOptimizer)
    inner = accumulating.inner_optimizer
    assert inner.gradient_accumulation_steps == 4 and not inner.use_ema
    sharded = plain.build_optimizer(70, 15, weight_update_sharding=True)
    assert sharded.weight_update_sharding and type(sharded.inner_optimizer).__name__ == "SGD"
    with pytest.raises(ValueError, match="ema_momentum"):
        small.with_settings(ema_momentum=1.0)


@pytest.mark.parametrize("replicas", [1, 8])
def test_fit_validates_the_averaged_weights_and_trains_on_its_own(replicas, cpu_devices):
    """Under the package's strategies, the recipe's callback evaluates the moving average in fit's
    validation and puts the trained weights back: the next epoch goes on from them."""
    import tensorflow as tf

    import tpu_scale

    strategy = tpu_scale.create_strategy(num_cpu_replicas=replicas)
    recipe = recipe_for_batch(64, 2, steps_per_epoch=8)
    rng = np.random.default_rng(0)
    x = rng.random((512, 4), dtype=np.float32)
    y = (x.sum(axis=1) > 2).astype(np.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    with strategy.scope():
        model = keras.Sequential([keras.Input([4]), keras.layers.Dense(8), keras.layers.Dense(2)])
        model.compile(
            recipe.build_optimizer(8, 2),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def weights():
        return [w.numpy().copy() for w in model.trainable_weights]

    class Record(keras.callbacks.Callback):
        """The first epoch's trained weights and average at its last step, the weights its
        validation evaluates, and the weights the second epoch starts from."""

        def __init__(self):
            super().__init__()
            self.seen = {}

        def on_train_batch_end(self, batch, logs=None):
            if "evaluated" not in self.seen:
                average = self.model.optimizer._model_variables_moving_average
                self.seen.update(trained=weights(), average=[v.numpy().copy() for v in average])

        def on_test_begin(self, logs=None):
            self.seen.setdefault("evaluated", weights())

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.seen["resumed"] = weights()

    record = Record()
    model.fit(data, validation_data=data, epochs=2, verbose=0, callbacks=recipe.callbacks() + [record])
    seen = record.seen
    for evaluated, average, trained, resumed in zip(
        seen["evaluated"], seen["average"], seen["trained"], seen["resumed"]
    ):
        np.testing.assert_allclose(evaluated, average, atol=1e-6)
        assert not np.allclose(evaluated, trained)
        np.testing.assert_allclose(resumed, trained, atol=1e-6)
    # fit ends with the average in the model (Keras's finalize_variable_values).
    for final, average in zip(weights(), model.optimizer._model_variables_moving_average):
        np.testing.assert_array_equal(final, average.numpy())


def test_recipe_is_monotonic_in_batch_size():
    recipes = [recipe_for_batch(b) for b in BATCHES]
    names = [r.optimizer for r in recipes]
    # One switch, from SGD to LARS, never back.
    assert names == sorted(names, key=["sgd", "lars"].index)
    assert names[0] == "sgd" and names[-1] == "lars"
    for name in ("sgd", "lars"):
        lrs = [r.peak_learning_rate for r in recipes if r.optimizer == name]
        assert lrs == sorted(lrs)
    warmups = [r.warmup_epochs for r in recipes]
    assert warmups == sorted(warmups)
    # Strictly increasing where the rule scales (SGD) or interpolates (LARS above 16K).
    sgd = [r.peak_learning_rate for r in recipes if r.optimizer == "sgd"]
    assert np.all(np.diff(sgd) > 0)
    big = [r.peak_learning_rate for r, b in zip(recipes, BATCHES) if b >= 16384]
    assert np.all(np.diff(big) > 0)


def test_recipe_warmup_fits_the_run():
    assert recipe_for_batch(65536, total_epochs=50).warmup_epochs == pytest.approx(20.0)
    assert recipe_for_batch(256, total_epochs=4).warmup_epochs == pytest.approx(1.6)
    assert recipe_for_batch(256, total_epochs=40).warmup_epochs == 2.0
    assert recipe_for_batch(64, total_epochs=1).warmup_epochs == pytest.approx(0.4)
    schedule = recipe_for_batch(16384).schedule(steps_per_epoch=10, total_epochs=10)
    assert (schedule.warmup_steps, schedule.total_steps) == (40, 100)
    assert _lr(schedule, 40) == pytest.approx(25.0)


def test_recipe_builds_its_optimizers():
    lars = recipe_for_batch(32768).build_optimizer(steps_per_epoch=39, total_epochs=72)
    assert isinstance(lars, LARS) and lars.weight_decay == 1e-4 and lars.eta == 0.001
    assert lars._learning_rate.peak_learning_rate == 34.0
    sgd = recipe_for_batch(64).build_optimizer(steps_per_epoch=20, total_epochs=10)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.nesterov and sgd.momentum == 0.9
    assert sgd._learning_rate.peak_learning_rate == pytest.approx(0.025)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="dense"),
            keras.layers.BatchNormalization(name="batch_normalization"),
        ]
    )
    sgd.build(model.trainable_variables)
    # Paths without the model's own name, which depends on the models made before in the process.
    decayed = {v.path.split("/", 1)[1]: sgd._use_weight_decay(v) for v in model.trainable_variables}
    assert decayed == {
        "dense/kernel": True,
        "dense/bias": False,
        "batch_normalization/gamma": False,
        "batch_normalization/beta": False,
    }


def test_recipe_with_settings_changes_only_the_settings_given():
    recipe = recipe_for_batch(512, 30, steps_per_epoch=10)
    changed = recipe.with_settings(peak_learning_rate=1.5, warmup_epochs=None, weight_decay=0.0)
    assert changed.peak_learning_rate == 1.5 and changed.weight_decay == 0.0
    assert changed.warmup_epochs == recipe.warmup_epochs
    assert (
        dataclasses.replace(
            changed, peak_learning_rate=recipe.peak_learning_rate, weight_decay=recipe.weight_decay
        )
        == recipe
    )
    assert recipe.with_settings() == recipe
    assert changed.describe() == (
        f"sgd, peak LR 1.5, warmup {recipe.warmup_epochs:.2f} epochs, augmentation "
        f"{recipe.augmentation} (centred squares), weights averaged (EMA 0.9)"
    )
    assert changed.with_settings(ema_momentum=0.0).describe().endswith(", weights as trained")
    with pytest.raises(TypeError, match="learning_rate"):
        recipe.with_settings(learning_rate=0.1)


def test_recipe_checks_its_arguments():
    for bad in (0, -64, 64.5, "64", True):
        with pytest.raises(ValueError, match="global_batch_size"):
            recipe_for_batch(bad)
    with pytest.raises(ValueError, match="total_epochs"):
        recipe_for_batch(64, total_epochs=0)
    with pytest.raises(ValueError, match="optimizer"):
        Recipe(64, "adam", 0.1, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe_for_batch(64).peak_learning_rate = 1.0


def test_recipe_trains_real_digits_well_above_chance(tmp_path):
    """The defaults on real images through the whole input path: scikit-learn's digits as a
    folder of JPEG and PNG files, the writer, the recipe's augmentation, one device."""
    from tpu_scale import data, losses, models
    from tpu_scale.testing.digits import write_digits_folder

    write_digits_folder(str(tmp_path / "images"), size=32)
    data.write_tfrecords(str(tmp_path / "images"), str(tmp_path / "records"))
    label_map = data.read_label_map(str(tmp_path / "records"))
    train_examples = label_map.counts["train"]
    batch, epochs = 64, 8
    steps_per_epoch = train_examples // batch
    recipe = recipe_for_batch(batch, epochs, train_examples=train_examples, num_classes=10)
    assert (recipe.optimizer, recipe.augmentation, recipe.weight_decay) == ("sgd", "none", 5e-4)
    inputs = dict(global_batch_size=batch, image_size=32)
    train = data.ImageNetInput(
        str(tmp_path / "records" / "train-*"),
        is_training=True,
        config=recipe.input_config(data.InputConfig(seed=0)),
        **inputs,
    )
    validation = data.ImageNetInput(
        str(tmp_path / "records" / "validation-*"),
        is_training=False,
        config=recipe.input_config(),
        **inputs,
    )
    keras.utils.set_random_seed(0)
    model = models.small_resnet(10, input_shape=(32, 32, 3))
    model.compile(
        recipe.build_optimizer(steps_per_epoch, epochs),
        losses.SmoothedSparseCategoricalCrossentropy(recipe.label_smoothing, from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(train.dataset(), epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    top_1 = model.evaluate(validation.dataset(), return_dict=True, verbose=0)["accuracy"]
    assert top_1 > 0.8, top_1  # chance is 0.1
