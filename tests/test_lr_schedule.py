import math

import pytest

from nanotron.config import LRSchedulerArgs
from nanotron.optim.lr_schedule import learning_rate_at


def test_linear_warmup_never_starts_at_zero_then_cosine_to_floor():
    args = LRSchedulerArgs(learning_rate=1.0, lr_warmup_steps=4, min_decay_lr=0.1)
    assert [learning_rate_at(t, args, 14) for t in (1, 2, 4)] == [0.25, 0.5, 1.0]
    # Cosine over the 10 steps after warmup.
    assert learning_rate_at(9, args, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert learning_rate_at(14, args, 14) == pytest.approx(0.1)
    assert learning_rate_at(20, args, 14) == pytest.approx(0.1)


def test_constant_warmup_and_linear_decay():
    args = LRSchedulerArgs(learning_rate=2.0, lr_warmup_steps=3, lr_warmup_style="constant", lr_decay_style="linear")
    assert learning_rate_at(1, args, 13) == 2.0
    assert learning_rate_at(8, args, 13) == pytest.approx(1.0)
    assert learning_rate_at(13, args, 13) == 0.0


def test_wsd_stable_phase_then_one_minus_sqrt_decay():
    args = LRSchedulerArgs(learning_rate=1.0, lr_warmup_steps=2, lr_decay_style="1-sqrt",
                           lr_decay_starting_step=10, lr_decay_steps=4, min_decay_lr=0.0)
    assert [learning_rate_at(t, args, 14) for t in (3, 7, 10)] == [1.0, 1.0, 1.0]
    assert learning_rate_at(11, args, 14) == pytest.approx(1 - math.sqrt(0.25))
    assert learning_rate_at(14, args, 14) == 0.0


def test_constant_schedule_and_no_warmup():
    args = LRSchedulerArgs(learning_rate=0.5, lr_decay_style="constant")
    assert {learning_rate_at(t, args, 100) for t in (1, 50, 100)} == {0.5}


def test_schedule_is_a_pure_function_of_the_step():
    args = LRSchedulerArgs(learning_rate=1e-3, lr_warmup_steps=10, min_decay_lr=1e-4)
    straight = [learning_rate_at(t, args, 100) for t in range(1, 101)]
    resumed = ([learning_rate_at(t, args, 100) for t in range(1, 51)]
               + [learning_rate_at(t, args, 100) for t in range(51, 101)])
    assert straight == resumed
