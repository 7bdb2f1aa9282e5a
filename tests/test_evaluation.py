"""`data.exact_evaluation`: every example once per pass, however the passes and replicas fall."""

import numpy as np
import pytest

from tpu_scale import data


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("eval"))
    data.make_synthetic_imagenet(
        folder, num_classes=10, train_examples=16, eval_examples=179, image_shape=(16, 16)
    )
    return folder


def _passes(strategy, evaluation, count):
    """The (label, weight) pairs of `count` passes from one iterator, as Keras's fit reads them."""
    iterator = iter(evaluation.dataset)
    passes = []
    for _ in range(count):
        seen = []
        for _ in range(evaluation.steps):
            batch = next(iterator)
            labels = strategy.experimental_local_results(batch[1])
            weights = (
                strategy.experimental_local_results(batch[2])
                if len(batch) == 3
                else [np.ones(len(y)) for y in labels]
            )
            for y, w in zip(labels, weights):
                seen.extend(zip(np.asarray(y).tolist(), np.asarray(w).tolist()))
        passes.append(seen)
    return passes


@pytest.mark.parametrize("pad", [False, True], ids=["partial", "padded"])
def test_every_pass_sees_every_example_once(strategy, records, pad):
    common = dict(is_training=False, global_batch_size=128, image_size=16)
    validation = data.ImageNetInput(f"{records}/validation-*", pad_last_batch=pad, **common)
    evaluation = data.exact_evaluation(validation, strategy, 179)
    # 179 examples in per-replica batches of 16: 12 batches, over 8 replicas: 2 steps.
    assert evaluation.steps == data.evaluation_steps(179, 128, 8) == 2
    plain = data.ImageNetInput(f"{records}/validation-*", **common)
    expected = sorted(int(y) for _, y in plain.dataset().unbatch())
    for seen in _passes(strategy, evaluation, 3):  # three evaluations from one iterator
        counted = sorted(y for y, w in seen for _ in range(int(w)))
        assert counted == expected
        if not pad:
            assert len(seen) == 179  # the top-up batches are empty
        else:
            assert len(seen) == 2 * 128  # static shapes: full batches, zero weights past the data


def test_steps_cover_any_count_and_replicas():
    assert data.evaluation_steps(5, 64, 2) == 1
    assert data.evaluation_steps(64, 64, 2) == 1
    assert data.evaluation_steps(65, 64, 2) == 2
    assert data.evaluation_steps(1, 1024, 1024) == 1


def test_a_training_input_or_no_examples_is_refused(strategy, records):
    train = data.ImageNetInput(
        f"{records}/train-*", is_training=True, global_batch_size=128, image_size=16
    )
    with pytest.raises(ValueError, match="is_training=False"):
        data.exact_evaluation(train, strategy, 16)
    validation = data.ImageNetInput(
        f"{records}/validation-*", is_training=False, global_batch_size=100, image_size=16
    )
    with pytest.raises(ValueError, match="does not divide over 8 replicas"):
        data.exact_evaluation(validation, strategy, 179)
    with pytest.raises(ValueError, match="num_examples must be at least 1"):
        data.exact_evaluation(validation, strategy, 0)
