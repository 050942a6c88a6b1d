"""The thin device install must never pull in torch.

Each snippet runs in a fresh interpreter (so other tests' imports cannot mask a leak) and
must print the heavy modules it found in ``sys.modules``; the list must be empty. Add a
snippet here for every module that promises to stay torch-free (e.g. the onnx device backend).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torchvision")

_PROTOCOL_ROUND_TRIP = """
import numpy as np
import protocol
env = protocol.Envelope(kind="weights", run="r", round=0, sender="d1",
                        body={"part": "wc", "version": 0, "samples": 1,
                              "weights": {"w": np.ones((2, 3), dtype="f4")}})
out = protocol.decode(protocol.encode(env))
assert out.body["weights"]["w"].shape == (2, 3)
"""

SNIPPETS = {
    "protocol": _PROTOCOL_ROUND_TRIP,
}


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_does_not_import_torch(name):
    # Prepare
    report = f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    code = SNIPPETS[name] + report
    # Execute
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    # Assert
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
