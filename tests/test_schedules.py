"""Pipeline schedules as data: every table is checked as a schedule (each chunk of each
microbatch forward once, then backward once, in dependency order) and by running its buffers
(every read finds what was written for it), and its bubble and stash are the formulas'."""

import itertools

import numpy as np
import pytest

from minigpt.pipeline import bubble_fraction, schedules

CASES = [("gpipe", S, M, 1) for S, M in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16))]
CASES += [("gpipe", S, M, R) for S, M, R in [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3),
                                              (4, 5, 2)]]
CASES += [("1f1b", S, M, 1) for S, M in itertools.product((1, 2, 4, 8), (1, 3, 4, 8, 16))]


def events(plan):
    """(tick, stage, kind, microbatch, virtual stage) for every forward and backward."""
    S = plan.stages
    out = []
    for kind, mbs, rounds in (("F", plan.fwd_mb, plan.fwd_round),
                              ("B", plan.bwd_mb, plan.bwd_round)):
        for t, s in zip(*np.nonzero(mbs >= 0)):
            out.append((int(t), int(s), kind, int(mbs[t, s]), int(rounds[t, s]) * S + int(s)))
    return out


@pytest.mark.parametrize("name, S, M, R", CASES)
def test_every_chunk_runs_forward_then_backward_once_in_dependency_order(name, S, M, R):
    plan = schedules.make(name, S, M, R)
    V = R * S
    when = {(kind, m, v): t for t, s, kind, m, v in events(plan)}
    assert len(when) == len(events(plan)) == 2 * M * V  # once each, none twice
    for m, v in itertools.product(range(M), range(V)):
        if v > 0:
            assert when["F", m, v] > when["F", m, v - 1]  # its input was computed before
            assert when["B", m, v - 1] > when["B", m, v]  # its gradient came first
        assert when["B", m, v] >= when["F", m, V - 1]  # after the loss of its microbatch
    assert [plan.head_mb[t] for t in range(plan.ticks) if plan.head_mb[t] >= 0] == \
        sorted(range(M), key=lambda m: when["F", m, V - 1])


@pytest.mark.parametrize("name, S, M, R", CASES)
def test_running_the_buffers_every_read_finds_what_was_written_for_it(name, S, M, R):
    """Play the table as the loop does, tick by tick: forward (reads the inbox, writes the
    stash), head (writes the last stage's gradient inbox), backward (reads stash and gradient
    inbox), then what arrives from the neighbours is written."""
    plan = schedules.make(name, S, M, R)
    V = R * S
    inbox = [[None] * plan.inbox_size for _ in range(S)]
    grads = [[None] * plan.grad_inbox_size for _ in range(S)]
    stash = [[None] * plan.stash_size for _ in range(S)]
    for t in range(plan.ticks):
        sent_f, sent_b = [None] * S, [None] * S
        for s in range(S):
            m, r = plan.fwd_mb[t, s], plan.fwd_round[t, s]
            if m >= 0:
                v = r * S + s
                if v == 0:
                    assert plan.fwd_src[t, s] == -1
                else:
                    assert inbox[s][plan.fwd_src[t, s]] == ("x", m, v)
                stash[s][plan.fwd_stash[t, s]] = ("x", m, v)
                sent_f[s] = ("x", m, v + 1)
        if plan.head_mb[t] >= 0:
            grads[S - 1][plan.head_slot[t]] = ("g", plan.head_mb[t], V - 1)
        for s in range(S):
            m, r = plan.bwd_mb[t, s], plan.bwd_round[t, s]
            if m >= 0:
                v = r * S + s
                assert stash[s][plan.bwd_stash[t, s]] == ("x", m, v)
                assert grads[s][plan.bwd_src[t, s]] == ("g", m, v)
                sent_b[s] = ("g", m, v - 1)
        for s in range(S):
            if plan.recv_fwd[t, s] >= 0:
                inbox[s][plan.recv_fwd[t, s]] = sent_f[(s - 1) % S]
            if plan.recv_bwd[t, s] >= 0:
                grads[s][plan.recv_bwd[t, s]] = sent_b[(s + 1) % S]


@pytest.mark.parametrize("name, S, M, R", CASES)
def test_bubble_is_the_formula_for_every_schedule(name, S, M, R):
    if R > 1 and M < S:
        pytest.skip("circular schedules need M >= S")
    assert schedules.make(name, S, M, R).bubble() == pytest.approx(bubble_fraction(S, M, R))


def test_1f1b_keeps_at_most_2s_minus_1_inputs_however_many_microbatches_gpipe_keeps_all():
    for S in (2, 4, 8):
        assert [schedules.make("1f1b", S, M).stash_size for M in (S, 4 * S, 16 * S)] == \
            [S, 2 * S - 1, 2 * S - 1]
        assert [schedules.make("gpipe", S, M).stash_size for M in (S, 4 * S)] == [S, 4 * S]
    assert schedules.make("gpipe", 4, 8, 2).stash_size == 16  # R M: one input per chunk


def test_a_forward_only_table_keeps_the_forwards_and_drops_the_rest():
    plan = schedules.make("1f1b", 4, 8)
    only = plan.forward_only()
    assert (only.bwd_mb < 0).all() and (only.recv_bwd < 0).all() and (only.head_slot < 0).all()
    assert (only.fwd_mb == plan.fwd_mb[:only.ticks]).all()
    assert only.ticks == 8 + 4 - 1 and (plan.fwd_mb[only.ticks:] < 0).all()


def test_circular_order_puts_chunks_s_s_plus_s_on_stage_s():
    order = schedules.layer_order(16, stages=4, repeats=2)  # 8 chunks of 2 layers
    assert sorted(order) == list(range(16))
    shares = order.reshape(4, 4)  # stage s holds positions 4s..4s+3
    assert shares.tolist() == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert (schedules.layer_order(8, 4, 1) == np.arange(8)).all()


@pytest.mark.parametrize("name, S, M, R, message", [
    ("1f1b", 4, 8, 2, "1f1b schedule runs with train.pipeline_repeats=1"),
    ("zigzag", 4, 8, 1, "unknown pipeline schedule 'zigzag'"),
    ("gpipe", 4, 2, 2, "needs at least as many microbatches as stages"),
])
def test_tables_that_cannot_be_made_are_refused(name, S, M, R, message):
    with pytest.raises(ValueError, match=message):
        schedules.make(name, S, M, R)
