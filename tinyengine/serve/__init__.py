"""The OpenAI-compatible HTTP server: `create_app(ServerSettings)` builds it.

app.py            wiring, auth, errors, /health, /v1/models, /metrics
checks.py         what every model endpoint checks first (ready, body size, model name)
generate.py       /v1/completions and /v1/chat/completions (streaming or not)
tokenize.py       /tokenize and /detokenize; the chat rendering generate.py shares
responses.py      response, chunk, usage and logprobs bodies (OpenAI's wire format, out)
protocol.py       request models, their validation, error bodies (OpenAI's wire format, in)
engine_client.py  EngineClient: the only view of the engine that handlers get
async_engine.py   AsyncLLMEngine: the engine thread behind EngineClient, the one
                  holder of the LLMEngine
request_tracker.py
                  the engine thread's books: request -> stream, timing, outbox
metrics.py        the Prometheus counters and histograms behind /metrics
settings.py       ServerSettings from environment variables or the CLI
cli.py            `python -m tinyengine serve`: its flags and the uvicorn run

This package is the only one in tinyengine that imports fastapi, starlette,
pydantic or uvicorn (tests/test_layers.py checks it); nothing below it
imports it.
"""

from tinyengine.serve.app import create_app
from tinyengine.serve.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
