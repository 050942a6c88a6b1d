"""What a device may count in anything it sends, and which devices an edge admits.

A device's hello says how many samples it holds and which classes. Self-declared, that bounds
nothing: a device announcing 100x its samples weighs 100x in every merge. An operator who split
the data (`splitedge data split` writes a manifest: each device's id, samples and class counts)
gives its edge the manifest (`splitedge edge --manifest`, shards.json or the folder of the split):
the edge then admits only the devices it lists (a sybil's new id is refused at its hello) and
bounds each by its entry, whatever its hello says. Without one (the edge says so at start-up), a
device is bounded by its own hello, and its statistics still may name only the classes it announced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Allowance:
    """At most `samples` in all; only `classes` (None: any); with `class_counts` (from a
    manifest), at most that many of each class."""

    samples: int
    classes: frozenset[int] | None = None
    class_counts: Mapping[int, int] | None = None

    @classmethod
    def of_hello(cls, body: Mapping[str, Any]) -> Allowance:
        """A hello without `classes` (a device that hides them, `--hide-classes`) allows any class."""
        classes = body.get("classes")
        return cls(int(body["samples"]), None if classes is None else frozenset(int(c) for c in np.asarray(classes)))

    def within(self, listed: Allowance | None) -> Allowance:
        """This (a hello's) bounded by the operator's entry: the fewer samples, the classes both
        name, the entry's class counts."""
        if listed is None:
            return self
        classes = listed.classes if self.classes is None else (
            self.classes if listed.classes is None else self.classes & listed.classes)
        return Allowance(min(self.samples, listed.samples), classes, listed.class_counts)


MANIFEST_NAME = "shards.json"
"""The manifest `splitedge data split` writes beside the shards."""


def manifest_file(path: Path | str) -> Path:
    """The manifest `path` names: the file itself, or the shards.json in the folder `data split`
    wrote (its --out), so an edge started with that folder finds it."""
    path = Path(path)
    return path / MANIFEST_NAME if path.is_dir() else path


def manifest_allowances(path: Path | str) -> dict[str, Allowance]:
    """device id -> its Allowance, from a `splitedge data split` manifest (its file, or the folder
    it sits in); ValueError with a line that says what is wrong otherwise."""
    given, path = Path(path), manifest_file(path)
    try:
        devices = json.loads(path.read_text())["devices"]
        return {str(d["id"]): listed(int(d["samples"]), d["class_counts"]) for d in devices}
    except FileNotFoundError:
        where = f"no {MANIFEST_NAME} in this folder" if given.is_dir() else "no such file"
        raise ValueError(f"--manifest {given}: {where} (give the {MANIFEST_NAME} `splitedge data split` writes "
                         f"beside the shards, or the folder holding it)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--manifest {path}: not a manifest written by `splitedge data split` ({exc})") from None


def listed(samples: int, class_counts: Any) -> Allowance:
    """An operator's entry: `samples` in all and `class_counts[c]` of class c (the classes held)."""
    counts = {c: int(n) for c, n in enumerate(np.asarray(class_counts).tolist()) if int(n) > 0}
    return Allowance(int(samples), frozenset(counts), counts)
