"""pipelinerl/envs/tool_calls.py, toolbox.py and tools/calculator.py: parsing good and malformed calls in both
formats, answers for the model instead of exceptions, and an arithmetic evaluator that refuses hostile input."""

from __future__ import annotations

import asyncio
import json
import random
from fractions import Fraction

import pytest

from pipelinerl.envs.tool_calls import (
    COMPACT_ERROR_REPLY,
    ToolCall,
    ToolError,
    ToolSpec,
    call_format,
    compact_reply,
    parse_compact,
    parse_qwen,
    qwen_reply,
)
from pipelinerl.envs.toolbox import CALCULATOR_SPEC, PYTHON_SPEC, Answer, Toolbox, calculator_tool, python_tool
from pipelinerl.envs.tools.calculator import MAX_LENGTH, CalculatorError, evaluate, evaluate_exact
from pipelinerl.envs.tools.sandbox import SandboxResult
from pipelinerl.tiny.model import ALPHABET

COUNTER = ToolSpec("count", "Count.", {"type": "object", "required": ["n"],
                                       "properties": {"n": {"type": "integer"}, "loud": {"type": "boolean"}}})
TOOLS = [CALCULATOR_SPEC, PYTHON_SPEC, COUNTER]


def qwen_call(obj) -> str:
    return "<tool_call>\n" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n</tool_call>"


# ------------------------------------------------------------ qwen format


def test_qwen_calls_in_order_with_text_around_them():
    text = ("I will compute.\n" + qwen_call({"name": "calculator", "arguments": {"expression": "12*34"}}) + "\nand\n"
            + '<tool_call>{"name": "count", "arguments": {"n": 3, "loud": true}}</tool_call>')
    assert parse_qwen(text, TOOLS) == [
        ToolCall("calculator", {"expression": "12*34"},
                 qwen_call({"name": "calculator", "arguments": {"expression": "12*34"}})),
        ToolCall("count", {"n": 3, "loud": True}, '<tool_call>{"name": "count", "arguments": {"n": 3, "loud": true}}'
                                                  "</tool_call>")]
    assert parse_qwen("no calls here", TOOLS) == []


def test_qwen_arguments_written_as_a_json_string_are_accepted():
    text = qwen_call({"name": "python", "arguments": json.dumps({"code": "print(1)"})})
    assert parse_qwen(text, TOOLS) == [ToolCall("python", {"code": "print(1)"}, text)]


@pytest.mark.parametrize(("body", "message"), [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "not valid JSON"),
    ('["calculator"]', "must be a JSON object"),
    ('{"arguments": {"expression": "1"}}', "must be a JSON object"),
    ('{"name": 7, "arguments": {}}', "must be a JSON object"),
    ('{"name": "search", "arguments": {"q": "x"}}', "unknown tool 'search'; the tools are: calculator, python, count"),
    ('{"name": "calculator", "arguments": {}}', "needs the argument(s) expression"),
    ('{"name": "calculator"}', "needs the argument(s) expression"),
    ('{"name": "calculator", "arguments": {"expression": "1", "precision": 3}}', "has no argument(s) precision"),
    ('{"name": "calculator", "arguments": {"expression": 12}}', "must be of type string, got 12"),
    ('{"name": "count", "arguments": {"n": true}}', "must be of type integer, got true"),
    ('{"name": "count", "arguments": {"n": 1.5}}', "must be of type integer"),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "calculator", "arguments": "not json"}', "must be a JSON object"),
    ('{"name": "calculator", "arguments": {"expression": "1"}, "id": 3}', "not id"),
    ("[" * 100_000, "not valid JSON"),  # deep nesting: the decoder's recursion limit, caught
])
def test_qwen_malformed_calls_become_tool_errors(body, message):
    (parsed,) = parse_qwen("text " + qwen_call(body) + " more", TOOLS)
    assert isinstance(parsed, ToolError) and message in parsed.message
    assert parsed.text == qwen_call(body)


def test_qwen_an_unclosed_call_and_too_many_calls_are_errors():
    good = qwen_call({"name": "calculator", "arguments": {"expression": "1"}})
    parsed = parse_qwen(good + '<tool_call>\n{"name": "calculator", "argu', TOOLS)
    assert isinstance(parsed[0], ToolCall)
    assert isinstance(parsed[1], ToolError) and "not closed" in parsed[1].message
    parsed = parse_qwen(good * 5, TOOLS, max_calls=3)
    assert [type(p) for p in parsed] == [ToolCall] * 3 + [ToolError] * 2
    assert "at most 3 tool calls" in parsed[-1].message


def test_qwen_parsing_never_raises_on_noise():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"calculator"', '"arguments"', "[", "]", ",",
              '"expression"', '"1+1"', "\n", "null", "1e999", "\\u0000", "x"]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        for p in parse_qwen(text, TOOLS):
            assert isinstance(p, (ToolCall, ToolError))


# ------------------------------------------------------------ compact format


def test_compact_calls():
    assert parse_compact("==12*34=", TOOLS) == [ToolCall("calculator", {"expression": "12*34"}, "==12*34=")]
    assert parse_compact("1==1+2===3*4=5", TOOLS) == [ToolCall("calculator", {"expression": "1+2"}, "==1+2="),
                                                      ToolCall("calculator", {"expression": "3*4"}, "==3*4=")]
    assert parse_compact("413", TOOLS) == [] and parse_compact("81-31-8-3", TOOLS) == []
    assert all(ch in ALPHABET for ch in "==12*34=")  # the tiny tokenizer can write a call


def test_compact_malformed_calls_become_tool_errors():
    (unclosed,) = parse_compact("5==12*34", TOOLS)
    assert isinstance(unclosed, ToolError) and "not closed" in unclosed.message and unclosed.text == "==12*34"
    (empty,) = parse_compact("===", TOOLS)
    assert isinstance(empty, ToolError) and "no expression" in empty.message
    (not_offered,) = parse_compact("==1+1=", [PYTHON_SPEC])
    assert isinstance(not_offered, ToolError) and "unknown tool 'calculator'" in not_offered.message
    assert [type(p) for p in parse_compact("==1=" * 10, TOOLS)] == [ToolCall] * 8 + [ToolError] * 2


def test_replies_for_each_format():
    assert qwen_reply("408", ok=True) == "408" and qwen_reply("division by zero", ok=False) == "Error: division by zero"
    assert compact_reply("408", ok=True) == "408" and compact_reply("-3", ok=True) == "-3"
    assert compact_reply("0.5", ok=True) == COMPACT_ERROR_REPLY  # the tiny alphabet has no decimal point
    assert compact_reply("division by zero", ok=False) == COMPACT_ERROR_REPLY
    assert call_format("compact").parse is parse_compact and call_format("qwen").reply is qwen_reply
    with pytest.raises(ValueError, match="qwen, compact"):
        call_format("xml")


# ------------------------------------------------------------ the toolbox


class FakeSandbox:
    """PythonSandbox.run's contract without processes: scripted results, the code recorded."""

    def __init__(self, result: SandboxResult):
        self.result, self.codes = result, []

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        self.codes.append(code)
        return self.result


def sandbox_result(ok: bool, stdout: str = "", stderr: str = "", reason: str = "ok") -> SandboxResult:
    return SandboxResult(ok=ok, stdout=stdout, stderr=stderr, reason=reason, exit_code=0 if ok else 1,
                         duration_s=0.01, truncated=False)


def test_toolbox_answers_calls_errors_and_refusals_in_order():
    box = Toolbox([calculator_tool()])
    calls = parse_qwen(qwen_call({"name": "calculator", "arguments": {"expression": "12*34"}})
                       + qwen_call({"name": "calculator", "arguments": {"expression": "1/0"}})
                       + qwen_call({"name": "nope", "arguments": {}}), box.specs)
    answers = asyncio.run(box.answer_all(calls))
    assert answers[0] == Answer("408", ok=True)
    assert answers[1] == Answer("division by zero", ok=False)
    assert answers[2] == Answer("unknown tool 'nope'; the tools are: calculator", ok=False)
    assert box.template_tools() == [{"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR_SPEC.description,
        "parameters": dict(CALCULATOR_SPEC.parameters)}}]
    # A call parsed against other specs than the toolbox's is answered, not raised.
    assert asyncio.run(box.answer(ToolCall("python", {"code": "1"}, ""))).ok is False
    with pytest.raises(ValueError, match="unique"):
        Toolbox([calculator_tool(), calculator_tool()])


def test_python_tool_answers_with_stdout_or_the_failure():
    sandbox = FakeSandbox(sandbox_result(True, stdout="42\n"))
    box = Toolbox([python_tool(sandbox)])
    (call,) = parse_qwen(qwen_call({"name": "python", "arguments": {"code": "print(6*7)"}}), box.specs)
    assert asyncio.run(box.answer(call)) == Answer("42\n", ok=True) and sandbox.codes == ["print(6*7)"]
    sandbox.result = sandbox_result(False, stderr="Traceback ...\nZeroDivisionError: division by zero\n",
                                    reason="error: exit code 1")
    answer = asyncio.run(box.answer(call))
    assert not answer.ok and answer.text.startswith("the script failed (error: exit code 1):\nTraceback")
    assert answer.text.endswith("ZeroDivisionError: division by zero")


# ------------------------------------------------------------ the calculator


@pytest.mark.parametrize(("expression", "value"), [
    ("12*34", "408"), ("(12+3)*4/5", "12"), ("7/2", "3.5"), ("1/3", "0.333333333333333"),
    ("-22/7", "-3.142857142857143"), ("0.1+0.2", "0.3"), ("2**10", "1024"), ("2**-2", "0.25"),
    ("-7//2", "-4"), ("-7%3", "2"), ("7.5//2", "3"), ("+-+3", "-3"), ("2**3**2", "512"), (" 1_000 * 3 ", "3000"),
    ("1e3", "1000"), ("10**20/4", "25000000000000000000"), ("(((1)))", "1"), ("2/3*3", "2"),
    ("(7//2)/(5//2)", "1.5"),  # a floor division is an int: dividing two of them stays exact
])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value


def test_calculator_agrees_with_exact_python_arithmetic():
    """Random integer expressions, checked against Python's own arithmetic on Fractions (the generator
    writes each expression twice: as text for the calculator, and as a value computed alongside)."""
    rng = random.Random(1)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b, "//": lambda a, b: a // b, "%": lambda a, b: a % b}

    def expr(depth: int) -> tuple[str, Fraction]:
        if depth == 0 or rng.random() < 0.3:
            n = rng.randrange(-50, 50)
            return (f"({n})" if n < 0 else str(n)), Fraction(n)
        (lt, lv), (rt, rv) = expr(depth - 1), expr(depth - 1)
        op = rng.choice(list(ops))
        if op in ("/", "//", "%") and rv == 0:
            return lt, lv
        return f"({lt}{op}{rt})", ops[op](lv, rv)

    for _ in range(300):
        text, value = expr(4)
        assert evaluate_exact(text) == value, text


@pytest.mark.parametrize(("expression", "message"), [
    ("9**9**9", "exponent 387420489 is too large"),
    ("2**100000", "exponent 100000 is too large"),
    ("10**5000", "too large"),
    ("(10**1000)**5", "too large"),
    ("7**9999", "too large"),
    ("2**-100000", "too large"),
    ("2**0.5", "exponents must be integers"),
    ("1e999", "too large"),
    ("1/0", "division by zero"), ("5//0", "division by zero"), ("5%0.0", "division by zero"),
    ("0**-1", "division by zero"),
    ("__import__('os').system('true')", "function call"),
    ("().__class__.__bases__", "attribute access"),
    ("(1).real", "attribute access"),
    ("x+1", "the name 'x'"),
    ("[1, 2]", "List"),
    ("'a'*3", "'a' is not a number"),
    ("True+1", "True is not a number"),
    ("1j*1j", "1j is not a number"),
    ("1 if 1 else 2", "IfExp"),
    ("lambda: 1", "Lambda"),
    ("1<2", "Compare"),
    ("2^3", "use ** for powers"),
    ("1+", "not an arithmetic expression"),
    ("", "empty"),
    ("1\x00", "not an arithmetic expression"),
    ("1" * (MAX_LENGTH + 1), "characters long"),
    ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression"),  # the parser's nesting limit
    ("-" * 300 + "1", "more than"),
    ("+".join(["1"] * 150), "more than"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError) as refused:
        evaluate(expression)
    assert message in str(refused.value)
    assert isinstance(refused.value, ValueError)


def test_calculator_refuses_non_text():
    with pytest.raises(CalculatorError, match="must be text"):
        evaluate(12)  # type: ignore[arg-type]
