"""Conveyor's wire protocol (PROTOCOL.md) and its asyncio Python client.

Pure: nothing here imports the server (`service/`) or the kernels. A lazy face:
`protocol.messages`, `protocol.errors` and `protocol.codec` need only msgspec;
the client (`protocol.client`, websockets) loads on first use of `connect`,
`Client` or `Stream`.
"""

from __future__ import annotations

from protocol._lazy import lazy_face

_EXPORTS = {
    'Accepted': 'protocol.messages',
    'Cancel': 'protocol.messages',
    'ChatMessage': 'protocol.messages',
    'Client': 'protocol.client',
    'ClientConnectionClosed': 'protocol.errors',
    'ClientMessage': 'protocol.messages',
    'ContextLengthExceeded': 'protocol.errors',
    'Delta': 'protocol.messages',
    'Done': 'protocol.messages',
    'DuplicateId': 'protocol.errors',
    'Error': 'protocol.messages',
    'ErrorCode': 'protocol.messages',
    'FinishReason': 'protocol.messages',
    'Generate': 'protocol.messages',
    'Hello': 'protocol.messages',
    'InternalError': 'protocol.errors',
    'InvalidRequest': 'protocol.errors',
    'DEFAULT_MAX_TOKENS': 'protocol.messages',
    'MAX_ID_LENGTH': 'protocol.messages',
    'MAX_LOGPROBS': 'protocol.messages',
    'MAX_STOP_STRINGS': 'protocol.messages',
    'Overloaded': 'protocol.errors',
    'PROTOCOL_VERSION': 'protocol.messages',
    'Ping': 'protocol.messages',
    'Pong': 'protocol.messages',
    'ProtocolError': 'protocol.errors',
    'RequestId': 'protocol.messages',
    'SamplingParams': 'protocol.messages',
    'ServerMessage': 'protocol.messages',
    'ShuttingDown': 'protocol.errors',
    'Stream': 'protocol.client',
    'Timings': 'protocol.messages',
    'TokenLogprob': 'protocol.messages',
    'TooManyRequests': 'protocol.errors',
    'Unauthorized': 'protocol.errors',
    'Usage': 'protocol.messages',
    'connect': 'protocol.client',
    'decode_client_frame': 'protocol.codec',
    'decode_server_frame': 'protocol.codec',
    'encode': 'protocol.codec',
    'error_class': 'protocol.errors',
    'error_from_frame': 'protocol.errors',
    'status_of': 'protocol.errors',
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
