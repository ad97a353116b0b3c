"""Ray start-up and the only place that knows resources: every `ray.remote(...)` of rayzero is applied here.

`plan(config, available)` (plan.py) turns the config and what the cluster offers into per-role resources and
devices; `build(config, spec)` (build.py) starts the roles with them; `connect(cluster_cfg)` joins or starts Ray.
"""

from rayzero.cluster.build import (Handles, ReplayShards, build, build_learner_group, connect, make_inference,
                                   make_replay, make_selfplay, selfplay_name)
from rayzero.cluster.plan import LearnerRanks, Plan, Role, learner_ranks, plan, sized

__all__ = ["Handles", "LearnerRanks", "Plan", "ReplayShards", "Role", "build", "build_learner_group", "connect",
           "learner_ranks", "make_inference", "make_replay", "make_selfplay", "plan", "selfplay_name",
           "sized"]
