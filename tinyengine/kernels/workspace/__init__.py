"""The workspace arena (workspace/arena.py): one growable, lockable scratch
buffer per device that every op draws its temporary memory from. Re-exported
here so callers write `from tinyengine.kernels.workspace import Workspace`."""

from tinyengine.kernels.workspace.arena import (
    ALIGNMENT,
    Workspace,
    WorkspaceLockedError,
    WorkspaceStats,
)

__all__ = ["ALIGNMENT", "Workspace", "WorkspaceLockedError", "WorkspaceStats"]
