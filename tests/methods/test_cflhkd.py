"""CFLHKD end to end over a real Mosquitto (digits): devices in two planted groups (the second
group's images turned a quarter) are clustered after the warm-up round, moved to their group's
edge, train their cluster model with distillation, and the run finishes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from splitedge.methods.clustering import adjusted_rand
from splitedge.methods.cflhkd.distill import merge_tables, teachers
from splitedge.sim import SimSettings, run_sim


def test_planted_groups_are_recovered_moved_and_trained(mosquitto, tmp_path) -> None:
    torch.set_num_threads(1)
    s = SimSettings(rounds=3, devices=6, edges=2, method="cflhkd", groups=2, broker=mosquitto.url, run="cfl-test",
                    out=tmp_path, deadline_s=120.0)
    summary = run_sim(s)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    clusters = json.loads((tmp_path / "clusters.json").read_text())
    # the clustering after warm-up round 1 found the planted groups, and each went to its own edge
    found = {d: v["cluster"] for d, v in clusters["devices"].items()}
    assert adjusted_rand(found, summary["planted_groups"]) == 1.0
    assert clusters["round"] == 1 and (tmp_path / "dendrogram.png").stat().st_size > 0
    edges = {d: v["edge"] for d, v in clusters["devices"].items()}
    assert len({edges[d] for d in ("d0", "d1", "d2")}) == 1 and len(set(edges.values())) == 2
    # from round 2 on, each edge holds exactly its cluster (the moves happened) and devices distil
    assert [r["phase"] for r in history] == ["warmup", "clustered", "clustered"]
    assert set(history[-1]["cluster_accuracy"]) == set(edges.values())
    assert history[-1]["loss"]["device"]["kd_global"] > 0 and history[-1]["loss"]["device"]["kd_peers"] > 0
    assert history[-1]["personalised_accuracy"] > history[0]["personalised_accuracy"]
    # logits travel, never data: a device sends classes x classes floats per round on top of its model
    assert summary["device_bytes_by_kind"]["out"]["logits"]["payload"] / (6 * 3) < 2 * 10 * 10 * 4


def test_teachers_weigh_clusters_by_their_counts_per_class() -> None:
    # Prepare: two clusters' tables over 2 classes; cluster 0 holds only class 0, cluster 1 both
    t0 = merge_tables([(np.array([0]), np.array([3]), np.array([[2.0, 0.0]]))], 2)
    t1 = merge_tables([(np.array([0, 1]), np.array([1, 4]), np.array([[6.0, 0.0], [0.0, 1.0]]))], 2)
    # Execute
    g, has_g, p, has_p = teachers({0: t0, 1: t1}, own=0)
    # Assert: class 0's global teacher is (3 * 2 + 1 * 6) / 4 = 3; cluster 0's peers are cluster 1 alone
    np.testing.assert_allclose(g[0], [3.0, 0.0])
    np.testing.assert_allclose(p, t1[1])
    assert has_g.tolist() == [True, True] and has_p.tolist() == [True, True]
    assert not teachers({0: t0}, own=0)[3].any()  # no peer cluster: no peer teacher
    # teacher_weights=equal: each cluster holding the class alike, (2 + 6) / 2 = 4, however many
    # samples it has (a large cluster no longer dominates); a class one cluster holds is its own
    g_eq = teachers({0: t0, 1: t1}, own=0, weighting="equal")[0]
    np.testing.assert_allclose(g_eq[0], [4.0, 0.0])
    np.testing.assert_allclose(g_eq[1], t1[1][1])
    with pytest.raises(ValueError, match="teacher weighting"):
        teachers({0: t0}, own=0, weighting="samples")


def test_distillation_term_hand_computed() -> None:
    import math

    from splitedge.methods.cflhkd.distill import kd_term
    from splitedge.methods.training import Batch

    # Prepare: T = 1, two classes; sample 0 (class 0) has a teacher row, sample 1 (class 1) has none
    term = kd_term("kd", "teacher", temperature=1.0, weight=0.5)
    teacher = torch.tensor([[0.0, 0.0], [9.0, 9.0]])
    has = torch.tensor([True, False])
    out = {"logits": torch.tensor([[math.log(3.0), 0.0], [5.0, 1.0]], requires_grad=True)}
    batch = Batch(torch.zeros(2, 1), torch.tensor([0, 1]), {"teacher": (teacher, has)})
    # Execute
    value = term.fn(out, batch)
    # Assert: teacher (1/2, 1/2), student (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2; masked mean over 2 samples
    expected = (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)) / 2
    assert float(value.detach()) == pytest.approx(expected, rel=1e-6) and term.weight == 0.5
    value.backward()
    assert out["logits"].grad[1].abs().sum() == 0  # no teacher for class 1: no pull


@st.composite
def _devices_on_edges(draw) -> tuple[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]], list[int]]:
    """Device tables (held classes, counts, mean logits) and each device's edge."""
    c = draw(st.integers(2, 10))
    n_dev = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tables = []
    for _ in range(n_dev):
        held = np.flatnonzero(rng.random(c) < 0.6)
        held = held if held.size else np.array([int(rng.integers(c))])
        tables.append((held.astype(np.int64), rng.integers(1, 500, held.size),
                       rng.normal(0, 5, (held.size, c)).astype(np.float32)))
    edges = [draw(st.integers(0, 3)) for _ in range(n_dev)]
    return c, tables, edges


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_devices_on_edges())
def test_teacher_tables_merged_through_edges_equal_one_merge_of_all_devices(case) -> None:
    # Prepare: every device's class-wise mean logits, spread over edges in any way
    c, tables, edges = case
    # Execute: each edge merges its devices and sends its held classes in float32 (as edge.py
    # does), the cloud merges the edges; and, for reference, one merge of every device
    sent = []
    for e in sorted(set(edges)):
        counts, logits = merge_tables([t for t, where in zip(tables, edges) if where == e], c)
        held = np.flatnonzero(counts)
        sent.append((held, counts[held], logits[held].astype(np.float32)))
    via_edges = merge_tables(sent, c)
    direct = merge_tables(tables, c)
    # Assert: counts exactly, logits up to the float32 the wire carries
    np.testing.assert_array_equal(via_edges[0], direct[0])
    np.testing.assert_allclose(via_edges[1], direct[1], rtol=1e-5, atol=1e-5)
    # and the global teacher over per-edge clusters is that same merge
    g, has_g, _, _ = teachers({e: merge_tables([s], c) for e, s in enumerate(sent)}, own=None)
    np.testing.assert_allclose(g, direct[1], rtol=1e-5, atol=1e-5)
    assert has_g.tolist() == (direct[0] > 0).tolist()


def test_the_two_way_hierarchy_teaches_the_clusters_with_the_global_model_and_distils_it_back(mosquitto,
                                                                                               tmp_path) -> None:
    """The paper's form (global_teacher=model, distill_global=true): after clustering every device
    holds the cloud's global model, which teaches its cluster model per sample, and distils its
    trained cluster model back into it; the cloud's global model is the merge of those
    distillations, scored on every group's held-out data with that group's labels."""
    torch.set_num_threads(1)
    s = SimSettings(rounds=3, devices=6, edges=2, method="cflhkd", groups=2, broker=mosquitto.url, run="cfl-two-way",
                    out=tmp_path, deadline_s=120.0, overrides={"global_teacher": "model", "distill_global": True})
    summary = run_sim(s)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in history] == ["warmup", "clustered", "clustered"]
    # both directions ran: the global model taught (kd_global) and learnt from the clusters (kd_up)
    losses = history[-1]["loss"]["device"]
    assert losses["kd_global"] > 0 and losses["kd_up"] > 0 and losses["kd_peers"] > 0, losses
    # the global model is measured where it means something, and it moved every clustered round
    assert "global_personal_accuracy" not in history[0]
    assert all(0 < r["global_personal_accuracy"] <= 1 for r in history[1:])
    assert [r["model_version"] for r in history] == [1, 2, 3]
    # the global model goes down to every device once clustered: weights of two parts per device
    down = summary["device_bytes_by_kind"]["in"]["weights"]["messages"]
    assert down >= 6 * (1 + 2 * 2), summary["device_bytes_by_kind"]["in"]["weights"]


def test_the_upward_term_gives_the_global_model_a_distillation_gradient() -> None:
    from splitedge.methods.cflhkd.distill import kd_model_term
    from splitedge.methods.training import Batch

    class Fixed(torch.nn.Module):
        """A teacher whose logits are given (model_outputs reads features_and_logits)."""

        def __init__(self, logits: torch.Tensor) -> None:
            super().__init__()
            self.logits = logits

        def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, self.logits

    # Prepare: T = 2; teacher logits (0, 2 ln 3) give softmax at T (1/4, 3/4); the student's (0, 0) give (1/2, 1/2)
    import math

    teacher = Fixed(torch.tensor([[0.0, 2 * math.log(3.0)]])).train()
    term = kd_model_term("kd_up", "teacher_cluster", temperature=2.0, weight=1.0)
    student = {"logits": torch.zeros(1, 2, requires_grad=True)}
    # Execute
    value = term.fn(student, Batch(torch.zeros(1, 2), torch.tensor([0]), {"teacher_cluster": teacher}))
    value.backward()
    # Assert: T^2 KL((1/4, 3/4) || (1/2, 1/2)); gradient T^2 / T (s - t) = 2 (1/4, -1/4), toward the teacher
    expected = 4 * (0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5))
    assert float(value.detach()) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(student["logits"].grad.numpy(), [[0.5, -0.5]], rtol=1e-6)
    assert teacher.training  # run in eval mode, its mode given back
    assert float(term.fn(student, Batch(torch.zeros(1, 2), torch.tensor([0]), {})).detach()) == 0.0  # no teacher


def test_the_two_way_hierarchy_has_no_private_form_yet_and_says_so() -> None:
    from splitedge.methods.cflhkd.config import CFLHKDConfig

    for private in ({"dp_sigma": 1.0, "dp_clip": 1.0, "dp_update_clip": 1.0}, {"secagg": "full"}):
        with pytest.raises(ValueError, match="no private or secure form yet"):
            CFLHKDConfig(global_teacher="model", **private)
        with pytest.raises(ValueError, match="no private or secure form yet"):
            CFLHKDConfig(distill_global=True, **private)
        CFLHKDConfig(**private)  # the one-way form has both
    with pytest.raises(ValueError, match="global_teacher must be table or model"):
        CFLHKDConfig(global_teacher="cloud")


@pytest.mark.parametrize("signal, names", [("updates", ["wg.2.weight", "wg.2.bias"]),
                                           ("stem", ["wc.0.weight", "wc.0.bias"]),
                                           ("model", ["wc.0.weight", "wc.0.bias", "wc.3.weight", "wg.0.weight",
                                                      "wg.2.weight", "wg.2.bias"])])
def test_each_clustering_signal_is_the_update_of_its_layers(signal: str, names: list[str]) -> None:
    # the classifier's update (label skew), the first layer's (image skew such as rotation) or the
    # whole model's; integer buffers (a BatchNorm's batch counter) never enter a signal
    from types import SimpleNamespace

    from splitedge.methods.cflhkd.device import CFLHKDDevice

    rng = np.random.default_rng(0)
    shapes = {"wc.0.weight": (4, 3, 3, 3), "wc.0.bias": (4,), "wc.1.num_batches_tracked": (), "wc.3.weight": (8, 4),
              "wg.0.weight": (6, 8), "wg.2.weight": (3, 6), "wg.2.bias": (3,)}
    start = {k: (np.array(5) if not s else rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
    after = {k: (v + 1 if v.dtype.kind == "i" else v + rng.normal(size=v.shape).astype(np.float32))
             for k, v in start.items()}
    part = SimpleNamespace(cfg=SimpleNamespace(signal=signal),
                           model=SimpleNamespace(wg=torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(),
                                                                        torch.nn.Linear(6, 3))))
    got = CFLHKDDevice.signal(part, after, start)  # type: ignore[arg-type]
    want = np.concatenate([(after[k] - start[k]).ravel() for k in names])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    part.cfg.signal, part.label_counts = "labels", np.array([3.0, 1.0, 0.0])
    np.testing.assert_allclose(CFLHKDDevice.signal(part, after, start), [0.75, 0.25, 0.0])


def test_the_layout_signal_turns_with_the_images_and_has_no_private_form() -> None:
    # an identity first layer: the signal is each 2 x 2 cell's mean pixel over the images, so
    # turning every image a half turn turns the 4 x 4 grid a half turn
    from splitedge.methods.cflhkd.config import CFLHKDConfig
    from splitedge.methods.cflhkd.layout import layout_signal

    conv = torch.nn.Conv2d(1, 1, 1, bias=False)
    torch.nn.init.ones_(conv.weight)
    model = torch.nn.Sequential(conv, torch.nn.Flatten())
    x = torch.rand(6, 1, 8, 8)
    grid = layout_signal(model, x).reshape(4, 4)
    np.testing.assert_allclose(grid, x.reshape(6, 4, 2, 4, 2).mean(dim=(0, 2, 4)).numpy(), rtol=1e-5)
    turned = layout_signal(model, torch.rot90(x, 2, dims=(2, 3))).reshape(4, 4)
    np.testing.assert_allclose(turned, np.rot90(grid, 2), rtol=1e-5)
    assert not np.allclose(turned, grid)
    with pytest.raises(ValueError, match="signal=layout .* no DP form"):
        CFLHKDConfig(signal="layout", dp_sigma=1.0, dp_clip=1.0, dp_update_clip=1.0)
    with pytest.raises(ValueError, match="signal must be one of updates, stem, model, labels, layout"):
        CFLHKDConfig(signal="pixels")
