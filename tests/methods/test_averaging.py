"""methods.averaging: exact sample-weighted averages, numpy only."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from splitedge.methods.averaging import average_states


def test_weighted_average_exact():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([[0.0]], np.float32)}
    b = {"w": np.array([4.0, 8.0], np.float32), "b": np.array([[3.0]], np.float32)}
    out = average_states([(a, 1), (b, 2)])        # weights 1/3, 2/3
    np.testing.assert_array_equal(out["w"], np.array([3.0, 6.0], np.float32))
    np.testing.assert_array_equal(out["b"], np.array([[2.0]], np.float32))
    assert list(out) == ["w", "b"] and out["w"].dtype == np.float32


def test_integer_buffers_take_max_and_zero_count_part_ignored():
    a = {"bn.num_batches_tracked": np.array(5, np.int64), "w": np.array([1.0])}
    b = {"bn.num_batches_tracked": np.array(9, np.int64), "w": np.array([100.0])}
    c = {"bn.num_batches_tracked": np.array(2, np.int64), "w": np.array([7.0])}
    out = average_states([(a, 3), (b, 0), (c, 1)])
    assert out["bn.num_batches_tracked"] == 9
    assert out["bn.num_batches_tracked"].dtype == np.int64
    np.testing.assert_allclose(out["w"], [(3 * 1.0 + 7.0) / 4])


def test_equal_counts_is_plain_mean_and_single_part_is_identity():
    rng = np.random.default_rng(0)
    parts = [{"w": rng.normal(size=(3, 4))} for _ in range(3)]
    out = average_states([(p, 10) for p in parts])
    np.testing.assert_allclose(out["w"], np.mean([p["w"] for p in parts], axis=0), rtol=1e-12)
    np.testing.assert_array_equal(average_states([(parts[0], 4)])["w"], parts[0]["w"])


@pytest.mark.parametrize("parts, match", [
    ([], "at least one"),
    ([({"w": np.zeros(2)}, 1), ({"v": np.zeros(2)}, 1)], "names differ"),
    ([({"w": np.zeros(2)}, 1), ({"w": np.zeros(3)}, 1)], "'w'"),
    ([({"w": np.zeros(2)}, -1)], "negative"),
    ([({"w": np.zeros(2)}, 0)], "total sample count"),
])
def test_bad_input_raises(parts, match):
    with pytest.raises(ValueError, match=match):
        average_states(parts)


def test_module_does_not_import_torch():
    code = "import sys, splitedge.methods.averaging; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_zero_d_entries_stay_arrays():
    # Prepare: BN's num_batches_tracked is a 0-d int64 array; a float scalar parameter too
    parts = [({"n": np.array(3, dtype=np.int64), "s": np.array(1.0, dtype=np.float32)}, 1),
             ({"n": np.array(5, dtype=np.int64), "s": np.array(3.0, dtype=np.float32)}, 1)]
    # Execute
    avg = average_states(parts)
    # Assert: still ndarrays (the wire codec only carries arrays), values right
    assert isinstance(avg["n"], np.ndarray) and avg["n"].shape == () and int(avg["n"]) == 5
    assert isinstance(avg["s"], np.ndarray) and float(avg["s"]) == 2.0


def test_weight_updates_pick_one_part_and_drop_stale_versions():
    # Prepare: reports holding two parts and an update trained from an old version
    from splitedge.methods.contract import RoundReport

    class Env:
        def __init__(self, part, version, samples):
            self.body = {"part": part, "version": version, "samples": samples, "weights": {"w": np.zeros(1)}}

    a, b = RoundReport("d0"), RoundReport("d1")
    a.messages["weights"] = [Env("wc", 2, 10), Env("we", 2, 99)]
    b.messages["weights"] = [Env("wc", 1, 5)]
    # Execute
    from splitedge.methods.averaging import weight_updates

    current = weight_updates([a, b], "wc", 2)
    any_version = weight_updates([a, b], "wc")
    # Assert
    assert [n for _, n in current] == [10] and [n for _, n in any_version] == [10, 5]
