"""The async engine: what turns a request into a stream of events, around the pure core.

    client.py            EngineClient (the ABC every front is typed against), EngineRequest
    stream.py            RequestStream, Event, Sink: a request's events, in order
    engine.py            Engine: the in-process EngineClient (Admission, step loop, streams)
    llm.py               LLM: offline, synchronous batch generation on the same core
    admission.py         Admission: input checks, tokenizing, defaults, the room check
    request_input.py     a request's input checked as the wire checks it; PromptTokenizer:
                         messages / text / ids -> token ids (chat template, no injection)
    sampling_defaults.py the model's generation config: unset values, default max_tokens
    step_loop.py         the Scheduler + StepLoop actor around EngineCore.step()
    output_processor.py  the request table: step outputs -> Delta / Error / Done events
    detokenizer.py       incremental detokenizing and stop strings
    metrics.py           Prometheus metrics of one engine
    faults.py            test-only fault injection into real steps

A lazy face: `from service.engine import Engine` imports the engine on first use, so the
front can import the contract (`service.engine.client`) without the step loop.
"""

from __future__ import annotations

from protocol._lazy import lazy_face

_EXPORTS = {
    "Engine": "service.engine.engine",
    "EngineClient": "service.engine.client",
    "EngineRequest": "service.engine.client",
    "LLM": "service.engine.llm",
    "PromptTokenizer": "service.engine.request_input",
    "RequestStream": "service.engine.stream",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
