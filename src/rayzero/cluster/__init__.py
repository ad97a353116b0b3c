"""Ray start-up and the only place that knows resources: every `ray.remote(...)` of rayzero is applied here.

`plan(config, available)` turns the config (and what the cluster offers) into per-role actor options;
`build(config, spec)` starts the roles with those options; `connect(cluster_cfg)` joins or starts Ray.
"""

from rayzero.cluster.build import (Handles, Plan, ReplayShards, build, build_learner_group, connect, make_selfplay,
                                   plan)

__all__ = ["Handles", "Plan", "ReplayShards", "build", "build_learner_group", "connect", "make_selfplay", "plan"]
