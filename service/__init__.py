"""Conveyor's server side: engine (scheduler, KV block pool, model runner) and the WebSocket server."""
