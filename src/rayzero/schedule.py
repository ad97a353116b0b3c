"""What the driver runs next: the decisions of the training loop, from the counters and what is in flight.

No Ray here: `Schedule` gets plain numbers and the set of roles with a call in flight, and answers with
`Call`s; `train.Driver` issues them and records their results. So the loop's rules are unit-tested without a
cluster (tests/test_schedule.py):
  * the learner starts once replay holds `replay.min_size` transitions (and every shard can be sampled);
  * self-play runs while the learner keeps up with `learner.replay_ratio` (learner samples per transition
    that reached replay), within a slack; the learner runs while it is behind. When the learner compiles its
    step (on a GPU: a minute or two in its first call), self-play runs freely until that first call returns
    (or until replay holds `learner.warmup_transitions`), and the ratio then counts from that point, so
    neither side starts out stalled;
  * reanalyse runs while it is behind its share (`reanalyse.fraction`) of the samples trained on;
  * evaluation every `run.eval_interval` seconds once the learner has stepped, and sooner when self-play's
    mean return over its last episodes reaches `run.stop_return` (no sooner than half an interval after the last
    evaluation), so that a run that can stop is not kept training until the interval is up;
  * with a time limit, training stops before it for the final evaluation, which then plays the final weights
    alone on the GPU and ends by the limit: its expected length (below) at the seconds a step measured alone at
    the start, at most `run.final_eval_seconds` (and a quarter of the limit). The last evaluation during
    training starts as late as it can and still end when training does: at that end less its expected length,
    even before the interval is up; a regular one that would still be playing then, or any that would end later,
    is not started. An evaluation lasts as long as its longest game, and games lengthen as the agent improves:
    the next is expected to take the last one's seconds a step, for up to EVAL_GROWTH times its longest game (at
    most run.eval_max_steps), plus a margin. So both play the freshest weights they can, where a fixed cadence
    could leave a run's last minutes unseen;
  * a role never has two calls in flight, except the learner, which has `learner.calls_in_flight` queued (its
    actor runs them in order), all counted in the ratio;
  * the run stops at the first limit reached (interrupt, time, env steps, learner steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from rayzero.config import Config, RunConfig

COLLECT, LEARN, REANALYSE, EVAL = "collect", "learn", "reanalyse", "eval"
EVAL_GROWTH = 1.5
"""The next evaluation's longest game is expected to be up to this times the last one's (Pong's grew from ~1,000
to the 4,000-step cap between two evaluations of a 540 s run)."""
EVAL_MARGIN = 1.1
"""And its steps to take up to this times the last one's seconds a step."""
STOP_SECONDS = 2.0
"""And the reserve adds this for stopping: the calls in flight ending and the final weights being published before
the final evaluation starts (a short run's reserve is otherwise less than that, and its end overran the limit)."""
LAST_EVAL_LEAD = 1.0
"""Seconds ahead of its latest start that the last evaluation may start: the loop's longest wait (wait_timeout)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One remote call to start: `role` and the index of its actor (self-play actor, reanalyse worker)."""

    role: str
    index: int = 0
    temperature: float = 1.0
    """collect: the visit temperature of self-play."""
    shard: int = 0
    """reanalyse: the replay shard to re-search."""

    @property
    def key(self) -> tuple[str, int]:
        """What may have only one call in flight."""
        return self.role, self.index


@dataclasses.dataclass
class Counters:
    """What the driver has recorded so far (results of finished calls only)."""

    env_steps: int = 0
    learner_steps: int = 0
    replay_transitions: int = 0
    """Transitions that reached replay (env steps still in an actor's segment buffer cannot be trained on)."""
    reanalysed: int = 0
    episodes: int = 0


@dataclasses.dataclass(frozen=True)
class Rules:
    """The numbers the schedule decides by, taken from the config and the built roles."""

    replay_ratio: float
    min_size: int
    samples_per_step: int
    """learner.batch_size x learner ranks (each rank trains on its own batch)."""
    steps_per_call: int
    slack: float
    """Learner samples by which self-play may run ahead of the ratio (replay must fill first)."""
    reanalyse_fraction: float = 0.0
    num_reanalyse: int = 0
    num_shards: int = 1
    temperature_schedule: tuple[tuple[int, float], ...] = ()
    eval_interval: float = 30.0
    stop_return: float = 0.0
    """The evaluation mean return that stops the run (0 = none): self-play reaching it brings an evaluation forward."""
    eval_max_steps: int = 0
    """Steps an evaluation's games play at most (0 = unknown)."""
    log_interval: float = 5.0
    checkpoint_interval: int = 1000
    time_limit: float = 0.0
    final_reserve: float = 0.0
    """The most seconds before time_limit at which training stops, so that the final evaluation ends by the
    limit (Schedule.reserve: fewer once its length can be estimated)."""
    final_max_steps: int = 0
    """Steps the final evaluation's games play at most (0 = unknown)."""
    max_env_steps: int = 0
    max_learner_steps: int = 0
    free_first_call: bool = False
    """Self-play is not held back by the ratio until the learner's first call returns (it compiles there)."""
    warmup_transitions: int = 0
    """With free_first_call: the most transitions self-play adds before that call returns (0 = no cap)."""
    learn_calls: int = 1
    """Learner calls kept in flight (learner.calls_in_flight)."""

    @classmethod
    def from_config(cls, config: Config, num_selfplay: int, num_shards: int, num_reanalyse: int,
                    learner_compiles: bool = False) -> Rules:
        learner, replay, run = config.learner, config.replay, config.run
        collect_env_steps = run.selfplay_steps_per_call * config.env.num_envs
        return cls(
            replay_ratio=learner.replay_ratio, min_size=replay.min_size,
            samples_per_step=learner.batch_size * config.cluster.num_learners, steps_per_call=learner.steps_per_call,
            slack=learner.replay_ratio * max(replay.min_size, 2 * collect_env_steps * num_selfplay),
            reanalyse_fraction=config.reanalyse.fraction, num_reanalyse=num_reanalyse, num_shards=num_shards,
            temperature_schedule=run.temperature_schedule, eval_interval=run.eval_interval,
            stop_return=run.stop_return, eval_max_steps=run.eval_max_steps,
            log_interval=run.log_interval, checkpoint_interval=learner.checkpoint_interval,
            time_limit=run.time_limit, final_reserve=final_reserve(run),
            final_max_steps=run.final_steps,
            max_env_steps=run.max_env_steps, max_learner_steps=run.max_learner_steps,
            free_first_call=learner_compiles, warmup_transitions=learner.warmup_transitions,
            learn_calls=learner.calls_in_flight,
        )


def final_reserve(run: RunConfig) -> float:
    """The most seconds of a time-limited run left to its final evaluation (run.final_eval_seconds, at most a
    quarter of the limit)."""
    if not run.time_limit:
        return 0.0
    return min(run.final_eval_seconds, run.time_limit / 4)


def _grown(steps: int, cap: int) -> float:
    """The longest game the next evaluation is expected to play, from the last one's `steps`: EVAL_GROWTH times
    as long, at most `cap` steps (0 = no cap)."""
    longest = EVAL_GROWTH * steps
    return min(longest, cap) if cap else longest


def temperature_at(schedule: tuple[tuple[int, float], ...], learner_steps: int) -> float:
    """The visit temperature of the last (learner step, temperature) entry whose step has passed."""
    value = schedule[0][1] if schedule else 1.0
    for step, temperature in schedule:
        if learner_steps >= step:
            value = temperature
    return value


class Schedule:
    """The loop's decisions; times are seconds on the driver's clock (`time.perf_counter()`)."""

    def __init__(self, rules: Rules, start: float, learner_steps: int = 0, now: float | None = None):
        """`start`: when the run started (the time limit counts from it); `now`: when the loop starts (the
        evaluation and log cadences count from it; default `start`)."""
        self.rules = rules
        self.start = start
        self.alone_step_seconds = 0.0  # an evaluation step's seconds with nothing else on the GPU (0 = unknown)
        self.longest_eval = 0  # the last evaluation's longest game, in steps
        now = start if now is None else now
        self.next_eval = now + rules.eval_interval
        self.last_eval_end = now - rules.eval_interval  # (none yet: an early one may start at once)
        self.eval_started = 0.0
        self.expected_eval = 0.0  # seconds the next evaluation is expected to take
        self.next_log = now + rules.log_interval
        interval = rules.checkpoint_interval
        self.next_checkpoint = (learner_steps // interval + 1) * interval
        self.reanalyse_calls = 0
        self.shards_filled = rules.num_shards == 1
        self.learned_once = not rules.free_first_call  # (when it matters) the learner's first call has returned
        self.ratio_base = 0.0  # transitions the ratio leaves out: those added before that call returned

    # -- what to start -----------------------------------------------------------------------------------

    def learner_ready(self, counters: Counters, shards_sampleable: Callable[[], bool]) -> bool:
        """Replay holds min_size transitions and every shard something to sample (asked once, then kept)."""
        if counters.replay_transitions < max(1, self.rules.min_size):
            return False
        if not self.shards_filled:
            self.shards_filled = shards_sampleable()
        return self.shards_filled

    def next_calls(self, counters: Counters, in_flight: Collection[tuple[str, int]], actors: Collection[int],
                   now: float, shards_sampleable: Callable[[], bool] = lambda: True) -> list[Call]:
        """The calls to start now. `in_flight`: keys (`Call.key`) of the calls not yet finished; `actors`: the
        indices of the live self-play actors; `shards_sampleable`: whether every replay shard can be sampled."""
        rules = self.rules
        ready = self.learner_ready(counters, shards_sampleable)
        samples = counters.learner_steps * rules.samples_per_step
        target = rules.replay_ratio * (counters.replay_transitions - self.ratio_base)
        calls = []
        warming_up = not self.learned_once and rules.warmup_transitions > 0 and \
            counters.replay_transitions >= rules.warmup_transitions  # full enough: wait for the first call
        if not warming_up and (not (ready and self.learned_once) or target <= samples + rules.slack):
            temperature = temperature_at(rules.temperature_schedule, counters.learner_steps)
            calls += [Call(COLLECT, i, temperature=temperature) for i in sorted(actors)
                      if (COLLECT, i) not in in_flight]
        if ready:
            call_samples = rules.steps_per_call * rules.samples_per_step
            queued = sum(1 for i in range(rules.learn_calls) if (LEARN, i) in in_flight)
            for i in range(rules.learn_calls):  # the queued calls' samples count as trained
                if (LEARN, i) not in in_flight and samples + queued * call_samples < target + call_samples:
                    calls.append(Call(LEARN, i))
                    queued += 1
        for i in range(rules.num_reanalyse):
            if ready and (REANALYSE, i) not in in_flight and counters.reanalysed < rules.reanalyse_fraction * samples:
                calls.append(Call(REANALYSE, i, shard=self.reanalyse_calls % rules.num_shards))
                self.reanalyse_calls += 1
        if (EVAL, 0) not in in_flight and counters.learner_steps > 0 and self._eval_due(now):
            self.eval_started = now
            calls.append(Call(EVAL))
        return calls

    def _eval_due(self, now: float) -> bool:
        """Whether an evaluation starts now (none in flight, the learner has stepped): see the module docstring."""
        if not self.rules.time_limit:
            return now >= self.next_eval
        end = self.train_end
        expected = self.expected_eval
        last_start = end - expected
        if expected > 0 and now >= last_start - LAST_EVAL_LEAD:
            # The last one that ends within the limit, as late as it can start. The loop wakes when it is due
            # (wait_timeout), but a result it is busy with can make it late: then it may still start within the
            # estimate's margin, which leaves it ending in time if its steps take no longer than the last one's.
            return now <= last_start + (1.0 - 1.0 / EVAL_MARGIN) * expected
        if now + expected > end:
            return False  # it would not end in time
        return now >= self.next_eval and now + expected <= last_start  # done before the last one is due

    def learned(self, counters: Counters) -> None:
        """A learner call returned (counters updated). After the run's first, the ratio counts from here: the
        transitions beyond what the learner's samples cover at the ratio are left out of it."""
        if not self.learned_once:  # only with free_first_call
            self.learned_once = True
            samples = counters.learner_steps * self.rules.samples_per_step
            self.ratio_base = max(0.0, counters.replay_transitions - samples / self.rules.replay_ratio)

    # -- cadences ----------------------------------------------------------------------------------------

    def evaluated(self, now: float, steps: int = 0) -> None:
        """An evaluation ended (`steps`: its longest game's, 0 if unknown): the next one is due an interval
        later, and expected to take as long as the module docstring says."""
        seconds = max(0.0, now - self.eval_started)
        self.longest_eval = steps or self.longest_eval
        if steps > 0:
            self.expected_eval = EVAL_MARGIN * seconds / steps * max(_grown(steps, self.rules.eval_max_steps), steps)
        else:  # an evaluation that failed: as long as the longest expected so far
            self.expected_eval = max(self.expected_eval, EVAL_MARGIN * seconds)
        self.next_eval = now + self.rules.eval_interval
        self.last_eval_end = now

    def self_play_return(self, mean_return: float, now: float) -> None:
        """Self-play's recent mean return (`mean_return`, exploring play) reached run.stop_return: the next
        evaluation is due now rather than at its interval, though not sooner than half an interval after the last
        one ended, so that a greedy agent short of the return is not evaluated back to back."""
        if self.rules.stop_return and mean_return >= self.rules.stop_return:
            self.next_eval = min(self.next_eval, max(now, self.last_eval_end + self.rules.eval_interval / 2))

    @property
    def reserve(self) -> float:
        """Seconds before the time limit that training stops for the final evaluation: its expected length, as
        for the evaluations during training but at `alone_step_seconds` (nothing else runs then) and up to
        rules.final_max_steps, and STOP_SECONDS to stop training; at most rules.final_reserve (all of it while the
        length cannot be estimated)."""
        rules = self.rules
        if not self.alone_step_seconds or not self.longest_eval:
            return rules.final_reserve
        if rules.eval_max_steps and self.longest_eval >= rules.eval_max_steps and not rules.final_max_steps:
            return rules.final_reserve  # a game was cut at the evaluations' cap, and the final one has none
        # A game cut at the evaluations' cap is taken as one of the cap's length: the games are expected to grow
        # by EVAL_GROWTH as for an uncut one; games longer than that stop at the limit, at their score so far.
        # Reserving all of the final cap instead kept ~50 s of training back in Pong run 21a, whose final games
        # then ended well within the reserve (docs/benchmarks.md, twenty-first session).
        longest = _grown(self.longest_eval, rules.final_max_steps)
        return min(rules.final_reserve, STOP_SECONDS + EVAL_MARGIN * self.alone_step_seconds * longest)

    @property
    def train_end(self) -> float:
        """When training stops (with a time limit): the limit less `reserve`."""
        return self.start + self.rules.time_limit - self.reserve

    def log_due(self, now: float) -> bool:
        """Whether a progress line is due (then the next one is an interval later)."""
        if now < self.next_log:
            return False
        self.next_log = now + self.rules.log_interval
        return True

    def checkpoint_due(self, learner_steps: int) -> bool:
        """Whether a checkpoint is due after a learner call that reached `learner_steps`."""
        if learner_steps < self.next_checkpoint:
            return False
        self.next_checkpoint += self.rules.checkpoint_interval
        return True

    def stop_reason(self, counters: Counters, now: float, interrupted: bool = False) -> str:
        """Why the run ends now ('' while it goes on)."""
        rules = self.rules
        if interrupted:
            return "interrupted"
        if rules.time_limit and now >= self.train_end:
            return "time_limit"
        if rules.max_env_steps and counters.env_steps >= rules.max_env_steps:
            return "max_env_steps"
        if rules.max_learner_steps and counters.learner_steps >= rules.max_learner_steps:
            return "max_learner_steps"
        return ""

    def wait_timeout(self, now: float) -> float:
        """How long the driver may wait for a result: until the next log line or evaluation, training's end,
        and at most a second, so a Ctrl-C (a flag the loop reads) is noticed promptly."""
        times = [self.next_log, self.next_eval]  # an evaluation past its interval but held back: not a busy wait
        if self.rules.time_limit:
            times += [self.train_end, self.train_end - self.expected_eval - LAST_EVAL_LEAD]  # the last one's start
        until = min([now + 1.0] + [t for t in times if t > now])
        return max(0.01, until - now)


class Waits:
    """Which side of the replay ratio waits on the other: the seconds the learner had no train call queued, and
    the actor-seconds self-play actors had no collect in flight, over the time since the last `read`. The side
    that waits less is the bound. `busy` sets what is in flight from now until the next `tick`."""

    def __init__(self, now: float):
        self.since = self.last = now
        self.learner_idle = self.selfplay_idle = 0.0
        self.learner_busy, self.actors, self.collecting = True, 0, 0

    def busy(self, learner: bool, actors: int, collecting: int) -> None:
        self.learner_busy, self.actors, self.collecting = learner, actors, collecting

    def tick(self, now: float) -> None:
        span, self.last = now - self.last, now
        if not self.learner_busy:
            self.learner_idle += span
        if self.actors:
            self.selfplay_idle += span * (self.actors - self.collecting) / self.actors

    def read(self, now: float) -> dict[str, float]:
        """The shares of the time since the last read that each side waited (self-play's: per actor, averaged)."""
        self.tick(now)
        span = max(now - self.since, 1e-9)
        shares = {"learner_wait_share": self.learner_idle / span, "selfplay_wait_share": self.selfplay_idle / span}
        self.since, self.learner_idle, self.selfplay_idle = now, 0.0, 0.0
        return shares
