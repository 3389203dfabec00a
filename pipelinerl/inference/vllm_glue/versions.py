"""Per-token policy versions on vLLM's OpenAI chat and completion responses.

vLLM tracks, per request, where each weight version starts (`CompletionOutput.weight_versions`, spans
over output-token indexes) but only its token-in/token-out route returns them. These subclasses add
one documented extra field to every non-streaming choice, and to the last chunk of each streamed
completion choice (the one with its `finish_reason`):

    choices[i].policy_versions: list[int]   one entry per completion token (same length as
                                            `token_ids`; streamed: as all the choice's chunks
                                            together): the policy version that produced it

    choices[i].routed_experts: {"dtype", "shape", "data"} | absent
                                            with inference.return_routed_experts (a mixture of
                                            experts): each completion token's experts in every MoE
                                            layer, shape [tokens, layers, k], the ids' little-endian
                                            bytes (uint8, or uint16 past 254 experts) in base64
                                            (routing.py)

Versions are integers because the server always sets them from the trainer's integer versions.
`serving.open_server` applies `add_versions` on policy servers.
"""

from __future__ import annotations

import json

from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

from pipelinerl.inference.vllm_glue.routing import encode

FIELD = "policy_versions"
ROUTING_FIELD = "routed_experts"


def per_token_versions(output) -> list[int] | None:
    """Expand a finished CompletionOutput's version spans into one version per output token."""
    spans = output.weight_versions
    if spans is None:
        return None
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    return versions


class VersionedChat(OpenAIServingChat):
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        final = []

        async def remember_last():
            async for res in result_generator:
                final[:] = [res]
                yield res

        response = await super().chat_completion_full_generator(request, remember_last(), *args, **kwargs)
        if final and hasattr(response, "choices"):
            by_index = {o.index: o for o in final[0].outputs}
            for choice in response.choices:
                _annotate(choice, by_index[choice.index])
        return response


class VersionedCompletion(OpenAIServingCompletion):
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = super().request_output_to_completion_response(final_res_batch, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]
        for choice, output in zip(response.choices, outputs):
            _annotate(choice, output)
        return response


    async def completion_stream_generator(self, request, engine_inputs, result_generator, *args, **kwargs):
        num_choices = request.n or 1
        finished: dict[int, dict] = {}  # choice index -> its extra fields, once its output finished

        async def remember_finished():
            async for prompt_idx, res in result_generator:
                for output in res.outputs:
                    if output.finished():
                        finished[output.index + prompt_idx * num_choices] = _fields(output)
                yield prompt_idx, res

        async for event in super().completion_stream_generator(request, engine_inputs, remember_finished(),
                                                               *args, **kwargs):
            yield _with_versions(event, finished) if finished else event


def _fields(output) -> dict:
    """The extra fields of a finished output's choice: its versions, and its routed experts when captured."""
    fields = {FIELD: per_token_versions(output)}
    routed = encode(getattr(output, "routed_experts", None))
    if routed is not None:
        fields[ROUTING_FIELD] = routed
    return fields


def _annotate(choice, output) -> None:
    for name, value in _fields(output).items():
        setattr(choice, name, value)


def _with_versions(event: str, finished: dict[int, dict]) -> str:
    """A streamed `data: {...}` chunk with `policy_versions` (and routed experts) on each choice that finished
    in it."""
    if not event.startswith("data: {"):
        return event
    chunk = json.loads(event[len("data: "):])
    ended = [c for c in chunk.get("choices", []) if c.get("finish_reason") is not None and c.get("index") in finished]
    if not ended:
        return event
    for choice in ended:
        choice.update(finished.pop(choice["index"]))
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def add_versions(state) -> None:
    """Give vLLM's serving objects the versioned behaviour. They are built by vLLM's `init_app_state`
    from ~20 arguments; switching their class to a subclass that only overrides response assembly
    avoids re-creating them (and copying that wiring)."""
    if getattr(state, "openai_serving_chat", None) is not None:
        state.openai_serving_chat.__class__ = VersionedChat
    if getattr(state, "openai_serving_completion", None) is not None:
        state.openai_serving_completion.__class__ = VersionedCompletion
