"""Inference: an SGLang-API-compatible CPU engine (scheduler + aiohttp server) and the client the
rest of the system uses to talk to it or to real SGLang / sglang-router."""
