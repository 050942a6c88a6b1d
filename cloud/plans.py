"""What the cloud announces: each round's plan (its part's versions and directives), the rosters
of the secure sums it names, and the stop that ends a run. The round driver (cloud/driver.py)
decides when each is sent; `cloud` is the coordinator (its part, session and settings).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.runtime.stopping import INTERRUPTED


def round_plan(cloud: Any, r: int, participants: tuple[str, ...] = ()) -> RoundPlan:
    """Round r as the part plans it, under this cloud's session and attempt."""
    spec, method = cloud.part.plan(r), cloud.method
    return RoundPlan(round=r, method=method.name, deadline_s=cloud.settings.deadline_s,
                     config=method.run_config.to_wire(), versions=dict(spec.versions),
                     directives=dict(spec.directives), session=cloud.session, attempt=cloud.attempt,
                     participants=participants)


def with_members(cloud: Any, plan: RoundPlan) -> RoundPlan:
    """With secure sums on, `plan` naming each edge's devices for its secure sums (those the
    edge lists as live, drawn when sampling), signed with the cloud's key in a signed
    federation: the edge relays it and cannot choose its devices' rosters
    (methods/privacy/roster.py)."""
    cfg = cloud.method.config
    if getattr(cfg, "secagg", "off") == "off":
        return plan
    from splitedge.methods.privacy import roster

    drawn = set(plan.participants)
    members = {e: [d for d in cloud.view.members.get(e, ()) if not drawn or d in drawn]
               for e in sorted(cloud.edges.awaited)}
    signed = roster.directive(cloud.run_id, plan, cfg.secagg, roster.minimum(cfg), members,
                              getattr(cloud.transport, "signer", None))
    return dataclasses.replace(plan, directives={**plan.directives, roster.ROSTER: signed})


def stop(cloud: Any, reason: str | None = None, interrupted: bool = False) -> RoundPlan:
    """The end of the run, after the cloud's last round. A stop with a `reason` (the run never
    started) goes only to nodes listening now (not retained: it would stop the next run's nodes
    at once). An `interrupted` cloud's stop (Ctrl-C, SIGTERM) names the last round it finished
    (INTERRUPTED): nodes do not take it for the run's end (Stops.interrupted_after), and its restart
    resumes the run."""
    directives: dict[str, Any] = {"reason": reason} if reason else {}
    if interrupted:
        directives[INTERRUPTED] = cloud.committer.last_finished_round()
    return RoundPlan(round=cloud.round + 1, method=cloud.method.name, deadline_s=1.0,
                     config=cloud.method.run_config.to_wire(), session=cloud.session, stop=True,
                     directives=directives)
