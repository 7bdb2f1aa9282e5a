"""Real images for tests: scikit-learn's handwritten digits as a folder of class folders.

Data the package did not make: the 1,797 8x8 digits that ship inside scikit-learn's wheel, written
as the kind of folder a user points the writer at, with the broken files such folders hold too.
"""

import os

import numpy as np


def write_digits_folder(folder, size=32, count=None):
    """scikit-learn's 1,797 handwritten digits as a folder of class folders of JPEG and PNG.

    Files. `count`: only the first `count` digits (at least 4, for the broken files), for a
    smaller folder."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for label in range(10):
        os.makedirs(os.path.join(folder, f"digit_{label}"))
    images, targets = digits.images[:count], digits.target[:count]
    for index, (image, label) in enumerate(zip(images, targets)):
        pixels = (image * (255.0 / 16.0)).astype(np.uint8)
        picture = Image.fromarray(pixels).resize((size, size), Image.BILINEAR).convert("RGB")
        fmt = "png" if index % 7 == 0 else "jpg"
        picture.save(os.path.join(folder, f"digit_{label}", f"{index:04d}.{fmt}"))
    # What a real folder holds too: a cut-off JPEG, a text file with an image's name, a note.
    whole = open(os.path.join(folder, "digit_3", "0003.jpg"), "rb").read()
    with open(os.path.join(folder, "digit_3", "cut_off.jpg"), "wb") as f:
        f.write(whole[: len(whole) // 2])
    with open(os.path.join(folder, "digit_5", "not_an_image.jpg"), "w") as f:
        f.write("hello")
    with open(os.path.join(folder, "digit_5", "notes.txt"), "w") as f:
        f.write("scanned at 8x8")
    return len(images)
