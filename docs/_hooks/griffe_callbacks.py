"""Griffe extension: `exgrpo_pl.callbacks` for the API reference.

The package installs the top-level `callbacks/` folder as `exgrpo_pl.callbacks` (`package-dir` in
pyproject.toml), so griffe, which reads the source tree, does not find it under `exgrpo_pl/`. This reads
`callbacks/*.py` into the `exgrpo_pl` package under that name.
"""

from __future__ import annotations

from pathlib import Path

import griffe

CALLBACKS = Path(__file__).parents[2] / "callbacks"


class CallbacksPackage(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "exgrpo_pl" or "callbacks" in pkg.members:
            return
        options = dict(
            extensions=loader.extensions,
            docstring_parser=loader.docstring_parser,
            docstring_options=loader.docstring_options,
            lines_collection=loader.lines_collection,
            modules_collection=loader.modules_collection,
        )
        init = CALLBACKS / "__init__.py"
        package = griffe.visit("callbacks", init, init.read_text(), parent=pkg, **options)
        pkg.set_member("callbacks", package)
        for path in sorted(CALLBACKS.glob("*.py")):
            if path.name != "__init__.py":
                module = griffe.visit(path.stem, path, path.read_text(), parent=package, **options)
                package.set_member(path.stem, module)
