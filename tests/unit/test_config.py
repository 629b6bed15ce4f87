"""SchedulerConfig validation and env defaults."""

import pytest

from scheduler.config import ENV_GRANT_ROUNDS, ENV_TICK_SLICE, SchedulerConfig, env_defaults


def test_defaults_match_the_contract():
    c = SchedulerConfig()
    assert (c.tick_slice, c.grant_rounds, c.skip_cap, c.backlog_cap, c.num_draft_tokens) == (True, 8, 2, 2, 4)
    assert (c.b1_policy, c.b1_default_enabled, c.b1_profile_requests, c.b1_probe_rounds) == ("auto", True, 3, 2)
    assert (c.max_batch_size, c.prefill_batch_size, c.max_queue_depth, c.policy_cache_dir) == (16, 8, 256, None)
    assert c.speculative_disable_by_batch_size == 0  # off: rotation among concurrent streams


@pytest.mark.parametrize(
    "overrides",
    [
        dict(grant_rounds=-1),
        dict(skip_cap=0),
        dict(backlog_cap=-1),
        dict(num_draft_tokens=0),
        dict(b1_policy="maybe"),
        dict(max_batch_size=0),
        dict(tick_slice=1),
        dict(grant_rounds=True),
        dict(grant_rounds=2.5),
        dict(max_queue_depth=0),
        dict(policy_cache_dir=3),
        dict(speculative_disable_by_batch_size=-1),
        dict(speculative_disable_by_batch_size=True),
    ],
)
def test_invalid_values_rejected(overrides):
    with pytest.raises(ValueError):
        SchedulerConfig(**overrides)


def test_replace_only_live_knobs():
    c = SchedulerConfig().replace(grant_rounds=0, skip_cap=3, tick_slice=False, backlog_cap=4)
    assert (c.grant_rounds, c.skip_cap, c.tick_slice, c.backlog_cap) == (0, 3, False, 4)
    with pytest.raises(ValueError, match="not reconfigurable"):
        SchedulerConfig().replace(max_batch_size=4)
    with pytest.raises(ValueError):
        SchedulerConfig().replace(grant_rounds=-2)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, dict(grant_rounds=8, tick_slice=True)),
        ({ENV_GRANT_ROUNDS: " 3 ", ENV_TICK_SLICE: "0"}, dict(grant_rounds=3, tick_slice=False)),
        ({ENV_GRANT_ROUNDS: "abc", ENV_TICK_SLICE: "junk"}, dict(grant_rounds=8, tick_slice=True)),
        ({ENV_GRANT_ROUNDS: "0"}, dict(grant_rounds=0, tick_slice=True)),
    ],
)
def test_env_defaults(env, expected):
    assert env_defaults(env) == expected
