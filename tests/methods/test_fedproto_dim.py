"""FedProto's prototype dimension comes from the model, fixed by the cloud before round 1, so a
numpy-only edge refuses prototypes of another dimension from the very first message (before,
the first message a rogue sent set it, and every honest device was refused after it)."""

from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.fedproto.protos import protos_body
from splitedge.protocol.errors import ProtocolError

from parts import wire


def test_the_cloud_settles_the_dimension_and_the_edge_holds_to_it_from_the_first_message() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.registry import create_method
    from splitedge.methods.contract import EdgeContext

    _, _, info = load_dataset("digits", max_train=50, max_test=20)
    config = build_run_config("fedproto", info, None, 0, {})
    dim = config.method.dim
    assert dim > 0
    method = create_method("fedproto", config.to_wire())  # as an edge builds it from the round
    edge = method.edge_part(EdgeContext(node_id="e0", method=method, rng=np.random.default_rng(0)))
    classes, counts = np.arange(2), np.array([3, 4])
    rogue = wire("moments", protos_body(classes, counts, np.ones((2, dim + 5), np.float32), "f4", 0), "d9")
    with pytest.raises(ProtocolError, match="dim"):
        edge.check(rogue, "child")
    honest = wire("moments", protos_body(classes, counts, np.ones((2, dim), np.float32), "f4", 0), "d0")
    edge.check(honest, "child")  # still accepted after the rogue's


def test_a_dimension_given_by_the_user_is_kept() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    _, _, info = load_dataset("digits", max_train=50, max_test=20)
    assert build_run_config("fedproto", info, None, 0, {"dim": 7}).method.dim == 7
    assert build_run_config("fedavg", info, None, 0, {}).method is not None  # methods without settle: unchanged
