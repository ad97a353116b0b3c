"""Lost-transition accounting: what the self-play actors sent to replay, what replay holds of it, and why the
rest is gone.

The driver records each finished collect (the positions that reached each shard, the positions still held in
the actor's buffers, the positions whose shard died before storing them) and each self-play actor it lost. At
the end, `reconcile` takes every shard's per-sender arrivals (`ReplayBuffer.arrivals`, kept in its snapshots)
and which shards Ray restarted, and sorts every position sent into "in replay" or one of these reasons:
  * `replay_shard_restored`: stored by a shard that crashed and came back from its last snapshot without it;
  * `replay_shard_down`: sent while its shard was down (the add failed);
  * `unexplained`: acknowledged by a shard that never restarted, yet not there (a bug; should stay 0).
So sent == in replay + the lost counts of those reasons. Apart from these, two reasons count positions that
self-play had recorded but never sent, so they are lost without having been transitions sent:
  * `selfplay_actor_killed`: held in the buffers of an actor that died;
  * `inference_actor_killed`: the last segment of an episode cut by the time limit whose bootstrap value
    could not be computed because the inference actor died.
No Ray here: numbers in, numbers out (tests/test_faults.py checks it against a real faulted run).
"""

from __future__ import annotations

import collections
from typing import Any

SHARD_RESTORED, SHARD_DOWN, ACTOR_KILLED, INFERENCE_KILLED, UNEXPLAINED = (
    "replay_shard_restored", "replay_shard_down", "selfplay_actor_killed", "inference_actor_killed", "unexplained")


class TransitionLedger:
    """Per replay shard and sender: the positions acknowledged (from collect results); per sender: the
    positions held unsent at its last collect and the positions dropped because their shard was down."""

    def __init__(self, num_shards: int, arrivals_at_start: list[dict[str, int]] | None = None):
        """`arrivals_at_start`: each shard's arrivals when the run started (a resumed run's restored replay)."""
        self.num_shards = num_shards
        self.acknowledged = [collections.Counter() for _ in range(num_shards)]
        self.base = [collections.Counter(a) for a in (arrivals_at_start or [{}] * num_shards)]
        self.held: dict[str, int] = {}
        self.dropped: collections.Counter = collections.Counter()
        self.discarded: dict[str, int] = {}  # per sender, since it started (a running count in its results)
        self.killed: set[str] = set()

    def collected(self, source: str, result: dict[str, Any]) -> None:
        """A collect of `source` returned: its `sent_by_shard`, `transitions_held`, `transitions_dropped`."""
        for shard, positions in enumerate(result.get("sent_by_shard", ())):
            self.acknowledged[shard][source] += positions
        self.held[source] = result.get("transitions_held", 0)
        self.dropped[source] += result.get("transitions_dropped", 0)
        self.discarded[source] = result.get("transitions_discarded", 0)

    def actor_lost(self, source: str) -> None:
        """`source` died: what it held unsent is lost (less what its last, unfinished collect got to replay)."""
        self.killed.add(source)
        self.held.setdefault(source, 0)

    def reconcile(self, arrivals: list[dict[str, int]], restarted: list[bool]) -> dict[str, Any]:
        """`arrivals`: each shard's per-sender arrivals now; `restarted`: whether Ray restarted each shard.
        Returns transitions_sent, transitions_in_replay and lost_transitions (counts per reason)."""
        if len(arrivals) != self.num_shards or len(restarted) != self.num_shards:
            raise ValueError(f"reconcile: {len(arrivals)} arrivals and {len(restarted)} restart flags for "
                             f"{self.num_shards} shards")
        lost = dict.fromkeys((SHARD_RESTORED, SHARD_DOWN, ACTOR_KILLED, INFERENCE_KILLED, UNEXPLAINED), 0)
        sent = in_replay = 0
        unacknowledged: collections.Counter = collections.Counter()  # arrivals of a collect that never returned
        for shard in range(self.num_shards):
            now = collections.Counter(arrivals[shard])
            now.subtract(self.base[shard])
            for source in set(now) | set(self.acknowledged[shard]):
                acknowledged, arrived = self.acknowledged[shard][source], max(0, now[source])
                sent += max(acknowledged, arrived)
                in_replay += arrived
                if arrived > acknowledged:
                    unacknowledged[source] += arrived - acknowledged
                elif acknowledged > arrived:
                    lost[SHARD_RESTORED if restarted[shard] else UNEXPLAINED] += acknowledged - arrived
        down = sum(self.dropped.values())
        sent += down
        lost[SHARD_DOWN] = down
        lost[INFERENCE_KILLED] = sum(self.discarded.values())
        lost[ACTOR_KILLED] = sum(max(0, self.held[source] - unacknowledged[source]) for source in self.killed)
        return {"transitions_sent": sent, "transitions_in_replay": in_replay, "lost_transitions": lost}
