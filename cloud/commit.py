"""What the cloud writes into its `--out` folder: each round's record (metrics.jsonl), the served
model's checkpoint and the resume state, in that order, the last being the round's commit point
(cloud/resume.py: a restarted cloud carries on after the last round it finds committed).

The coordinator decides what a round's record, model and state are; this only writes them, and
turns a write that fails into one error naming the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from splitedge.cloud import resume
from splitedge.runtime.faults import crash_point
from splitedge.runtime.outputs import dumps, save_checkpoint


class RunWriter:
    """The run folder of a cloud, or nothing at all when it has none (`out_dir` None)."""

    def __init__(self, out_dir: Path | None) -> None:
        self.out_dir = out_dir

    def round(self, record: Mapping[str, Any], model: Callable[[], Mapping[str, np.ndarray]],
              metadata: Callable[[], dict[str, str]], state: Callable[[], resume.CloudState]) -> None:
        """Append the round's record, write the served model with its metadata, then commit the
        state; each of `model`, `metadata` and `state` is asked for only when there is a folder."""
        out = self.out_dir
        if out is None:
            return
        try:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "a") as fh:
                fh.write(dumps(record) + "\n")
            crash_point("cloud.metrics", record["round"])
            save_checkpoint(out / "model.safetensors", model(), metadata())
            crash_point("cloud.checkpoint", record["round"])
            resume.save(out, state())
        except OSError as exc:  # "[Errno 28] No space left on device" named no file
            raise OSError(exc.errno, f"cannot write round {record['round']} into {out}: {exc.strerror or exc}") from exc

    def commit(self, state: Callable[[], resume.CloudState]) -> None:
        """Commit the state alone (a merged round's outbox before it is published; the run's end)."""
        if self.out_dir is not None:
            resume.save(self.out_dir, state())
