"""A tiny ImageFolder tree of flat-colour JPEGs, for the data set readers' tests."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

COLOURS = {"cat": (200, 30, 30), "ant": (20, 180, 40)}


def make_tree(root: Path, per_class: int = 3) -> Path:
    """A tiny ImageFolder tree of flat-colour 8x8 JPEGs (flat colours survive JPEG almost exactly)."""
    for split in ("train", "test"):
        for cls, rgb in COLOURS.items():
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (8, 8), rgb).save(root / split / cls / f"{i:04d}.jpg", quality=95)
    return root
