"""The learning-rate schedule: warm-up, hold, cosine, and how a resumed run with a new end goes on
(the rates are pinned, step by step)."""

import dataclasses

import pytest

from minigpt.config import ConfigError, TrainConfig
from minigpt.optim import lr_schedule


def rates_at(cfg: TrainConfig, *steps: int) -> list[float]:
    rates = lr_schedule.lr_schedule(cfg)
    return [float(rates(s)) for s in steps]


def test_warm_up_then_a_cosine_to_the_floor():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert rates_at(cfg, 0, 9, 10, 60, 110, 500) == pytest.approx(
        [1e-4, 1e-3, 1e-3, 0.55e-3, 1e-4, 1e-4])


def test_a_later_decay_start_holds_the_peak_then_decays_warmup_stable_decay():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1, decay_start=60)
    assert rates_at(cfg, 5, 10, 59, 60, 85, 110) == pytest.approx(
        [6e-4, 1e-3, 1e-3, 1e-3, 0.55e-3, 1e-4])


SAVED = TrainConfig(steps=200, warmup_steps=20, lr=1e-3, min_lr_ratio=0.1)


def test_extending_a_finished_run_goes_on_at_the_floor():
    cfg, message = lr_schedule.continued(SAVED, dataclasses.replace(SAVED, steps=400), 200)
    assert rates_at(cfg, 200, 300, 399, 400) == pytest.approx([1e-4] * 4)
    assert message == ("the run now ends at step 400 instead of 200: the learning rate goes on "
                       "from 0.0001 (its value at step 200) and holds at 0.0001 until step 400")


def test_the_message_says_whether_the_rate_decays_rises_or_warms_up_first():
    _, message = lr_schedule.continued(SAVED, dataclasses.replace(SAVED, steps=400), 110)
    assert message.endswith("from 0.00055 (its value at step 110) and decays by a cosine from "
                            "0.00055 at step 110 to 0.0001 at step 400")
    louder = dataclasses.replace(SAVED, steps=400, lr=1e4)  # --lr 1e4 on resume: a floor of 1e3
    cfg, message = lr_schedule.continued(SAVED, louder, 200)
    assert message.endswith("from 0.0001 (its value at step 200) and rises by a cosine from "
                            "0.0001 at step 200 to 1e+03 at step 400")
    assert rates_at(cfg, 300, 400) == pytest.approx([500.0, 1e3])
    _, message = lr_schedule.continued(SAVED, dataclasses.replace(SAVED, steps=400), 5)
    assert message.endswith("from 0.0003 (its value at step 5), warms up to 0.001 by step 20 "
                            "and then decays by a cosine from 0.001 at step 20 to 0.0001 at "
                            "step 400")


def test_extending_mid_run_decays_from_where_the_rate_is_to_the_new_end():
    assert rates_at(SAVED, 110) == pytest.approx([5.5e-4])  # halfway down the old cosine
    cfg, _ = lr_schedule.continued(SAVED, dataclasses.replace(SAVED, steps=400), 110)
    # No jump at the resume step; halfway to the new end, halfway down from 5.5e-4 to 1e-4.
    assert rates_at(cfg, 110, 255, 400) == pytest.approx([5.5e-4, 3.25e-4, 1e-4])
    assert (cfg.decay_start, cfg.decay_start_lr, cfg.warmup_steps) == (110, pytest.approx(5.5e-4),
                                                                       20)


def test_shortening_mid_run_decays_faster_from_where_the_rate_is():
    cfg, _ = lr_schedule.continued(SAVED, dataclasses.replace(SAVED, steps=150), 110)
    assert rates_at(cfg, 110, 130, 150) == pytest.approx([5.5e-4, 3.25e-4, 1e-4])


def test_extending_during_the_warm_up_finishes_it_then_decays_from_the_peak():
    saved = TrainConfig(steps=100, warmup_steps=-1, lr=1e-3, min_lr_ratio=0.1)  # warm-up 10
    cfg, _ = lr_schedule.continued(saved, dataclasses.replace(saved, steps=300), 5)
    # The warm-up keeps its length (a tenth of 300 would be 30): no change to the rate at step 5.
    assert rates_at(cfg, 5, 9, 10, 155, 300) == pytest.approx(
        [6e-4, 1e-3, 1e-3, 5.5e-4, 1e-4])


def test_a_decay_fraction_holds_the_peak_and_decays_over_the_last_part_of_the_run():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1, decay_fraction=0.3)
    assert lr_schedule.lr_schedule(cfg).decay_start == 70
    assert rates_at(cfg, 9, 10, 69, 70, 85, 100) == pytest.approx(
        [1e-3, 1e-3, 1e-3, 1e-3, 0.55e-3, 1e-4])
    # A time budget refits the step count: the decay keeps its share of the new length.
    assert lr_schedule.lr_schedule(dataclasses.replace(cfg, steps=1000)).decay_start == 700
    # The whole run (1) is the plain cosine from the warm-up's end.
    assert lr_schedule.lr_schedule(dataclasses.replace(cfg, decay_fraction=1.0)).decay_start == 10


def test_extending_a_run_holding_its_peak_decays_over_the_same_share_of_the_new_end():
    saved = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1, decay_fraction=0.3)
    cfg, _ = lr_schedule.continued(saved, dataclasses.replace(saved, steps=200), 50)
    assert (cfg.decay_start, cfg.decay_start_lr) == (140, 1e-3)
    assert rates_at(cfg, 50, 139, 170, 200) == pytest.approx([1e-3, 1e-3, 0.55e-3, 1e-4])
    # Shortened so that its decay should already have begun: it decays from here, no jump.
    cfg, _ = lr_schedule.continued(saved, dataclasses.replace(saved, steps=60), 50)
    assert rates_at(cfg, 50, 55, 60) == pytest.approx([1e-3, 0.55e-3, 1e-4])
    # Already decaying: on from the rate it has reached, as a cosine run does.
    cfg, _ = lr_schedule.continued(saved, dataclasses.replace(saved, steps=200), 85)
    assert rates_at(cfg, 85) == pytest.approx([0.55e-3])
    assert rates_at(cfg, 200) == pytest.approx([1e-4])


def test_a_decay_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(ConfigError, match="decay_fraction must be in"):
        TrainConfig(decay_fraction=1.5)
