"""Tool calls in a model turn's text, in two formats, and the tool specs they are checked against.

- **qwen**: Qwen2.5's format, which its chat template teaches when given `tools`: each call is
  `<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>` (whitespace
  around the JSON allowed), several per turn allowed.
- **compact**: for the tiny model, whose tokenizer writes only `0123456789+-*=`: `==12*34=` calls the
  calculator on `12*34` (`==` opens a call, the next `=` closes it), several per turn allowed.

Parsing never raises for anything the model wrote: each call becomes a `ToolCall` whose arguments match
its tool's spec, or a `ToolError` whose message is what the model is told instead. Running calls is
pipelinerl/envs/toolbox.py's job.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.tiny.model import ALPHABET

MAX_CALLS = 8  # calls per turn; more are answered with a ToolError each

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
COMPACT_OPEN, COMPACT_CLOSE = "==", "="
COMPACT_TOOL, COMPACT_ARGUMENT = "calculator", "expression"
COMPACT_ERROR_REPLY = "*"  # what the tiny model reads for any failed call: its alphabet has no words

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "object": (dict,), "array": (list,)}


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it: a name, a description and its parameters as a flat JSON-schema object
    (`{"type": "object", "properties": {name: {"type": ...}}, "required": [...]}`)."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def template_entry(self) -> dict:
        """The entry of a chat template's `tools` list (the OpenAI function format Qwen2.5's template takes)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}

    def argument_error(self, arguments: Mapping[str, Any]) -> str | None:
        """Why `arguments` do not fit the parameters (a missing, unknown or mistyped one), or None."""
        properties = self.parameters.get("properties", {})
        missing = [n for n in self.parameters.get("required", ()) if n not in arguments]
        if missing:
            return f"tool {self.name!r} needs the argument(s) {', '.join(missing)}"
        unknown = [n for n in arguments if n not in properties]
        if unknown:
            return f"tool {self.name!r} has no argument(s) {', '.join(unknown)}; it takes {', '.join(properties)}"
        for name, value in arguments.items():
            wanted = properties[name].get("type")
            types = _JSON_TYPES.get(wanted, (object,))
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                return f"argument {name!r} of tool {self.name!r} must be of type {wanted}, got {json.dumps(value)}"
        return None


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a known tool and arguments that fit its spec; `text` is the call as written."""

    name: str
    arguments: dict[str, Any]
    text: str


@dataclass(frozen=True)
class ToolError:
    """A call that cannot be run; `message` is what the model is told, `text` the offending text."""

    message: str
    text: str


Parsed = ToolCall | ToolError


def parse_qwen(text: str, tools: Sequence[ToolSpec], max_calls: int = MAX_CALLS) -> list[Parsed]:
    """The `<tool_call>` blocks of `text` in order, each checked against `tools`. A block left open at the
    end (a turn cut at its length limit) is a ToolError; text outside the blocks is ignored."""
    by_name = {t.name: t for t in tools}
    out = [ToolError(f"the tool call is not closed with {QWEN_CLOSE}", raw) if body is None
           else _qwen_call(body, raw, by_name) for raw, body in _blocks(text, QWEN_OPEN, QWEN_CLOSE)]
    return _capped(out, max_calls)


def _blocks(text: str, open_: str, close: str) -> Iterator[tuple[str, str | None]]:
    """(raw, body) of each `open_ body close` block of `text` in order; a block left open at the end is the
    last, as (the rest of the text, None)."""
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        end = text.find(close, start + len(open_))
        if end < 0:
            yield text[start:], None
            return
        pos = end + len(close)
        yield text[start:pos], text[start + len(open_):end]


def _qwen_call(body: str, raw: str, tools: Mapping[str, ToolSpec]) -> Parsed:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        return ToolError(f"the tool call is not valid JSON ({e})", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolError('a tool call must be a JSON object {"name": ..., "arguments": {...}}', raw)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolError(f"the arguments of tool {obj['name']!r} must be a JSON object", raw)
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return ToolError(f"a tool call has only the keys name and arguments, not {', '.join(sorted(extra))}", raw)
    return _checked_call(obj["name"], arguments, raw, tools)


def parse_compact(text: str, tools: Sequence[ToolSpec], max_calls: int = MAX_CALLS) -> list[Parsed]:
    """The `==EXPRESSION=` calls of `text` in order: each a call of COMPACT_TOOL with the expression as
    COMPACT_ARGUMENT, checked against `tools` (an environment that does not offer the calculator answers
    "unknown tool"). A call left open, or an empty expression, is a ToolError."""
    by_name = {t.name: t for t in tools}
    out: list[Parsed] = []
    for raw, expression in _blocks(text, COMPACT_OPEN, COMPACT_CLOSE):
        if expression is None:
            out.append(ToolError(f"the call is not closed with {COMPACT_CLOSE!r}", raw))
        elif expression:
            out.append(_checked_call(COMPACT_TOOL, {COMPACT_ARGUMENT: expression}, raw, by_name))
        else:
            out.append(ToolError("the call has no expression", raw))
    return _capped(out, max_calls)


def _checked_call(name: str, arguments: dict, raw: str, tools: Mapping[str, ToolSpec]) -> Parsed:
    spec = tools.get(name)
    if spec is None:
        offered = ", ".join(tools) or "none"
        return ToolError(f"unknown tool {name!r}; the tools are: {offered}", raw)
    problem = spec.argument_error(arguments)
    return ToolError(problem, raw) if problem else ToolCall(name, arguments, raw)


def _capped(calls: list[Parsed], max_calls: int) -> list[Parsed]:
    return [c if i < max_calls else ToolError(f"at most {max_calls} tool calls per turn", c.text)
            for i, c in enumerate(calls)]


def qwen_reply(answer: str, ok: bool) -> str:
    """A tool message's content in the qwen format: the answer as is (an error's text says it is one)."""
    return answer if ok else f"Error: {answer}"


def compact_reply(answer: str, ok: bool) -> str:
    """A tool message's content in the compact format: the answer if the tiny alphabet can write it,
    otherwise (an error, a decimal point, a word) COMPACT_ERROR_REPLY."""
    return answer if ok and answer and all(ch in ALPHABET for ch in answer) else COMPACT_ERROR_REPLY


@dataclass(frozen=True)
class CallFormat:
    """How one model family writes calls (`parse`) and reads the answers (`reply`: answer text, ok ->
    the content of the `tool` message the chat template renders)."""

    name: str
    parse: Callable[[str, Sequence[ToolSpec]], list[Parsed]]
    reply: Callable[[str, bool], str]


FORMATS = {"qwen": CallFormat("qwen", parse_qwen, qwen_reply),
           "compact": CallFormat("compact", parse_compact, compact_reply)}


def call_format(name: str) -> CallFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]
