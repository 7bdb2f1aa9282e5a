"""`data.exact_evaluation`: every example once per pass, however the passes and replicas fall."""

import numpy as np
import pytest

from tpu_scale import data


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("eval"))
    data.make_synthetic_imagenet(
        folder, num_classes=10, train_examples=16, validation_examples=179, image_shape=(16, 16)
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


def test_every_pass_sees_every_example_once(strategy, records):
    common = dict(is_training=False, global_batch_size=128, image_size=16)
    validation = data.ImageNetInput(f"{records}/validation-*", **common)
    evaluation = data.exact_evaluation(validation, strategy, 179)
    # 179 examples in per-replica batches of 16: 12 batches, over 8 replicas: 2 steps.
    assert evaluation.steps == data.evaluation_steps(179, 128, 8) == 2
    plain = data.ImageNetInput(f"{records}/validation-*", **common)
    expected = sorted(int(y) for _, y in plain.dataset().unbatch())
    for seen in _passes(strategy, evaluation, 3):  # three evaluations from one iterator
        counted = sorted(y for y, w in seen for _ in range(int(w)))
        assert counted == expected
        # Whole batches on every replica (no replica is ever handed an empty batch), zero
        # weights past the data: the input's last, short batch filled.
        assert len(seen) == 2 * 128
        assert sorted({w for _, w in seen}) == [0.0, 1.0]


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


class _TwoWorkers:
    """What exact_evaluation reads of a 2-worker strategy with 4 replicas (2 per worker)."""

    num_replicas_in_sync = 4

    class cluster_resolver:  # noqa: N801
        @staticmethod
        def cluster_spec():
            class Spec:
                def as_dict(self):
                    return {"worker": ["localhost:1", "localhost:2"]}

            return Spec()

    def distribute_datasets_from_function(self, fn):
        return fn


def test_several_workers_get_the_longest_pipelines_steps(records):
    evaluation_input = data.ImageNetInput(
        f"{records}/validation-*", is_training=False, global_batch_size=32, image_size=16
    )
    counts = evaluation_input.source.records_per_shard(2)
    files = sorted(
        (path, count)
        for path, count in evaluation_input.label_map.record_counts_by_path().items()
        if "/validation-" in path
    )
    assert counts == [sum(c for _, c in files[0::2]), sum(c for _, c in files[1::2])]
    assert sum(counts) == 179
    evaluation = data.exact_evaluation(evaluation_input, _TwoWorkers(), 179)
    # 8 examples a replica, 2 replicas a worker: the longer pipeline's batches, 2 a step.
    assert evaluation.steps == max(-(-(-(-c // 8)) // 2) for c in counts)
    # Fewer files than pipelines: each pass runs to its end (no known step count).
    assert evaluation_input.source.records_per_shard(len(files) + 1) is None
