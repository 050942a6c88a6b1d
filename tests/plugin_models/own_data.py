"""A data set of one's own, defined only here (tests/methods/test_plugins.py): a loader named on the
command line as own_data:load, returning ((x_train, y_train), (x_test, y_test), classes)."""

from __future__ import annotations

import numpy as np

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def load(path: str | None = None):
    """scikit-learn's digits as 8x8 uint8 images with named classes; `path`, when given, keeps
    only that many training images (what --data is for a loader is the loader's to say)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8]: the channel is added
    y = d.target.astype(np.int64)
    n = 1400 if path is None else int(path)
    return (x[:n], y[:n]), (x[1400:], y[1400:]), list(NAMES)


def float_images(path=None):
    (x, y), test, names = load(path)
    return (x.astype(np.float32), y), test, names


def labels_past_the_classes(path=None):
    (x, y), test, names = load(path)
    return (x, y), test, names[:5]


def not_square(path=None):
    (x, y), (xt, yt), names = load(path)
    return (x[:, :, :6], y), (xt[:, :, :6], yt), names


def shapes_disagree(path=None):
    (x, y), (xt, yt), names = load(path)
    return (x, y), (np.repeat(xt[..., None], 3, axis=3), yt), names


def not_three_things(path=None):
    return load(path)[0]
