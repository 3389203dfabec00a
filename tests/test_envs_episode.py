"""pipelinerl/envs/episode.py: token-in/token-out episodes with the tiny tokenizer and a Qwen2.5-style template.

A scripted server records the prefix of every call; each test checks that the final sequence begins with
every one of them, token for token, and that masks, versions and logprobs line up with hand-built lists.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pipelinerl.envs.episode import NO_LOGPROB, NO_VERSION, Episode, EpisodeLimits
from pipelinerl.envs.tool_calls import COMPACT_ERROR_REPLY, ToolSpec, call_format
from pipelinerl.envs.toolbox import Toolbox, calculator_tool
from pipelinerl.tasks.base import PromptItem
from pipelinerl.tiny.model import build_tokenizer

# A chat template in Qwen2.5's format (written for these tests): a system turn, listing the tools inside
# <tools></tools> when there are any; assistant tool calls as <tool_call> JSON blocks; consecutive `tool`
# messages wrapped in <tool_response> blocks inside one user turn.
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nThese functions can be called; their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <name>, \"arguments\": <arguments object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALC = ToolSpec("calculator", "Evaluate an arithmetic expression.",
                {"type": "object", "required": ["expression"], "properties": {"expression": {"type": "string"}}})
CORPUS = ["You are a helpful assistant. What is 12*34+5? Let me compute it with the calculator.",
          '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
          "<tool_response>\n408\n</tool_response> The answer is 413. hello world, functions and arguments"]


def qwen_style_tokenizer():
    """A byte-level BPE trained here on a few sentences (no hub), with Qwen2.5's special tokens and
    <tool_call> tags as added tokens, and the Qwen2.5-style template; EOS is <|im_end|> as in Qwen2.5-Instruct."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS * 20, trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=QWEN_STYLE_TEMPLATE, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    return qwen_style_tokenizer()


class ScriptedServer:
    """Returns scripted completions in order and records the prefix (and max_tokens) of every call.
    Turn k's tokens carry version 10 + k and logprob -(k + 1) / 10 per token."""

    def __init__(self, turns: list[tuple[list[int], bool]]):
        self.turns, self.prefixes, self.max_tokens = list(turns), [], []

    def complete(self, prefix: list[int], max_tokens: int):
        k = len(self.prefixes)
        self.prefixes.append(list(prefix))
        self.max_tokens.append(max_tokens)
        ids, finished = self.turns[k]
        return ids, [-(k + 1) / 10] * len(ids), [10 + k] * len(ids), finished


def play(episode: Episode, server: ScriptedServer, replies: list[list[dict] | None]) -> Episode:
    """The actor's loop: complete the prefix, append the turn, append the environment's reply (None: finish)."""
    for reply in replies:
        ids, logprobs, versions, finished = server.complete(episode.prefix(), episode.max_new_tokens())
        episode.add_model_turn(ids, logprobs, versions, finished)
        if episode.done:
            break
        if reply is None:
            episode.finish()
            break
        if episode.add_env_turn(reply) is None:
            break
    return episode


def assert_prefixes_kept(episode: Episode, server: ScriptedServer) -> None:
    """Every call's prefix is the final sequence's prefix, and call k+1 continues call k plus its tokens."""
    final = episode.token_ids
    model_turns = episode.model_turns
    for k, prefix in enumerate(server.prefixes):
        assert final[:len(prefix)] == prefix, f"turn {k}: the server continued a prefix the episode does not keep"
        turn = model_turns[k]
        assert turn.start == len(prefix)
        assert final[turn.start:turn.end] == server.turns[k][0]  # the sampled tokens, verbatim
        if k + 1 < len(server.prefixes):
            assert server.prefixes[k + 1][:turn.end] == prefix + server.turns[k][0]


def assert_columns(episode: Episode, server: ScriptedServer) -> None:
    """loss_mask / versions / logprobs, hand-built from the turn spans: model tokens carry their call's
    values, prompt and environment tokens 0 / NO_VERSION / NO_LOGPROB."""
    mask, versions, logprobs = [], [], []
    k = 0
    for turn in episode.turns:
        n = turn.end - turn.start
        if turn.kind == "model":
            mask += [1] * n
            versions += [10 + k] * n
            logprobs += [-(k + 1) / 10] * n
            k += 1
        else:
            mask += [0] * n
            versions += [NO_VERSION] * n
            logprobs += [NO_LOGPROB] * n
    assert (episode.loss_mask, episode.versions, episode.logprobs) == (mask, versions, logprobs)
    assert len(episode.token_ids) == len(mask)
    assert [t.start for t in episode.turns[1:]] == [t.end for t in episode.turns[:-1]]  # contiguous spans


# ------------------------------------------------------------ the tiny tokenizer


def chars(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(text))


def test_tiny_prompt_is_the_single_turn_prompt(tiny):
    item = PromptItem(id="x", prompt="12*34+5=", answer="314")
    expected = [tiny.bos_token_id] + chars(tiny, "12*34+5=")
    assert Episode(tiny, item.messages).prefix() == item.token_ids(tiny) == expected


def test_tiny_multi_turn_keeps_every_prefix_and_every_eos(tiny):
    eos = tiny.eos_token_id
    server = ScriptedServer([(chars(tiny, "==12*34=") + [eos], True), (chars(tiny, "==408+5=") + [eos], True),
                             (chars(tiny, "314") + [eos], True)])
    episode = play(Episode(tiny, [{"role": "user", "content": "12*34+5="}]), server,
                   [[{"role": "tool", "content": "408"}], [{"role": "tool", "content": "413"}], None])
    assert episode.end_reason == "finished" and not episode.truncated
    # Hand-built: BOS, prompt, then each model turn with the EOS it sampled, then the tool's digits.
    expected = ([tiny.bos_token_id] + chars(tiny, "12*34+5=") + chars(tiny, "==12*34=") + [eos] + chars(tiny, "408")
                + chars(tiny, "==408+5=") + [eos] + chars(tiny, "413") + chars(tiny, "314") + [eos])
    assert episode.token_ids == expected
    assert [(t.kind, t.end - t.start) for t in episode.turns] == [
        ("prompt", 9), ("model", 9), ("env", 3), ("model", 9), ("env", 3), ("model", 4)]
    assert [t.text for t in episode.model_turns] == ["==12*34=", "==408+5=", "314"]
    assert_prefixes_kept(episode, server)
    assert_columns(episode, server)
    # A re-rendering of the conversation drops the EOS ending each model turn (the template never renders
    # it): the bug this builder exists to avoid. The episode differs from it by exactly those tokens.
    rerendered = tiny.apply_chat_template(episode.messages, tokenize=False)
    eos_at_turn_ends = {t.end - 1 for t in episode.model_turns}
    assert tiny.encode(rerendered, add_special_tokens=False) == [
        t for i, t in enumerate(episode.token_ids) if i not in eos_at_turn_ends]


def test_tiny_turn_without_eos_gets_nothing_inserted(tiny):
    """A turn stopped without EOS (a stop string): the tiny template closes turns with nothing, so the
    environment's digits follow the sampled tokens directly."""
    episode = Episode(tiny, [{"role": "user", "content": "7*8="}])
    episode.add_model_turn(chars(tiny, "==7*8="), [-0.5] * 6, [3] * 6, finished=True)
    env = episode.add_env_turn([{"role": "tool", "content": "56"}])
    assert episode.token_ids[env.start:env.end] == chars(tiny, "56")


# ------------------------------------------------------------ the Qwen2.5-style template


def qwen_turn(tok, text: str, end: bool = True) -> list[int]:
    """A model turn as the canonical tokens of `text`, then <|im_end|> (Qwen2.5-Instruct's EOS)."""
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if end else [])


def call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def render_ids(tok, messages, generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tools=[CALC.template_entry()], add_generation_prompt=generation_prompt,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_qwen_style_tokenizer_has_the_format(qwen):
    text = qwen.apply_chat_template([{"role": "user", "content": "hi"}], tools=[CALC.template_entry()],
                                    add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n") and "<tools>\n{" in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen.encode(text, add_special_tokens=False)
    assert ids.count(qwen.convert_tokens_to_ids("<|im_start|>")) == 3  # one token each, not spelled out
    assert ids.count(qwen.eos_token_id) == 2


def test_qwen_multi_turn_keeps_every_prefix_and_equals_the_full_rendering(qwen):
    turns = [qwen_turn(qwen, "Let me compute.\n" + call_text("12*34")), qwen_turn(qwen, call_text("408+5")),
             qwen_turn(qwen, "The answer is 413.")]
    server = ScriptedServer([(t, True) for t in turns])
    replies = [[{"role": "tool", "content": "408"}], [{"role": "tool", "content": "413"}], None]
    initial = [{"role": "user", "content": "What is 12*34+5?"}]
    episode = Episode(qwen, initial, tools=[CALC.template_entry()])
    play(episode, server, replies)
    assert episode.end_reason == "finished"
    assert_prefixes_kept(episode, server)
    assert_columns(episode, server)
    # With canonical model tokens, every prefix is the template's full rendering of the conversation so far.
    messages = list(initial)
    for k, prefix in enumerate(server.prefixes):
        assert prefix == render_ids(qwen, messages, generation_prompt=True), f"turn {k}"
        messages += [episode.messages[len(messages)]] + (replies[k] or [])
    # The final sequence: the full rendering, less the "\n" the template writes after the last <|im_end|>.
    assert episode.token_ids == render_ids(qwen, episode.messages, generation_prompt=False)[:-1]
    first_env = episode.turns[2]
    assert first_env.kind == "env" and qwen.decode(episode.token_ids[first_env.start:first_env.end]) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert episode.model_turns[0].text == "Let me compute.\n" + call_text("12*34")  # <|im_end|> not in the text


def test_qwen_parallel_tool_responses_share_one_user_turn(qwen):
    episode = Episode(qwen, [{"role": "user", "content": "Two sums"}], tools=[CALC.template_entry()])
    episode.add_model_turn(ids := qwen_turn(qwen, call_text("1+2") + "\n" + call_text("3*4")), [0.0] * len(ids),
                           [0] * len(ids), finished=True)
    env = episode.add_env_turn([{"role": "tool", "content": "3"}, {"role": "tool", "content": "12"}])
    assert qwen.decode(episode.token_ids[env.start:env.end]) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n12\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert episode.prefix() == render_ids(qwen, episode.messages, generation_prompt=True)


def test_qwen_model_tokens_are_never_re_encoded(qwen):
    """A turn sampled as one token per byte decodes to text whose encoding is different (merged) tokens:
    the episode keeps the sampled ones, and the environment's tokens are still the template's."""
    sampled = [qwen.convert_tokens_to_ids(t) for t in "hello"] + [qwen.convert_tokens_to_ids("Ġworld"),
                                                                   qwen.eos_token_id]
    assert qwen.encode(qwen.decode(sampled), add_special_tokens=False) != sampled  # re-encoding would change them
    server = ScriptedServer([(sampled, True), (qwen_turn(qwen, "ok"), True)])
    episode = play(Episode(qwen, [{"role": "user", "content": "Say hello"}]), server,
                   [[{"role": "user", "content": "again"}], None])
    assert_prefixes_kept(episode, server)
    assert_columns(episode, server)
    model = episode.model_turns[0]
    assert episode.token_ids[model.start:model.end] == sampled
    env = episode.turns[2]
    assert episode.token_ids[env.start:env.end] == qwen.encode(
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_qwen_turn_without_im_end_gets_it_as_an_environment_token(qwen):
    """A turn stopped by a stop string (or cut) lacks <|im_end|>: the template's close is inserted at the
    start of the environment turn, with loss mask 0; the model's tokens are untouched."""
    sampled = qwen_turn(qwen, call_text("12*34"), end=False)
    episode = Episode(qwen, [{"role": "user", "content": "12*34?"}], tools=[CALC.template_entry()])
    episode.add_model_turn(sampled, [-0.2] * len(sampled), [5] * len(sampled), finished=True)
    env = episode.add_env_turn([{"role": "tool", "content": "408"}])
    assert episode.token_ids[env.start] == qwen.eos_token_id and episode.loss_mask[env.start] == 0
    assert episode.versions[env.start] == NO_VERSION
    assert episode.prefix() == render_ids(qwen, episode.messages, generation_prompt=True)


def test_a_template_that_rewrites_content_is_refused():
    """A template that rewrites the assistant's content would not render the sampled text verbatim."""
    tok = build_tokenizer()
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] | replace('2', '3') }}{% endfor %}"
    episode = Episode(tok, [{"role": "user", "content": "1+1="}])
    with pytest.raises(ValueError, match="verbatim"):
        episode.add_model_turn(chars(tok, "2"), [0.0], [0], finished=True)


# ------------------------------------------------------------ limits


def test_a_turn_cut_at_max_tokens_per_turn_ends_the_episode(tiny):
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=3, max_total_tokens=100)
    server = ScriptedServer([(chars(tiny, "==1"), False)])
    episode = play(Episode(tiny, [{"role": "user", "content": "1+1="}], limits), server, [[]])
    assert server.max_tokens == [3]
    assert (episode.done, episode.truncated, episode.end_reason) == (True, True, "max_tokens_per_turn")
    assert episode.token_ids[-3:] == chars(tiny, "==1")


def test_max_total_tokens_bounds_the_calls_and_refuses_a_reply_that_leaves_no_room(tiny):
    eos = tiny.eos_token_id
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=6, max_total_tokens=12)
    episode = Episode(tiny, [{"role": "user", "content": "12+3="}], limits)  # 6 prompt tokens
    assert episode.max_new_tokens() == 6
    episode.add_model_turn(chars(tiny, "==1") + [eos], [0.0] * 4, [0] * 4, finished=True)  # 10 tokens
    assert episode.add_env_turn([{"role": "tool", "content": "12"}]) is None  # 12: no room left
    assert (episode.end_reason, len(episode.token_ids)) == ("max_total_tokens", 10)

    episode = Episode(tiny, [{"role": "user", "content": "12+3="}], limits)
    episode.add_model_turn([eos], [0.0], [0], finished=True)
    episode.add_env_turn([{"role": "tool", "content": "12"}])  # 9 tokens: 3 left
    assert episode.max_new_tokens() == 3
    episode.add_model_turn(chars(tiny, "123"), [0.0] * 3, [0] * 3, finished=False)
    assert episode.end_reason == "max_total_tokens" and len(episode.token_ids) == 12
    with pytest.raises(ValueError, match="max_total_tokens"):
        Episode(tiny, [{"role": "user", "content": "1" * 11}], limits)


def test_max_turns_ends_the_episode_when_the_environment_asks_for_more(tiny):
    eos = tiny.eos_token_id
    limits = EpisodeLimits(max_turns=2, max_tokens_per_turn=8, max_total_tokens=100)
    server = ScriptedServer([(chars(tiny, "==1+1=") + [eos], True), (chars(tiny, "==2+2=") + [eos], True)])
    replies = [[{"role": "tool", "content": "2"}], [{"role": "tool", "content": "4"}], None]
    episode = play(Episode(tiny, [{"role": "user", "content": "1+1+2="}], limits), server, replies)
    assert episode.end_reason == "max_turns" and episode.truncated
    assert episode.turns[-1].kind == "model" and episode.token_ids[-1] == eos  # the refused reply is not appended
    assert_prefixes_kept(episode, server)


def test_bad_model_turns_are_refused(tiny):
    episode = Episode(tiny, [{"role": "user", "content": "1+1="}], EpisodeLimits(max_tokens_per_turn=2))
    with pytest.raises(ValueError, match="one logprob and one version"):
        episode.add_model_turn([3, 4], [0.0], [0, 0], finished=True)
    with pytest.raises(ValueError, match="allowed 2"):
        episode.add_model_turn([3, 4, 5], [0.0] * 3, [0] * 3, finished=True)
    assert len(episode.token_ids) == 5 and episode.turns[-1].kind == "prompt"  # nothing appended


# ------------------------------------------------------------ with the tool-call parsers and the toolbox


def test_tiny_episode_with_compact_calls_answered_by_the_calculator(tiny):
    """The pieces composed as an environment will: parse the turn's text, answer the calls (a bad
    expression is answered with the compact error reply), render the answers as tool messages."""
    fmt, box = call_format("compact"), Toolbox([calculator_tool()])
    eos = tiny.eos_token_id
    server = ScriptedServer([(chars(tiny, "==12*34=") + [eos], True), (chars(tiny, "==408+*5=") + [eos], True),
                             (chars(tiny, "==408+5=") + [eos], True), (chars(tiny, "314") + [eos], True)])
    episode = Episode(tiny, [{"role": "user", "content": "12*34+5="}])
    while not episode.done:
        ids, logprobs, versions, finished = server.complete(episode.prefix(), episode.max_new_tokens())
        turn = episode.add_model_turn(ids, logprobs, versions, finished)
        calls = fmt.parse(turn.text, box.specs)
        if not calls:
            episode.finish()
            break
        answers = asyncio.run(box.answer_all(calls))
        episode.add_env_turn([{"role": "tool", "content": fmt.reply(a.text, a.ok)} for a in answers])
    env_texts = [t.text for t in episode.turns if t.kind == "env"]
    assert env_texts == ["408", COMPACT_ERROR_REPLY, "413"]
    assert episode.end_reason == "finished" and len(episode.model_turns) == 4
    assert_prefixes_kept(episode, server)
    assert_columns(episode, server)


# ------------------------------------------------------------ branches (a program going back in its conversation)


def two_calls(qwen, max_turns: int = 8) -> tuple[Episode, ScriptedServer, list[list[int]]]:
    """user | call 12*34 | tool 408 | call 408+5 | tool 413, ready for a third model turn."""
    turns = [qwen_turn(qwen, call_text("12*34")), qwen_turn(qwen, call_text("408+5"))]
    server = ScriptedServer([(t, True) for t in turns])
    episode = Episode(qwen, [{"role": "user", "content": "What is 12*34+5?"}], tools=[CALC.template_entry()],
                      limits=EpisodeLimits(max_turns=max_turns))
    play(episode, server, [[{"role": "tool", "content": "408"}], [{"role": "tool", "content": "413"}]])
    return episode, server, turns


def test_a_branch_after_a_model_turn_is_the_sequence_built_along_it(qwen):
    episode, server, turns = two_calls(qwen)
    drift, turn = episode.branch(2, [{"role": "tool", "content": "999"}])  # the first call's answer rewritten
    assert (drift, turn.kind, episode.sampled_turns) == (len(turns[1]), "env", 2)
    along = Episode(qwen, [{"role": "user", "content": "What is 12*34+5?"}], tools=[CALC.template_entry()])
    play(along, ScriptedServer([(turns[0], True)]), [[{"role": "tool", "content": "999"}]])
    assert episode.token_ids == along.token_ids and episode.messages == along.messages
    assert (episode.loss_mask, episode.versions, episode.logprobs) == (along.loss_mask, along.versions,
                                                                       along.logprobs)
    assert episode.prefix() == render_ids(qwen, along.messages, generation_prompt=True)


def test_a_retried_call_goes_back_to_before_its_turn_token_for_token(qwen):
    episode, server, turns = two_calls(qwen)
    drift, turn = episode.branch(3, [])  # user, call, tool 408 again: the second call retried
    assert drift == len(turns[1]) and turn.kind == "env"
    assert episode.prefix() == server.prefixes[1]  # exactly the tokens its first try was sampled from
    assert len(episode.model_turns) == 1 and episode.sampled_turns == 2


def test_a_branch_that_keeps_no_model_turn_restarts_from_a_prompt_with_nothing_trained(qwen):
    episode, _, turns = two_calls(qwen)
    summary = [{"role": "user", "content": "What is 12*34+5?"}, {"role": "assistant", "content": "12*34 is 408."},
               {"role": "user", "content": "Now add 5."}]
    drift, turn = episode.branch(1, summary[1:])
    assert (drift, turn.kind, [t.kind for t in episode.turns]) == (sum(map(len, turns)), "prompt", ["prompt"])
    assert episode.token_ids == render_ids(qwen, summary, generation_prompt=True)
    assert set(episode.loss_mask) == {0} and episode.messages == summary


def test_mask_after_takes_the_last_turns_out_of_the_loss_and_keeps_them(qwen):
    episode, _, turns = two_calls(qwen)
    before = list(episode.token_ids)
    assert episode.mask_after(3) == len(turns[1])
    assert episode.token_ids == before and sum(episode.loss_mask) == len(turns[0])
    assert episode.mask_after(0) == len(turns[0]) and sum(episode.loss_mask) == 0


def test_max_turns_counts_the_turns_a_branch_cut_off(qwen):
    episode, _, turns = two_calls(qwen, max_turns=3)
    assert episode.branch(3, [])[1] is not None  # the second call retried: 2 turns sampled of 3
    episode.add_model_turn(turns[1], [0.0] * len(turns[1]), [0] * len(turns[1]), finished=True)
    drift, turn = episode.branch(3, [])  # and retried again: a fourth turn would be one too many
    assert (drift, turn, episode.end_reason, episode.sampled_turns) == (len(turns[1]), None, "max_turns", 3)


def test_a_branch_out_of_the_conversation_or_past_the_token_limit_is_refused_and_changes_nothing(qwen):
    episode, _, _ = two_calls(qwen)
    before = (list(episode.token_ids), list(episode.messages))
    with pytest.raises(ValueError, match="within the conversation"):
        episode.branch(6, [])
    with pytest.raises(ValueError, match="max_total_tokens"):
        episode.branch(0, [{"role": "user", "content": "hello world " * 2000}])
    assert (episode.token_ids, episode.messages) == before


# ------------------------------------------------------------ per-turn cost (issue 46)


class CountingTokenizer:
    """The tokenizer, recording how many messages each rendering is given and how long each encoded text is."""

    def __init__(self, tok):
        self.tok, self.rendered, self.encoded = tok, [], []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def apply_chat_template(self, messages, **kwargs):
        self.rendered.append(len(messages))
        return self.tok.apply_chat_template(messages, **kwargs)

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tok.encode(text, **kwargs)


def long_episode(tok, turns: int) -> Episode:
    """`turns` calculator calls, each answered, on the Qwen-style template."""
    episode = Episode(tok, [{"role": "user", "content": "What is 12*34+5?"}], tools=[CALC.template_entry()],
                      limits=EpisodeLimits(max_turns=turns + 1, max_total_tokens=10**6))
    turn = qwen_turn(tok.tok if isinstance(tok, CountingTokenizer) else tok, "Let me compute.\n" + call_text("12*34"))
    for _ in range(turns):
        episode.add_model_turn(turn, [0.0] * len(turn), [0] * len(turn), finished=True)
        episode.add_env_turn([{"role": "tool", "content": "408"}, {"role": "tool", "content": "413"}])
    return episode


def test_a_turn_renders_and_encodes_only_the_end_of_the_conversation(qwen):
    counting = CountingTokenizer(qwen)
    episode = long_episode(counting, 60)
    # at most the first message, the last episode.CONTEXT_MESSAGES and a turn's new ones (two tool messages),
    # once each episode's few checked renderings are done; and only a turn's new text is ever encoded
    assert max(counting.rendered[-100:]) <= 1 + 3 + 2 and max(counting.rendered) < 20
    assert max(counting.encoded[1:]) < 200 and len(episode.token_ids) > 4000
    # and the sequence is the one full renderings give
    assert episode.token_ids == render_ids(qwen, episode.messages, generation_prompt=True)


def test_a_template_that_numbers_its_messages_is_rendered_on_the_whole_history(qwen, monkeypatch):
    import copy

    from pipelinerl.envs import episode as module

    numbered = copy.deepcopy(qwen)
    numbered.chat_template = qwen.chat_template.replace("'\\n<tool_response>\\n'",
                                                        "'\\n<tool_response ' + (loop.index | string) + '>\\n'")
    assert numbered.chat_template != qwen.chat_template
    monkeypatch.setattr(module, "_WHOLE_TEMPLATES", set())
    counting = CountingTokenizer(numbered)
    episode = long_episode(counting, 8)
    assert numbered.chat_template in module._WHOLE_TEMPLATES and max(counting.rendered) > 12
    assert episode.token_ids == render_ids(numbered, episode.messages, generation_prompt=True)
