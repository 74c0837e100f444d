"""Model architectures (nn.Modules), the per-step forward context, weight
loading and the architecture registry.

Imports point down only: tinyengine.models may import tinyengine.kernels (and
reaches the ops through the ForwardContext's op set), and must never import
anything above it (worker, scheduling, the engine, serve). Import submodules
directly (`from tinyengine.models.loader import load_model`); this package
file stays empty so that importing tinyengine.models.context does not pull in
every architecture.
"""
