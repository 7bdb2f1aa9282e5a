"""The time-to-accuracy benchmark's own logic: reading the example's epoch lines, the threshold, the
timing of a run, the folders of the two contenders, the ratio."""

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import time_to_accuracy as tta  # noqa: E402

from tpu_scale import training  # noqa: E402


def _example_epoch_line(monkeypatch, logs):
    """The line the example's epoch logger logs at the end of an epoch, as it formats it."""
    lines = []
    monkeypatch.setattr(training.logger, "info", lambda fmt, *a: lines.append(fmt % a))
    progress = training.EpochLogger(128, 8, 30)
    progress.on_epoch_begin(2)
    progress.on_train_batch_end(0)
    progress.on_train_batch_end(1)
    progress.on_epoch_end(2, logs)
    assert len(lines) == 1
    return lines[0]


def test_the_examples_epoch_line_is_read(monkeypatch):
    line = _example_epoch_line(monkeypatch, {"loss": 1.9, "top_1": 0.41, "val_top_1": 0.5363})
    # As absl prints it, prefix and all.
    assert tta.parse_epoch_line(f"I1201 12:00:00.123 77 train_imagenet.py:480] {line}\n") == (
        3,
        30,
        0.5363,
    )
    # No validation in the logs: NaN, which reaches no threshold.
    line = _example_epoch_line(monkeypatch, {"loss": 1.9, "top_1": 0.41})
    epoch, _, top_1 = tta.parse_epoch_line(line)
    assert epoch == 3 and math.isnan(top_1)
    assert tta.first_reaching([{"val_top_1": top_1}], 0.0) is None


def test_the_plain_childs_line_and_other_lines():
    assert tta.parse_epoch_line("epoch 12/30: loss 0.3, top-1 0.95, val top-1 0.9106") == (
        12,
        30,
        0.9106,
    )
    # The example's final line and its resume message carry no epoch's validation top-1.
    assert tta.parse_epoch_line("top-1 0.9441 (chance 0.1000) | 180 images/s | wall 95 s") is None
    assert tta.parse_epoch_line("Resuming from the backup after epoch 2 of 10") is None


def test_first_reaching_is_the_first_epoch_at_or_above():
    epochs = [{"epoch": i + 1, "val_top_1": v} for i, v in enumerate([0.5, 0.9, 0.85, 0.95])]
    assert tta.first_reaching(epochs, 0.9)["epoch"] == 2
    assert tta.first_reaching(epochs, 0.91)["epoch"] == 4
    assert tta.first_reaching(epochs, 0.96) is None


def _fake_run(tmp_path, script):
    child = tmp_path / "child.py"
    child.write_text(script)
    return [sys.executable, str(child)]


def _gone(pid_file):
    """True if the process whose id `pid_file` holds has ended."""
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_a_run_is_timed_to_the_threshold_and_to_its_end(tmp_path):
    pid, after = tmp_path / "pid", tmp_path / "after_last_epoch"
    command = _fake_run(
        tmp_path,
        "import os, time\n"
        f"open({str(pid)!r}, 'w').write(str(os.getpid()))\n"
        "print('starting', flush=True)\n"
        "for i, v in enumerate([0.3, 0.7, 0.92, 0.91]):\n"
        "    time.sleep(0.5)\n"
        "    print(f'epoch {i + 1}/4: loss 1.0, top-1 0.5, val top-1 {v}', flush=True)\n"
        "time.sleep(3)\n"
        f"open({str(after)!r}, 'w').write('still running')\n",
    )
    run = tta.timed_run(command, 0.9, timeout=60, env=dict(os.environ))
    # Ended at its last epoch: the child is gone and never got past its sleep.
    assert _gone(pid) and not after.exists()
    assert run["ended"] == "last epoch" and run["reached_epoch"] == 3
    assert [e["epoch"] for e in run["epochs"]] == [1, 2, 3, 4]
    seconds = [e["seconds"] for e in run["epochs"]]
    assert seconds == sorted(seconds) and seconds[0] >= 0.5
    assert run["seconds_to_threshold"] == seconds[2]
    assert (run["best_top_1"], run["final_top_1"]) == (0.92, 0.91)


def test_the_keras_contender_gets_the_folder_without_its_broken_files(tmp_path):
    images, clean = tta.prepare_folders(str(tmp_path), "digits")
    broken = {"cut_off.jpg", "not_an_image.jpg"}
    names = {n for _, _, files in os.walk(images) for n in files}
    clean_names = {n for _, _, files in os.walk(clean) for n in files}
    assert broken <= names and not broken & clean_names
    assert names - broken == clean_names and len(clean_names) == 1797
    runs = tta.commands(images, clean, tta.SETTINGS["mnist5k"], 0)
    assert runs["package"][runs["package"].index("--image_dir") + 1] == images
    # Both Keras scripts read the same clean folder, so they see the same split.
    for name, optimizer in (("keras", "adam"), ("practised", "practised")):
        assert runs[name][runs[name].index("--image_dir") + 1] == clean
        assert runs[name][runs[name].index("--optimizer") + 1] == optimizer
        assert runs[name][:-2] == runs["keras"][:-2]


def test_a_run_that_never_gets_there_says_why(tmp_path):
    command = _fake_run(
        tmp_path,
        "print('epoch 1/3: val top-1 0.4', flush=True)\n"
        "print('epoch 2/3: val top-1 0.5', flush=True)\n"
        "raise SystemExit(3)\n",
    )
    run = tta.timed_run(command, 0.9, timeout=30, env=dict(os.environ))
    assert run["reached_epoch"] is None and run["seconds_to_threshold"] is None
    assert run["ended"] == "exited 3" and len(run["epochs"]) == 2
    assert run["final_top_1"] == 0.5
    # The last epoch ends the run, however long the process then takes to exit.
    pid, after = tmp_path / "slow_pid", tmp_path / "slow_after"
    slow_exit = _fake_run(
        tmp_path,
        "import os, time\n"
        f"open({str(pid)!r}, 'w').write(str(os.getpid()))\n"
        "print('epoch 1/2: val top-1 0.4', flush=True)\n"
        "print('epoch 2/2: val top-1 0.5', flush=True)\n"
        "time.sleep(3)\n"
        f"open({str(after)!r}, 'w').write('still running')\n",
    )
    run = tta.timed_run(slow_exit, 0.9, timeout=60, env=dict(os.environ))
    assert run["ended"] == "last epoch" and _gone(pid) and not after.exists()
    # A run that prints nothing is ended at the timeout, and says so.
    pid, after = tmp_path / "hung_pid", tmp_path / "hung_after"
    hung = _fake_run(
        tmp_path,
        "import os, time\n"
        f"open({str(pid)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(5)\n"
        f"open({str(after)!r}, 'w').write('still running')\n",
    )
    run = tta.timed_run(hung, 0.9, timeout=1, env=dict(os.environ))
    assert run["ended"] == "timeout" and _gone(pid) and not after.exists()


def test_the_summary_and_ratio_count_only_runs_that_reached():
    def run(name, seconds, epoch, seed=0):
        return {
            "contender": name,
            "seed": seed,
            "seconds_to_threshold": seconds,
            "reached_epoch": epoch,
        }

    runs = [
        run("package", 30.0, 5, seed=0),
        run("keras", 60.0, 12, seed=0),
        run("package", 40.0, 6, seed=1),
        run("keras", None, None, seed=1),
        run("package", 50.0, 6, seed=2),
        run("keras", 80.0, 14, seed=2),
    ]
    summary = tta.summarize(runs, ("package", "keras"))
    assert summary["package"]["seconds_to_threshold"] == {"median": 40.0, "min": 30.0, "max": 50.0}
    assert summary["keras"]["reached"] == 2 and summary["keras"]["runs"] == 3
    assert summary["keras"]["seconds_to_threshold"]["median"] == 70.0
    assert summary["ratio"] == 40.0 / 70.0
    # Within a round: seeds 0 and 2, the only ones keras reached it in.
    assert summary["round_ratios"]["keras"] == {
        "median": (0.5 + 50.0 / 80.0) / 2,
        "min": 0.5,
        "max": 50.0 / 80.0,
        "rounds": 2,
    }
    assert tta.summarize(runs[1::2], ("package", "keras"))["ratio"] is None
    three = tta.summarize(
        runs + [run("practised", 20.0, 4, seed=1)], ("package", "keras", "practised")
    )
    assert three["ratios"] == {"keras": 40.0 / 70.0, "practised": 2.0}
    assert three["round_ratios"]["practised"]["median"] == 2.0


def test_lower_marks_are_read_off_each_runs_epochs():
    def run(name, curve):
        epochs = [{"epoch": i + 1, "val_top_1": v, "seconds": 10.0 * (i + 1)} for i, v in curve]
        return {"contender": name, "seed": 0, "epochs": epochs}

    runs = [
        run("package", enumerate([0.4, 0.75, 0.92])),
        run("keras", enumerate([0.2, 0.55, 0.6, 0.81, 0.9])),
    ]
    marks = tta.summarize_marks(runs, ("package", "keras"), [0.5, 0.8, 0.95])
    assert marks["0.5"]["package"]["reached_epoch"]["median"] == 2
    assert marks["0.5"]["keras"]["seconds_to_threshold"]["median"] == 20.0
    assert marks["0.8"]["ratio"] == 30.0 / 40.0
    assert marks["0.8"]["round_ratios"]["keras"]["median"] == 30.0 / 40.0
    assert marks["0.95"]["package"]["reached"] == 0 and marks["0.95"]["ratio"] is None
