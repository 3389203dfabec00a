"""One multi-turn episode as a single token sequence, built by appending (token-in, token-out).

The sequence starts with the prompt: the chat template applied to the initial messages with the generation
prompt. A model turn appends the sampled tokens exactly as the server returned them: they are never
decoded and encoded again, so no re-tokenisation can merge, split or drop a token the policy produced.
An environment turn appends only what the chat template renders *after* the conversation so far:

    env text = owed + render(conversation + env messages, generation prompt)[len(render(conversation)):]

computed on text, then tokenised alone. Every server call therefore continues the episode's exact
token prefix (`prefix()`), and the final sequence begins with every prefix a server was given.

End-of-turn tokens. The template closes an assistant message with its own text (`close`: Qwen2.5's
`<|im_end|>\\n`, nothing for the tiny model's template). The model's sampled end token (a token of
`end_token_ids`, by default the tokenizer's EOS) is kept as sampled, always. What the template's close
needs beyond it is `owed`, appended at the start of the next environment turn as environment tokens:

- the turn ended with an end token the close begins with (Qwen2.5: `<|im_end|>`): owed = the rest (`\\n`);
- the turn ended without an end token (cut at its length limit, or stopped by a stop string): owed = the
  whole close, so `<|im_end|>` is inserted, as an environment token with loss mask 0;
- the turn ended with an end token the template never renders (the tiny model's `<eos>`): the token stays
  and owed = the whole close (nothing for the tiny template). A full re-rendering of the messages would
  drop that token at every turn; this sequence keeps it, since the policy saw it.

Where every model turn is the canonical tokenisation of its text followed by the end token the template's
close begins with (Qwen2.5), the sequence equals the tokenised full rendering of the conversation: the
environment's text starts at a special token, so tokenising it alone splits nothing differently
(tests/test_envs_episode.py checks this, and the tiny template's one difference: the kept EOS tokens).
Templates that are not prefix-stable (a later message changes the rendering of earlier ones, e.g. one
that drops past reasoning) cannot be continued by appending: `ValueError`.

Per-turn cost. A turn renders only the end of the conversation: the first message (a template may treat it
apart: a system prompt, the tool list), the last CONTEXT_MESSAGES (a message's rendering may depend on its
neighbours: Qwen2.5 groups consecutive tool messages) and the new ones; what the template writes after them is
what it writes after the whole history for every template that renders each message from its neighbours only,
so a turn's work does not grow with the episode. The first CHECKED_DELTAS such renderings of each episode are
checked against the full history's; a template that differs (it numbers messages, say) is rendered whole from
then on, in every episode (logged once).

Branches. A program that drives the conversation itself (an agent on the OpenAI API) may go back in it: retry a
turn, edit or drop earlier messages. `branch(keep, messages)` continues the episode from its first `keep`
messages followed by `messages`: the sequence is cut after the last model turn within those messages, the kept
messages after it are rendered again with the new ones as one environment turn, and the model tokens cut off
(the drift) are no longer in the sequence, so never trained; with no model turn kept, the episode restarts from
a prompt of those messages. `mask_after(keep)` is the same at the end of an episode: the model turns after
`keep` messages stay in the sequence with loss mask 0. `max_turns` counts every model turn sampled, cut ones
included, so a program that retries forever still ends.

Raw text. A program on text completions (envs/agent_gateway.py) writes the whole text itself: with `raw`, the
messages are plain text segments (the program's text, the model's turns) joined as they are, with no template
and no close after a model turn, and the prompt is tokenised as a server tokenises a text prompt (a BOS where
the tokenizer adds one). Everything above holds with this identity "template".

Only the prompt gets BOS (from the template); environment text is tokenised without adding special tokens.
Text that spells one (a tool printing `<|im_end|>`) becomes that token, as in a full rendering: an
environment that must prevent it escapes its messages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

CONTEXT_MESSAGES = 3  # the last messages of the history rendered with a turn's new ones (module doc)
CHECKED_DELTAS = 2  # per episode, renderings of a shortened history checked against the full one
_WHOLE_TEMPLATES: set[str] = set()  # chat templates whose turns must be rendered on the whole history
log = logging.getLogger(__name__)

NO_VERSION = -1  # per-token version of prompt and environment tokens
NO_LOGPROB = 0.0  # per-token behaviour logprob of prompt and environment tokens


@dataclass(frozen=True)
class EpisodeLimits:
    """When an episode is cut (it then ends `truncated`). Token counts include the prompt."""

    max_turns: int = 8  # model turns; the environment asking for one more ends the episode
    max_tokens_per_turn: int = 512  # new tokens of one model turn (the server call's max_tokens)
    max_total_tokens: int = 4096  # of the whole sequence: prompt, model and environment tokens

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"episode limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Turn:
    """A span [start, end) of the sequence. `text`: a model turn's content (its tokens decoded without the
    end token: what tool calls are parsed from and what the template renders as the assistant message);
    the prompt's or an environment turn's rendered text."""

    kind: Literal["prompt", "model", "env"]
    start: int
    end: int
    text: str


class Episode:
    """The token builder. Per token: `token_ids`, `loss_mask` (1 for model tokens only), `versions`
    (NO_VERSION for prompt and environment tokens), `logprobs` (behaviour logprobs; NO_LOGPROB for those).
    `end_reason` is None while the episode runs, then "finished" (`finish()`), or a truncation:
    "max_turns", "max_tokens_per_turn" (a model turn cut at its limit), "max_total_tokens"."""

    def __init__(self, tokenizer, messages: Sequence[dict], limits: EpisodeLimits | None = None,
                 tools: Sequence[dict] | None = None, end_token_ids: Iterable[int] | None = None, raw: bool = False):
        """`messages`: the initial chat messages; `tools`: the template's `tools` argument (tool_calls.py's
        ToolSpec.template_entry), rendered at every turn; `end_token_ids`: the tokens that end a model turn
        (default: the tokenizer's EOS); `raw`: the messages are plain text, joined as they are (module doc)."""
        self.tokenizer, self.limits, self.raw = tokenizer, limits or EpisodeLimits(), raw
        self.tools = list(tools) if tools else None
        self.end_token_ids = set(end_token_ids) if end_token_ids is not None else {tokenizer.eos_token_id}
        self.messages: list[dict] = [dict(m) for m in messages]
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.end_reason: str | None = None
        self.sampled_turns = 0  # model turns sampled, those a branch cut off included (what max_turns counts)
        self._owed = ""  # what the template's close of the last model turn needs beyond the sampled tokens
        self._marks: list[tuple[int, str]] = []  # per turn: (messages so far, owed) after it, to go back to
        self._checked = 0  # shortened renderings checked so far (CHECKED_DELTAS)
        prompt, ids = self._prompt(self.messages)
        self._append("prompt", ids, prompt)

    def _prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        prompt = self._render(messages, generation_prompt=True)
        # raw text is tokenised as a server tokenises a text prompt: with the special tokens its tokenizer adds
        ids = list(self.tokenizer.encode(prompt)) if self.raw else self._encode(prompt)
        if len(ids) >= self.limits.max_total_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens, no fewer than max_total_tokens="
                             f"{self.limits.max_total_tokens}: raise the limit or shorten the prompt")
        return prompt, ids

    # ------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def truncated(self) -> bool:
        return self.end_reason not in (None, "finished")

    @property
    def prompt_length(self) -> int:
        return self.turns[0].end

    @property
    def model_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.kind == "model"]

    def prefix(self) -> list[int]:
        """The token ids the next server call must continue: the whole sequence so far."""
        assert not self.done, "the episode has ended"
        assert self.turns[-1].kind != "model", "a model turn must be followed by an environment turn"
        return list(self.token_ids)

    def max_new_tokens(self) -> int:
        """The next server call's max_tokens: the per-turn limit, or what the total limit leaves."""
        return min(self.limits.max_tokens_per_turn, self.limits.max_total_tokens - len(self.token_ids))

    # ------------------------------------------------------------ turns

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                       finished: bool) -> Turn:
        """Append a server's completion of `prefix()` verbatim. `finished`: it ended by an end token or a
        stop string; False (cut at max_tokens) ends the episode truncated."""
        assert not self.done, "the episode has ended"
        assert self.turns[-1].kind != "model", "two model turns in a row: add an environment turn between"
        token_ids = list(token_ids)
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(f"a model turn needs one logprob and one version per token: got {len(token_ids)} "
                             f"tokens, {len(logprobs)} logprobs, {len(versions)} versions")
        budget = self.max_new_tokens()
        if len(token_ids) > budget:
            raise ValueError(f"the model turn has {len(token_ids)} tokens but the call was allowed {budget}: "
                             "pass max_new_tokens() as the request's max_tokens")
        ended = bool(token_ids) and token_ids[-1] in self.end_token_ids
        content_ids = token_ids[:-1] if ended else token_ids
        content = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        close = self._close(content)
        end_text = self.tokenizer.decode(token_ids[-1:], skip_special_tokens=False) if ended else ""
        self._owed = close[len(end_text):] if ended and close.startswith(end_text) else close
        self.messages.append({"role": "assistant", "content": content})
        self.sampled_turns += 1
        turn = self._append("model", token_ids, content, list(logprobs), list(versions))
        if not finished:
            self.end_reason = ("max_tokens_per_turn" if budget == self.limits.max_tokens_per_turn
                               else "max_total_tokens")
        return turn

    def add_env_turn(self, messages: Sequence[dict]) -> Turn | None:
        """Append the environment's reply to the last model turn (tool results, a user message) as the
        template renders it, with the generation prompt of the next model turn. Returns None, appending
        nothing, when no model turn may follow: the episode then ends truncated ("max_turns", or
        "max_total_tokens" when the reply would leave no room for one new token)."""
        assert not self.done, "the episode has ended"
        assert self.turns[-1].kind == "model", "an environment turn follows a model turn"
        if self.sampled_turns >= self.limits.max_turns:
            self.end_reason = "max_turns"
            return None
        messages = [dict(m) for m in messages]
        before, after = self._render_after(messages, False, True)
        if not after.startswith(before):
            raise ValueError("the chat template renders the earlier turns differently once the environment's "
                             "messages are added, so the episode cannot be continued by appending")
        text = self._owed + after[len(before):]
        ids = self._encode(text)
        if len(self.token_ids) + len(ids) >= self.limits.max_total_tokens:
            self.end_reason = "max_total_tokens"
            return None
        self.messages.extend(messages)
        return self._append("env", ids, text)

    def branch(self, keep: int, messages: Sequence[dict]) -> tuple[int, Turn | None]:
        """Continue from the first `keep` messages of the conversation followed by `messages` (module doc).
        Returns (the model tokens cut off, the turn that now ends the sequence: an environment turn, or the
        prompt when no model turn was kept; None when a limit ends the episode instead, as in add_env_turn).
        ValueError when the restarted prompt would exceed max_total_tokens (nothing changed), or when the template
        cannot render the tail after the kept turns (as in add_env_turn; the sequence is then cut)."""
        assert not self.done, "the episode has ended"
        if not 0 <= keep <= len(self.messages):
            raise ValueError(f"keep must be within the conversation's {len(self.messages)} messages, got {keep}")
        messages = [dict(m) for m in messages]
        cut = self._last_model_turn_within(keep)
        if cut is None:
            start = self.messages[:keep] + messages
            prompt, ids = self._prompt(start)
            drift = sum(self.loss_mask)
            self._truncate(0, [], "")
            self.messages = start
            return drift, self._append("prompt", ids, prompt)
        tail = self.messages[self._marks[cut][0]:keep] + messages
        drift = sum(self.loss_mask[self.turns[cut].end:])
        self._truncate(cut + 1, self.messages[:self._marks[cut][0]], self._marks[cut][1])
        return drift, self.add_env_turn(tail)

    def mask_after(self, keep: int) -> int:
        """Take the model turns after the first `keep` messages out of the loss (loss mask 0, kept in the
        sequence); returns how many model tokens that was."""
        cut = self._last_model_turn_within(keep)
        start = self.turns[cut].end if cut is not None else self.prompt_length
        dropped = sum(self.loss_mask[start:])
        self.loss_mask[start:] = [0] * (len(self.loss_mask) - start)
        return dropped

    def _last_model_turn_within(self, keep: int) -> int | None:
        """The index of the last model turn whose assistant message is among the first `keep` messages."""
        return max((i for i, t in enumerate(self.turns) if t.kind == "model" and self._marks[i][0] <= keep),
                   default=None)

    def _truncate(self, turns: int, messages: list[dict], owed: str) -> None:
        end = self.turns[turns - 1].end if turns else 0
        for seq in (self.token_ids, self.loss_mask, self.versions, self.logprobs):
            del seq[end:]
        del self.turns[turns:], self._marks[turns:]
        self.messages, self._owed = messages, owed

    def finish(self) -> None:
        """The environment ends the episode after the last model turn (nothing more is appended)."""
        assert not self.done, "the episode has ended"
        self.end_reason = "finished"

    # ------------------------------------------------------------ rendering

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.raw:
            return "".join(m["content"] for m in messages)
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _render_after(self, new: list[dict], generation_before: bool, generation_after: bool) -> tuple[str, str]:
        """(the history rendered, the history and `new` rendered), each with its generation prompt or not: what
        the second adds to the first is the template's text for `new` after the history. The history is
        shortened to its first and last CONTEXT_MESSAGES messages when the template allows (module doc)."""
        history, template = self.messages, str(self.tokenizer.chat_template)
        short = history
        if len(history) > CONTEXT_MESSAGES + 1 and template not in _WHOLE_TEMPLATES:
            short = history[:1] + history[-CONTEXT_MESSAGES:]
        before, after = self._render(short, generation_before), self._render(short + new, generation_after)
        if short is history or self._checked >= CHECKED_DELTAS:
            return before, after
        self._checked += 1
        whole = self._render(history, generation_before), self._render(history + new, generation_after)
        if (whole[1].startswith(whole[0]), whole[1][len(whole[0]):]) != (after.startswith(before), after[len(before):]):
            _WHOLE_TEMPLATES.add(template)
            log.warning("the chat template renders a message differently on a shortened history: its episodes' "
                        "turns are rendered on the whole history from now on (their cost grows with the episode)")
            return whole
        return before, after

    def _close(self, content: str) -> str:
        """The text the template renders after an assistant message's content."""
        opened, rendered = self._render_after([{"role": "assistant", "content": content}], True, False)
        if not (rendered.startswith(opened) and rendered[len(opened):].startswith(content)):
            raise ValueError("the chat template does not render an assistant message as its content verbatim "
                             "after the generation prompt, so model tokens cannot be appended as sampled")
        return rendered[len(opened) + len(content):]

    def _append(self, kind: Literal["prompt", "model", "env"], ids: list[int], text: str,
                logprobs: list[float] | None = None, versions: list[int] | None = None) -> Turn:
        start = len(self.token_ids)
        model = kind == "model"
        self.token_ids.extend(ids)
        self.loss_mask.extend([int(model)] * len(ids))
        self.versions.extend(versions if model else [NO_VERSION] * len(ids))
        self.logprobs.extend(logprobs if model else [NO_LOGPROB] * len(ids))
        turn = Turn(kind, start, len(self.token_ids), text)
        self.turns.append(turn)
        self._marks.append((len(self.messages), self._owed))
        return turn
