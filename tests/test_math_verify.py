"""The math reward's math-verify checks time out in the trainer's processes and leave their signals alone.

math-verify's own timeout is ``signal.alarm``: off the main thread it refuses to run, and in the
main thread its ``alarm(0)`` cancels whatever alarm the process had set. The reward runs math-verify
in a child process (megatron_gspo/data/rewards/math_verify_worker.py) instead; these tests show both failures of
the in-process way and that the reward has neither, that a check past its CPU-time limit or past the
wall-clock backstop scores 0 and the next check works, and that a stop signal reaches neither the
check nor the verdict; a timeout names the side that took the time (an adversarial reference is not
blamed on the response), and a batch's checks run in parallel processes.
"""

import logging
import os
import signal
import threading
import time

import pytest

from megatron_gspo.runtime.stop import PreemptionFlag
from megatron_gspo.data.rewards.math_verify_worker import process_checker
from megatron_gspo.data.rewards import math_reward

SLOW = r"\boxed{10^{10^{10}}}"  # sympy evaluates the power: far longer than any deadline here


def test_in_process_math_verify_fails_both_ways():
    """What the child process avoids: math-verify's signal.alarm timeout in this process."""
    from math_verify import parse

    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(lambda: parse(r"\boxed{1}"))))
    t.start()
    t.join()
    assert isinstance(errors[0], ValueError) and "threaded environment" in str(errors[0])
    signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        signal.alarm(100)
        parse(r"\boxed{1}")
        assert signal.alarm(0) == 0  # its alarm(0) cancelled ours
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


def test_the_reward_works_off_the_main_thread_and_keeps_the_process_alarm():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("", r"so \boxed{\frac{2}{4}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]
    handler = lambda *a: None  # noqa: E731
    signal.signal(signal.SIGALRM, handler)
    try:
        signal.alarm(100)
        assert math_reward("", r"\boxed{7}", "#### 7") == 1.0
        assert signal.getsignal(signal.SIGALRM) is handler
        assert signal.alarm(0) > 90  # still pending: nothing here touched it
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_a_check_past_its_cpu_limit_scores_zero_and_the_child_goes_on():
    """The limit is CPU time (load-independent), kept by the child itself: the check is cut, scores 0,
    and the same child answers the next check."""
    checker = process_checker()
    math_reward("", r"\boxed{1}", "1")  # the child is up
    timeouts, starts = checker.num_timeouts, checker.num_starts
    assert math_reward("", SLOW, "1", timeout_s=1.0) == 0.0
    assert checker.num_timeouts == timeouts + 1
    assert math_reward("", r"\boxed{3}", "3") == 1.0
    assert checker.num_starts == starts  # no restart was needed


def test_the_wall_clock_backstop_kills_the_child_and_the_next_check_works():
    """What no Python-level timer interrupts ends at the parent's backstop: the child is killed, the
    response scores 0, the next check starts a fresh child."""
    checker = process_checker()
    math_reward("", r"\boxed{1}", "1")
    timeouts, starts = checker.num_timeouts, checker.num_starts
    t0 = time.monotonic()
    assert math_reward("", SLOW, "1", timeout_s=1000.0, wall_timeout_s=2.0) == 0.0
    assert 2.0 <= time.monotonic() - t0 < 30  # the backstop, not the computation, ended it
    assert checker.num_timeouts == timeouts + 1
    assert math_reward("", r"\boxed{3}", "3") == 1.0
    assert checker.num_starts == starts + 1


def test_stop_signals_reach_neither_the_check_nor_the_verdict():
    """A preemption (SIGTERM to every process of the job) during a check: this process records it in
    its PreemptionFlag (the trainer decides at its next check point), the child ignores it and answers."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    old = PreemptionFlag.of_process()
    if old is not None:
        old.release()  # a fresh flag below, as in a new process
    try:
        flag = PreemptionFlag.install()
        checker = process_checker()
        math_reward("", r"\boxed{1}", "1")
        (child,) = checker.pids
        starts = checker.num_starts
        threading.Timer(0.2, lambda: (os.kill(child, signal.SIGTERM), os.kill(os.getpid(), signal.SIGTERM))).start()
        got = math_reward("", r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}")
        time.sleep(0.5)
        assert got == 1.0 and flag.set and flag.name == "SIGTERM"
        assert checker.pids == [child] and checker.num_starts == starts
        assert math_reward("", r"\boxed{2}", "2") == 1.0
    finally:
        PreemptionFlag._process = old  # the signalled flag is not the next test's
        for s, h in previous.items():
            signal.signal(s, h)


@pytest.mark.parametrize("response, answer", [(r"\boxed{5}", ""), ("", "5")])
def test_nothing_to_compare_scores_zero_without_a_check(response, answer):
    assert math_reward("", response, answer) == 0.0


# math-verify's parse of it takes seconds of CPU time (3000 terms: ~1 s on this CPU): an adversarial reference
SLOW_REFERENCE = "+".join(["x"] * 6000)


@pytest.mark.parametrize("response, answer, side, starts", [
    (r"\boxed{1}", SLOW_REFERENCE, "the reference (scored 0, as every response to this reference); the reference "
                                   "answer starts 'x+x+x", "reference"),
    (r"\boxed{" + SLOW_REFERENCE + "}", "1", "the response (scored 0); the response starts '\\\\boxed{x+x", "response"),
])
def test_a_timeout_names_the_side_that_took_the_time(caplog, response, answer, side, starts):
    """The reference is parsed on its own, under its own limit: a slow one is blamed as the reference."""
    with caplog.at_level(logging.WARNING, logger="megatron_gspo"):
        assert math_reward("", response, answer, timeout_s=0.3) == 0.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"math-verify used more than 0.3 s of CPU time on {side}" in said[0], said
    assert starts in said[0], said


def test_a_batchs_slow_reference_is_checked_once_and_said_once(caplog):
    from megatron_gspo.config import RewardConfig
    from megatron_gspo.data.rewards import build_reward, compute_rewards

    reward = build_reward(RewardConfig(name="math", kwargs={"timeout_s": 0.3}, num_workers=2))
    try:
        answers = [SLOW_REFERENCE] * 4 + ["7"]
        with caplog.at_level(logging.WARNING, logger="megatron_gspo"):
            got = compute_rewards(reward, ["q"] * 5, [r"\boxed{x}"] * 4 + [r"\boxed{7}"], answers)
        assert got.tolist() == [0, 0, 0, 0, 1]
        said = [r.getMessage() for r in caplog.records]
        # two checkers may each meet it before either has timed out; never all four responses
        assert 1 <= len(said) <= 2 and all("on the reference" in m for m in said), said
        assert reward.main.pool.num_timeouts == len(said)
    finally:
        reward.close()
