"""The driver's decisions (schedule.py), without Ray: plain counters in, calls out."""

import pytest

from rayzero import config as config_lib
from rayzero.config import RunConfig
from rayzero.schedule import (COLLECT, EVAL, LEARN, REANALYSE, Counters, Rules, Schedule, Waits, final_reserve,
                              temperature_at)

RULES = Rules(replay_ratio=2.0, min_size=100, samples_per_step=10, steps_per_call=5, slack=50.0,
              eval_interval=30.0, log_interval=5.0, checkpoint_interval=100)


def roles(calls):
    return sorted(call.key for call in calls)


def test_learner_starts_only_when_replay_holds_min_size():
    schedule = Schedule(RULES, start=0.0)
    counters = Counters(replay_transitions=99)
    assert (LEARN, 0) not in roles(schedule.next_calls(counters, set(), [0], now=1.0))
    counters.replay_transitions = 100
    assert (LEARN, 0) in roles(schedule.next_calls(counters, set(), [0], now=1.0))


def test_learner_waits_for_every_shard():
    rules = Rules(**{**RULES.__dict__, "num_shards": 2})
    schedule = Schedule(rules, start=0.0)
    counters = Counters(replay_transitions=500)
    asked = []
    assert (LEARN, 0) not in roles(schedule.next_calls(counters, set(), [0], 1.0, lambda: asked.append(1) or False))
    assert (LEARN, 0) in roles(schedule.next_calls(counters, set(), [0], 1.0, lambda: asked.append(1) or True))
    schedule.next_calls(counters, set(), [0], 1.0, lambda: asked.append(1) or False)
    assert len(asked) == 2  # once every shard was sampleable, it is not asked again


def test_selfplay_is_throttled_at_the_replay_ratio():
    schedule = Schedule(RULES, start=0.0)  # a learner that does not compile: the ratio holds from the start
    # 1000 transitions at ratio 2 want 2000 samples; the learner has trained on 1000 (+ slack 50): far behind.
    behind = Counters(replay_transitions=1000, learner_steps=100)
    calls = roles(schedule.next_calls(behind, set(), [0, 1], now=1.0))
    assert (COLLECT, 0) not in calls and (COLLECT, 1) not in calls and (LEARN, 0) in calls
    # Within the slack self-play goes on.
    keeping_up = Counters(replay_transitions=1000, learner_steps=196)  # 1960 + 50 >= 2000
    assert {(COLLECT, 0), (COLLECT, 1)} <= set(roles(schedule.next_calls(keeping_up, set(), [0, 1], now=1.0)))
    # The learner stops once it is a call ahead of the ratio.
    ahead = Counters(replay_transitions=1000, learner_steps=205)  # 2050 samples >= 2000 + 5 * 10
    assert (LEARN, 0) not in roles(schedule.next_calls(ahead, set(), [0, 1], now=1.0))


def test_selfplay_runs_before_replay_is_ready_whatever_the_ratio():
    schedule = Schedule(RULES, start=0.0)
    calls = roles(schedule.next_calls(Counters(replay_transitions=50), set(), [0, 1, 2], now=1.0))
    assert calls == [(COLLECT, 0), (COLLECT, 1), (COLLECT, 2)]


def test_never_two_calls_on_one_role():
    rules = Rules(**{**RULES.__dict__, "reanalyse_fraction": 1.0, "num_reanalyse": 2})
    schedule = Schedule(rules, start=0.0)
    counters = Counters(replay_transitions=1000, learner_steps=196)  # within the slack: every role has work
    in_flight = set()
    for turn in range(20):
        calls = schedule.next_calls(counters, in_flight, [0, 1, 2], now=100.0 + turn)
        keys = [call.key for call in calls]
        assert len(keys) == len(set(keys)) and not set(keys) & in_flight, (keys, in_flight)
        in_flight |= set(keys)
    assert in_flight == {(COLLECT, 0), (COLLECT, 1), (COLLECT, 2), (LEARN, 0), (REANALYSE, 0), (REANALYSE, 1),
                         (EVAL, 0)}


def test_reanalyse_round_robins_over_shards_while_behind():
    rules = Rules(**{**RULES.__dict__, "reanalyse_fraction": 0.5, "num_reanalyse": 1, "num_shards": 2})
    schedule = Schedule(rules, start=0.0)
    counters = Counters(replay_transitions=1000, learner_steps=100)  # 1000 samples: 500 positions due
    shards = []
    for _ in range(3):
        (call,) = [c for c in schedule.next_calls(counters, set(), [], 1.0) if c.role == REANALYSE]
        shards.append(call.shard)
    assert shards == [0, 1, 0]
    counters.reanalysed = 500
    assert not [c for c in schedule.next_calls(counters, set(), [], 1.0) if c.role == REANALYSE]


def test_evaluation_every_interval_once_the_learner_has_stepped():
    schedule = Schedule(RULES, start=0.0)
    assert (EVAL, 0) not in roles(schedule.next_calls(Counters(learner_steps=0), set(), [], now=31.0))
    assert (EVAL, 0) not in roles(schedule.next_calls(Counters(learner_steps=5), set(), [], now=29.0))
    assert (EVAL, 0) in roles(schedule.next_calls(Counters(learner_steps=5), set(), [], now=31.0))
    schedule.evaluated(now=40.0)
    assert (EVAL, 0) not in roles(schedule.next_calls(Counters(learner_steps=5), set(), [], now=60.0))
    assert (EVAL, 0) in roles(schedule.next_calls(Counters(learner_steps=5), set(), [], now=70.0))


def test_no_evaluation_starts_that_would_end_past_the_time_limit():
    """A run ends within a minute of --time-limit: an evaluation expected to end after the limit is not started
    (the final evaluation plays the final weights at the limit instead). One whose games' length is unknown (it
    failed) is expected to take 1.1 times as long as the last."""
    rules = Rules(**{**RULES.__dict__, "eval_interval": 10.0, "time_limit": 100.0})
    schedule = Schedule(rules, start=0.0)
    stepped = Counters(learner_steps=5)
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=50.0))
    schedule.evaluated(80.0)  # it took 30 s: the next one is expected to take 33
    for now in (90.0, 95.0, 99.0):
        assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=now))
    endless = Schedule(Rules(**{**RULES.__dict__, "eval_interval": 10.0}), start=0.0)  # no time limit
    assert (EVAL, 0) in roles(endless.next_calls(stepped, set(), [], now=50.0))
    endless.evaluated(80.0)
    assert (EVAL, 0) in roles(endless.next_calls(stepped, set(), [], now=90.0))


def test_self_play_reaching_the_stop_return_brings_the_evaluation_forward_once_per_half_interval():
    """run.stop_return 195, evaluations every 20 s: self-play's mean return reaching 195 at 7 s makes an
    evaluation due then, not at 20 s; after one that ended at 12 s (greedy play short of it), the next early one
    waits until 22 s (half an interval), the regular one until 32 s. Below the return, or with no stop_return,
    nothing moves."""
    rules = Rules(**{**RULES.__dict__, "eval_interval": 20.0, "stop_return": 195.0})
    stepped = Counters(learner_steps=5)
    schedule = Schedule(rules, start=0.0)
    schedule.self_play_return(150.0, now=7.0)
    assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=7.0))
    schedule.self_play_return(195.0, now=7.0)
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=7.0))
    schedule.evaluated(12.0)
    schedule.self_play_return(230.0, now=13.0)
    assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=21.9))
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=22.0))
    never = Schedule(Rules(**{**RULES.__dict__, "eval_interval": 20.0}), start=0.0)  # stop_return 0: none
    never.self_play_return(500.0, now=7.0)
    assert (EVAL, 0) not in roles(never.next_calls(stepped, set(), [], now=19.9))
    assert (EVAL, 0) in roles(never.next_calls(stepped, set(), [], now=20.0))
    assert Rules.from_config(config_lib.load("cartpole"), 1, 1, 0).stop_return == 195.0


def test_the_last_evaluation_within_the_time_limit_starts_as_late_as_it_can():
    """A 540 s limit, evaluations 60 s apart with games of at most 4,000 steps. The next evaluation is expected
    to take 1.1 x the last one's seconds a step x 1.5 its longest game (at most 4,000 steps). The last one starts
    at the limit less that, ahead of the interval if need be; a regular one that would still be playing then
    waits for it."""
    rules = Rules(**{**RULES.__dict__, "eval_interval": 60.0, "time_limit": 540.0, "eval_max_steps": 4000})
    schedule = Schedule(rules, start=0.0)
    stepped = Counters(learner_steps=5)
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=60.0))
    schedule.evaluated(120.0, steps=1000)  # 60 ms a step: next 1.1 x 0.06 x 1,500 = 99 s, the last at 441
    assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=170.0))  # the interval
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=180.0))  # ends by 279: before 441
    schedule.evaluated(260.0, steps=2000)  # 40 ms a step: next 1.1 x 0.04 x 3,000 = 132 s, the last at 408
    # Due at 320 it would play until 452, past 408: it waits, and the last one starts at 408 (from 407: the
    # loop's longest wait), or up to the estimate's margin later (408 + 132 - 120 = 420) when the loop is late.
    for now in (320.0, 380.0, 406.9, 420.5, 450.0):
        assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=now))
    for now in (410.0, 420.0, 407.0, 408.0):
        assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=now))
    schedule.evaluated(520.0, steps=4000)  # games at the cap: next 1.1 x 112 s, not 1.5 x
    assert schedule.expected_eval == pytest.approx(1.1 * 112.0)
    assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=530.0))  # the limit is too near
    # A short evaluation that is due well before the last one's start still runs at its interval.
    early = Schedule(rules, start=0.0)
    assert (EVAL, 0) in roles(early.next_calls(stepped, set(), [], now=60.0))
    early.evaluated(65.0, steps=500)
    assert (EVAL, 0) in roles(early.next_calls(stepped, set(), [], now=125.0))


def test_a_driver_that_wakes_when_told_starts_the_last_evaluation_in_time():
    """The driver's loop: it waits as wait_timeout says, then is busy with a result for up to 3 s. The last
    evaluation before a 540 s limit (a 358 s one took 72 s for 1,996 steps: the next is expected to take 120 s)
    still starts by its latest start (420 s) plus the estimate's margin, and not a second before it is due."""
    rules = Rules(**{**RULES.__dict__, "eval_interval": 30.0, "time_limit": 540.0, "eval_max_steps": 4000,
                     "log_interval": 5.0})
    stepped = Counters(learner_steps=5)
    for busy in (0.0, 0.7, 3.0):
        schedule = Schedule(rules, start=0.0, now=23.0)
        schedule.eval_started = 286.0
        schedule.evaluated(358.0, steps=1996)
        last_start = 540.0 - schedule.expected_eval
        now, started = 358.0, None
        while now < 540.0 and started is None:
            if (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now)):
                started = now
            now += schedule.wait_timeout(now) + busy
        assert started is not None, busy
        assert last_start - 1.0 <= started <= last_start + schedule.expected_eval * (1 - 1 / 1.1), (busy, started)


def test_training_stops_before_the_time_limit_for_the_final_evaluation():
    """run.final_eval_seconds (at most a quarter of the limit) is left to the final evaluation: training stops
    that long before the limit, and no evaluation during training is started that would end after that."""
    assert final_reserve(RunConfig(time_limit=540.0, final_eval_seconds=40.0)) == 40.0
    assert final_reserve(RunConfig(time_limit=60.0, final_eval_seconds=40.0)) == 15.0
    assert final_reserve(RunConfig(time_limit=0.0, final_eval_seconds=40.0)) == 0.0  # no limit: after the end
    rules = Rules(**{**RULES.__dict__, "time_limit": 540.0, "final_reserve": 40.0, "eval_interval": 30.0,
                     "log_interval": 1e6})
    schedule = Schedule(rules, start=100.0)
    assert schedule.stop_reason(Counters(), now=599.9) == ""
    assert schedule.stop_reason(Counters(), now=600.0) == "time_limit"
    assert schedule.wait_timeout(now=599.5) == pytest.approx(0.5)
    stepped = Counters(learner_steps=5)
    schedule.eval_started = 400.0
    schedule.evaluated(460.0, steps=1000)  # the next expected to take 1.1 x 90 s = 99 s: the last at 501
    assert (EVAL, 0) not in roles(schedule.next_calls(stepped, set(), [], now=495.0))
    assert (EVAL, 0) in roles(schedule.next_calls(stepped, set(), [], now=501.0))


def test_the_final_evaluations_reserve_follows_the_last_evaluations_games_at_the_step_time_alone():
    """Training stops the final evaluation's expected length before the limit: 2 s to stop, and 1.1 x the step time
    measured alone x 1.5 the last evaluation's longest game (a game cut at the evaluations' cap counts at the cap; at most
    the final evaluation's step cap), at most rules.final_reserve, and all of that while either is unknown or a
    game was cut with no final cap."""
    rules = Rules(**{**RULES.__dict__, "time_limit": 540.0, "final_reserve": 120.0, "final_max_steps": 27_000,
                     "eval_interval": 30.0, "eval_max_steps": 4000})
    schedule = Schedule(rules, start=0.0)
    assert schedule.reserve == 120.0 and schedule.train_end == 420.0  # nothing measured yet
    schedule.alone_step_seconds = 0.016
    assert schedule.reserve == 120.0  # no evaluation yet
    schedule.evaluated(300.0, steps=2000)  # Breakout-like: 2 + 1.1 x 0.016 x 3,000 = 54.8 s
    assert schedule.reserve == pytest.approx(54.8)
    assert schedule.stop_reason(Counters(), now=485.0) == ""
    assert schedule.stop_reason(Counters(), now=485.3) == "time_limit"
    schedule.evaluated(400.0, steps=3000)  # Pong-like, under the evaluations' cap: 2 + 1.1 x 0.016 x 4,500 = 81.2 s
    assert schedule.reserve == pytest.approx(81.2)
    schedule.evaluated(450.0, steps=4000)  # a game cut at the evaluations' cap: 2 + 1.1 x 0.016 x 6,000 = 107.6 s
    assert schedule.reserve == pytest.approx(107.6)
    schedule.alone_step_seconds = 0.03  # 2 + 1.1 x 0.03 x 6,000 = 200 s: at most the final reserve
    assert schedule.reserve == 120.0
    capped = Schedule(Rules(**{**rules.__dict__, "final_max_steps": 5000}), start=0.0)
    capped.alone_step_seconds = 0.016
    capped.evaluated(300.0, steps=4000)  # cut, and the final one's cap is lower than 6,000: 2 + 1.1 x 0.016 x 5,000
    assert capped.reserve == pytest.approx(90.0)
    uncapped = Schedule(Rules(**{**rules.__dict__, "final_max_steps": 0}), start=0.0)
    uncapped.alone_step_seconds = 0.016
    uncapped.evaluated(300.0, steps=4000)
    assert uncapped.reserve == 120.0


def test_ends_at_the_time_limit():
    rules = Rules(**{**RULES.__dict__, "time_limit": 60.0, "eval_interval": 1e6, "log_interval": 1e6})
    schedule = Schedule(rules, start=1000.0)
    assert schedule.stop_reason(Counters(), now=1059.9) == ""
    assert schedule.stop_reason(Counters(), now=1060.0) == "time_limit"
    # The driver never waits past the limit.
    assert schedule.wait_timeout(now=1059.5) == pytest.approx(0.5)


@pytest.mark.parametrize("field, counters, reason", [
    ("max_env_steps", Counters(env_steps=500), "max_env_steps"),
    ("max_learner_steps", Counters(learner_steps=500), "max_learner_steps"),
])
def test_ends_at_the_step_limits(field, counters, reason):
    schedule = Schedule(Rules(**{**RULES.__dict__, field: 500}), start=0.0)
    assert schedule.stop_reason(counters, now=1.0) == reason
    assert schedule.stop_reason(Counters(), now=1.0) == ""


def test_an_interrupt_ends_first():
    schedule = Schedule(Rules(**{**RULES.__dict__, "time_limit": 1.0}), start=0.0)
    assert schedule.stop_reason(Counters(), now=5.0, interrupted=True) == "interrupted"


def test_checkpoint_and_log_cadence():
    schedule = Schedule(RULES, start=0.0, learner_steps=150)  # resumed at step 150: next checkpoint at 200
    assert not schedule.checkpoint_due(199)
    assert schedule.checkpoint_due(210) and not schedule.checkpoint_due(250) and schedule.checkpoint_due(300)
    assert not schedule.log_due(4.0) and schedule.log_due(5.0) and not schedule.log_due(6.0)


def test_temperature_follows_the_schedule():
    steps = ((0, 1.0), (100, 0.5), (200, 0.25))
    assert [temperature_at(steps, s) for s in (0, 99, 100, 250)] == [1.0, 1.0, 0.5, 0.25]
    schedule = Schedule(Rules(**{**RULES.__dict__, "temperature_schedule": steps}), start=0.0)
    (call,) = schedule.next_calls(Counters(learner_steps=120), set(), [0], now=1.0)
    assert call.role == COLLECT and call.temperature == 0.5


def test_warmup_caps_what_self_play_adds_while_the_first_call_compiles():
    """With learner.warmup_transitions, self-play stops at that many transitions until the first learner call
    returns (so replay is not full of the initial network's play when learning starts), then the ratio rules."""
    rules = Rules(**{**RULES.__dict__, "free_first_call": True, "warmup_transitions": 500})
    schedule = Schedule(rules, start=0.0)
    assert (COLLECT, 0) in roles(schedule.next_calls(Counters(replay_transitions=499), {(LEARN, 0)}, [0], 1.0))
    assert (COLLECT, 0) not in roles(schedule.next_calls(Counters(replay_transitions=500), {(LEARN, 0)}, [0], 1.0))
    returned = Counters(replay_transitions=520, learner_steps=5)
    schedule.learned(returned)
    assert (COLLECT, 0) in roles(schedule.next_calls(returned, set(), [0], 2.0))
    uncapped = Schedule(Rules(**{**RULES.__dict__, "free_first_call": True}), start=0.0)
    assert (COLLECT, 0) in roles(uncapped.next_calls(Counters(replay_transitions=10**6), {(LEARN, 0)}, [0], 1.0))
    preset = Rules.from_config(config_lib.load("atari"), num_selfplay=12, num_shards=1, num_reanalyse=0,
                               learner_compiles=True)
    assert preset.warmup_transitions == config_lib.load("atari").learner.warmup_transitions
    with pytest.raises(config_lib.ConfigError, match="learner.warmup_transitions=10 is below replay.min_size=100"):
        config_lib.load("cartpole", ["learner.warmup_transitions=10", "replay.min_size=100"])


def test_rules_from_a_preset():
    cfg = config_lib.load("cartpole", ["cluster.num_learners=2", "cluster.learner_cpus=0"])
    rules = Rules.from_config(cfg, num_selfplay=1, num_shards=2, num_reanalyse=0)
    assert rules.samples_per_step == 2 * cfg.learner.batch_size
    collect = cfg.run.selfplay_steps_per_call * cfg.env.num_envs
    assert rules.slack == cfg.learner.replay_ratio * max(cfg.replay.min_size, 2 * collect)


def test_selfplay_runs_freely_until_the_first_learner_call_returns_then_the_ratio_counts_from_there():
    """A compiling learner's first call can take minutes: self-play is not held back meanwhile, and the
    transitions it added then do not leave the learner a ratio's worth behind."""
    schedule = Schedule(Rules(**{**RULES.__dict__, "free_first_call": True}), start=0.0)
    compiling = Counters(replay_transitions=5000, learner_steps=0)  # far behind the ratio, first call in flight
    calls = roles(schedule.next_calls(compiling, {(LEARN, 0)}, [0, 1], now=1.0))
    assert calls == [(COLLECT, 0), (COLLECT, 1)]
    first = Counters(replay_transitions=6000, learner_steps=5)  # the first call returned: 50 samples
    schedule.learned(first)
    assert schedule.ratio_base == pytest.approx(6000 - 50 / 2.0)
    assert {(COLLECT, 0), (COLLECT, 1), (LEARN, 0)} <= set(roles(schedule.next_calls(first, set(), [0, 1], 2.0)))
    # From there on the ratio holds: 200 more transitions want 400 more samples than the learner has.
    behind = Counters(replay_transitions=6200, learner_steps=5 + 10)
    calls = roles(schedule.next_calls(behind, set(), [0, 1], now=3.0))
    assert (COLLECT, 0) not in calls and (LEARN, 0) in calls
    schedule.learned(Counters(replay_transitions=9000, learner_steps=100))  # later calls move nothing
    assert schedule.ratio_base == pytest.approx(6000 - 50 / 2.0)


def test_learner_calls_queue_up_to_calls_in_flight_and_count_in_the_ratio():
    """learner.calls_in_flight=2: while the learner is behind, a second call waits at its actor, so it never idles
    between calls; calls already in flight count as trained, so the queue does not overrun the ratio."""
    rules = Rules(**{**RULES.__dict__, "learn_calls": 2})
    schedule = Schedule(rules, start=0.0)
    far_behind = Counters(replay_transitions=1000, learner_steps=100)  # wants 2000 samples, has 1000
    assert [c.key for c in schedule.next_calls(far_behind, set(), [], now=1.0)] == [(LEARN, 0), (LEARN, 1)]
    assert [c.key for c in schedule.next_calls(far_behind, {(LEARN, 0)}, [], now=1.0)] == [(LEARN, 1)]
    assert schedule.next_calls(far_behind, {(LEARN, 0), (LEARN, 1)}, [], now=1.0) == []
    # At the ratio (2000 samples): the learner may run one call (50 samples) ahead, so one is queued, and none
    # while that one is in flight.
    near = Counters(replay_transitions=1000, learner_steps=200)
    assert [c.key for c in schedule.next_calls(near, set(), [], now=1.0)] == [(LEARN, 0)]
    assert schedule.next_calls(near, {(LEARN, 0)}, [], now=1.0) == []
    assert Rules.from_config(config_lib.load("atari"), 12, 1, 0).learn_calls == 2
    assert Rules.from_config(config_lib.load("cartpole"), 1, 1, 0).learn_calls == 1


def test_waits_share_the_time_each_side_of_the_replay_ratio_stood_without_work():
    """Known answer: over 10 s, the learner had no call queued for 3 s, and one of two self-play actors had no
    collect in flight for 4 s: 4 of the two actors' 20 s, 0.2."""
    waits = Waits(now=100.0)
    waits.busy(learner=True, actors=2, collecting=2)
    waits.tick(102.0)
    waits.busy(learner=False, actors=2, collecting=1)  # 102-105: the learner waits, one actor waits
    waits.tick(105.0)
    waits.busy(learner=True, actors=2, collecting=1)  # 105-106: one actor waits
    waits.tick(106.0)
    waits.busy(learner=True, actors=2, collecting=2)
    assert waits.read(110.0) == pytest.approx({"learner_wait_share": 0.3, "selfplay_wait_share": 0.2})
    # The next read covers only the time since this one: both busy throughout.
    assert waits.read(115.0) == pytest.approx({"learner_wait_share": 0.0, "selfplay_wait_share": 0.0})
    waits.busy(learner=False, actors=0, collecting=0)  # no actors (all lost): self-play's share stays 0
    assert waits.read(120.0) == pytest.approx({"learner_wait_share": 1.0, "selfplay_wait_share": 0.0})

