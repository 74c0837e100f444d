"""Model architectures (nn.Modules), the per-step forward context, weight
loading and the architecture registry.

Imports point down only: models/ may use kernels/ through the ForwardContext's
op set, and must never import tinyengine/. Import submodules directly
(`from models.loader import load_model`); this package file stays empty so
that importing models.context does not pull in every architecture.
"""
