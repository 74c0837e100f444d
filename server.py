"""`uvicorn server:app` — the OpenAI-compatible server, configured by environment
variables (see docs/serving.md): TINYENGINE_MODEL (a folder or a preset name,
default deepseek-v4-tiny), TINYENGINE_<ENGINECONFIG_FIELD> for engine options,
TINYENGINE_API_KEY, TINYENGINE_MAX_REQUEST_BYTES, TINYENGINE_SERVED_MODEL_NAME.

Importing this module reads the settings and builds the app; the engine
thread starts only when the server starts (the app's lifespan), so /health
answers while the model loads.
"""

from tinyengine.serve import ServerSettings, create_app

app = create_app(ServerSettings.from_env())
