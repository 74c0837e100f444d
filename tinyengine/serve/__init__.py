"""The OpenAI-compatible HTTP server: `create_app(ServerSettings)` builds it.

app.py        wiring, auth, errors, /health, /v1/models, /metrics
checks.py     what every model endpoint checks first (ready, body size, model name)
generate.py   /v1/completions and /v1/chat/completions (streaming or not)
tokenize.py   /tokenize and /detokenize
responses.py  response, chunk, usage and logprobs bodies
settings.py   ServerSettings from environment variables or the CLI
"""

from tinyengine.serve.app import create_app
from tinyengine.serve.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
