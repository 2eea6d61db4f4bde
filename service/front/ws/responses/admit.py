"""One response from its checked create to the engine's queue, and the context it leaves.

Shared by the two transports of the Responses API: the WebSocket actor
(connection.py) and `POST /v1/responses` (service/front/openai/responses.py).

    check_model       another model: model_not_found (404)
    admit             the prompt (chained on the previous response's exact tokens, tools
                      rendered as the model's template or the generic prompt wants them),
                      then `engine.add_request`: the tools, tool_choice and text.format go
                      with it, so the engine constrains the output as on the chat route
    context_of        what a finished response leaves for `previous_response_id`
    from_protocol_error  an engine refusal as the Responses API's error
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from protocol import (ChatMessage, ContextLengthExceeded, Done, InvalidRequest,
                      ProtocolError)
from protocol.responses_request import CreateRequest, ResponsesError
from protocol.structured import FunctionCall, ToolCall
from service.engine.client import EngineClient, EngineRequest
from service.front.openai.errors import ERROR_TYPES
from service.front.ws.responses.context import (build_prompt, context_after, prompt_tokenizer,
                                                tools_key)
from service.front.ws.responses.run import ResponseRun, tools_active
from service.front.ws.responses.store import StoredResponse

if TYPE_CHECKING:
    from service.engine.constraints.tools import ToolPlan

__all__ = ["admit", "check_model", "context_of", "from_protocol_error"]


def check_model(req: CreateRequest, model: str) -> None:
    """Raises ResponsesError 404 `model_not_found` when the create names another model."""
    if req.model is not None and req.model != model:
        raise ResponsesError(f"The model '{req.model}' does not exist; this server serves "
                             f"'{model}'.", code="model_not_found", param="model", status=404)


def _param(engine_param: str | None) -> str | None:
    """The create's field for an engine param ("$.tool_choice.function.name" ->
    "tool_choice")."""
    if not engine_param:
        return None
    for prefix, field in (("$.params.response_format", "text.format"), ("$.tools", "tools"),
                          ("$.tool_choice", "tool_choice")):
        if engine_param.startswith(prefix):
            return field
    return "input"


def from_protocol_error(e: ProtocolError, req: CreateRequest) -> ResponsesError:
    """An engine admission error as the Responses API's error: the same code, its class's
    HTTP status (`protocol.errors`) with OpenAI's type, and the create's own field as
    `param`."""
    status = e.http_status
    kind = ERROR_TYPES.get(status, "server_error")
    param, message = None, e.message
    if isinstance(e, ContextLengthExceeded):
        param = "input" if e.prompt_alone or req.max_output_tokens is None \
            else "max_output_tokens"
        if param == "max_output_tokens":  # the engine names its own field
            message = message.replace("max_tokens (", "max_output_tokens (")
    elif isinstance(e, InvalidRequest):
        param = _param(e.param)
    code = "server_error" if e.code == "internal_error" else e.code
    if isinstance(e, InvalidRequest):
        code = "invalid_value"
    return ResponsesError(message, code=code, param=param, status=status, type=kind)


async def admit(engine: EngineClient, run: ResponseRun, previous: StoredResponse | None, *,
                request_id: str, connection_id: str | None, received: float) -> None:
    """Build the run's prompt (off the event loop) and queue it in `engine`; sets
    `run.prompt_ids`, `run.messages` and `run.tools_key`.

    Raises ProtocolError: the engine's refusal (a bad schema or tool list, no room, ...);
    nothing is queued then.
    """
    req = run.request
    # as on the chat route, tool_choice "none" leaves the tools out of the prompt and the
    # output free; a warm-up renders none either (it samples nothing)
    active = tools_active(req) and req.generate

    def render() -> tuple[list[int], tuple[ChatMessage, ...], ToolPlan | None]:
        pt = prompt_tokenizer(engine.tokenizer)
        plan = pt.tool_plan(req.tools, req.tool_choice, parallel=req.parallel_tool_calls,
                            request_id=request_id) if active else None
        ids, messages = build_prompt(pt, previous, req.instructions, req.messages,
                                     generate=req.generate, tools=plan)
        return ids, messages, plan

    ids, messages, plan = await asyncio.to_thread(render)  # templating: off the loop
    # unset (None) values are the engine's to fill: its admission holds the defaults
    params: dict[str, Any] = {"max_tokens": req.max_output_tokens if req.generate else 1,
                              "temperature": req.temperature, "top_p": req.top_p}
    if req.response_format is not None and req.generate:
        params["response_format"] = req.response_format
    tools: dict[str, Any] = {}
    if plan is not None:
        tools = {"tools": list(plan.tools), "tool_choice": req.tool_choice,
                 "parallel_tool_calls": plan.parallel, "tool_style": plan.style}
    await engine.add_request(EngineRequest(
        prompt_token_ids=ids, params=params, request_id=request_id, client_id=run.id,
        arrival_time=received, connection_id=connection_id, **tools), run.on_event)
    run.prompt_ids, run.messages, run.tools_key = ids, messages, tools_key(plan)


def context_of(run: ResponseRun, done: Done,
               special_ids: frozenset[int]) -> StoredResponse | None:
    """The context a finished response leaves for `previous_response_id` (None when it
    failed or was cancelled): its prompt + output ids (calls as the model wrote them: see
    context.py), and the conversation with its answer as an assistant turn (its text and
    its calls, for a conversation rendered anew)."""
    if done.finish_reason not in ("stop", "length", "tool_calls"):
        return None
    req = run.request
    messages = run.messages
    if req.generate:
        text = "".join(run.text)
        calls = [ToolCall(id=c.call_id, function=FunctionCall(c.name, c.arguments))
                 for c in run.output.calls]
        messages = messages + (ChatMessage("assistant", text or None, tool_calls=calls or None),)
    output = run.output_ids if req.generate else []
    return context_after(run.id, run.prompt_ids, output, messages, req.instructions,
                         special_ids, run.tools_key)
