"""A part's declared state is all it needs: a part restored from its bytes computes the same next
round, bit for bit, as one never interrupted. Every registered method, end to end: a digits
federation on an embedded broker run plainly, and again with every part of every tier (devices,
edges, cloud) replaced after each of its rounds by a freshly built one restored from the bytes
of its `resume_state()`. An attribute a part needs but does not declare comes back as built
(a fresh optimiser, an empty cache, version -1), and the runs part ways: in accuracy, in the
served model, or in what the devices send."""

from __future__ import annotations

import collections
import json
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitedge.methods import snapshot
from splitedge.methods.contract import Kept, Part
from splitedge.runtime.parts import PartHost

from parts import shipped_methods

ROUNDS, DEVICES, EDGES = 3, 4, 2


class CyclingHost(PartHost):
    """After each round, the part is rebuilt from the bytes of its state (`restore` keeps the
    node's rng as it was); `cycled` counts the swaps per node, so a test sees every tier did."""

    cycled: collections.Counter = collections.Counter()
    failures: list[str] = []
    """What went wrong in a swap, node by node: a node logs and goes on, so the test must say it."""

    def end_round(self) -> None:
        if self.part is None:
            CyclingHost.failures.append(f"{self.name}: no part at the end of a round")
            return
        try:
            state = self.state()
            self.restore({**state, "part": snapshot.loads(snapshot.dumps(state["part"]))})
        except Exception:  # noqa: BLE001 - recorded for the assertion, with its traceback
            CyclingHost.failures.append(f"{self.name}: {traceback.format_exc()}")
            raise
        CyclingHost.cycled[self.name] += 1


def _run(method: str, out: Path, settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    from splitedge.sim import SimSettings, run_sim

    s = SimSettings(rounds=ROUNDS, devices=DEVICES, edges=EDGES, method=method, seed=2, max_train=600, max_test=300,
                    out=out, overrides={**({"patch": 2} if method in ("fedmar", "decmar") else {}), **settings})
    summary = run_sim(s)
    return summary, load_file(str(out / "model.safetensors"))


def _sent(summary: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Messages and payload bytes the devices sent, per kind."""
    return {k: (v["messages"], v["payload"]) for k, v in summary["device_bytes_by_kind"]["out"].items()}


CASES = [(m, {}) for m in shipped_methods()] + [(m, {"calibrate": "lda"}) for m in ("fedavg", "splitfed", "fedproto", "cflhkd")]
"""Every registered method (the registry's, less those other test modules add) as it comes, and
the calibrating forms of methods whose default does not calibrate."""


@pytest.mark.parametrize("method, settings", CASES, ids=[m + ("+lda" if s else "") for m, s in CASES])
def test_a_part_restored_from_its_bytes_does_the_same_next_round(method: str, settings: dict, tmp_path: Path,
                                                                 monkeypatch) -> None:
    import splitedge.sim

    # Prepare: the uninterrupted run
    plain, plain_model = _run(method, tmp_path / "plain", settings)
    monkeypatch.setattr(splitedge.sim.Federation, "hosts", lambda self: (CyclingHost,) * 3)
    CyclingHost.cycled.clear()
    CyclingHost.failures.clear()
    # Execute: every part of every tier rebuilt from its bytes after each of its rounds (and
    # after each calibration phase, which devices and edges work through like a round)
    cycled, cycled_model = _run(method, tmp_path / "cycled", settings)
    # Assert: every node's part was swapped after every round, and nothing told the runs apart
    phases = 1 + ("calibrate" in settings or "accuracy_calibrated_per_round" in plain) + (method in ("fedproto", "cflhkd")
                                                                                          and "calibrate" in settings)
    # a round whose calibration inputs had not changed ran no calibration phase (its head stood)
    reused = sum(bool(json.loads(line).get("calibration_reused"))
                 for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())
    nodes = ["cloud", *(f"edge e{e}" for e in range(EDGES)), *(f"device d{d}" for d in range(DEVICES))]
    assert CyclingHost.failures == []
    assert {n: CyclingHost.cycled[n] for n in nodes} == \
        {n: ROUNDS if n == "cloud" else ROUNDS * phases - reused * (phases - 1) for n in nodes}
    assert plain["closed_on_quorum"] and cycled["closed_on_quorum"]
    assert repr(cycled["accuracy_per_round"]) == repr(plain["accuracy_per_round"])  # NaN rounds (SSL) compare too
    assert cycled.get("accuracy_calibrated_per_round") == plain.get("accuracy_calibrated_per_round")
    # ... nor what the devices sent: a part that lost a cache it asks for again (an edge's device
    # moments) learns the same, at the cost of messages an uninterrupted part never sends
    assert _sent(cycled) == _sent(plain)
    assert cycled_model.keys() == plain_model.keys()
    assert all(np.array_equal(cycled_model[k], plain_model[k]) for k in plain_model), \
        [k for k in plain_model if not np.array_equal(cycled_model[k], plain_model[k])]


# -- the mechanism ---------------------------------------------------------------------------

class _Holder(Part):
    count: Kept[int]
    table: Kept[dict]
    pending: Kept[Any]

    def __init__(self) -> None:  # no context: these tests touch only the state hooks
        self.count, self.table, self.pending = 0, {}, None


def test_declared_attributes_come_back_and_nothing_else() -> None:
    part = _Holder()
    part.count, part.table, part.scratch = 3, {(1, 2): np.arange(3)}, "rebuilt, not kept"
    saved = snapshot.loads(snapshot.dumps(part.resume_state()))
    assert sorted(saved) == ["count", "pending", "table"]  # None is a value like any other
    fresh = _Holder()
    fresh.restore_state(saved)
    assert fresh.count == 3 and fresh.pending is None and not hasattr(fresh, "scratch")
    np.testing.assert_array_equal(fresh.table[(1, 2)], np.arange(3))


def test_a_declared_value_that_cannot_be_kept_is_an_error_naming_it() -> None:
    part = _Holder()
    part.table = {"log": object()}
    with pytest.raises(snapshot.SnapshotError, match=r"_Holder\.table \(dict\) is declared .*, but object values cannot"):
        part.resume_state()
    del part.pending
    part.table = {}
    with pytest.raises(snapshot.SnapshotError, match=r"_Holder\.pending is declared in its state but not set"):
        part.resume_state()


def test_a_state_of_another_version_of_the_part_is_refused_naming_the_keys() -> None:
    saved = _Holder().resume_state()
    with pytest.raises(snapshot.SnapshotError, match="holds extra, which _Holder does not declare"):
        _Holder().restore_state({**saved, "extra": 1})
    with pytest.raises(snapshot.SnapshotError, match="lacks table, which _Holder declares"):
        _Holder().restore_state({k: v for k, v in saved.items() if k != "table"})


@pytest.mark.parametrize("array", [
    np.array(3.5, dtype=np.float32),                   # 0-d
    np.zeros((0, 3)),                                  # empty
    np.arange(12, dtype=">i4").reshape(3, 4).T,        # big-endian, not C-contiguous
    np.array([True, False]), np.array(["ab", "c"]),    # bool, text
    np.linspace(0, 1, 7, dtype=np.float16),            # a parked part's half floats
], ids=["0d", "empty", "big-endian-transposed", "bool", "text", "f2"])
def test_an_array_comes_back_with_its_dtype_shape_and_values_and_writable(array: np.ndarray) -> None:
    back = snapshot.loads(snapshot.dumps({"a": array}))["a"]
    assert back.dtype == array.dtype and back.shape == array.shape and back.flags.writeable
    np.testing.assert_array_equal(back, array)


def test_a_state_file_written_in_the_npy_form_is_still_read() -> None:
    """Files written before arrays were kept as raw bytes hold np.save's form (a cloud's resume
    state, a sim's sim.state): they load as they did."""
    import io

    import msgpack

    def old_default(obj: Any) -> Any:
        buf = io.BytesIO()
        np.save(buf, obj, allow_pickle=False)
        return msgpack.ExtType(42, buf.getvalue())

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 4}
    back = snapshot.loads(msgpack.packb(state, default=old_default, use_bin_type=True))
    np.testing.assert_array_equal(back["w"], state["w"])
    assert back["n"] == 4


def test_a_truncated_or_object_array_in_a_state_file_is_a_clear_error() -> None:
    import msgpack

    good = snapshot.raw_array(np.arange(4, dtype=np.int64))
    for data, said in [(good[:-3], "holds 29 bytes, not 32"), (good[:3], "unreadable array"),
                       (b"\x02|O\x01" + (2).to_bytes(8, "little"), "array of Python objects")]:
        with pytest.raises(snapshot.SnapshotError, match=said):
            snapshot.loads(msgpack.packb({"a": msgpack.ExtType(43, data)}, use_bin_type=True))
    with pytest.raises(TypeError, match="Python objects"):
        snapshot.dumps({"a": np.array([object()])})
