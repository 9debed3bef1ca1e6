"""bench/ is scripts, not a package: tests load a script as a module by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py as the module `name` (registered in sys.modules, as dataclasses and pickling need)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
