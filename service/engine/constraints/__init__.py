"""Structured output and tool calling on the engine side (issue 48).

    grammar.py      a request's constraint (response_format, structured, a tool plan) ->
                    the grammar text llguidance compiles, with the field to blame
    compiler.py     GrammarCompiler: compiles in a thread pool, off the event loop and the
                    step loop, caches by grammar text; bad grammars -> InvalidRequest
    tools.py        ToolPlan: how tools reach the prompt (the template's own form, or the
                    generic system-prompt form) and the grammar of a call
    tool_parser.py  ToolCallParser: a completion's text -> streamed tool-call pieces

The token masks themselves are applied in the worker (`service.worker.token_mask`), with
each request's `service.worker.grammar_state.GrammarState`.
"""
