"""What the ingress and the engine replicas pass each other through Ray (pickled).

These are not wire frames: clients never see them. The events a replica streams
back are the protocol's own `Delta` / `Error` / `Done` Structs, unchanged.

    ingress --ReplicaRequest--> router --> EngineReplica.generate
    ingress <--Admitted | Error-- (first item), then [Delta, ..., Done] batches
    ingress --(request_id, ReplicaPin)--> router --> that replica's abort / metrics
"""

from __future__ import annotations

from msgspec import Struct

from protocol import SamplingParams
from protocol.structured import Tool, ToolChoice


class ReplicaRequest(Struct, frozen=True, kw_only=True):
    """One admitted-at-the-ingress request, tokenized, on its way to a replica.

    request_id: engine-wide unique key (the ingress makes it unique across ingresses).
    client_id: the id written into its events (the client's own).
    connection_id: logged with every line about the request.
    prompt_token_ids: [P] the prompt exactly as the engine will see it.
    params: validated sampling parameters.
    waited_s: seconds from receipt at the ingress to this hand-off (tokenizing and
        routing), so the replica's timings start at the ingress's receipt.
    block_hashes: [P // block_size] chained hashes of the prompt's full blocks, computed
        in the ingress process with the engine's block hash; only the router reads them
        (Python's hash of None differs between processes, so they mean nothing elsewhere).
    tools, tool_choice, parallel_tool_calls: the request's tools, checked at the ingress
        (the prompt ids were rendered with them); the replica's engine builds the same call
        grammar from them, so the output is constrained as in one process. A
        `response_format` or `structured` constraint travels in `params`.
    tool_style: how the ingress rendered the tools ("hermes", "llama", "generic"; None:
        no tools), so the replica parses calls in the form its prompt asked for.
    """

    request_id: str
    client_id: str
    connection_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    waited_s: float = 0.0
    block_hashes: tuple[int, ...] = ()
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = False
    tool_style: str | None = None


class Admitted(Struct, frozen=True):
    """First item of a replica's stream: the request is in that engine's queue.

    prompt_tokens: the prompt's length in tokens; replica_id: the serving replica's full
    Ray Serve id (`SERVE_REPLICA::app#deployment#tag`), for aborts and metrics.
    """

    prompt_tokens: int
    replica_id: str


class ReplicaPin(Struct, frozen=True):
    """A routing hint: send this call to the replica with this full id.

    The prefix-affinity router honours it (aborts and per-replica metrics must reach
    one particular replica); when that replica is gone, any replica may take the call.
    """

    replica_id: str


class ReplicaInfo(Struct, frozen=True, kw_only=True):
    """What an ingress needs from a replica to admit requests like the engine does.

    tokenizer: the engine's transformers tokenizer (pickled by Ray); vocab_size: ids
    must be below it; block_size: tokens per KV block (for the routing hashes);
    num_kv_blocks: the whole KV cache (a request must fit it alone); sampling_defaults:
    what unset sampling parameters become (`service.engine.sampling_defaults.SamplingDefaults`,
    the model's generation config), applied at the ingress as the engine applies them.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    tokenizer: object
    sampling_defaults: object
