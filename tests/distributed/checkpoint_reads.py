"""Which checkpoint tensors a model build reads, and how: the loader's
safetensors handles wrapped to record every name read whole (get_tensor)
and every name read as a lazy slice (get_slice). The sharding tests use it
to check that a rank reads only its part of each tensor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reads:
    whole: list[str] = field(default_factory=list)
    sliced: list[str] = field(default_factory=list)

    @property
    def touched(self) -> list[str]:
        return self.whole + self.sliced


def record_reads(monkeypatch: Any) -> Reads:
    """From now on (for the test), every safe_open of the loader records its reads."""
    import tinyengine.models.loader as loader

    reads, real_open = Reads(), loader.safe_open

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.handle = real_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.handle.__exit__(*exc)

        def keys(self) -> Any:
            return self.inner.keys()

        def get_slice(self, name: str) -> Any:
            reads.sliced.append(name)
            return self.inner.get_slice(name)

        def get_tensor(self, name: str) -> Any:
            reads.whole.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return reads
