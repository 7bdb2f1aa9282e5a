"""The README's quickstart, run as a user would on a small real dataset (scikit-learn's digits).

The block is taken from README.md as written, with the names of the user's data, run folder and
hardware budget given for this machine: the records, the image size, the batch, the epochs, and
the small ResNet for ResNet-50 (ResNet-50 at 1000 classes does not train in a test's time on two
cores).
"""

import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quickstart_code():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_as_written_trains_resumably_and_evaluates_every_example(
    digits_records, tmp_path, capsys
):
    from tpu_scale.data import read_label_map

    code = quickstart_code()
    run_dir = str(tmp_path / "run")
    # The user's names, in one place: each must still be in the README's block.
    names = {
        "/data/imagenet": digits_records,
        "/runs/resnet50": run_dir,
        "image_size=224": "image_size=32",
        "1024": "128",
        "epochs, steps = 90": "epochs, steps = 3",
        "models.resnet50(inputs.num_classes,": "models.small_resnet(inputs.num_classes, (32, 32, 3),",
        "model.fit(": "history = model.fit(verbose=0, x=",
    }
    for old, new in names.items():
        assert old in code, f"the README quickstart no longer contains {old!r}"
        code = code.replace(old, new)
    namespace = {}
    exec(compile(code, "README.md quickstart", "exec"), namespace)
    model, strategy = namespace["model"], namespace["strategy"]
    inputs, validation = namespace["inputs"], namespace["validation"]
    assert str(strategy.mesh) in capsys.readouterr().out

    # Every validation example counted once: the compiled accuracy is a whole number of the
    # examples, and right as the model's own predictions outside the strategy (as saved), up to
    # near-ties (top two logits within 1e-3) that the replicas' batch split can round either way.
    total = read_label_map(digits_records).counts["validation"]
    assert inputs.validation_examples == total
    history = namespace["history"].history
    evaluated = model.evaluate(
        validation.dataset, steps=validation.steps, return_dict=True, verbose=0
    )
    correct = near_ties = 0
    for images, labels in inputs.validation.dataset():
        logits = model(images, training=False).numpy()
        correct += int((np.argmax(logits, axis=-1) == labels.numpy()).sum())
        top_two = np.sort(logits, axis=-1)[:, -2:]
        near_ties += int((top_two[:, 1] - top_two[:, 0] < 1e-3).sum())
    for accuracy in (evaluated["accuracy"], history["val_accuracy"][-1]):
        assert accuracy * total == pytest.approx(round(accuracy * total), abs=1e-3)
    assert history["val_accuracy"][-1] == pytest.approx(evaluated["accuracy"], abs=1e-6)
    assert abs(round(evaluated["accuracy"] * total) - correct) <= max(1, near_ties)
    # The run's folder holds what a resumed run needs.
    assert sorted(os.listdir(run_dir)) == ["backup", "checkpoints", "logs"]
