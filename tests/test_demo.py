"""The demo's simulators and workloads: ground truth by construction, honest judges, clean splits.

Fast tests of the pure parts (ticket, problem and coding-task generators,
the operator, the calculator, the answer checker, the developer's reviews,
the feedback each workload sends, the C-LoRA table arithmetic). The slow
smoke run of the whole demo on the tiny model is in `test_demo_smoke.py`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from clora_feedback.bench import experiments as bench
from clora_feedback.demo import arithmetic, coding, support
from clora_feedback.demo.experiment import (
    AgentRun,
    ExperimentConfig,
    RolloutCalibration,
    StepRecord,
)
from clora_feedback.demo.plots import moving_average
from clora_feedback.demo.workloads import (
    CodingWorkload,
    Episode,
    SupportWorkload,
    ToolUseWorkload,
    forced_call_completion,
)
from clora_feedback.schemas.feedback import Correction, Resolution, Reward

# -- support ---------------------------------------------------------------------------------


def test_tickets_are_deterministic_and_cover_every_team() -> None:
    a = support.tickets(3, "train", 200)
    assert a == support.tickets(3, "train", 200)
    assert a != support.tickets(4, "train", 200)
    counts = Counter(t.team for t in a)
    assert set(counts) == set(support.TEAMS)
    assert min(counts.values()) > 200 / len(support.TEAMS) / 2  # roughly balanced


def test_held_out_tickets_never_appear_in_training() -> None:
    train = {t.text for t in support.tickets(0, "train", 2000)}
    held_out = support.tickets(0, "eval", 300)
    assert all("{" in tpl for tpls in support._TEMPLATES.values() for tpl in tpls)
    assert not [t for t in held_out if t.text in train]


def test_ticket_text_carries_its_teams_template_and_no_label() -> None:
    for t in support.tickets(1, "eval", 100):
        pattern = re.escape(support._TEMPLATES[t.team][t.template])
        pattern = re.sub(r"\\\{\w+\\\}", ".+", pattern)
        assert re.fullmatch(pattern, t.text)
        assert t.messages()[-1] == {"role": "user", "content": t.text}


@pytest.mark.parametrize(
    ("reply", "team"),
    [
        ("payment", "payment"),
        ("Delivery.", "delivery"),
        ("  technical\n", "technical"),
        ("account team", "account"),
        ("I think payment", None),
        ("refund", None),
        ("", None),
        (None, None),
    ],
)
def test_route_of_reads_the_first_word(reply: str | None, team: str | None) -> None:
    assert support.route_of(reply) == team


def test_operator_resolves_only_the_right_team() -> None:
    ticket = support.Ticket("t", "My parcel is late.", "delivery", 0)
    op = support.SimulatedOperator()
    assert op.judge(ticket, "delivery") == support.Verdict("resolved", "delivery", 1.0)
    assert op.judge(ticket, "payment") == support.Verdict("escalated", "payment", 0.0)
    assert op.judge(ticket, "no idea") == support.Verdict("escalated", None, 0.0)


# -- arithmetic ------------------------------------------------------------------------------


def test_every_problem_answer_is_its_expression() -> None:
    kinds = Counter()
    for p in arithmetic.problems(0, "train", 300) + arithmetic.problems(0, "eval", 100):
        assert float(arithmetic.calculate(p.expression)) == p.answer
        assert p.answer > 0 and p.answer == int(p.answer)
        assert all(str(n) in p.text for n in re.findall(r"\d+", p.expression))
        kinds[p.kind] += 1
    assert set(kinds) == set(arithmetic.TEMPLATES)


def test_problem_splits_use_disjoint_names() -> None:
    def names(split: str) -> set[str]:
        return {p.text.split()[0] for p in arithmetic.problems(0, split, 200)}  # type: ignore[arg-type]

    assert names("train").isdisjoint(names("eval"))


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("12 x 3", "36"), ("-4+10", "6")],
)
def test_calculator_computes(expression: str, value: str) -> None:
    assert arithmetic.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "abs(3)", "2**100000", "1/0", "a+1", "", "[1,2]", "'3'+'4'"],
)
def test_calculator_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(arithmetic.CalculatorError):
        arithmetic.calculate(expression)


def test_tool_results_report_errors_as_text() -> None:
    assert arithmetic.tool_result("calculator", '{"expression": "6*7"}') == "42"
    assert arithmetic.tool_result("calculator", '{"type": "object"}').startswith("error")
    assert arithmetic.tool_result("calculator", "not json").startswith("error")
    assert arithmetic.tool_result("search", "{}").startswith("error")


@pytest.mark.parametrize(
    ("arguments", "value"),
    [('{"answer": 42}', 42.0), ('{"answer": "1,200"}', 1200.0), ('{"answer": true}', None),
     ('{"x": 1}', None), ("oops", None)],
)  # fmt: skip
def test_final_value(arguments: str, value: float | None) -> None:
    assert arithmetic.final_value(arguments) == value


def test_grade_rewards_only_the_exact_number() -> None:
    p = arithmetic.Problem("p", "", 19, "12+7", "add")
    assert arithmetic.grade(p, 19.0) == 1.0
    assert arithmetic.grade(p, 19.5) == 0.0
    assert arithmetic.grade(p, None) == 0.0


def test_review_corrects_the_first_wrong_turn() -> None:
    p = arithmetic.Problem("p", "", 19, "12+7", "add")
    calc_ok = arithmetic.Call("calculator", '{"expression": "12+7"}', "19")
    calc_bad = arithmetic.Call("calculator", '{"expression": "12-7"}', "5")
    final_ok = arithmetic.Call("final_answer", '{"answer": 19}')
    final_bad = arithmetic.Call("final_answer", '{"answer": 5}')
    assert arithmetic.review(p, [calc_ok, final_ok]) is None
    assert arithmetic.review(p, [final_ok]) is None
    assert arithmetic.review(p, [calc_bad, final_bad]) == arithmetic.Fix(0, "calculator", {"expression": "12+7"})  # fmt: skip
    assert arithmetic.review(p, [calc_ok, final_bad]) == arithmetic.Fix(1, "final_answer", {"answer": 19})  # fmt: skip
    assert arithmetic.review(p, [calc_ok, calc_ok]) == arithmetic.Fix(1, "final_answer", {"answer": 19})  # fmt: skip
    assert arithmetic.review(p, [arithmetic.Call(None)]) == arithmetic.Fix(0, "calculator", {"expression": "12+7"})  # fmt: skip


# -- coding ----------------------------------------------------------------------------------


def test_coding_tasks_split_variable_names_and_accept_their_reference() -> None:
    train = coding.tasks(0, "train", 300)
    held_out = coding.tasks(0, "eval", 100)
    var = re.compile(r"`(\w+)`")
    train_vars = {var.search(t.request).group(1) for t in train}  # type: ignore[union-attr]
    eval_vars = {var.search(t.request).group(1) for t in held_out}  # type: ignore[union-attr]
    assert train_vars.isdisjoint(eval_vars)
    dev = coding.SimulatedDeveloper()
    for t in train + held_out:
        assert dev.review(t, t.reference).accepted


def test_developer_runs_the_code_and_accepts_any_equal_program() -> None:
    t = coding.CodingTask("t", "the list `xs` reversed", "xs[::-1]", "xs", ([3, 1, 2], [7]))
    dev = coding.SimulatedDeveloper()
    for output in (
        "xs[::-1]",
        "`xs[::-1]`",
        "```python\nxs[ : : -1 ]\n```",
        "list(reversed(xs));",
        "list(reversed(list(xs)))",
    ):
        assert dev.review(t, output) == coding.Review(True, output, 1.0)
    for output in ("reversed(xs)", "", "xs", "def f(): return xs[::-1]", "print('hi')"):
        review = dev.review(t, output)
        assert (review.accepted, review.corrected, review.reward) == (False, "xs[::-1]", 0.0)
        assert review.reason


def test_the_developer_runs_nothing_outside_its_sandbox() -> None:
    for code in (
        "__import__('os').system('true')",
        "xs.__class__",
        "open('/etc/passwd')",
        "[x for x in xs]",
        "xs * 1000",
        "(lambda: 1)()",
        "xs + [1] + " + "9" * 40,
    ):
        with pytest.raises(coding.RejectedCode):
            coding.run_expression(code, "xs", [1, 2])
    assert coding.run_expression("max(xs) - min(xs)", "xs", [1, 5]) == 4


# -- the feedback each workload sends --------------------------------------------------------


def test_support_feedback_is_one_resolution() -> None:
    ticket = support.tickets(0, "eval", 1)[0]
    ok = Episode(ticket.id, completion_ids=["chatcmpl-1"], reward=1.0)
    (good,) = SupportWorkload().feedback("support", ticket, ok, event_id="e1")
    assert isinstance(good, Resolution)
    assert (good.outcome, good.completion_id, good.event_id) == ("resolved", "chatcmpl-1", "e1")
    bad = Episode(ticket.id, completion_ids=["chatcmpl-2"], reward=0.0)
    (event,) = SupportWorkload().feedback("support", ticket, bad, event_id="e2")
    assert isinstance(event, Resolution) and event.outcome == "escalated"
    assert event.correct_answer == ticket.team and good.correct_answer is None  # rerouted


def test_tool_use_feedback_rewards_every_turn_and_corrects_the_wrong_one() -> None:
    p = arithmetic.Problem("p", "", 19, "12+7", "add")
    episode = Episode(
        "p",
        completion_ids=["c1", "c2"],
        reward=0.0,
        trace=[
            arithmetic.Call("calculator", '{"expression": "12+7"}', "19"),
            arithmetic.Call("final_answer", '{"answer": 5}'),
        ],
    )
    reward, fix = ToolUseWorkload(corrections=True).feedback("math", p, episode, event_id="e")
    assert isinstance(reward, Reward) and reward.completion_ids == ["c1", "c2"]
    assert reward.value == 0.0
    assert isinstance(fix, Correction) and fix.completion_id == "c2"
    assert fix.corrected_content == forced_call_completion("final_answer", {"answer": 19})
    assert len(ToolUseWorkload(corrections=False).feedback("math", p, episode, event_id="e")) == 1


def test_forced_call_completion_continues_the_forced_prefix() -> None:
    from clora_feedback.chat_format.calls import parse_tool_calls
    from clora_feedback.chat_format.tools import forced_call_prefix

    prefix = forced_call_prefix("required", arithmetic.TOOLS)
    text = prefix + forced_call_completion("calculator", {"expression": "3*4"})
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("calculator", '{"expression":"3*4"}')]


def test_coding_feedback_is_a_correction_or_an_acceptance() -> None:
    task = coding.tasks(0, "eval", 1)[0]
    good = Episode(task.id, completion_ids=["c"], reward=1.0, answer=task.reference)
    (event,) = CodingWorkload().feedback("coding", task, good, event_id="e")
    assert isinstance(event, Correction) and event.accepted_as_is
    bad = Episode(task.id, completion_ids=["c"], reward=0.0, answer="print('hi')")
    (event,) = CodingWorkload().feedback("coding", task, bad, event_id="e")
    assert isinstance(event, Correction) and event.corrected_content == task.reference


# -- reporting arithmetic ---------------------------------------------------------------------


def test_moving_average() -> None:
    assert moving_average([1, 0, 1, 1], 2) == [1.0, 0.5, 0.5, 1.0]
    assert moving_average([], 3) == []


def _run(seed: int, start: float, end: float, reward: float) -> AgentRun:
    step = StepRecord(1, reward, 1, 4, 8, rollout_s=2.0, train_s=3.0, step_s=5.0)
    return AgentRun(
        "a", seed, "x", 0.0, 0.0, steps=[step], started_at=start, finished_at=end, cold_start_s=1.0
    )


def test_c_lora_row_compares_makespans_and_completion_times() -> None:
    serial = [(_run(i, 0, 10, 1.0), 10.0) for i in range(2)]
    concurrent = [_run(0, 100, 112, 1.0), _run(1, 100, 115, 0.0)]
    row = bench.summarize(2, concurrent, 100.0, 16.0, serial)
    assert row["speedup"] == pytest.approx(20.0 / 16.0)
    assert row["first_done_s"] == 12.0 and row["serial_first_done_s"] == 10.0
    assert row["mean_experiment_s"] == 13.5 and row["serial_mean_experiment_s"] == 15.0
    assert row["reward_mean"] == 0.5 and math.isclose(row["reward_std"], math.sqrt(0.5))
    assert "| 2 | 1.25x | - | - | - |" in bench.table([row])  # no calibration: no bound
    assert SimpleNamespace(**row).n == 2


def test_ideal_concurrent_time_multiplexes_rollouts_and_serializes_training() -> None:
    # C + K * (m(N) * R + N * T): 5 + 3 * (2.5 * 10 + 8 * 12)
    assert bench.ideal_concurrent_s(8, 3, 10.0, 12.0, 2.5, 5.0) == pytest.approx(368.0)
    # One tenant, no batching gain: exactly one serial experiment, C + K * (R + T).
    assert bench.ideal_concurrent_s(1, 3, 10.0, 12.0, 1.0, 5.0) == pytest.approx(71.0)


def test_c_lora_row_reports_the_bound_and_the_fraction_of_it() -> None:
    serial = [(_run(i, 0, 10, 1.0), 10.0) for i in range(2)]  # R=2, T=3, step 5, wall 10
    concurrent = [_run(0, 100, 112, 1.0), _run(1, 100, 115, 0.0)]
    calibration = RolloutCalibration(2, one_s=4.0, together_s=6.0, wall_s=11.0)
    row = bench.summarize(2, concurrent, 100.0, 16.0, serial, calibration)
    costs = bench.serial_costs(serial)
    assert costs == {"rollout_s": 2.0, "train_s": 3.0, "overhead_s": 5.0, "steps": 1.0}
    assert row["multiplier"] == 1.5
    ideal = 5.0 + 1 * (1.5 * 2.0 + 2 * 3.0)  # 14 s
    assert row["ideal_s"] == pytest.approx(ideal)
    assert row["bound"] == pytest.approx(20.0 / ideal)
    assert row["of_bound"] == pytest.approx(ideal / 16.0)
    assert row["speedup"] == pytest.approx(row["bound"] * row["of_bound"])
    assert "| 2 | 1.25x | 1.43x | 88% | 1.50 |" in bench.table([row])
    checks = bench.goals([row])
    assert any("88%" in c and "not met" in c for c in checks), checks


def test_c_lora_row_estimates_serial_figures_from_fewer_runs() -> None:
    serial = [(_run(0, 0, 10, 1.0), 10.0), (_run(1, 0, 10, 1.0), 12.0)]
    concurrent = [_run(i, 100, 110 + i, 1.0) for i in range(4)]
    row = bench.summarize(4, concurrent, 100.0, 20.0, serial)
    assert row["serial_estimated"] and row["serial_runs"] == 2
    assert row["serial_makespan_s"] == pytest.approx(44.0)  # 4 x mean(10, 12)
    assert row["serial_mean_experiment_s"] == pytest.approx(11.0 * (1 + 2 + 3 + 4) / 4)
    assert "| 4 | ~2.20x |" in bench.table([row])


def test_experiment_schedule_is_checked() -> None:
    assert ExperimentConfig(schedule="lockstep").schedule == "lockstep"
    with pytest.raises(ValueError, match="schedule"):
        ExperimentConfig(schedule="eventually")
