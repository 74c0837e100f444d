"""The package's layers, enforced by parsing every import (module level and
inside functions alike): imports only point down.

    serve/ (HTTP)  >  engine modules (llm, engine, ...)  >  worker/  >  models/  >  kernels/
                                                          >  scheduling/ (no torch)
                                                models/ and worker/  >  distributed/

and the layers live inside the `tinyengine` package: a top-level `kernels` or
`models` package would collide with other distributions' import names (Hugging
Face's `kernels`, a dependency of transformers).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyengine"

# Engine modules at the package's top level that a lower layer may use: they
# hold plain data and import nothing above them.
LEAF_MODULES = ("tinyengine.config", "tinyengine.sampling_params")

# layer (a folder under tinyengine/) -> the tinyengine modules it may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "kernels": ("tinyengine.kernels",),
    "distributed": ("tinyengine.distributed",),
    "models": ("tinyengine.kernels", "tinyengine.models", "tinyengine.distributed"),
    "scheduling": ("tinyengine.scheduling", "tinyengine.sampling_params"),
    "worker": (
        "tinyengine.distributed",
        "tinyengine.kernels",
        "tinyengine.models",
        "tinyengine.scheduling",
        "tinyengine.worker",
        *LEAF_MODULES,
    ),
}
HTTP_PACKAGES = ("fastapi", "starlette", "pydantic", "uvicorn")


def _imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every module a file imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            # `from tinyengine import kernels` imports the submodule
            names += [f"{module}.{alias.name}" for alias in node.names if module == "tinyengine"]
    return names


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_point_down(layer: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(PACKAGE / layer)
        for module in _imports(path)
        if module.startswith("tinyengine") and not _is_under(module, ALLOWED[layer])
    ]
    assert not wrong, f"tinyengine/{layer} may import only {ALLOWED[layer]}:\n" + "\n".join(wrong)


def test_scheduling_imports_no_torch() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(PACKAGE / "scheduling")
        for module in _imports(path)
        if _is_under(module, ("torch", "triton", "numpy"))
    ]
    assert not wrong, "tinyengine/scheduling is pure Python:\n" + "\n".join(wrong)


def test_only_serve_speaks_http() -> None:
    serve = PACKAGE / "serve"
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(PACKAGE)
        if serve not in path.parents
        for module in _imports(path)
        if _is_under(module, HTTP_PACKAGES)
    ]
    assert not wrong, "only tinyengine/serve imports the HTTP stack:\n" + "\n".join(wrong)


def test_nothing_below_serve_imports_it() -> None:
    """The engine, worker, models and kernels never reach up into serve/, bench/
    or the CLI (serve/, bench/ and __main__ are the periphery)."""
    periphery = (PACKAGE / "serve", PACKAGE / "bench")
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(PACKAGE)
        if not any(p in path.parents for p in periphery) and path.name != "__main__.py"
        for module in _imports(path)
        if _is_under(module, ("tinyengine.serve", "tinyengine.bench"))
    ]
    assert not wrong, "\n".join(wrong)


def test_no_top_level_kernels_or_models_package() -> None:
    for name in ("kernels", "models"):
        folder = ROOT / name
        stray = sorted(folder.rglob("*.py")) if folder.is_dir() else []
        assert not stray, (
            f"a top-level {name}/ package is back ({stray[0].relative_to(ROOT)}); it belongs in "
            f"tinyengine/{name}/ (a top-level `{name}` collides with other distributions)"
        )
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["tinyengine*"], f"pyproject packages {include}: only tinyengine ships"


def test_the_check_itself_sees_an_upward_import(tmp_path: Path) -> None:
    """The parser finds imports inside functions and relative ones."""
    layer = tmp_path / "tinyengine" / "kernels"
    layer.mkdir(parents=True)
    source = layer / "bad.py"
    source.write_text("def f():\n    from ..engine import LLMEngine\n    import tinyengine.serve\n")
    found = _imports(source, root=tmp_path)
    assert "tinyengine.engine" in found and "tinyengine.serve" in found
