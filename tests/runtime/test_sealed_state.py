"""State files carry a checksum: a flipped byte in the cloud's resume.state or an edge's state
file is refused with the path, never loaded as a changed weight; files written before seals
still load, with a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from splitedge.cloud import resume
from splitedge.methods import snapshot


def _state() -> resume.CloudState:
    return resume.CloudState(run="r", method="fedavg", config={"k": 1}, seed=0, session="s1", round=2,
                             part={"w": np.arange(64, dtype=np.float32)})


def test_a_sealed_state_reads_back_as_written(tmp_path: Path) -> None:
    resume.save(tmp_path, _state())
    back = resume.load(tmp_path)
    assert back is not None and back.round == 2 and np.array_equal(back.part["w"], np.arange(64, dtype=np.float32))
    assert (tmp_path / resume.STATE_FILE).read_bytes().startswith(snapshot.SEAL)


@pytest.mark.parametrize("where", [len(snapshot.SEAL) + 3, -5])  # in the checksum, in the weights
def test_a_flipped_byte_is_refused_with_the_path(tmp_path: Path, where: int) -> None:
    # Prepare
    resume.save(tmp_path, _state())
    path = tmp_path / resume.STATE_FILE
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    # Execute / Assert
    with pytest.raises(snapshot.SnapshotError, match="is damaged .*checksum.*--overwrite") as caught:
        resume.load(tmp_path)
    assert str(path) in str(caught.value)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    resume.save(tmp_path, _state())
    path = tmp_path / resume.STATE_FILE
    path.write_bytes(path.read_bytes()[: len(snapshot.SEAL) + 10])
    with pytest.raises(snapshot.SnapshotError, match="damaged"):
        resume.load(tmp_path)


def test_a_file_from_before_seals_loads_with_a_warning(tmp_path: Path, caplog) -> None:
    state = _state()
    data = {name: getattr(state, name) for name in state.__dataclass_fields__}
    snapshot.write_atomic(tmp_path / resume.STATE_FILE, snapshot.dumps(data))
    with caplog.at_level(logging.WARNING):
        back = resume.load(tmp_path)
    assert back is not None and back.round == 2 and "no checksum" in caplog.text


def test_an_edge_with_a_damaged_state_file_starts_afresh(tmp_path: Path, caplog) -> None:
    from splitedge.runtime import statefile

    path = tmp_path / "e0.state"
    snapshot.write_sealed(path, {"format": statefile.FORMAT, "run": "r", "w": np.ones(16, np.float32)})
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x10
    path.write_bytes(bytes(data))

    class Node:  # resume() reads only the run id before it refuses
        run_id = "r"

    with caplog.at_level(logging.WARNING):
        assert statefile.resume(path, Node()) is False
    assert "is damaged" in caplog.text and "starting afresh" in caplog.text


def test_a_damaged_checkpoint_is_set_aside_and_replaced(tmp_path: Path, caplog) -> None:
    """A truncated model.safetensors used to crash the resumed cloud (SafetensorError) after
    its next round."""
    from safetensors.numpy import load_file

    from splitedge.runtime.outputs import save_checkpoint

    path = tmp_path / "model.safetensors"
    save_checkpoint(path, {"w": np.ones(1000, np.float32)}, {"round": "2"})
    path.write_bytes(path.read_bytes()[:200])
    with caplog.at_level(logging.WARNING):
        save_checkpoint(path, {"w": np.full(1000, 3.0, np.float32)}, {"round": "3"})
    assert np.all(load_file(str(path))["w"] == 3.0)
    assert (tmp_path / "model.safetensors.damaged").stat().st_size == 200 and "unreadable" in caplog.text
