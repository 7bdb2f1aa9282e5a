"""The README's quickstart, run as a user would on a small real dataset (scikit-learn's digits).

The block is taken from README.md as written; only what names the user's data and hardware budget
changes: the record paths, the image size, the example count, the epochs, and ResNet-50 for the
small ResNet (ResNet-50 at 1000 classes does not train in a test's time on two cores).
"""

import os
import re
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quickstart_code():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_as_written_trains_and_evaluates_every_example(digits_records, capsys):
    import keras

    from tpu_scale.data import read_label_map

    records, label_map = digits_records, read_label_map(digits_records)
    code = quickstart_code()
    replacements = [
        ('"/data/train-*"', repr(records + "/train-*")),
        ('"/data/validation-*"', repr(records + "/validation-*")),
        ("image_size=224", "image_size=32"),
        ("batch, epochs = 1024, 90", "batch, epochs = 128, 3"),
        ("1_281_167", str(label_map.counts["train"])),
        (
            "models.resnet50(num_classes=1000, bn_group_size=None)",
            "models.small_resnet(10, image_size=32, bn_group_size=None)",
        ),
    ]
    for old, new in replacements:
        assert old in code, f"the README quickstart no longer contains {old!r}"
        code = code.replace(old, new)
    epoch_ends = []

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.monotonic())

    callbacks = "callbacks=[callbacks.AverageMovingStatistics()]"
    assert callbacks in code, f"the README quickstart no longer contains {callbacks!r}"
    code = code.replace(callbacks, callbacks[:-1] + ", EpochTimes()]")
    code = code.replace("model.fit(", "history = model.fit(verbose=0, x=", 1)
    namespace = {"EpochTimes": EpochTimes}
    started = time.monotonic()
    exec(compile(code, "README.md quickstart", "exec"), namespace)
    model, strategy, validation = namespace["model"], namespace["strategy"], namespace["validation"]
    assert str(namespace["strategy"].mesh) in capsys.readouterr().out

    # The compiled `accuracy` counts each validation example once: it equals the accuracy of the
    # model's own predictions over the validation set, example by example. The callback gave every
    # replica the same batch-norm statistics, so fit's last validation, the strategy's evaluation
    # and the model called outside the strategy (as saved) are one model.
    history = namespace["history"].history
    data = strategy.distribute_datasets_from_function(validation.dataset)
    evaluated = model.evaluate(data, return_dict=True, verbose=0)
    correct = total = near_ties = 0
    for images, labels in validation.dataset():
        logits = model(images, training=False).numpy()
        correct += int((np.argmax(logits, axis=-1) == labels.numpy()).sum())
        total += len(labels)
        top_two = np.sort(logits, axis=-1)[:, -2:]
        near_ties += int((top_two[:, 1] - top_two[:, 0] < 1e-3).sum())
    assert total == label_map.counts["validation"]
    for accuracy in (evaluated["accuracy"], history["val_accuracy"][-1]):
        # A whole number of the `total` examples (padding or a missed batch would change the
        # denominator).
        assert accuracy * total == pytest.approx(round(accuracy * total), abs=1e-3)
    # fit's last validation and the evaluation after it: the same statistics, the same examples.
    assert history["val_accuracy"][-1] == pytest.approx(evaluated["accuracy"], abs=1e-6)
    # The same examples right as the model's own predictions, up to the near-ties (top two logits
    # within 1e-3) that the replicas' batch split can round the other way.
    accuracy = evaluated["accuracy"]
    assert abs(round(accuracy * total) - correct) <= max(1, near_ties), (
        accuracy,
        correct,
        total,
        near_ties,
    )
    # No stalled epoch: iterator deletion at the end of each evaluation once took up to 60 s. (The
    # first epoch also traces the step and builds the pipelines, so it is left out.)
    durations = np.diff(epoch_ends)
    assert len(durations) == 2 and durations.max() < 30, (epoch_ends[0] - started, durations)
